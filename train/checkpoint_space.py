"""What a checkpoint write that failed says: which file, why, how much it needed and how much was free.

Both writers (the one-file `AtomicCheckpointIO`, train/callbacks.py, and the sharded `train.sharded_checkpoint.write`)
remove what they had written when a write fails (a full disk) and raise `CheckpointWriteError` from here: one line
naming the file, the reason and the space it needed, the previous checkpoint kept.
"""

import shutil
from pathlib import Path

import torch

from train.errors import TrainingError


class CheckpointWriteError(TrainingError):
    """A checkpoint could not be written; the previous one is kept (one line, exit status 1)."""


def tensor_bytes(obj) -> int:
    """Bytes of the tensors held in a (nested) checkpoint dict: about what its file takes on disk. A DTensor
    counts its local shard (what this rank writes)."""
    if isinstance(obj, torch.Tensor):
        local = getattr(obj, "_local_tensor", obj)
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _free_bytes(path: Path) -> int | None:
    for folder in (path, *path.parents):
        if folder.exists():
            return shutil.disk_usage(folder).free
    return None


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def write_failed(path: Path, error: BaseException, needed: int) -> CheckpointWriteError:
    """The one-line error of a failed write of `path` (`needed`: about what it takes), to be raised from `error`."""
    text = str(error).strip()
    reason = getattr(error, "strerror", None) or (text.splitlines()[0] if text else type(error).__name__)
    free = _free_bytes(path)
    space = f"it needs about {_gb(needed)}" + (f", {_gb(free)} is free there" if free is not None else "")
    return CheckpointWriteError(
        f"Could not write the checkpoint {path} ({reason}; {space}); nothing partial is left and the previous "
        f"checkpoint is kept. Free space there or set paths.output_dir / hydra.run.dir on a larger disk, then rerun "
        "the same command to resume."
    )
