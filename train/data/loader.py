"""The train loader and its sampler, whose position in the epoch is state: a run resumes exactly mid-epoch."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from train.data.permutation import Permutation


class ResumableSampler(DistributedSampler):
    """The shuffled order of an epoch over a mixture of sources, dealt to data-parallel ranks; it can start
    part-way into an epoch.

    `counts[s]` windows of source s are items `offsets[s] ..` of the dataset (`WindowDataset`'s
    numbering). An epoch has N = sum(counts) samples; source s gets the share `weights[s]` of them
    (largest remainders; with one source, or weights proportional to the counts, every window once). The
    epoch's positions are permuted by a `Permutation` keyed by (seed, epoch), so the sources are
    interleaved at random in exact proportions; sample j of source s is window `perm_s(j mod counts[s])`,
    a permutation keyed by (seed, epoch, s, j // counts[s]): a source given more than its size is
    repeated, each pass in another order; one given less sees another subset every epoch. Nothing is
    materialised: a rank's positions are computed in chunks as they are drawn.

    As in DistributedSampler (so Lightning leaves it in place under DDP), `set_epoch` sets the epoch and
    rank r of R takes every R-th position, the last partial round dropped. `start` (set by
    `ResumableDataLoader.load_state_dict`) skips that many of this rank's samples on the next iteration only.
    """

    _CHUNK = 8192

    def __init__(self, dataset: Dataset, *, num_replicas: int = 1, rank: int = 0, seed: int = 0,
                 counts: list[int] | None = None, weights: list[float] | None = None):
        super().__init__(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.counts = list(counts) if counts is not None else [len(dataset)]
        self.offsets = np.cumsum([0] + self.counts).tolist()
        total = self.offsets[-1]
        self.allocation = mixture_allocation(self.counts, weights, total)
        self.alloc_starts = np.cumsum([0] + self.allocation)
        self.epoch_length = total
        self.num_samples = total // self.num_replicas
        self.total_size = self.num_samples * self.num_replicas
        # Identifies the mixture in the loader's state: a resume over other sources or weights is refused.
        digest = hashlib.sha256(repr((self.counts, self.allocation)).encode()).digest()
        self.mixture_id = int.from_bytes(digest[:6], "little")
        self.start = 0
        self._perms: dict[tuple[int, ...], Permutation] = {}

    def _perm(self, n: int, *key: int) -> Permutation:
        if key not in self._perms:
            if len(self._perms) > 64:
                self._perms.clear()
            self._perms[key] = Permutation(n, *key)
        return self._perms[key]

    def positions(self, first: int, stop: int) -> np.ndarray:
        """Dataset indices of this rank's samples first .. stop-1 of the current epoch."""
        k = self.rank + self.num_replicas * np.arange(first, stop, dtype=np.int64)
        p = self._perm(self.epoch_length, self.seed, self.epoch).take(k)
        source = np.searchsorted(self.alloc_starts, p, side="right") - 1
        j = p - self.alloc_starts[source]
        out = np.empty_like(p)
        for s in np.unique(source):
            here = source == s
            count = self.counts[s]
            passes = j[here] // count
            windows = np.empty(int(here.sum()), dtype=np.int64)
            for q in np.unique(passes):
                sel = passes == q
                windows[sel] = self._perm(count, self.seed, self.epoch, int(s), int(q)).take(j[here][sel] % count)
            out[here] = self.offsets[s] + windows
        return out

    def __iter__(self) -> Iterator[int]:
        start, self.start = self.start, 0
        for first in range(start, self.num_samples, self._CHUNK):
            yield from self.positions(first, min(first + self._CHUNK, self.num_samples)).tolist()

    def __len__(self) -> int:
        return self.num_samples


class InOrderSampler(DistributedSampler):
    """The validation order: every index in order, rank r of R taking every R-th (DistributedSampler without
    shuffling, the last round padded from the start), computed as it is drawn rather than held as a list."""

    def __init__(self, dataset: Dataset, *, num_replicas: int = 1, rank: int = 0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        for position in range(self.rank, self.total_size, self.num_replicas):
            yield position % n


def mixture_allocation(counts: list[int], weights: list[float] | None, total: int) -> list[int]:
    """Samples of each source in an epoch of `total`: proportional to `weights` (default: the counts)."""
    if weights is None:
        return list(counts)
    shares = np.asarray(weights, dtype=np.float64)
    shares = shares / shares.sum() * total
    allocation = np.floor(shares).astype(np.int64)
    # Largest remainders first, ties to the earlier source: deterministic.
    for s in np.argsort(-(shares - allocation), kind="stable")[: total - int(allocation.sum())]:
        allocation[s] += 1
    return allocation.tolist()


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
            "mixture": getattr(sampler, "mixture_id", 0),
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
            "the mixture (windows and weights of each source)": (saved["mixture"], now["mixture"]),
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
