"""Tensor-parallel training through the pretraining app (Lightning + ZooParallelStrategy, 2 gloo
processes): the loss curve of TP 2 matches TP 1 from the same seed (with parallel.overlap=token_split too), the
checkpoint holds the unsharded weights, and the saved HF model equals the TP-1 one; then Llama -> Ladder conversion
end to end."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models.checkpoint import read_weights
from tests.test_train import TINY, compose_pretrain
from train.export_checkpoint import load_unsharded
from train.pretrain import train

TP_TINY = [o.replace("num_key_value_heads=1", "num_key_value_heads=2") for o in TINY]
STEPS = 6
RUN = [
    *TP_TINY, "logger=csv", f"trainer.max_steps={STEPS}", "trainer.val_check_interval=3",
    "callbacks.model_checkpoint.every_n_train_steps=3", "callbacks.progress_bar=null",
]


def run_pretrain(run_dir: Path, *overrides: str) -> None:
    command = [sys.executable, "-m", "train.pretrain", f"hydra.run.dir={run_dir}", *RUN, *overrides]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)


def losses(run_dir: Path) -> list[float]:
    (path,) = run_dir.glob("csv/*/metrics.csv")
    return [float(r["train/loss"]) for r in csv.DictReader(path.open()) if r.get("train/loss")]


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    train(compose_pretrain(RUN, root / "tp1"))  # in this process: one interpreter start fewer
    run_pretrain(root / "tp2", "parallel=tp2")
    run_pretrain(root / "tp2_split", "parallel=tp2", "parallel.overlap=token_split")
    return root / "tp1", root / "tp2"


def test_tp2_loss_curve_matches_tp1(tp_runs):
    tp1, tp2 = tp_runs
    a, b = losses(tp1), losses(tp2)
    assert len(a) == len(b) == STEPS
    # fp32; the only difference is the order of the sums inside the all-reduces
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=0)


def test_tp2_with_token_split_trains_the_same_curve(tp_runs):
    # parallel.overlap=token_split (parallel/overlap.py): the batch in two halves taking turns; the same steps.
    tp1, tp2 = tp_runs
    a, b = losses(tp1), losses(tp2.parent / "tp2_split")
    assert len(a) == len(b) == STEPS
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-5, atol=0)


def test_tp2_checkpoint_and_hf_model_are_unsharded(tp_runs):
    tp1, tp2 = tp_runs
    ckpt1 = torch.load(tp1 / "checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    # tp 2 writes a sharded checkpoint (each rank its shards); read at tp 1 it is the unsharded model
    unsharded = load_unsharded(tp2 / "checkpoints/last.ckpt").state_dict()
    for name, full in ckpt1["state_dict"].items():
        assert unsharded[name.removeprefix("model.")].shape == full.shape, name
    # tp 1 writes one model.safetensors, tp 2 streams one file per block: the same weights
    w1, w2 = load_file(tp1 / "hf/model.safetensors"), read_weights(tp2 / "hf")
    assert w1.keys() == w2.keys()
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=1e-4, msg=name)


RETRAIN = [
    "trainer.max_steps=3", "trainer.limit_val_batches=2", "trainer.val_check_interval=3",
    "data.seq_len=32", "data.batch_size=4", "logger=none", "callbacks=none",
]


def test_convert_llama_to_ladder_and_retrain(tp_runs, tmp_path):
    llama_dir = tp_runs[0] / "hf"
    out = tmp_path / "convert"
    command = [
        sys.executable, "-m", "train.convert", f"source={llama_dir}", "ladder_layers=1", f"hydra.run.dir={out}",
        "data.seq_len=32", "data.batch_size=4", "evaluate.max_batches=3", "retrain.enabled=true",
        "retrain.overrides=[" + ",".join(f"'{o}'" for o in RETRAIN) + "]",
    ]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    result = json.loads((out / "conversion.json").read_text())
    assert set(result["val"]) == {"llama (source)", "ladder, no retraining", "ladder, retrained"}
    assert result["val"]["ladder, no retraining"]["loss"] != result["val"]["llama (source)"]["loss"]
    config = json.loads((out / "ladder/config.json").read_text())
    assert config["model_type"] == "zoo_ladder" and config["ladder_layers"] == 1
    assert (out / "conversion.md").read_text().count("|") > 8
