"""Bad inputs to `train.pretrain` that a new user's sweep hit: overwrite under resume=auto, resume= of
an HF model, a full disk during a checkpoint; each refused in one `Error:` line naming the value, with a non-zero exit
and nothing on disk changed unasked, or done as the README promises (tests/test_bad_inputs_train.py: the others)."""

import errno
import subprocess
from pathlib import Path

import pytest
import torch

from tests.test_train import pretrain_command, run_pretrain, subprocess_env
from train.callbacks import AtomicCheckpointIO
from train.checkpoint_space import CheckpointWriteError
from train.run_directory import readable_checkpoint


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file of the run under `folder` with its size and modification time (what 'nothing changed'
    compares); Hydra's own record of each command (.hydra/, the appended pretrain.log) and the run directory's
    lock (.run.lock, naming whichever command last held it) left out."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))
            if p.is_file() and ".hydra" not in p.parts and p.suffix != ".log" and p.name != ".run.lock"}  # fmt: skip


def _run(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(pretrain_command(run_dir, *overrides), cwd=run_dir.parent, env=subprocess_env(),
                          capture_output=True, text=True, timeout=240)  # fmt: skip


def _error_lines(proc) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("Error:")]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("bad_inputs") / "run"
    run_pretrain(run_dir, "trainer.max_steps=3", "logger=csv")
    return run_dir


def test_resume_from_an_hf_weights_file_is_refused(finished_run, tmp_path):
    """resume=<run>/hf/model.safetensors: one line saying it is not a training checkpoint and what to pass
    (+model.init_from), exit 1, before anything is built (was: a 60-line traceback from torch.load)."""
    weights = finished_run / "hf" / "model.safetensors"
    before = _snapshot(finished_run)
    proc = _run(tmp_path / "new", "trainer.max_steps=3", f"resume={weights}")
    assert proc.returncode == 1, proc.stderr[-2000:]
    (line,) = _error_lines(proc)
    assert str(weights) in line and "not a training checkpoint" in line and "+model.init_from=" in line
    assert "Traceback" not in proc.stdout + proc.stderr
    # the hf/ folder itself, by the same check (in process)
    with pytest.raises(ValueError, match=r"is not a training checkpoint but a Hugging Face model folder.*\+model\.init_from="):
        readable_checkpoint(str(weights.parent), fall_back=False)
    assert _snapshot(finished_run) == before


def test_overwrite_with_resume_of_its_own_checkpoint_is_refused(finished_run):
    before = _snapshot(finished_run)
    resume = finished_run / "checkpoints" / "last.ckpt"
    proc = _run(finished_run, "trainer.max_steps=5", "overwrite=true", f"resume={resume}")
    assert proc.returncode == 1
    (line,) = _error_lines(proc)
    assert "overwrite=true" in line and str(resume) in line
    assert _snapshot(finished_run) == before


def test_overwrite_true_replaces_the_run_even_with_resume_auto(finished_run):
    """README: "overwrite=true replaces the run, the old last.ckpt and hf/ removed first" (was: resume=auto
    continued the old run from step 3 and ignored overwrite)."""
    old = torch.load(finished_run / "checkpoints" / "last.ckpt", weights_only=False, mmap=True)["global_step"]
    assert old == 3
    proc = _run(finished_run, "trainer.max_steps=2", "overwrite=true", "resume=auto", "logger=csv")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "Resuming from" not in output and "overwrite=true: removed the earlier run's" in output
    new = torch.load(finished_run / "checkpoints" / "last.ckpt", weights_only=False, mmap=True)["global_step"]
    assert new == 2  # a new run of 2 steps, not the old one continued (it was already past 2)


def test_a_full_disk_leaves_no_partial_file_and_says_how_much_was_needed(tmp_path, monkeypatch):
    """A checkpoint write that fails (ENOSPC) removes its .tmp, keeps the previous checkpoint and raises one
    error naming the file, the reason and the size it needed (was: two tracebacks and a partial last.ckpt.tmp)."""
    io = AtomicCheckpointIO()
    path = tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(1000)}, "global_step": 1}, path)
    previous = path.read_bytes()
    real_save = torch.save

    def full_disk(obj, file, *args, **kwargs):
        file.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointWriteError) as caught:
        io.save_checkpoint({"state_dict": {"w": torch.ones(250_000)}, "global_step": 2}, path)
    monkeypatch.setattr(torch, "save", real_save)
    message = str(caught.value)
    assert str(path) in message and "No space left on device" in message and "needs about 1.0 MB" in message
    assert "\n" not in message
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]  # no last.ckpt.tmp
    assert path.read_bytes() == previous
