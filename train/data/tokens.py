"""Reading a prepared corpus (`train.data.prepare`) without loading it: fixed-length windows by position.

A split's shards are one token stream, cut into non-overlapping windows of `seq_len` tokens (the
remainder dropped); window i is tokens [i * seq_len, (i + 1) * seq_len), which may span two shards. A
window is read with positioned reads (`os.pread`) from the shard files into a fresh buffer: the bytes
stay in the kernel's page cache, shared by every rank of a node, and a process' memory does not grow as an
epoch walks through the corpus (a `np.memmap` would leave every page it touched mapped into the process,
counted in its RSS). Each process (DataLoader workers included) opens its own file descriptors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


@dataclass(frozen=True)
class TokenSplit:
    """One split of a prepared folder: its shard files and where each starts in the split's token stream."""

    folder: Path
    files: tuple[str, ...]
    starts: tuple[int, ...]  # token offset of each shard, then the total
    dtype: np.dtype

    @classmethod
    def of(cls, folder: str | Path, manifest: dict[str, Any], split: str) -> TokenSplit:
        shards = manifest["splits"][split]["shards"]
        starts = np.cumsum([0] + [s["tokens"] for s in shards]).tolist()
        return cls(Path(folder), tuple(s["file"] for s in shards), tuple(starts), np.dtype(manifest["dtype"]))

    @property
    def tokens(self) -> int:
        return self.starts[-1]

    def num_windows(self, seq_len: int) -> int:
        return self.tokens // seq_len

    def read(self, start: int, length: int, files: dict[int, int]) -> np.ndarray:
        """Tokens [start, start + length) as int64; `files` caches this process' descriptors by shard."""
        out = np.empty(length, dtype=self.dtype)
        done = 0
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while done < length:
            offset = start + done - self.starts[shard]
            take = min(length - done, self.starts[shard + 1] - self.starts[shard] - offset)
            if shard not in files:
                files[shard] = os.open(self.folder / self.files[shard], os.O_RDONLY)
            nbytes = take * self.dtype.itemsize
            data = os.pread(files[shard], nbytes, offset * self.dtype.itemsize)
            if len(data) != nbytes:
                raise OSError(
                    f"{self.folder / self.files[shard]} is shorter than its manifest says; prepare the corpus "
                    "again (python -m train.prepare_data ... overwrite=true)."
                )
            out[done : done + take] = np.frombuffer(data, dtype=self.dtype)
            done += take
            shard += 1
        return out.astype(np.int64)


class WindowDataset(Dataset):
    """The windows of one split of several prepared corpora, numbered source after source.

    Item `offsets[s] + w` is window w of source s: `{"input_ids": LongTensor[seq_len]}`, with `"source": s`
    when `with_source` (validation batches carry it, for the loss per source).
    """

    def __init__(self, splits: list[TokenSplit], seq_len: int, limits: list[int] | None = None,
                 with_source: bool = False):
        self.splits, self.seq_len, self.with_source = splits, seq_len, with_source
        counts = [s.num_windows(seq_len) for s in splits]
        if limits is not None:
            counts = [min(c, limit) for c, limit in zip(counts, limits, strict=True)]
        self.counts = counts
        self.offsets = np.cumsum([0] + counts).tolist()
        self._files: dict[int, dict[int, int]] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_files": {}}  # descriptors are per process

    def _descriptors(self, source: int) -> dict[int, int]:
        if self._pid != os.getpid():  # a forked DataLoader worker: its own descriptors
            self._files, self._pid = {}, os.getpid()
        return self._files.setdefault(source, {})

    def window(self, index: int) -> tuple[int, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        source = int(np.searchsorted(self.offsets, index, side="right")) - 1
        local = index - self.offsets[source]
        split = self.splits[source]
        return source, split.read(local * self.seq_len, self.seq_len, self._descriptors(source))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        source, tokens = self.window(index)
        item = {"input_ids": torch.from_numpy(tokens)}
        if self.with_source:
            item["source"] = torch.tensor(source)
        return item

    def __del__(self) -> None:
        if getattr(self, "_pid", None) == os.getpid():
            for files in self._files.values():
                for fd in files.values():
                    os.close(fd)

