"""Training the MoE family through the pretraining app (`python -m train.pretrain model=moe|scmoe|moepp`).

- `parallel=ep2` (2 gloo processes, batch 2 per data rank) trains `moe` on the loss curve of one process
  with batch 4 (rtol 1e-5: only the order of sums differs), the balance loss included; with DeepSeek-V3's
  balance bias on, the biases the trainer moves after each step (expert loads summed over the ep ranks)
  end equal to the one process's;
- `scmoe` and `moepp` likewise at ep 2 (no balance bias; slow, `pytest -m slow`);
- a one-process fast run of `scmoe` and of `moepp` logs the language-model loss and the balance loss on
  their own (`train/lm_loss`, `train/aux/load_balance`), which add up to `train/loss`;
- conf/model/{moe,scmoe,moepp}.yaml have the active parameters of conf/model/llama.yaml (within 0.5%).
"""

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import models
from models.checkpoint import read_weights
from tests.test_train import TINY, compose_pretrain, subprocess_env
from train.data import load_tokenizer
from train.pretrain import train

REPO = Path(__file__).resolve().parents[1]
STEPS = 4
RUN = [
    *TINY, "logger=csv", f"trainer.max_steps={STEPS}", "trainer.val_check_interval=2", "callbacks.progress_bar=null",
    "sample.num_lines=0",
]


def metrics(run_dir: Path) -> list[dict]:
    (path,) = run_dir.glob("csv/*/metrics.csv")
    return [row for row in csv.DictReader(path.open()) if row.get("train/loss")]


def column(rows: list[dict], name: str) -> list[float]:
    return [float(r[name]) for r in rows]


def train_one_process_and_ep2(root: Path, overrides: list[str]) -> Path:
    """The same global batch of 4 sequences: one process with batch 4 (in this process), and `parallel=ep2`
    with batch 2 per data rank (2 gloo processes started by Lightning from the real command line)."""
    train(compose_pretrain([*overrides, "data.batch_size=4"], root / "one_process"))
    run_dir = root / "ep2"
    command = [sys.executable, "-m", "train.pretrain", f"hydra.run.dir={run_dir}", *overrides, "parallel=ep2", "data.batch_size=2"]
    proc = subprocess.run(command, cwd=root, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return root


def assert_same_curves(root: Path) -> None:
    one, ep2 = metrics(root / "one_process"), metrics(root / "ep2")
    assert len(one) == len(ep2) == STEPS
    for name in ("train/loss", "train/lm_loss", "train/aux/load_balance"):
        torch.testing.assert_close(torch.tensor(column(ep2, name)), torch.tensor(column(one, name)), rtol=1e-5, atol=0)


@pytest.fixture(scope="module")
def ep2_runs(tmp_path_factory):
    return train_one_process_and_ep2(
        tmp_path_factory.mktemp("moe_ep2"), ["model=moe", "+model.config.router_balance_bias=true", *RUN]
    )


def test_moe_ep2_loss_curve_matches_one_process(ep2_runs):
    assert_same_curves(ep2_runs)


# Slow (an in-process run and a 2-rank command each): the default run keeps moe's ep2 curve above (the same
# strategy, data split and gradient sync), and tests/test_ep.py::test_ep2_equals_one_process checks scmoe's and
# moepp's EP 2 logits, loss with the balance loss and every gradient after grad_sync against one process;
# test_one_process_fast_run_logs_the_aux_loss below trains both through the app.
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["scmoe", "moepp"])
def test_ep2_loss_curve_matches_one_process(arch, tmp_path):
    assert_same_curves(train_one_process_and_ep2(tmp_path, [f"model={arch}", *RUN]))


def test_moe_ep2_moves_the_balance_biases_as_one_process(ep2_runs):
    one = read_weights(ep2_runs / "one_process/hf")
    ep2 = read_weights(ep2_runs / "ep2/hf")  # FSDP's streamed export: one file per block
    biases = sorted(k for k in one if k.endswith("router.expert_bias"))
    assert len(biases) == 2  # one MoE layer per layer of the 2-layer tiny model
    # The step-wise updates are +-1e-3 and re-centred: they moved, and moved alike (summed loads)
    assert all(one[k].abs().sum() > 0 for k in biases)
    for k in biases:
        torch.testing.assert_close(ep2[k], one[k], rtol=0, atol=1e-7)


@pytest.mark.parametrize("arch", ["scmoe", "moepp"])
def test_one_process_fast_run_logs_the_aux_loss(arch, tmp_path):
    result = train(compose_pretrain([f"model={arch}", *RUN, "trainer.max_steps=2", "data.batch_size=2"], tmp_path))
    assert result["global_step"] == 2 and result["model"] == arch
    rows = metrics(tmp_path)
    assert len(rows) == 2
    total, lm, aux = (torch.tensor(column(rows, n)) for n in ("train/loss", "train/lm_loss", "train/aux/load_balance"))
    # 0.01 x a balance loss of about 1 (1 when balanced)
    assert ((aux > 0.005) & (aux < 0.03)).all()
    torch.testing.assert_close(total, lm + aux, rtol=1e-6, atol=0)


@pytest.mark.parametrize("arch", ["moe", "scmoe", "moepp"])
def test_model_configs_have_llamas_active_parameters(arch):
    vocab = len(load_tokenizer())

    def config(name):
        fields = OmegaConf.to_container(OmegaConf.load(REPO / "conf/model" / f"{name}.yaml").config)
        return models.build_config(name, vocab_size=vocab, **fields)

    llama, moe = config("llama"), config(arch)
    assert moe.num_active_parameters_formula() == pytest.approx(llama.num_parameters_formula(), rel=5e-3)
    assert moe.num_parameters_formula() > 1.25 * moe.num_active_parameters_formula()
    assert moe.intermediate_size % 8 == 0
    # The formula counts what a token can reach: total minus the experts it is not routed to.
    model = models.ZOO[arch].model_class(moe)
    experts = [m for m in model.modules() if isinstance(m, models.common.moe.GroupedExperts)]
    per_expert = sum(p[0].numel() for p in experts[0].parameters())
    k = moe.num_experts_per_tok
    unused = sum(e.num_experts - min(k, e.num_experts) for e in experts) * per_expert
    assert moe.num_active_parameters_formula() == sum(p.numel() for p in model.parameters()) - unused
