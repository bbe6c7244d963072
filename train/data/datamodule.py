"""`LMDataModule`: packed causal-LM blocks of a corpus served to Lightning, one slice per data-parallel rank."""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from train.data.corpus import CORPUS
from train.data.loader import BlockDataset, ResumableDataLoader, ResumableSampler
from train.data.packing import blocks_from_stream, cached_token_streams
from train.data.tokenizer import load_tokenizer


class LMDataModule(L.LightningDataModule):
    """Packed causal-LM blocks for Lightning: batches are `{"input_ids": LongTensor[batch_size, seq_len]}`.

    `prepare_data()` tokenizes and caches (once per node); `setup()` loads the packed tensors. The train
    loader shuffles with a permutation fixed by (seed, epoch), drops the last partial batch and resumes
    exactly mid-epoch from a Lightning checkpoint (see `ResumableDataLoader`). Under a parallel Lightning
    strategy each data-parallel rank takes its own slice (`trainer.distributed_sampler_kwargs`, which for
    ModelParallelStrategy is the data-parallel mesh); outside Lightning, an initialised torch.distributed
    means one slice per global rank; `dp_size`/`dp_rank` override both (e.g. so that the ranks of one
    tensor-parallel group see the same batches). The validation loader is in order, not shuffled, and
    `max_val_batches` keeps only its first batches.

    `seed` drives the shuffling only. The train/validation split has its own `split_seed` (default 0,
    the split the bundled tokenizer was trained on), so runs with different seeds are validated on the
    same works and the tokenizer never saw them.
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
    ):
        super().__init__()
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if value < 1:
                raise ValueError(f"{name}={value} must be at least 1.")
        if (dp_size is None) != (dp_rank is None):
            raise ValueError(
                f"Give both dp_size and dp_rank or neither (got dp_size={dp_size}, dp_rank={dp_rank})."
            )
        self.source = source
        self.tokenizer_name = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.split_seed = split_seed
        self.validation_fraction = validation_fraction
        self.hf_config = hf_config
        self.max_val_batches = max_val_batches
        self.text_column = text_column
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.tokenizer = load_tokenizer(tokenizer)
        self.vocab_size = len(self.tokenizer)
        self.train_blocks: torch.Tensor | None = None
        self.val_blocks: torch.Tensor | None = None

    def _streams(self) -> dict[str, torch.Tensor]:
        return cached_token_streams(
            self.tokenizer,
            self.source,
            validation_fraction=self.validation_fraction,
            seed=self.split_seed,
            hf_config=self.hf_config,
            text_column=self.text_column,
        )

    def prepare_data(self) -> None:
        self._streams()

    def setup(self, stage: str | None = None) -> None:
        if self.train_blocks is not None:
            return
        streams = self._streams()
        train = blocks_from_stream(streams["train"], self.seq_len)
        val = blocks_from_stream(streams["validation"], self.seq_len)
        if self.max_val_batches is not None:
            val = val[: self.max_val_batches * self.batch_size]
        num_replicas, _ = self._data_parallel()
        for name, blocks, needed in (
            ("train", train, self.batch_size * num_replicas),
            ("validation", val, 1),
        ):
            if blocks.shape[0] < needed:
                raise ValueError(
                    f"The {name} split of {self.source!r} has {blocks.shape[0]} blocks of seq_len={self.seq_len}"
                    f" tokens, fewer than the {needed} needed; lower seq_len or batch_size."
                )
        self.train_blocks, self.val_blocks = train, val

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
        if self.train_blocks is None:
            self.setup("fit")
        dataset = BlockDataset(self.train_blocks)
        num_replicas, rank = self._data_parallel()
        sampler = ResumableSampler(dataset, num_replicas=num_replicas, rank=rank, seed=self.seed)
        return ResumableDataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        if self.val_blocks is None:
            self.setup("validate")
        return DataLoader(
            BlockDataset(self.val_blocks),
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
