"""`LMDataModule`: windows of prepared token shards served to Lightning, one share per data-parallel rank."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from torch.utils.data import DataLoader

from train.data.corpus import CORPUS
from train.data.documents import DataError, SourceSettings
from train.data.loader import InOrderSampler, ResumableDataLoader, ResumableSampler
from train.data.prepare import (
    MANIFEST,
    check_manifest,
    default_prepared_dir,
    prepare_corpus,
    read_manifest,
)
from train.data.tokenizer import load_tokenizer, tokenizer_fingerprint
from train.data.tokens import TokenSplit, WindowDataset


class LMDataModule(L.LightningDataModule):
    """Causal-LM windows for Lightning: batches are `{"input_ids": LongTensor[batch_size, seq_len]}` (validation
    batches also `"source"`, the index of the source each row comes from).

    The corpus is `source` (the bundled corpus, a local file or folder, a hub dataset, or a folder prepared
    by `python -m train.prepare_data`), or `sources`, a list of `{path: <any of those>, weight: w, name: ...}`
    mixed by weight (`ResumableSampler`). A source that is not prepared yet is prepared on first use
    (`train.data.prepare`): `prepare_data()`, which Lightning runs on one process per node while the
    others wait, or `setup()` outside Lightning (a file lock makes other processes wait). `setup()` then
    only opens the shards: a rank's memory does not grow with the corpus.

    The train loader shuffles with a permutation fixed by (seed, epoch), drops the last partial batch and
    resumes exactly mid-epoch from a Lightning checkpoint (see `ResumableDataLoader`). Under a parallel
    Lightning strategy each data-parallel rank takes its own share (`trainer.distributed_sampler_kwargs`,
    which for the zoo's strategy are the dp x ep ranks); outside Lightning, an initialised torch.distributed
    means one share per global rank; `dp_size`/`dp_rank` override both. The validation loader is in order,
    not shuffled; `max_val_batches` keeps the first batches of each source.

    `seed` drives the shuffling only. The train/validation split has its own `split_seed` (default 0,
    the split the bundled tokenizer was trained on), so runs with different seeds are validated on the
    same documents and the tokenizer never saw them.
    """

    def __init__(
        self,
        source: str = CORPUS,
        tokenizer: str | None = None,
        seq_len: int = 128,
        batch_size: int = 16,
        num_workers: int = 0,
        seed: int = 0,
        validation_fraction: float = 0.1,
        hf_config: str | None = None,
        max_val_batches: int | None = None,
        text_column: str = "text",
        dp_size: int | None = None,
        dp_rank: int | None = None,
        split_seed: int = 0,
        sources: list[dict[str, Any]] | None = None,
        prepared_dir: str | None = None,
        num_proc: int | None = None,
        shard_tokens: int = 100_000_000,
    ):
        super().__init__()
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if value < 1:
                raise DataError(f"data.{name}={value} must be at least 1.")
        if (dp_size is None) != (dp_rank is None):
            raise ValueError(
                f"Give both dp_size and dp_rank or neither (got dp_size={dp_size}, dp_rank={dp_rank})."
            )
        self.settings = SourceSettings(source, hf_config, text_column, validation_fraction, split_seed)
        self.tokenizer_name = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.max_val_batches = max_val_batches
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.num_proc = num_proc
        self.shard_tokens = shard_tokens
        self.entries = source_entries(sources, source, prepared_dir)
        self.source_names = [entry["name"] for entry in self.entries]
        self.tokenizer = load_tokenizer(tokenizer)
        self.vocab_size = len(self.tokenizer)
        self._tokenizer_id = tokenizer_fingerprint(self.tokenizer)
        self.train_dataset: WindowDataset | None = None
        self.val_dataset: WindowDataset | None = None
        self.weights: list[float] | None = None

    @property
    def source(self) -> str:
        return self.settings.source

    def folders(self, overwrite: bool = False, progress: bool = True) -> list[Path]:
        """The prepared folder of every source, prepared now where it is missing (`overwrite`: prepared
        again; a folder given as a source's path, already prepared, is read as it is)."""
        folders = []
        for entry in self.entries:
            path = entry["path"]
            if entry["prepared_dir"] is None and (Path(path).expanduser() / MANIFEST).exists():
                folders.append(Path(path).expanduser())
                continue
            settings = replace(self.settings, source=path)
            folder = entry["prepared_dir"] or default_prepared_dir(settings, self._tokenizer_id)
            # Prepared now if missing; a folder prepared from other files, a split or a tokenizer is refused.
            folders.append(
                prepare_corpus(settings, self.tokenizer_name, folder=folder, num_proc=self.num_proc,
                               shard_tokens=self.shard_tokens, overwrite=overwrite, progress=progress,
                               tokenizer=self.tokenizer)
            )
        return folders

    def prepare_data(self) -> None:
        self.folders()

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        train, validation = [], []
        for folder in self.folders():
            manifest = read_manifest(folder)
            check_manifest(manifest, folder, self._tokenizer_id, str(self.tokenizer_name or "null"))
            train.append(TokenSplit.of(folder, manifest, "train"))
            validation.append(TokenSplit.of(folder, manifest, "validation"))
        num_replicas, _ = self._data_parallel()
        self.train_dataset = WindowDataset(train, self.seq_len)
        for name, count, entry in zip(self.source_names, self.train_dataset.counts, self.entries, strict=True):
            if count == 0 and entry["weight"] > 0:
                raise DataError(
                    f"The source {name!r} has no window of data.seq_len={self.seq_len} tokens ({entry['path']}); "
                    "lower data.seq_len or give it weight 0."
                )
        needed = self.batch_size * num_replicas
        if len(self.train_dataset) < needed:
            raise DataError(
                f"The train split of {', '.join(self.source_names)} has {len(self.train_dataset)} windows of "
                f"data.seq_len={self.seq_len} tokens, fewer than one batch per data replica (data.batch_size="
                f"{self.batch_size} x {num_replicas} replicas = {needed}); lower data.seq_len or data.batch_size."
            )
        weights = [float(entry["weight"]) for entry in self.entries]
        self.weights = weights if len(self.entries) > 1 else None
        limit = None if self.max_val_batches is None else self.max_val_batches * self.batch_size
        self.val_dataset = WindowDataset(
            validation, self.seq_len, limits=None if limit is None else [limit] * len(validation), with_source=True
        )
        if len(self.val_dataset) == 0:
            raise DataError(
                f"The validation split of {', '.join(self.source_names)} has no window of data.seq_len="
                f"{self.seq_len} tokens; lower data.seq_len or raise data.validation_fraction."
            )

    def _data_parallel(self) -> tuple[int, int]:
        """(number of data-parallel replicas, this replica's index): the ranks that see different batches.
        Under train.strategy.ZooParallelStrategy these are the dp x ep ranks (the ranks of one sp or tp group
        share a batch), under DDP every rank; the strategy says so in `distributed_sampler_kwargs`."""
        if self.dp_size is not None and self.dp_rank is not None:
            return self.dp_size, self.dp_rank
        trainer = self.trainer
        kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
        if kwargs:
            return int(kwargs["num_replicas"]), int(kwargs["rank"])
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
        return 1, 0

    def train_dataloader(self) -> ResumableDataLoader:
        if self.train_dataset is None:
            self.setup("fit")
        num_replicas, rank = self._data_parallel()
        sampler = ResumableSampler(
            self.train_dataset, num_replicas=num_replicas, rank=rank, seed=self.seed,
            counts=self.train_dataset.counts, weights=self.weights,
        )
        return ResumableDataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        if self.val_dataset is None:
            self.setup("validate")
        num_replicas, rank = self._data_parallel()
        return DataLoader(
            self.val_dataset,
            batch_size=self.batch_size,
            sampler=InOrderSampler(self.val_dataset, num_replicas=num_replicas, rank=rank),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )


def source_entries(sources: list[dict[str, Any]] | None, source: str, prepared_dir: str | None) -> list[dict[str, Any]]:
    """`data.sources` checked, or the one `data.source`: [{path, weight, name, prepared_dir}]."""
    if sources is None:
        return [{"path": source, "weight": 1.0, "name": _name(source), "prepared_dir": prepared_dir}]
    if prepared_dir is not None:
        raise DataError(
            "data.prepared_dir names the folder of data.source; with data.sources give each entry a path "
            "(a prepared folder or a source) instead."
        )
    if not sources:
        raise DataError("data.sources=[] holds no source; give [{path: ..., weight: ...}, ...] or null.")
    entries = []
    for i, entry in enumerate(sources):
        if not isinstance(entry, dict) or "path" not in entry or set(entry) - {"path", "weight", "name"}:
            raise DataError(
                f"data.sources[{i}]={entry!r}; each entry is {{path: <prepared folder or source>, weight: <w>, "
                "name: <optional>}}."
            )
        weight = entry.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or weight < 0:
            raise DataError(f"data.sources[{i}].weight={weight!r} must be a number >= 0.")
        entries.append({"path": str(entry["path"]), "weight": float(weight),
                        "name": str(entry.get("name") or _name(str(entry["path"]))), "prepared_dir": None})
    if sum(e["weight"] for e in entries) <= 0:
        raise DataError("data.sources' weights are all 0; give at least one source a weight > 0.")
    names = [e["name"] for e in entries]
    if len(set(names)) != len(names):
        raise DataError(f"data.sources' names {names} repeat; give each entry its own name.")
    return entries


def _name(path: str) -> str:
    return Path(path.rstrip("/")).name or path
