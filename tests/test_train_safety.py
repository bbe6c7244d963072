"""What a pretraining run does when things go wrong, and the small things its user sees.

- resume with another `optimizer.lr`: the new lr is the one used from the first resumed step;
- a kill (SIGKILL) while a checkpoint is being written leaves the previous `last.ckpt` loadable and
  the rerun resumes from it; an unreadable `last.ckpt` fails in one sentence or falls back;
- a NaN loss stops before the update (the last checkpoint intact) or is skipped (`nonfinite_loss`);
- a tensor-parallel rank that dies ends the whole command quickly with an error naming it;
- the progress bar counts steps, `<run dir>/pretrain.log` holds the run's log, the parameter count is
  the model's under TP, and multirun W&B runs are named by their overrides.

The subprocess runs go through a small wrapper script (written to the test's temp dir) that patches
one thing and then runs `train/pretrain.py` as `__main__`: Lightning starts the other ranks with the
same script, so they are patched too.
"""

import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import open_dict, read_write

import models
from tests.test_train import REPO, TINY, compose_pretrain, run_pretrain, subprocess_env, wait_for_file
from train.callbacks import AtomicCheckpointIO
from train.data import load_tokenizer
from train.module import NonFiniteLossError, TrainingError, warmup_cosine
from train.pretrain import build_trainer, name_multirun_job, train
from train.run_directory import checkpoint_problem, readable_checkpoint
from train.strategy import ZooParallelStrategy

TP_TINY = [o.replace("num_key_value_heads=1", "num_key_value_heads=2") for o in TINY]

# Runs train/pretrain.py as __main__ after the test's patch (PATCH below), from a script file so
# that Lightning's other ranks run it too.
RUN_PRETRAIN = """
path = os.path.join(os.environ["REPO"], "train", "pretrain.py")
exec(compile(open(path).read(), path, "exec"), {"__name__": "__main__", "__file__": path})
"""


def start_wrapped(tmp_path: Path, patch: str, run_dir: Path, *overrides: str, env: dict | None = None):
    script = tmp_path / "wrapped_pretrain.py"
    script.write_text("import os\n" + textwrap.dedent(patch) + RUN_PRETRAIN)
    log = open(tmp_path / f"{run_dir.name}.out", "w")
    proc = subprocess.Popen(
        [sys.executable, str(script), f"hydra.run.dir={run_dir}", *overrides],
        cwd=tmp_path,
        env={**subprocess_env(), "REPO": str(REPO), **(env or {})},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the test can kill every rank at once
    )
    return proc, tmp_path / f"{run_dir.name}.out"


def csv_rows(path: Path) -> list[dict]:
    import csv

    return list(csv.DictReader(path.open()))


# ----------------------------------------------------------------------------------- optimizer.lr


def test_changed_lr_is_applied_on_resume(tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO, logger="train.module")
    common = [*TINY, "trainer=cpu", "trainer.val_check_interval=2", "logger=csv"]
    first = train(compose_pretrain([*common, "trainer.max_steps=4", "optimizer.lr=3e-3"], tmp_path))
    assert first["global_step"] == 4
    # the progress bar counts optimizer steps out of max_steps, not the batches of `Epoch 0/-2`
    bar = capsys.readouterr().out
    assert "4/4" in bar and "Epoch" not in bar

    resumed = train(compose_pretrain([*common, "trainer.max_steps=8", "optimizer.lr=1e-3"], tmp_path))
    assert resumed["resumed_from"] == str(tmp_path / "checkpoints" / "last.ckpt")
    assert "optimizer.lr changed 0.003 -> 0.001 on resume: applied" in caplog.text

    # The lr the first resumed step (step 4) ran with: the new lr on this run's schedule (the old lr
    # would give 3x that).
    rows = [r for r in csv_rows(tmp_path / "csv" / "version_1" / "metrics.csv") if r.get("train/lr")]
    expected = 1e-3 * warmup_cosine(4, warmup_steps=2, total_steps=8, min_lr_ratio=0.1)
    assert math.isclose(float(rows[0]["train/lr"]), expected, rel_tol=1e-6)
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["lr_schedulers"][0]["base_lrs"] == [1e-3, 1e-3]
    assert {g["initial_lr"] for g in ckpt["optimizer_states"][0]["param_groups"]} == {1e-3}


# ------------------------------------------------------------------------------------ checkpoints

# From the second checkpoint on, the write stops after 64 KiB (flushed) and waits to be killed.
SLOW_SECOND_CHECKPOINT = """
import time
import train.callbacks

_open, _saves = open, []


class StuckFile:
    def __init__(self, file):
        self._file, self._written = file, 0

    def write(self, data):
        n = self._file.write(data)
        self._written += n
        if self._written > 65536:
            self._file.flush()
            time.sleep(600)  # the test kills the process here
        return n

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._file.__exit__(*exc)


def stuck_open(path, mode="r", *args, **kwargs):
    file = _open(path, mode, *args, **kwargs)
    if str(path).endswith(".ckpt.tmp"):
        _saves.append(path)
        if len(_saves) >= 2:
            return StuckFile(file)
    return file


train.callbacks.open = stuck_open
"""


def test_kill_during_checkpoint_write_keeps_the_previous_one(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [
        *TINY, "trainer=cpu", "logger=csv", "trainer.max_steps=9", "trainer.val_check_interval=3",
        "callbacks.model_checkpoint.every_n_train_steps=3",
    ]
    last = run_dir / "checkpoints" / "last.ckpt"
    partial = run_dir / "checkpoints" / "last.ckpt.tmp"
    proc, _ = start_wrapped(tmp_path, SLOW_SECOND_CHECKPOINT, run_dir, *overrides)
    try:
        wait_for_file(last, proc, timeout=240)  # the first save, complete
        deadline = time.monotonic() + 120
        while not (partial.is_file() and partial.stat().st_size > 0):  # the second, stuck halfway
            assert proc.poll() is None and time.monotonic() < deadline, "no stuck second checkpoint"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    # killed halfway through the step-6 write: that file is broken, last.ckpt still the step-3 one
    assert partial.stat().st_size > 0 and checkpoint_problem(partial) is not None
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 3

    output = run_pretrain(run_dir, *overrides)
    assert f"Resuming from {last}" in output
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 9
    assert not partial.exists()  # the next save replaced it

    # <run dir>/pretrain.log has the run's log: our lines, Lightning's, the summary (both runs: 'a')
    log = (run_dir / "pretrain.log").read_text()
    for line in (f"Resuming from {last}", "[val] step      9", "`Trainer.fit` stopped", "pretrain summary"):
        assert line in log, line


def test_unreadable_last_checkpoint_fails_or_falls_back(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    good = checkpoints / "step=3.ckpt"
    torch.save({"global_step": 3, "weights": torch.zeros(1000)}, good)
    last = checkpoints / "last.ckpt"
    last.write_bytes(good.read_bytes()[:2000])  # cut short, as by a crash in a non-atomic write
    os.utime(good, (time.time() - 60, time.time() - 60))

    assert readable_checkpoint(str(good), fall_back=False) == str(good)
    assert readable_checkpoint(str(last), fall_back=True) == str(good)
    with pytest.raises(TrainingError, match=f"Cannot resume: {last} cannot be loaded .* \\({good} is the newest other"):
        readable_checkpoint(str(last), fall_back=False)  # an explicit resume=<path>: named, not taken
    good.unlink()
    with pytest.raises(TrainingError, match="Move it away, .* or start over with resume=never overwrite=true.$"):
        readable_checkpoint(str(last), fall_back=True)


def test_atomic_checkpoint_io_and_collective_timeout_in_the_tp_trainer(tmp_path):
    cfg = compose_pretrain([*TP_TINY, "parallel=tp2", "parallel.timeout_s=42"], tmp_path)
    trainer = build_trainer(cfg)
    assert isinstance(trainer.strategy, ZooParallelStrategy)
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    assert trainer.strategy._timeout == timedelta(seconds=42)

    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 7}, tmp_path / "a" / "last.ckpt")
    assert torch.load(tmp_path / "a" / "last.ckpt", weights_only=False) == {"global_step": 7}
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["last.ckpt"]


# ------------------------------------------------------------------------------- non-finite loss


def poison_loss(monkeypatch, at_call: int, factor: float = math.nan) -> None:
    """The `at_call`-th training forward (1-based) of the llama returns its loss times `factor`."""
    model_class = models.get("llama").model_class
    forward = model_class.forward
    calls = {"n": 0}

    def poisoned(self, *args, labels=None, **kwargs):
        output = forward(self, *args, labels=labels, **kwargs)
        # (not the FLOP count of train.throughput, one forward on the meta device before training)
        if labels is not None and self.training and self.device.type != "meta":
            calls["n"] += 1
            if calls["n"] == at_call:
                output.loss = output.loss * factor
        return output

    monkeypatch.setattr(model_class, "forward", poisoned)


def assert_finite_weights(state: dict) -> None:
    for name, tensor in state.items():
        assert torch.isfinite(tensor).all(), name


def test_nonfinite_loss_stops_before_the_update(tmp_path, monkeypatch):
    poison_loss(monkeypatch, at_call=6)  # the batch of step 5
    overrides = [
        *TINY, "trainer=cpu", "logger=none", "trainer.max_steps=8", "trainer.val_check_interval=4",
        "callbacks.model_checkpoint.every_n_train_steps=2",
    ]
    with pytest.raises(NonFiniteLossError, match=r"stopped at step 5: train/loss is nan; the last checkpoint, .*last\.ckpt, is untouched"):
        train(compose_pretrain(overrides, tmp_path))
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 4
    assert_finite_weights(ckpt["state_dict"])
    assert not (tmp_path / "hf").exists()


def test_nonfinite_gradient_of_a_finite_loss_stops_too(tmp_path, monkeypatch):
    poison_loss(monkeypatch, at_call=3, factor=1e37)  # a finite loss whose gradient overflows
    overrides = [*TINY, "trainer=cpu", "logger=none", "trainer.max_steps=4", "trainer.val_check_interval=4"]
    with pytest.raises(NonFiniteLossError, match="stopped at step 2: the gradient norm is inf"):
        train(compose_pretrain(overrides, tmp_path))


class RecordWeights(L.Callback):
    """Keeps the weights after every training batch, by global step (a callback for the test below)."""

    seen: dict[int, dict] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        RecordWeights.seen[trainer.global_step] = {k: v.clone() for k, v in pl_module.state_dict().items()}


def test_nonfinite_loss_skip_skips_only_that_update(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="train.module")
    poison_loss(monkeypatch, at_call=3)  # the batch of step 2
    overrides = [
        *TINY, "trainer=cpu", "logger=csv", "trainer.max_steps=6", "trainer.val_check_interval=3",
        "nonfinite_loss=skip", f"+callbacks.record._target_={__name__}.RecordWeights",
    ]
    result = train(compose_pretrain(overrides, tmp_path))
    # the weights after step 2 (global_step 3) are those after step 1; every other step moves them
    weights = RecordWeights.seen
    for step in range(2, 7):
        same = all(torch.equal(weights[step][k], weights[step - 1][k]) for k in weights[step])
        assert same == (step == 3), step
    assert result["global_step"] == 6 and math.isfinite(result["val_at_end"]["loss"])
    assert "step 2: train/loss is nan; skipped this update (nonfinite_loss=skip)" in caplog.text
    # every step is in the record, the skipped one with its loss, nan
    losses = [float(r["train/loss"]) for r in csv_rows(next(tmp_path.glob("csv/*/metrics.csv"))) if r.get("train/loss")]
    assert len(losses) == 6 and math.isnan(losses[2]) and sum(map(math.isnan, losses)) == 1
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert_finite_weights(ckpt["state_dict"])


# ----------------------------------------------------------------------------------- a dead rank

# Rank KILL_RANK kills itself (SIGKILL: no clean-up) at the start of step 3, noting the time first.
KILL_RANK_AT_STEP_3 = """
import signal
import time
from train.module import CausalLMModule

_training_step = CausalLMModule.training_step


def training_step(self, batch, batch_idx):
    if self.global_rank == int(os.environ["KILL_RANK"]) and self.global_step == 3:
        with open(os.environ["KILLED_AT"], "w") as f:
            f.write(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    return _training_step(self, batch, batch_idx)


CausalLMModule.training_step = training_step
"""

TP_RUN = [
    *TP_TINY, "parallel=tp2", "parallel.timeout_s=30", "logger=none", "trainer.max_steps=200",
    "trainer.val_check_interval=100",
]


def run_killing_a_rank(tmp_path: Path, rank: int) -> tuple[int, Path, float, int]:
    """Runs TP 2 with rank `rank` killed at step 3: (exit code, the output's file, seconds from the
    kill to the end of the command, its process group)."""
    killed_at = tmp_path / f"killed_at_{rank}"
    run_dir = tmp_path / f"kill_rank_{rank}"
    env = {"KILL_RANK": str(rank), "KILLED_AT": str(killed_at)}
    proc, out = start_wrapped(tmp_path, KILL_RANK_AT_STEP_3, run_dir, *TP_RUN, env=env)
    try:
        returncode = proc.wait(timeout=240)
        ended = time.time()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert killed_at.is_file(), out.read_text()[-3000:]
    return returncode, out, ended - float(killed_at.read_text()), proc.pid


def assert_group_ends(pgid: int, timeout: float) -> None:
    """Every process of the command's group (the other ranks) has exited within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            os.killpg(pgid, signal.SIGKILL)
            pytest.fail(f"a rank was still running {timeout} s after the command ended")
        time.sleep(0.2)


def test_dead_tp_rank_ends_the_run_with_an_error_naming_it(tmp_path):
    returncode, out, seconds, pgid = run_killing_a_rank(tmp_path, rank=1)
    assert seconds < 60, f"rank 0 took {seconds:.1f} s to end after rank 1 died"
    assert_group_ends(pgid, timeout=10)
    output = out.read_text()
    assert "Traceback" not in output
    # Rank 0's collective fails at once (gloo) and it exits with an error naming rank 1. Lightning's
    # own watcher of the ranks it started (polling every 5 s) may SIGKILL it first, after logging
    # that rank 1 died: both name the dead rank and exit non-zero.
    if returncode == 1:
        assert "Rank 0 stopped at step 3: rank 1 (pid" in output and "was killed by SIGKILL" in output
    else:
        assert returncode == -signal.SIGKILL and "[rank: 1] Child process with PID" in output, output[-3000:]

    # Logged before the run: the whole model's parameter count, not one rank's shards.
    cfg = compose_pretrain(TP_TINY, tmp_path)
    model = models.build_model("llama", vocab_size=len(load_tokenizer()), **cfg.model.config)
    count = sum(p.numel() for p in model.parameters())
    assert f"model: llama, {count:,} parameters (split over 2 tensor-parallel ranks)" in output


@pytest.mark.slow  # 20 s; the other rank's death: test_dead_tp_rank_ends_the_run_with_an_error_naming_it
def test_dead_tp_rank_0_ends_the_other_rank(tmp_path):
    returncode, out, _, pgid = run_killing_a_rank(tmp_path, rank=0)
    assert returncode == -signal.SIGKILL
    # rank 1 notices at once (gloo: the peer's sockets close) and exits with an error naming rank 0
    started = time.monotonic()
    assert_group_ends(pgid, timeout=60)
    print(f"rank 1 ended {time.monotonic() - started:.1f} s after rank 0")
    output = out.read_text()
    assert "Rank 1 stopped at step 3: rank 0 (pid" in output and "is gone" in output, output[-3000:]


# ------------------------------------------------------------------------------------- W&B names


def test_multirun_jobs_get_wandb_names_from_their_overrides(tmp_path):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("pretrain", overrides=["model=parallel", "trainer.max_steps=4"], return_hydra_config=True)
    try:
        for mode, expected in ((RunMode.RUN, "pretrain"), (RunMode.MULTIRUN, "pretrain/model=parallel,trainer.max_steps=4")):
            with read_write(cfg.hydra), open_dict(cfg.hydra):
                cfg.hydra.mode = mode
                cfg.hydra.job.override_dirname = "model=parallel,trainer.max_steps=4"
            HydraConfig.instance().set_config(cfg)
            job = cfg.copy()
            with open_dict(job):
                del job["hydra"]
            name_multirun_job(job)
            assert job.logger.wandb.name == expected
    finally:
        HydraConfig.instance().cfg = None
