"""Data x tensor parallelism through the pretraining app, and the gradient synchronisation behind it.

- `sync_plan`: which parameter's gradient is summed over which token dimensions, from the recorded
  ShardSpecs (a replicated parameter over dp x ep x sp, an expert sharded over ep over dp x sp only,
  nothing over tp);
- `sync_gradients` on 4 gloo ranks (dp 2 x ep 2), one gradient per bucket: replicated gradients are
  averaged over all four, an expert's summed over its dp peers and divided by dp x ep, a missing one
  counts as zeros;
- the presets: `parallel=<preset>` states the degrees, trainer.devices follows from them, ep2 / sp2 are
  refused for an architecture without that layout before any process starts;
- `parallel=dp2_tp2` (4 processes, batch 4 per data rank) trains on the loss curve of one process with
  batch 8 (rtol 1e-5: only the order of sums differs), its checkpoint holds the unsharded weights, and its
  step-3 checkpoint resumes at tp 2 and at tp 1 (batch 8) on that same curve.
"""

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoModelForCausalLM

import parallel
from parallel.grad_sync import sync_gradients, sync_plan
from parallel.layout import MeshDim, ShardSpec, keep_own_entry, record
from tests.distributed import run_ranks
from tests.test_train import TINY, compose_pretrain, subprocess_env
from train.data import LMDataModule
from train.export_checkpoint import load_unsharded
from train.export_checkpoint import main as export_main
from train.module import CausalLMModule
from train.pretrain import build_trainer, check_config, train, trainer_devices
from train.strategy import ZooParallelStrategy

TP_TINY = [o.replace("num_key_value_heads=1", "num_key_value_heads=2") for o in TINY]

# --- which gradients are averaged over which dimensions ------------------------------------------


class Toy(nn.Module):
    """A norm (replicated), a projection sharded over tp, two experts (one per ep rank, rank r keeping
    expert r), a frozen parameter and one that this test leaves without a gradient."""

    def __init__(self, ep_rank: int = 0, ep: int = 2):
        super().__init__()
        self.norm = nn.Parameter(torch.ones(4))
        self.proj = nn.Linear(4, 8, bias=False)
        self.experts = nn.ModuleDict({str(i): nn.Linear(4, 4, bias=False) for i in range(ep)})
        self.unused = nn.Parameter(torch.ones(3))
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)
        record(self.proj, "weight", ShardSpec("tp", 0, 0, 2))  # as split_param would record it
        keep_own_entry("experts", self.experts, MeshDim("ep", ep_rank, ep))


def test_sync_plan_follows_the_shard_specs():
    toy = Toy()
    every = {"dp": 2, "ep": 2, "sp": 2, "tp": 2}
    assert sync_plan(toy, every) == {
        "norm": ("dp", "ep", "sp"),
        "proj.weight": ("dp", "ep", "sp"),
        "experts.0.weight": ("dp", "sp"),  # an expert is held by one ep rank: its gradient is already whole
        "unused": ("dp", "ep", "sp"),
    }
    # tp ranks see the same tokens: nothing to average; size-1 dimensions are skipped
    assert set(sync_plan(toy, {"dp": 1, "ep": 1, "sp": 1, "tp": 2}).values()) == {()}
    assert sync_plan(toy, {"dp": 2, "tp": 2})["experts.0.weight"] == ("dp",)
    assert sync_plan(toy, {"ep": 2})["experts.0.weight"] == ()


def _sync_on_dp2_ep2(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    mesh = parallel.init_mesh(dp=2, ep=2)
    ep_rank = mesh.get_local_rank("ep")
    toy = Toy(ep_rank)
    toy.norm.grad = torch.full((4,), rank + 1.0)
    toy.proj.weight.grad = torch.full((8, 4), 10.0 * (rank + 1))
    toy.experts[str(ep_rank)].weight.grad = torch.full((4, 4), 100.0 * (rank + 1))
    if rank > 0:
        toy.unused.grad = torch.full((3,), 4.0)  # none on rank 0
    sync_gradients(toy, mesh, bucket_mb=1e-6)  # one gradient per bucket

    assert torch.equal(toy.norm.grad, torch.full((4,), 2.5))  # (1 + 2 + 3 + 4) / 4
    assert torch.equal(toy.proj.weight.grad, torch.full((8, 4), 25.0))
    assert torch.equal(toy.unused.grad, torch.full((3,), 3.0))  # (0 + 4 + 4 + 4) / 4
    # rank = 2 * dp_rank + ep_rank: expert e is summed over ranks e and e + 2, divided by dp x ep
    expected = 100.0 * ((ep_rank + 1) + (ep_rank + 3)) / 4
    assert torch.equal(toy.experts[str(ep_rank)].weight.grad, torch.full((4, 4), expected))
    assert toy.frozen.grad is None


def test_sync_gradients_on_gloo_dp2_ep2():
    run_ranks(_sync_on_dp2_ep2, 4)


class CountBatches(L.Callback):
    def __init__(self):
        self.batches = 0

    def on_train_batch_end(self, *args) -> None:
        self.batches += 1


def test_sync_runs_once_per_optimizer_step_with_gradient_accumulation(tmp_path, monkeypatch):
    """The replicated trainer (ZooParallelStrategy(fsdp=False)) in this process (a 1-rank mesh): with
    accumulate_grad_batches=2 the gradients are synchronised after the second micro-batch's backward only."""
    synced = []
    monkeypatch.setattr("train.strategy.sync_gradients", lambda model, mesh: synced.append(model.global_step))
    cfg = compose_pretrain(TINY, tmp_path)
    data = LMDataModule(seq_len=32, batch_size=4, max_val_batches=1)
    module = CausalLMModule("llama", dict(cfg.model.config), data.vocab_size, dict(cfg.optimizer))
    counter = CountBatches()
    trainer = L.Trainer(
        strategy=ZooParallelStrategy(fsdp=False), accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=2,
        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[counter],
    )
    environ = dict(os.environ)
    try:
        trainer.fit(module, datamodule=data)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # Lightning exported LOCAL_RANK, MASTER_PORT, ... for its process group: a later subprocess of this
        # test session would take itself for an already launched rank.
        os.environ.clear()
        os.environ.update(environ)
    assert counter.batches == 6 and synced == [0, 1, 2]


# --- presets --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "degrees"),
    [
        ("none", (1, 1, 1, 1)),
        ("tp2", (1, 1, 1, 2)),
        ("tp4", (1, 1, 1, 4)),
        ("dp2_tp2", (2, 1, 1, 2)),
        ("ep2", (1, 2, 1, 1)),
        ("sp2", (1, 1, 2, 1)),
    ],
)
def test_presets_state_the_degrees_and_devices_follow(preset, degrees, tmp_path):
    heads = ["model.config.num_attention_heads=4", "model.config.num_key_value_heads=4"]  # tp 4 fits
    cfg = compose_pretrain([*TP_TINY, *heads, f"parallel={preset}"], tmp_path)
    assert tuple(cfg.parallel[d] for d in ("dp", "ep", "sp", "tp")) == degrees
    assert trainer_devices(cfg) == math.prod(degrees)
    if preset in ("ep2", "sp2"):
        # llama shards over tp only: refused before any process starts
        with pytest.raises(ValueError, match="no (expert|sequence)-parallel layout"):
            check_config(cfg)
        return
    check_config(cfg)
    trainer = build_trainer(cfg)
    if math.prod(degrees) > 1:
        assert isinstance(trainer.strategy, ZooParallelStrategy)
        assert trainer.strategy.degrees == dict(zip(("dp", "ep", "sp", "tp"), degrees, strict=True))
    assert trainer.num_devices == math.prod(degrees)


def test_devices_over_nodes(tmp_path):
    cfg = compose_pretrain([*TP_TINY, "parallel=dp2_tp2", "trainer.num_nodes=2"], tmp_path)
    assert trainer_devices(cfg) == 2
    check_config(cfg)


# --- dp 2 x tp 2 training == one process on the same global batch ----------------------------------

STEPS = 6
RUN = [
    *TP_TINY, "logger=csv", f"trainer.max_steps={STEPS}", "trainer.val_check_interval=3",
    "callbacks.model_checkpoint.every_n_train_steps=3", "callbacks.progress_bar=null",
]
# keep the step-3 checkpoint (as step3.ckpt) beside last.ckpt
KEEP_CHECKPOINTS = [
    "callbacks.model_checkpoint.save_top_k=-1", "+callbacks.model_checkpoint.filename='step{step}'",
    "+callbacks.model_checkpoint.auto_insert_metric_name=false",
]


def run_subprocess(run_dir: Path, *overrides: str) -> None:
    command = [sys.executable, "-m", "train.pretrain", f"hydra.run.dir={run_dir}", *RUN, *overrides]
    proc = subprocess.run(
        command, cwd=run_dir.parent, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def losses(run_dir: Path) -> list[float]:
    (path,) = run_dir.glob("csv/*/metrics.csv")
    return [float(r["train/loss"]) for r in csv.DictReader(path.open()) if r.get("train/loss")]


@pytest.fixture(scope="module")
def dp2_tp2_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp2_tp2")
    train(compose_pretrain([*RUN, "data.batch_size=8", *KEEP_CHECKPOINTS], root / "one_process"))
    run_subprocess(root / "dp2_tp2", "parallel=dp2_tp2", "data.batch_size=4", *KEEP_CHECKPOINTS)
    return root


def test_dp2_tp2_loss_curve_matches_one_process(dp2_tp2_runs):
    one, dp2_tp2 = losses(dp2_tp2_runs / "one_process"), losses(dp2_tp2_runs / "dp2_tp2")
    assert len(one) == len(dp2_tp2) == STEPS
    torch.testing.assert_close(torch.tensor(dp2_tp2), torch.tensor(one), rtol=1e-5, atol=0)
    # FSDP's checkpoint: a torch.distributed.checkpoint directory behind the link, one shard file per rank,
    # holding the unsharded model's tensors (read back in one process, at tp 1)
    last = dp2_tp2_runs / "dp2_tp2/checkpoints/last.ckpt"
    assert last.is_symlink() and sorted(p.name for p in last.resolve().glob("*.distcp")) == [
        f"__{rank}_0.distcp" for rank in range(4)
    ]
    reference = torch.load(dp2_tp2_runs / "one_process/checkpoints/last.ckpt", map_location="cpu", weights_only=False)
    model = load_unsharded(last)
    assert {f"model.{k}": v.shape for k, v in model.state_dict().items()} == {
        k: v.shape for k, v in reference["state_dict"].items()
    }
    # the streamed hf/ export holds the same weights as the checkpoint
    exported = AutoModelForCausalLM.from_pretrained(dp2_tp2_runs / "dp2_tp2/hf")
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], tensor, rtol=0, atol=0)


# dp2_tp2: the same degrees; tp2: dp 1 x tp 2; dp4: dp 4 x tp 1; none: one process (tp 1), all from the
# checkpoint FSDP wrote at dp 2 x tp 2.
RESUME_AT = {
    "dp2_tp2": ["parallel=dp2_tp2", "data.batch_size=4"],
    "tp2": ["parallel=tp2", "data.batch_size=8"],
    "dp4": ["parallel=dp2_tp2", "parallel.dp=4", "parallel.tp=1", "data.batch_size=2"],
    "none": ["parallel=none", "data.batch_size=8"],
}


@pytest.mark.parametrize(
    "degrees",
    [pytest.param("dp2_tp2", marks=pytest.mark.slow), "tp2", pytest.param("dp4", marks=pytest.mark.slow), "none"],
)
def test_dp2_tp2_checkpoint_resumes_at_other_degrees(dp2_tp2_runs, degrees, tmp_path):
    step3 = dp2_tp2_runs / "dp2_tp2/checkpoints/step3.ckpt"
    # the same global batch of 8, over the data ranks
    overrides = [*RESUME_AT[degrees], f"resume={step3}"]
    if degrees == "none":
        environ = dict(os.environ)
        train(compose_pretrain([*RUN, *overrides], tmp_path / "resumed"))
        # the process group the sharded resume started in this process ended with the run, and its environment
        # (MASTER_PORT, ...) is gone: later runs started from here would take it for theirs
        assert not dist.is_initialized() and dict(os.environ) == environ
    else:
        run_subprocess(tmp_path / "resumed", *overrides)
    resumed = losses(tmp_path / "resumed")
    assert len(resumed) == STEPS - 3
    one = losses(dp2_tp2_runs / "one_process")
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(one[3:]), rtol=1e-5, atol=0)



def test_a_damaged_shard_of_the_dp2_tp2_run_is_refused_in_one_line(dp2_tp2_runs, tmp_path, capsys):
    """1 KB overwritten inside a record of rank 1's shard file (the file's size unchanged): resuming it and exporting
    it each end in one line naming the file, nothing loaded (without the records' CRC-32 both went on silently)."""
    import pickle
    import shutil

    from train.errors import TrainingError

    damaged = tmp_path / "checkpoints" / "step3.ckpt"
    shutil.copytree((dp2_tp2_runs / "dp2_tp2/checkpoints/step3.ckpt").resolve(), damaged)
    with open(damaged / ".metadata", "rb") as file:
        storage = pickle.load(file).storage_data
    weights = (s for i, s in storage.items() if s.relative_path == "__1_0.distcp" and i.fqn.startswith("state_dict."))
    record = max(weights, key=lambda s: s.length)  # a weight's record: what both the resume and the export read
    with open(damaged / "__1_0.distcp", "r+b") as file:
        file.seek(record.offset + record.length // 2)
        file.write(os.urandom(1024))
    expected = f"{damaged} is damaged: the record at byte {record.offset:,} of __1_0.distcp fails its CRC-32 check"
    with pytest.raises(TrainingError) as caught:
        train(compose_pretrain([*RUN, *RESUME_AT["none"], f"resume={damaged}"], tmp_path / "resumed"))
    assert str(caught.value).startswith(f"Cannot resume: {expected}") and "\n" not in str(caught.value)
    assert export_main([str(damaged), str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"Error: cannot export {damaged}: the record at byte {record.offset:,} of __1_0.distcp")
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_one_process_file_checkpoint_resumes_under_fsdp_at_dp2_tp2(dp2_tp2_runs, tmp_path):
    """The other way: one process's one-file checkpoint (step 3) continued at dp 2 x tp 2 on FSDP (each rank
    copies its regions of the unsharded weights and Adam state) on the curve of the run that never stopped."""
    step3 = dp2_tp2_runs / "one_process/checkpoints/step3.ckpt"
    assert step3.is_file()
    run_subprocess(tmp_path / "resumed", *RESUME_AT["dp2_tp2"], f"resume={step3}")
    resumed = losses(tmp_path / "resumed")
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses(dp2_tp2_runs / "one_process")[3:]), rtol=1e-5, atol=0)


def test_export_checkpoint_offline_equals_the_streamed_export(dp2_tp2_runs, tmp_path, capsys):
    """`python -m train.export_checkpoint` on the dp 2 x tp 2 run's sharded checkpoint, in one process: the same
    hf/ weights as the run's own streamed export; a non-empty output directory is refused (nothing overwritten)."""
    run_dir, out = dp2_tp2_runs / "dp2_tp2", tmp_path / "exported"
    assert export_main([str(run_dir / "checkpoints/last.ckpt"), str(out)]) == 0
    offline = AutoModelForCausalLM.from_pretrained(out).state_dict()
    streamed = AutoModelForCausalLM.from_pretrained(run_dir / "hf").state_dict()
    assert offline.keys() == streamed.keys()
    for name, tensor in streamed.items():
        torch.testing.assert_close(offline[name], tensor, rtol=0, atol=0)
    assert export_main([str(run_dir / "checkpoints/last.ckpt"), str(out)]) == 1
    assert "is not empty" in capsys.readouterr().err
