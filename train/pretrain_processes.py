"""How a pretraining run lives with its processes: the ranks it started and the signals it gets.

- `explain_lost_ranks`: a collective that failed because another rank died becomes a `TrainingError` naming
  that rank (and rank 0 kills the ranks it started that are still there);
- `sigterm_outside_fit`: SIGTERM in a validation outside fit becomes `Interrupted` (exit status 143);
- `process_group_of_this_run`: a process group the run started ends with it, and the environment is put back.
"""

import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from train.errors import Interrupted, TrainingError
from train.run_directory import checkpoint_on_disk

# In a rank that Lightning started, the parent is rank 0: if it changes, rank 0 is gone.
_PARENT_PID = os.getppid()


def exit_status(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"


def lost_rank(trainer: L.Trainer) -> str:
    """The rank whose loss broke a collective, as far as this rank can tell."""
    # Rank 0 started the other ranks of its node (Lightning's subprocess launcher) and can ask the OS.
    # The others were started by rank 0 and are orphaned when it dies.
    children = list(getattr(trainer.strategy.launcher, "procs", None) or [])
    # A dead process's sockets close (the error here) just before its exit is reported: wait a little.
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        ended = [(rank, p) for rank, p in enumerate(children, start=1) if p.poll() not in (None, 0)]
        if ended:
            return ", ".join(f"rank {rank} (pid {p.pid}) {exit_status(p.returncode)}" for rank, p in ended)
        if trainer.global_rank != 0 and os.getppid() != _PARENT_PID:
            return f"rank 0 (pid {_PARENT_PID}) is gone"
        time.sleep(0.1)
    stopped = [(rank, p) for rank, p in enumerate(children, start=1) if process_state(p.pid) == "T"]
    if stopped:
        return ", ".join(f"rank {rank} (pid {p.pid}) is stopped (SIGSTOP or a debugger)" for rank, p in stopped)
    return "another rank stopped answering"


def process_state(pid: int) -> str | None:
    """The state letter of a Linux process (R running, S sleeping, T stopped, ...), None if unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def end_other_ranks(trainer: L.Trainer) -> list[int]:
    """Rank 0 kills the ranks it started that are still there (stopped or hung ones would otherwise outlive
    the command, holding their devices); SIGKILL, the one signal a stopped process obeys. Their pids."""
    children = [p for p in getattr(trainer.strategy.launcher, "procs", None) or [] if p.poll() is None]
    for p in children:
        p.kill()
    for p in children:
        p.wait(timeout=10)
    return [p.pid for p in children]


@contextmanager
def explain_lost_ranks(trainer: L.Trainer, output_dir: Path):
    """Turns the error a collective raises when another rank died (gloo: at once; otherwise after the
    process group's timeout, `parallel.timeout_s`) into a `TrainingError` that names that rank."""
    try:
        yield
    except TrainingError:
        raise
    except RuntimeError as error:
        collective = isinstance(error, dist.DistError) or "gloo" in str(error)
        if trainer.world_size == 1 or not collective:
            raise
        detail = str(error).splitlines()[0][:300]
        lost = lost_rank(trainer)
        ended = end_other_ranks(trainer) if trainer.global_rank == 0 else []
        killed = f" Killed the ranks still running (pids {', '.join(map(str, ended))})." if ended else ""
        why = " That rank's own output says why." if "stopped (SIGSTOP" not in lost else ""
        raise TrainingError(
            f"Rank {trainer.global_rank} stopped at step {trainer.global_step}: {lost}, so a collective failed "
            f"({detail}).{killed}{why} {checkpoint_on_disk(output_dir)}"
        ) from error


@contextmanager
def sigterm_outside_fit(trainer: L.Trainer, output_dir: Path):
    """SIGTERM in a validation outside fit (step 0, the final one): Lightning stops with SIGTERMException, a
    SystemExit with status 0; it becomes `Interrupted` (exit status 143) saying what is on disk. (During fit
    `StopOnSigterm` writes the checkpoint first.)"""
    try:
        yield
    except SIGTERMException:
        raise Interrupted(
            f"Stopped by SIGTERM at step {trainer.global_step} (in a validation). {checkpoint_on_disk(output_dir)}"
        ) from None


@contextmanager
def process_group_of_this_run():
    """A process group the run starts in this process (ZooParallelStrategy: Lightning starts one even for a
    single process resuming a sharded checkpoint) ends with the run, and the environment Lightning exported for
    it (MASTER_PORT, WORLD_SIZE, LOCAL_RANK, ...) is put back: a later run in the same process (eval.tour,
    eval.replicate, train.convert's retraining) or a process it starts would otherwise take it for its own."""
    started_here = not (dist.is_available() and dist.is_initialized())
    environ = dict(os.environ)
    try:
        yield
    finally:
        if started_here and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            os.environ.clear()
            os.environ.update(environ)
