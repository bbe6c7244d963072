"""Tokenize a source once, on every core, into memory-mappable token shards and a manifest.

The layout of a prepared folder (nanoGPT's flat token files, Megatron's one-time preprocessing):

    manifest.json            written last, atomically: the folder is complete exactly when it exists
    train-00000.bin ...      raw little-endian token ids (uint16 when the vocabulary fits, else uint32),
    validation-00000.bin     every document followed by eos, documents back to back
    progress.json            while preparing only: what is on disk so far, to continue an interrupted run

Documents are streamed from the source (`train.data.documents`) in batches to `num_proc` worker
processes (each with its own tokenizer); results come back in order, so the bytes do not depend on the
number of workers. At most a few batches per worker are in flight: memory is bounded whatever the corpus.
Every `_PROGRESS_EVERY` batches (and at each shard's end) the shards are flushed and `progress.json`
records their lengths and how many documents were read; a preparation that was killed continues from
there (the partial shard cut back to its recorded length, the documents read skipped), or starts over
with `overwrite=True`. A file lock keeps a second preparer of the same folder (another rank, another
node on a shared file system, another test process) waiting until the first has finished.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerFast

from train.data.corpus import cache_dir
from train.data.documents import DataError, SourceSettings, documents, source_fingerprint
from train.data.tokenizer import load_tokenizer, tokenizer_fingerprint

FORMAT = 1
MANIFEST = "manifest.json"
PROGRESS = "progress.json"
SPLITS = ("train", "validation")
_BATCH_CHARS = 1 << 20  # text per work unit (~1 MB): small enough to keep every worker busy
_PROGRESS_EVERY = 64  # work units between progress records
_INLINE_BATCHES = 16  # work units tokenized in this process before the workers start


@dataclass
class Shard:
    file: str
    tokens: int = 0
    documents: int = 0


@dataclass
class SplitShards:
    shards: list[Shard] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.shards)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def default_num_proc() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def preparation_key(settings: SourceSettings, tokenizer_id: str) -> dict[str, Any]:
    """Everything the tokens of a prepared folder depend on (and nothing they do not, like num_proc)."""
    return {
        "format": FORMAT,
        "source": source_fingerprint(settings),
        "validation_fraction": settings.validation_fraction,
        "split_seed": settings.split_seed,
        "tokenizer": tokenizer_id,
    }


def default_prepared_dir(settings: SourceSettings, tokenizer_id: str) -> Path:
    """`<cache>/prepared/<source label>-<key>`: one folder per source, split and tokenizer."""
    key = hashlib.sha256(json.dumps(preparation_key(settings, tokenizer_id), sort_keys=True).encode())
    label = "".join(c if c.isalnum() or c in "-_." else "_" for c in settings.source.rstrip("/"))[-60:]
    return cache_dir() / "prepared" / f"{label}-{key.hexdigest()[:16]}"


def read_manifest(folder: Path) -> dict[str, Any] | None:
    path = Path(folder) / MANIFEST
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise DataError(f"{path} cannot be read ({error}); prepare the folder again with overwrite=true.") from error


def check_manifest(manifest: dict[str, Any], folder: Path, tokenizer_id: str | None, tokenizer_name: str) -> None:
    """A prepared folder made with another tokenizer (or format) is refused, naming both."""
    if manifest.get("format") != FORMAT:
        raise DataError(
            f"{folder} was prepared in format {manifest.get('format')}, this code reads format {FORMAT}; prepare "
            "it again (python -m train.prepare_data ... overwrite=true)."
        )
    made_with = manifest["tokenizer"]["fingerprint"]
    if tokenizer_id is not None and made_with != tokenizer_id:
        raise DataError(
            f"{folder} was prepared with another tokenizer ({manifest['tokenizer']['name']}, fingerprint "
            f"{made_with}) than data.tokenizer={tokenizer_name} (fingerprint {tokenizer_id}); use the tokenizer "
            "it was made with, or prepare the corpus for this one (another data.prepared_dir)."
        )


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"Waiting for another process preparing {folder} ...", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # readers see the old file or the complete new one


# ----------------------------------------------------------------------------------------------- workers

_worker_tokenizer = None


def _init_worker(tokenizer_name: str | None) -> None:
    global _worker_tokenizer
    _worker_tokenizer = load_tokenizer(tokenizer_name)


def _encode(batch: tuple[list[str], list[str]], dtype: str) -> tuple[list[str], list[np.ndarray]]:
    """(splits, texts) -> (splits, token arrays with eos after each; an empty document gives none)."""
    splits, texts = batch
    tokenizer = _worker_tokenizer
    eos = tokenizer.eos_token_id
    # verbose=False: whole documents are far longer than model_max_length, and that is intended here.
    encoded = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    return splits, [np.asarray([*ids, eos], dtype=dtype) if ids else np.zeros(0, dtype) for ids in encoded]


def _batches(stream: Iterator[tuple[str, str]]) -> Iterator[tuple[list[str], list[str]]]:
    splits: list[str] = []
    texts: list[str] = []
    chars = 0
    for split, text in stream:
        splits.append(split)
        texts.append(text)
        chars += len(text)
        if chars >= _BATCH_CHARS:
            yield splits, texts
            splits, texts, chars = [], [], 0
    if texts:
        yield splits, texts


def _in_order(batches: Iterator, num_proc: int, tokenizer_name: str | None, dtype: str) -> Iterator:
    """`_encode` over `batches` by `num_proc` processes, results in input order, a bounded number in flight.

    The workers come from a fork server (a fresh single-threaded process), not a fork of this one: this
    process has threads (pyarrow's, torch's) whose locks a forked child could inherit held. A worker that
    dies ends the preparation with an error (`BrokenProcessPool`), never a hang. The tokenizers library
    would also spread each batch over every core with threads of its own; off here, so that `num_proc`
    processes use `num_proc` cores."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # The first batches are tokenized here: a corpus that small (the bundled one) is done before worker
    # processes would have started. Larger ones go on in the workers.
    _init_worker(tokenizer_name)
    for batch in batches if num_proc == 1 else itertools.islice(batches, _INLINE_BATCHES):
        yield len(batch[0]), _encode(batch, dtype)
    if num_proc == 1:
        return
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["train.data.prepare"])  # imported once by the server, not by each worker
    pool = ProcessPoolExecutor(num_proc, mp_context=context, initializer=_init_worker, initargs=(tokenizer_name,))
    try:
        pending: collections.deque = collections.deque()
        for batch in batches:
            pending.append((len(batch[0]), pool.submit(_encode, batch, dtype)))
            if len(pending) >= 2 * num_proc:
                n, future = pending.popleft()
                yield n, future.result()
        while pending:
            n, future = pending.popleft()
            yield n, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------------------------- preparing


class _SplitWriter:
    """Appends token arrays to one split's shards, starting a new shard past `shard_tokens`."""

    def __init__(self, folder: Path, split: str, shard_tokens: int, done: SplitShards, dtype: np.dtype):
        self.folder, self.split, self.shard_tokens, self.dtype = folder, split, shard_tokens, dtype
        self.done = done
        if not done.shards:
            done.shards.append(Shard(f"{split}-00000.bin"))
        current = done.shards[-1]
        path = folder / current.file
        # Continuing: cut the open shard back to what the progress record vouches for.
        with open(path, "ab") as f:
            f.truncate(current.tokens * dtype.itemsize)
        self._file = open(path, "ab")

    def add(self, tokens: np.ndarray) -> None:
        current = self.done.shards[-1]
        if current.tokens >= self.shard_tokens:
            self._file.close()
            current = Shard(f"{self.split}-{len(self.done.shards):05d}.bin")
            self.done.shards.append(current)
            self._file = open(self.folder / current.file, "wb")
        self._file.write(tokens.tobytes())
        current.tokens += int(tokens.size)
        current.documents += 1 if tokens.size else 0

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        self.flush()
        self._file.close()
        if self.done.shards and self.done.shards[-1].tokens == 0 and len(self.done.shards) > 1:
            (self.folder / self.done.shards.pop().file).unlink()


def prepare_corpus(
    settings: SourceSettings,
    tokenizer_name: str | None = None,
    *,
    folder: str | Path | None = None,
    num_proc: int | None = None,
    shard_tokens: int = 100_000_000,
    overwrite: bool = False,
    progress: bool = True,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> Path:
    """Prepares `settings.source` with the tokenizer into `folder` (default: `default_prepared_dir`) and
    returns the folder. A complete folder (its manifest from the same tokenizer) is returned as it is.
    `tokenizer`: `load_tokenizer(tokenizer_name)` when the caller holds it already (workers load it by name)."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(tokenizer_name)
    tokenizer_id = tokenizer_fingerprint(tokenizer)
    settings.check()
    folder = Path(folder).expanduser() if folder is not None else default_prepared_dir(settings, tokenizer_id)
    num_proc = default_num_proc() if num_proc in (None, 0) else int(num_proc)
    if num_proc < 1 or shard_tokens < 1:
        raise DataError(f"data.num_proc={num_proc} and data.shard_tokens={shard_tokens} must be at least 1.")
    key = preparation_key(settings, tokenizer_id)
    if _complete(folder, key, tokenizer_id, tokenizer_name, overwrite):
        return folder  # read without the lock: a prepared folder may sit on a read-only file system
    with _locked(folder):
        if _complete(folder, key, tokenizer_id, tokenizer_name, overwrite):
            return folder  # another process prepared it while this one waited
        state = _start(folder, key, overwrite)
        _run(folder, settings, tokenizer, tokenizer_name, key, state, num_proc, shard_tokens, progress)
    return folder


def _complete(folder: Path, key: dict, tokenizer_id: str, tokenizer_name: str | None, overwrite: bool) -> bool:
    """Whether `folder` holds this source prepared with this tokenizer (another one is refused)."""
    manifest = read_manifest(folder)
    if manifest is None or overwrite:
        return False
    check_manifest(manifest, folder, tokenizer_id, str(tokenizer_name or "null"))
    if manifest["key"] != key:
        raise DataError(
            f"{folder} holds a corpus prepared from other files or split settings than data.source="
            f"{key['source']['source']!r} now has; prepare it again (python -m train.prepare_data ... "
            "overwrite=true) or give another data.prepared_dir."
        )
    return True


def _start(folder: Path, key: dict[str, Any], overwrite: bool) -> dict[str, Any]:
    """The progress to continue from, or a fresh start (said in one line either way when there was one)."""
    recorded = None
    if (folder / PROGRESS).exists() and not overwrite:
        try:
            recorded = json.loads((folder / PROGRESS).read_text())
        except (OSError, json.JSONDecodeError):
            recorded = None
        if recorded is not None and recorded.get("key") != key:
            print(f"{folder}: an interrupted preparation of other settings; starting over.", file=sys.stderr)
            recorded = None
        elif recorded is not None:
            print(
                f"{folder}: continuing an interrupted preparation after {recorded['documents_read']:,} documents "
                "(overwrite=true starts over).",
                file=sys.stderr,
            )
            # Shards begun after the last record are written again from there.
            kept = {shard["file"] for split in SPLITS for shard in recorded["splits"][split]}
            for path in folder.glob("*.bin"):
                if path.name not in kept:
                    path.unlink()
    elif overwrite and folder.exists() and any(folder.iterdir()):
        print(f"{folder}: overwrite=true, preparing it again from the start.", file=sys.stderr)
    if recorded is None:
        if folder.exists() and any(folder.iterdir()):
            ours = all(p.name.endswith((".bin", ".tmp")) or p.name in (MANIFEST, PROGRESS) for p in folder.iterdir())
            if ours or overwrite:
                shutil.rmtree(folder)
            else:
                raise DataError(
                    f"data.prepared_dir={folder} exists and holds other files; give an empty or new folder."
                )
        folder.mkdir(parents=True, exist_ok=True)
        recorded = {"key": key, "documents_read": 0, "seconds": 0.0, "splits": {s: [] for s in SPLITS}}
    return recorded


def _run(folder, settings, tokenizer, tokenizer_name, key, state, num_proc, shard_tokens, progress) -> None:
    dtype = token_dtype(len(tokenizer))
    done = {s: SplitShards([Shard(**shard) for shard in state["splits"][s]]) for s in SPLITS}
    writers = {s: _SplitWriter(folder, s, shard_tokens, done[s], dtype) for s in SPLITS}
    read = state["documents_read"]
    started, seconds_before = time.perf_counter(), state["seconds"]

    def record() -> None:
        for writer in writers.values():
            writer.flush()
        state.update(
            documents_read=read,
            seconds=seconds_before + time.perf_counter() - started,
            splits={s: [asdict(shard) for shard in done[s].shards] for s in SPLITS},
        )
        _write_json(folder / PROGRESS, state)

    bar = _progress_bar(progress, folder, sum(d.tokens for d in done.values()))
    new_tokens = 0
    stream = _batches(documents(settings, skip=read))
    try:
        for units, (n, (splits, arrays)) in enumerate(_in_order(stream, num_proc, tokenizer_name, dtype.str), 1):
            for split, tokens in zip(splits, arrays, strict=True):
                writers[split].add(tokens)
                new_tokens += tokens.size
            read += n
            if bar is not None:
                bar.update(sum(a.size for a in arrays))
            if units % _PROGRESS_EVERY == 0:
                record()
        for writer in writers.values():
            writer.close()
        if done["train"].tokens == 0:
            raise DataError(_no_train_tokens(settings, read, done["validation"].documents))
    except DataError:
        # A bad input: nothing is kept, so that no later run takes the folder for a start.
        for writer in writers.values():
            writer.close()
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    record()
    seconds = state["seconds"]
    manifest = {
        "format": FORMAT,
        "key": key,
        "source": key["source"],
        "tokenizer": {
            "name": str(tokenizer_name) if tokenizer_name is not None else "bundled",
            "fingerprint": key["tokenizer"],
            "vocab_size": len(tokenizer),
            "eos_token_id": tokenizer.eos_token_id,
        },
        "dtype": dtype.name,
        "split": {
            "validation_fraction": settings.validation_fraction,
            "split_seed": settings.split_seed,
            "text_column": settings.text_column,
            "hf_config": settings.hf_config,
        },
        "documents_read": read,
        "splits": {s: {"tokens": done[s].tokens, "documents": done[s].documents,
                       "shards": [asdict(shard) for shard in done[s].shards]} for s in SPLITS},
        "num_proc": num_proc,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(new_tokens / max(time.perf_counter() - started, 1e-9)),
    }
    _write_json(folder / MANIFEST, manifest)  # the folder is complete from here on
    (folder / PROGRESS).unlink()


def _no_train_tokens(settings: SourceSettings, documents_read: int, validation_documents: int) -> str:
    where = f"data.source={settings.source!r}"
    if documents_read == 0:
        return f"{where} holds no documents; give it text."
    if validation_documents:
        return (
            f"{where} holds {documents_read} document(s), all of them drawn into the validation split "
            f"(data.validation_fraction={settings.validation_fraction}); give it more documents (or a train* and a "
            "validation* file)."
        )
    return f"{where} holds {documents_read} document(s), all of them empty; give it text."


def _progress_bar(enabled: bool, folder: Path, initial: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(
        desc=f"tokenizing into {folder.name}", unit="tok", unit_scale=True, initial=initial, file=sys.stderr,
        dynamic_ncols=True, mininterval=1.0,
    )
