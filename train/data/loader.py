"""The train loader and its sampler, whose position in the epoch is state: a run resumes exactly mid-epoch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class BlockDataset(Dataset):
    """Rows of a [n, seq_len] LongTensor as `{"input_ids": LongTensor[seq_len]}`."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[index]}


class ResumableSampler(DistributedSampler):
    """DistributedSampler (shuffle, drop_last) that can start part-way into an epoch.

    The order is a permutation seeded by `seed + epoch` (`set_epoch`, called by Lightning every epoch);
    rank r of R takes every R-th index of it. Being a DistributedSampler, Lightning leaves it in place
    under DDP instead of wrapping it. `start` (set by `ResumableDataLoader.load_state_dict`) skips that
    many of this rank's samples on the next iteration only.
    """

    def __init__(self, dataset: Dataset, *, num_replicas: int = 1, rank: int = 0, seed: int = 0):
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.start = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start, self.start = self.start, 0
        return iter(indices[start:])


class ResumableDataLoader(DataLoader):
    """DataLoader whose position in the epoch is part of its state, for exact mid-epoch resume.

    `state_dict()` = {epoch, batches_consumed, ...}: batches_consumed counts batches handed to the
    caller in the current epoch (counted where they leave this loader, so worker prefetching does not
    inflate it). `load_state_dict()` restores the epoch and makes the next iteration start after those
    batches: the sampler skips `batches_consumed * batch_size` of this rank's indices, so the skipped
    blocks are not even loaded. The skip applies to the next iteration only, and only if the sampler is
    still at the saved epoch and batches remain in it: from a checkpoint taken after an epoch's last
    batch Lightning goes on to the next epoch, which starts from its beginning.

    Lightning 2.6 calls `state_dict()` on every train dataloader that has both methods when it writes
    a checkpoint (`fit_loop.on_save_checkpoint` -> `CombinedLoader._state_dicts`), and on resume calls
    `load_state_dict()` before it first iterates the loader (`FitLoop.setup_data`). Its batch counters
    are restored from the checkpoint at the same time, so the epoch ends after the remaining batches.
    Under DDP every rank loads rank 0's state: all ranks consume the same number of batches.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.batches_consumed = 0
        self._resume: tuple[int, int] | None = None  # (epoch, batches to skip), set by load_state_dict

    def _epoch(self) -> int:
        return getattr(self.sampler, "epoch", 0)

    def __iter__(self) -> Iterator[Any]:
        # A generator: nothing below runs until the first batch is requested, so a set_epoch() that
        # comes between iter() and next() (Lightning does exactly that) is honoured.
        resume, self._resume = self._resume, None
        start = 0
        if resume is not None and resume[0] == self._epoch() and resume[1] < len(self):
            start = resume[1]
        # Otherwise the saved position does not apply: the checkpoint was taken after the last batch of
        # its epoch and Lightning has moved on to the next epoch, which starts from the beginning.
        self.batches_consumed = start
        if isinstance(self.sampler, ResumableSampler):
            self.sampler.start = start * self.batch_size
            iterator = super().__iter__()
        else:
            # Some other sampler (e.g. Lightning swapped in a SequentialSampler for overfit_batches):
            # skip by drawing the batches, slower but the same result.
            iterator = super().__iter__()
            for _ in range(start):
                next(iterator, None)
        for batch in iterator:
            self.batches_consumed += 1
            yield batch

    def _identity(self) -> dict[str, int]:
        sampler = self.sampler
        return {
            "num_samples": len(self.dataset),
            "batch_size": self.batch_size,
            "num_replicas": getattr(sampler, "num_replicas", 1),
            "seed": getattr(sampler, "seed", 0),
        }

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch(), "batches_consumed": self.batches_consumed, **self._identity()}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        # Of batch_size and num_replicas only their product, the global batch, has to match: optimizer step
        # k takes positions [k*G, (k+1)*G) of the shuffled order however many data-parallel replicas they
        # are dealt to (rank r takes every R-th), so a run resumes exactly at other parallel degrees.
        now = self._identity()
        saved = {**now, **{k: state_dict[k] for k in now if k in state_dict}}
        pairs = {
            "num_samples": (saved["num_samples"], now["num_samples"]),
            "seed": (saved["seed"], now["seed"]),
            "the global batch (batch_size x num_replicas)": (
                saved["batch_size"] * saved["num_replicas"],
                now["batch_size"] * now["num_replicas"],
            ),
        }
        mismatched = {k: pair for k, pair in pairs.items() if pair[0] != pair[1]}
        if mismatched:
            details = ", ".join(f"{k} was {saved} and is now {now}" for k, (saved, now) in mismatched.items())
            raise ValueError(
                f"Cannot resume the train dataloader mid-epoch exactly: {details}; keep them as saved."
            )
        epoch, consumed = int(state_dict["epoch"]), int(state_dict["batches_consumed"])
        # Restore the epoch too, so a loader restored outside Lightning (nobody calls set_epoch) continues
        # the saved epoch; Lightning calls set_epoch itself, with the same value mid-epoch.
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        self._resume = (epoch, consumed)
        self.batches_consumed = consumed  # a checkpoint taken before iterating again saves the same spot
