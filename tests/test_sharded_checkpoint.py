"""Sharded (torch.distributed.checkpoint) training checkpoints: atomic, refused when bad, exported offline,
and an expert-parallel one resumed at another ep degree.

- a run killed while its second sharded checkpoint is being written keeps the first behind `last.ckpt`
  (loadable, its step), and the rerun resumes from it, finishes, and leaves no stray directory;
- the run-directory rules work with a link: `overwrite=true` removes the link and its directory;
- a checkpoint of moe saved at dp 2 x ep 2 resumes at ep 1 (one process) on the curve of the run that never
  stopped (rtol 1e-5).
"""

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.test_train import TINY, compose_pretrain, subprocess_env
from tests.test_train_safety import start_wrapped
from train import sharded_checkpoint
from train.pretrain import check_run_directory, train

TP_TINY = [o.replace("num_key_value_heads=1", "num_key_value_heads=2") for o in TINY]
RUN = [
    *TP_TINY, "logger=csv", "trainer.val_check_interval=3", "callbacks.model_checkpoint.every_n_train_steps=3",
    "callbacks.progress_bar=null",
]

def run_pretrain(run_dir: Path, *overrides: str, timeout: float = 300) -> str:
    """The entry point run to completion with exactly `overrides`; its output."""
    command = [sys.executable, "-m", "train.pretrain", f"hydra.run.dir={run_dir}", *overrides]
    proc = subprocess.run(command, cwd=run_dir.parent, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output


# The second sharded save hangs after its shards are written, before its meta.pt and the link swap.
STUCK_SECOND_SAVE = """
import time
import train.sharded_checkpoint as sc

_write_meta, _saves = sc.write_meta, []


def stuck_write_meta(directory, meta):
    _saves.append(directory)
    if len(_saves) >= 2:
        (directory / "stuck").touch()
        time.sleep(600)  # the test kills the run here
    _write_meta(directory, meta)


sc.write_meta = stuck_write_meta
"""


@pytest.mark.slow  # 35 s; the one-file checkpoint's kill test (test_train_safety.py) stays in the default run
def test_kill_during_a_sharded_save_keeps_the_previous_one(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [*RUN, "parallel=tp2", "trainer.max_steps=9"]
    last = run_dir / "checkpoints" / "last.ckpt"
    proc, _ = start_wrapped(tmp_path, STUCK_SECOND_SAVE, run_dir, *overrides)
    try:
        deadline = time.monotonic() + 240
        while not list((run_dir / "checkpoints").glob("last.ckpt.d*/stuck")):
            assert proc.poll() is None and time.monotonic() < deadline, "no stuck second save"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    # killed with the step-6 shards written but not linked: last.ckpt is still the complete step-3 checkpoint
    assert last.is_symlink() and sharded_checkpoint.problem(last) is None
    assert sharded_checkpoint.read_meta(last)["global_step"] == 3
    stray = [p for p in last.parent.glob("last.ckpt.d*") if p != last.resolve()]
    assert len(stray) == 1 and sharded_checkpoint.problem(stray[0]) is not None

    output = run_pretrain(run_dir, *overrides)
    assert f"Resuming from {last}" in output
    assert sharded_checkpoint.read_meta(last)["global_step"] == 9
    assert sorted(p.name for p in last.parent.glob("last.ckpt.d*")) == [last.resolve().name]  # stray removed

    # overwrite=true with resume=never removes the link and its directory
    cfg = compose_pretrain([*overrides, "resume=never", "overwrite=true"], run_dir)
    check_run_directory(cfg, run_dir)
    assert not last.exists() and not list(last.parent.glob("last.ckpt.d*"))


def losses(run_dir: Path) -> list[float]:
    (path,) = run_dir.glob("csv/*/metrics.csv")
    return [float(r["train/loss"]) for r in csv.DictReader(path.open()) if r.get("train/loss")]


MOE = [
    "model=moe", "model.config.num_hidden_layers=2", "model.config.hidden_size=64", "model.config.intermediate_size=128",
    "model.config.num_attention_heads=2", "model.config.num_key_value_heads=2", "model.config.num_local_experts=4",
    "data.seq_len=32", "trainer.limit_val_batches=2", "optimizer.warmup_steps=2", "logger=csv",
    "trainer.val_check_interval=3", "callbacks.model_checkpoint.every_n_train_steps=3", "callbacks.progress_bar=null",
    "callbacks.model_checkpoint.save_top_k=-1", "+callbacks.model_checkpoint.filename='step{step}'",
    "+callbacks.model_checkpoint.auto_insert_metric_name=false", "trainer.max_steps=6",
]


@pytest.mark.slow
def test_dp2_ep2_checkpoint_resumes_at_ep1(tmp_path):
    run_dir = tmp_path / "dp2_ep2"
    run_pretrain(run_dir, *MOE, "parallel=ep2", "parallel.dp=2", "data.batch_size=2", timeout=400)
    step3 = run_dir / "checkpoints" / "step3.ckpt"
    assert step3.is_symlink()
    # the same global batch of 8 on one process
    train(compose_pretrain([*MOE, "parallel=none", "data.batch_size=8", f"resume={step3}"], tmp_path / "ep1"))
    torch.testing.assert_close(
        torch.tensor(losses(tmp_path / "ep1")), torch.tensor(losses(run_dir)[3:]), rtol=1e-5, atol=0
    )


LINEAR = [
    "model=linear_hybrid", "model.config.num_hidden_layers=4", "model.config.hidden_size=64",
    "model.config.intermediate_size=128", "model.config.num_attention_heads=2", "model.config.num_key_value_heads=2",
    *[o for o in MOE if not o.startswith(("model", "trainer.max_steps"))], "trainer.max_steps=6",
]


@pytest.mark.slow
def test_dp2_sp2_checkpoint_resumes_at_sp1(tmp_path):
    """Sequence parallelism (LASP-2 and LASP-2H, FSDP over dp x sp): saved at dp 2 x sp 2, resumed on one
    process on the same curve."""
    run_dir = tmp_path / "dp2_sp2"
    run_pretrain(run_dir, *LINEAR, "parallel=sp2", "parallel.dp=2", "data.batch_size=4", timeout=400)
    step3 = run_dir / "checkpoints" / "step3.ckpt"
    train(compose_pretrain([*LINEAR, "parallel=none", "data.batch_size=8", f"resume={step3}"], tmp_path / "sp1"))
    torch.testing.assert_close(
        torch.tensor(losses(tmp_path / "sp1")), torch.tensor(losses(run_dir)[3:]), rtol=1e-5, atol=0
    )


def test_a_sharded_checkpoint_with_nonfinite_weights_is_refused_without_reading_them(tmp_path):
    from train.module import TrainingError
    from train.run_directory import check_checkpoint_contents

    directory = tmp_path / "last.ckpt.d1"
    directory.mkdir()
    (directory / ".metadata").write_bytes(b"")  # the shards are never read: only meta.pt
    meta = {"global_step": 4, "hyper_parameters": {}, "nonfinite": [("model.lm_head.weight", 3, 0, 4096)]}
    sharded_checkpoint.write_meta(directory, meta)
    link = tmp_path / "last.ckpt"
    sharded_checkpoint.swap_in(link, directory)
    with pytest.raises(TrainingError, match=r"model.lm_head.weight \(3 NaN of 4096\)"):
        check_checkpoint_contents(str(link), max_steps=10)
    with pytest.raises(TrainingError, match="already past trainer.max_steps=3"):
        check_checkpoint_contents(str(link), max_steps=3)
    meta["nonfinite"] = []
    sharded_checkpoint.write_meta(directory, meta)
    assert check_checkpoint_contents(str(link), max_steps=10) == 4
