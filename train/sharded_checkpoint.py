"""Sharded training checkpoints on disk: a torch.distributed.checkpoint (DCP) directory behind a link.

`<run>/checkpoints/last.ckpt` (and `step3.ckpt`, ...) of a sharded run is a symbolic link to a directory
`last.ckpt.d<time>/` holding

- the DCP files (`.metadata`, `__<rank>_0.distcp`): every rank writes only its own shards of the weights
  and of the optimizer state (`parallel.checkpoint`'s views: they reshard to other degrees on load);
- `meta.pt`: everything else Lightning keeps in a checkpoint (step, loops, callbacks, lr schedule,
  hyper-parameters), the optimizer's hyper-parameters per group, the model's config, and the names of any
  weights that held NaN or inf when saved (so a resume can refuse them without reading the weights).

Atomic like the file checkpoints (`train.callbacks.AtomicCheckpointIO`): the new directory is written
completely (every rank's shards, then `meta.pt`, fsynced), and only then does rank 0 swap the link with
an atomic rename. A process killed at any point leaves the link on the previous complete checkpoint;
a directory that no link names is removed by the next save. A save that fails (a full disk) removes its
directory and says so in one line (`write`).

Damage after the save is refused, never loaded: every record of the DCP files carries a CRC-32 checked as it
is read (`train.checkpoint_checksums`), and `problem` finds without reading any record a shard file that is
missing or cut short, a `.metadata` or `meta.pt` that cannot be read, or a link whose directory is gone.
"""

import os
import shutil
import time
from pathlib import Path

import torch

from train import checkpoint_checksums
from train.checkpoint_space import write_failed
from train.errors import TrainingError

META = "meta.pt"

__all__ = [
    "META", "DamagedCheckpoint", "is_sharded", "read_meta", "remove", "swap_in", "new_directory", "problem", "write",
    "load", "loadable_siblings",
]


class DamagedCheckpoint(TrainingError):
    """A record of a sharded checkpoint whose bytes changed after it was written (found while loading it)."""

    def __init__(self, path: str | Path, detail: str):
        self.path, self.detail = Path(path), detail
        super().__init__(f"{path} is damaged: {detail}")


def is_sharded(path: str | Path) -> bool:
    """Whether `path` is a sharded checkpoint (a directory, or a link to one), not a one-file checkpoint."""
    return Path(path).is_dir()


def read_meta(path: str | Path) -> dict:
    """The small part of a checkpoint: for a one-file checkpoint the whole dict (tensors memory-mapped, not
    read), for a sharded one its `meta.pt`."""
    path = Path(path)
    if path.is_dir():
        return torch.load(path / META, map_location="cpu", weights_only=False)
    return torch.load(path, map_location="cpu", mmap=True, weights_only=False)


NOT_A_TRAINING_CHECKPOINT = "not a training checkpoint"
HF_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".json", ".pt", ".pth")


def problem(path: str | Path) -> str | None:
    """Why `path` cannot be resumed from (cut short by a crash, another format), or None if it can. A model that
    is not a training checkpoint (a Hugging Face folder or weights file) says `NOT_A_TRAINING_CHECKPOINT` first."""
    path = Path(path)
    if path.is_dir() and (path / "config.json").is_file():
        return f"{NOT_A_TRAINING_CHECKPOINT} but a Hugging Face model folder"
    if path.is_file() and path.suffix in HF_WEIGHT_SUFFIXES:
        return f"{NOT_A_TRAINING_CHECKPOINT} but a {path.suffix} file (a model's weights or settings)"
    if path.is_symlink() and not path.exists():
        return f"it links to {os.readlink(path)}, which does not exist (removed by hand or by another program)"
    if path.is_dir() and not (path / ".metadata").is_file():
        return "no .metadata: its shards were never completed"
    if path.is_dir() and (damage := checkpoint_checksums.truncated_or_missing(path)):
        return damage
    try:
        meta = read_meta(path)
    except Exception as error:  # any failure to load means the same to the user
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no details'}"
    if not isinstance(meta, dict) or not {"state_dict", "global_step"} & set(meta):
        return f"{NOT_A_TRAINING_CHECKPOINT}: it holds no state_dict or global_step"
    return None


def new_directory(link: Path) -> Path:
    """A fresh directory name for the checkpoint `link` will point to (rank 0 picks it, all ranks use it)."""
    return link.with_name(f"{link.name}.d{time.time_ns()}")


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_meta(directory: Path, meta: dict) -> None:
    with open(directory / META, "wb") as file:
        torch.save(meta, file)
        file.flush()
        os.fsync(file.fileno())
    _fsync_directory(directory)


def swap_in(link: Path, directory: Path) -> None:
    """Point `link` at the complete `directory` atomically (rank 0), then remove the directories of `link`
    that no longer have a link (the previous checkpoint, a save killed half-way)."""
    staged = link.with_name(f"{link.name}.link-tmp")
    staged.unlink(missing_ok=True)
    staged.symlink_to(directory.name)  # relative: the run directory can move
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)  # a directory in the link's place (not ours): replaced
    os.replace(staged, link)
    _fsync_directory(link.parent)
    for stale in link.parent.glob(f"{link.name}.d*"):
        if stale.is_dir() and stale.name != directory.name:
            shutil.rmtree(stale, ignore_errors=True)


def write(directory: Path, tensors: dict, meta: dict | None, needed_bytes: int) -> None:
    """Every rank's shards of `tensors` into the fresh `directory` (collective), then `meta` as `meta.pt` (rank 0,
    the one rank given a `meta`). A failure on any rank (a full disk) removes the directory and raises
    `CheckpointWriteError` on every rank: one line, the link still on the previous checkpoint."""
    try:
        checkpoint_checksums.save(tensors, directory)
        if meta is not None:
            write_meta(directory, meta)
    except Exception as error:
        if meta is not None:
            shutil.rmtree(directory, ignore_errors=True)
        raise write_failed(directory, error, needed_bytes) from None


def load(state: dict, path: str | Path, **kwargs) -> None:
    """Load `state`'s tensors from the sharded checkpoint `path` (`kwargs`: DCP's planner, no_dist), each record
    checked against its CRC-32; a damaged one raises `DamagedCheckpoint` (one line, on every rank)."""
    try:
        checkpoint_checksums.load(state, Path(path), **kwargs)
    except checkpoint_checksums.DamagedRecord as error:
        raise DamagedCheckpoint(path, f"{error} (the file changed on disk after the checkpoint was written)") from None


def loadable_siblings(path: str | Path) -> list[Path]:
    """The other checkpoints beside `path` (`*.ckpt`) that `problem` passes, newest first."""
    path = Path(path)
    others = (p for p in path.parent.glob("*.ckpt") if p.name != path.name and p.exists())
    return [p for p in sorted(others, key=lambda p: p.stat().st_mtime, reverse=True) if problem(p) is None]


def remove(path: str | Path) -> None:
    """Remove a checkpoint: a file, or a link and the directory it points to."""
    path = Path(path)
    if path.is_symlink():
        target = path.resolve()
        path.unlink()
        if target.is_dir() and target.parent == path.parent.resolve():
            shutil.rmtree(target, ignore_errors=True)
    elif path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
