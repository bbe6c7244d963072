"""One run per run directory, and no rank outliving its launcher.

- `hold_run_directory`: the run's first process holds an exclusive lock on `<run dir>/.run.lock` for the run's
  life (`fcntl.flock`: the kernel drops it when the process ends, however it ends). A second run into the same
  directory is refused in one line naming the process that holds it. The file keeps the holder's pid and start
  time; a lock left by a process that has ended is taken over, said in one line.
- `end_with_launcher`: a rank started by a launcher (torchrun, or the processes Lightning starts for the other
  ranks) asks the kernel for SIGTERM when its launcher dies (`prctl(PR_SET_PDEATHSIG)`). torch starts ranks in
  sessions of their own, so killing only torchrun would otherwise leave them training unattended, or asleep
  forever in start-up. SIGTERM is the scheduler's signal: in training the ranks agree on it at the end of the
  step and write the checkpoint (exit 143); before the trainer starts it ends the process.
"""

import contextlib
import ctypes
import fcntl
import logging
import os
import re
import signal
import time
from pathlib import Path

from train.cli import ExplainedError

log = logging.getLogger("train.pretrain")

LOCK_FILE = ".run.lock"
_PR_SET_PDEATHSIG = 1


class RunDirectoryInUse(ExplainedError):
    """Another run holds the run directory."""


def _is_first_process() -> bool:
    """The process a run starts from: rank 0 of torchrun or srun, or the process Lightning starts the others from
    (on node 0)."""
    return all(os.environ.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def hold_run_directory(output_dir: Path):
    """The run directory's lock, held by the run's first process while the body runs (other ranks: nothing)."""
    if not _is_first_process():
        yield
        return
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / LOCK_FILE
    with open(path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "a process that has not written its pid yet"
            raise RunDirectoryInUse(
                f"hydra.run.dir={output_dir} is in use by another run ({holder}): two runs in one directory would "
                "both write its checkpoints and hf/. Wait for it to end, stop it, or give another hydra.run.dir."
            ) from None
        lock.seek(0)
        before = lock.read().strip()
        found = re.match(r"pid (\d+)", before)
        pid = int(found.group(1)) if found else None
        if pid is not None and pid != os.getpid() and not _alive(pid):
            log.info(f"{path}: the run that held it ({before}) has ended; this run takes it over.")
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        lock.flush()
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def end_with_launcher() -> None:
    """SIGTERM to this process when the process that launched it dies (Linux; elsewhere nothing)."""
    launched = "TORCHELASTIC_RUN_ID" in os.environ or not _is_first_process()
    if not launched or not hasattr(os, "getppid"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before the request was made
        os.kill(os.getpid(), signal.SIGTERM)
