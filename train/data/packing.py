"""Documents -> token streams -> fixed-length blocks of token ids (documents separated by eos).

Token streams are cached on disk (`OVERLAP_ZOO_CACHE`, default `~/.cache/overlap-zoo/`) so repeated runs
and tests do not re-tokenize; a cache key covers everything a stream depends on.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from train.data.corpus import CORPUS, cache_dir, load_text_dataset, shakespeare_works

# Bumped whenever the cached token streams would change for the same key (tokenization or file format).
_CACHE_FORMAT = 1


def token_stream(
    dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerFast, batch_size: int = 64
) -> torch.Tensor:
    """All documents tokenized (no special tokens added) and concatenated, eos after each; int32, 1-D."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("The tokenizer has no eos token; load it with load_tokenizer() to get one.")
    pieces: list[np.ndarray] = []
    for start in range(0, len(dataset), batch_size):
        texts = dataset[start : start + batch_size]["text"]
        # verbose=False: whole documents are far longer than model_max_length, and that is intended here.
        encoded = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        pieces.extend(np.asarray([*ids, eos], dtype=np.int32) for ids in encoded if ids)
    if not pieces:
        return torch.zeros(0, dtype=torch.int32)
    return torch.from_numpy(np.concatenate(pieces))


def blocks_from_stream(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Consecutive non-overlapping blocks of `seq_len` tokens, remainder dropped: LongTensor [n, seq_len]."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be at least 1.")
    n = stream.numel() // seq_len
    return stream[: n * seq_len].long().view(n, seq_len)


def next_token_targets(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """[B, T] -> [B, T]: position t's target is label t+1, the last position's `ignore_index`. Sequence
    parallelism shifts before it splits a sequence over the sp ranks, so that the last position of a chunk
    predicts the first token of the next chunk (a loss that shifts inside each chunk would drop those)."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index)


def pack_dataset(dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerFast, seq_len: int) -> torch.Tensor:
    """Tokenize, append eos after each document, concatenate, cut into [num_blocks, seq_len] LongTensor.

    Labels are the blocks themselves: the models shift by one internally.
    """
    return blocks_from_stream(token_stream(dataset, tokenizer), seq_len)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerFast) -> str:
    """Short hash of everything that decides the token ids `pack_dataset` produces."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        payload = backend.to_str()  # the full tokenizer.json: model, vocab, merges, added tokens
    else:
        payload = json.dumps(tokenizer.get_vocab(), sort_keys=True)
    payload += f"|{type(tokenizer).__name__}|eos={tokenizer.eos_token_id}"
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def token_cache_paths(
    tokenizer: PreTrainedTokenizerFast,
    source: str = CORPUS,
    *,
    validation_fraction: float = 0.1,
    seed: int = 0,
    hf_config: str | None = None,
    text_column: str = "text",
) -> dict[str, Path]:
    """Cache file of each split's token stream.

    The key covers everything the stream depends on: the source (for the bundled corpus, its file names
    and sizes), the split settings, the tokenizer fingerprint and the split.
    """
    if source == CORPUS:
        source_id: Any = [[w.name, w.size] for w in shakespeare_works()]
    else:
        source_id = [source, hf_config, text_column]
    key_fields = {
        "format": _CACHE_FORMAT,
        "source": source_id,
        "validation_fraction": validation_fraction,
        "seed": seed,
        "tokenizer": tokenizer_fingerprint(tokenizer),
    }
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:20]
    label = "".join(c if c.isalnum() or c in "-_." else "_" for c in source)[-60:]
    return {split: cache_dir() / "packed" / f"{label}-{split}-{key}.pt" for split in ("train", "validation")}


def cached_token_streams(
    tokenizer: PreTrainedTokenizerFast,
    source: str = CORPUS,
    *,
    validation_fraction: float = 0.1,
    seed: int = 0,
    hf_config: str | None = None,
    text_column: str = "text",
) -> dict[str, torch.Tensor]:
    """Token streams (`token_stream`) of "train" and "validation", read from the disk cache or built now.

    The cache holds streams, not blocks: one tokenization serves every seq_len (blocks are a view).
    Writes go to a temporary file renamed into place, so concurrent writers (several ranks, several
    test processes) never leave a partial file behind; at worst both tokenize and one file wins.
    """
    settings = {"validation_fraction": validation_fraction, "seed": seed, "hf_config": hf_config}
    paths = token_cache_paths(tokenizer, source, text_column=text_column, **settings)
    streams = {split: torch.load(path, weights_only=True) for split, path in paths.items() if path.exists()}
    missing = [split for split in paths if split not in streams]
    if missing:
        dsd = load_text_dataset(source, text_column=text_column, **settings)
        for split in missing:
            streams[split] = token_stream(dsd[split], tokenizer)
            _atomic_save(streams[split], paths[split])
    return streams


def _atomic_save(tensor: torch.Tensor, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(tensor, f)
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the complete new one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
