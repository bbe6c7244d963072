"""The documents of a source, streamed one at a time with their split: what `train.data.prepare` tokenizes.

A source is the bundled corpus (`shakespeare`), a local file or folder of jsonl / json / parquet / text
files, or a hub dataset name. Nothing is loaded whole: local files and hub datasets are read through
`datasets.load_dataset(..., streaming=True)`, so the text never has to fit in memory (nor, for the hub, on
disk). The validation split is the source's own "validation" split where it has one; the bundled corpus is
split by work (`split_works`, the split the bundled tokenizer was trained on); any other source sends each
document to validation with probability `validation_fraction`, decided by a hash of (seed, its index), so
the split is the same however many processes tokenize and wherever a preparation is continued.

`source_fingerprint` identifies what a source holds without reading it: file names, sizes and modification
times for local files, the name and config for a hub dataset.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from train.data.corpus import CORPUS, shakespeare_works, split_works
from train.data.hub import hub_problem, is_local_source, offline_setting

# Extensions `datasets` reads as data files, by builder.
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".text": "text"}


class DataError(ValueError):
    """A source, setting or prepared folder that cannot be used; the message names it and what would fit."""


@dataclass(frozen=True)
class SourceSettings:
    """What decides the documents of a source and their split."""

    source: str = CORPUS
    hf_config: str | None = None
    text_column: str = "text"
    validation_fraction: float = 0.1
    split_seed: int = 0

    def check(self) -> None:
        if not 0.0 < self.validation_fraction < 1.0:
            raise DataError(
                f"data.validation_fraction={self.validation_fraction} must be strictly between 0 and 1."
            )
        if self.source == CORPUS:
            return
        if is_local_source(self.source, "data.source") and self.hf_config is not None:
            raise DataError(
                f"data.hf_config={self.hf_config!r} names a configuration of a hub dataset, but data.source="
                f"{self.source!r} is a local path; set data.hf_config=null."
            )
        if is_local_source(self.source, "data.source"):
            for path in local_files(Path(self.source)):
                if path.stat().st_size == 0:
                    raise DataError(f"data.source holds an empty file, {path}; remove it or give it text.")


def local_files(source: Path) -> list[Path]:
    """The data files of a local source: the file itself, or every readable data file under the folder."""
    source = source.expanduser()
    if source.is_file():
        files = [source]
    else:
        files = sorted(
            p for p in source.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.parts[-1:])
        )
        files = [p for p in files if p.suffix in _BUILDERS]
    if not files:
        raise DataError(
            f"data.source={str(source)!r} holds no data files (one of {', '.join(sorted(_BUILDERS))}); "
            "point it at a file or a folder of them."
        )
    kinds = {_BUILDERS.get(p.suffix) for p in files}
    if None in kinds or len(kinds) > 1:
        raise DataError(
            f"data.source={str(source)!r} mixes file types {sorted(p.suffix for p in files)[:5]}; use files of "
            f"one type ({', '.join(sorted(_BUILDERS))})."
        )
    return files


def source_fingerprint(settings: SourceSettings) -> dict[str, Any]:
    """What a prepared corpus was made from, cheap to compute: a changed file changes it."""
    if settings.source == CORPUS:
        files: Any = [[w.name, w.size] for w in shakespeare_works()]
        return {"source": CORPUS, "files": files}
    if is_local_source(settings.source, "data.source"):
        root = Path(settings.source).expanduser().resolve()
        paths = local_files(root)
        base = root if root.is_dir() else root.parent
        files = [[str(p.relative_to(base)), p.stat().st_size, p.stat().st_mtime_ns] for p in paths]
        return {"source": str(root), "files": files, "text_column": settings.text_column}
    return {"source": settings.source, "hf_config": settings.hf_config, "text_column": settings.text_column}


def in_validation(index: int, fraction: float, seed: int) -> bool:
    """Whether document `index` of a source without a validation split is a validation document."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


def documents(settings: SourceSettings, skip: int = 0) -> Iterator[tuple[str, str]]:
    """(split, text) of every document, in a fixed order; the first `skip` documents are not yielded."""
    settings.check()
    if settings.source == CORPUS:
        stream = _shakespeare(settings)
    else:
        stream = _streamed(settings)
    return itertools.islice(stream, skip, None)


def _shakespeare(settings: SourceSettings) -> Iterator[tuple[str, str]]:
    train, validation = split_works(shakespeare_works(), settings.validation_fraction, settings.split_seed)
    for split, works in (("train", train), ("validation", validation)):
        for work in works:
            # Text mode: universal newlines, as the `datasets` text builder reads them.
            yield split, work.path.read_text(encoding="utf-8")


def _streamed(settings: SourceSettings) -> Iterator[tuple[str, str]]:
    splits = _open_streaming(settings)
    if "train" not in splits:
        raise DataError(f"data.source={settings.source!r} has no 'train' split (it has {list(splits)}).")
    column = settings.text_column
    if "validation" in splits:
        named = [("train", splits["train"]), ("validation", splits["validation"])]
    else:
        named = [("train", splits["train"])]
    index = 0
    for split, dataset in named:
        rows = iter(dataset)
        while True:
            try:
                row = next(rows)
            except StopIteration:
                break
            except UnicodeDecodeError as error:
                raise DataError(
                    f"data.source={settings.source!r} holds a file that is not UTF-8 text ({error.reason} at "
                    f"byte {error.start}); convert it to UTF-8 or remove it."
                ) from error
            if column not in row:
                raise DataError(
                    f"data.source={settings.source!r} has no column {column!r}; set data.text_column to one of "
                    f"{sorted(row)}."
                )
            text = row[column]
            if not isinstance(text, str):
                raise DataError(
                    f"data.text_column={column!r} of data.source={settings.source!r} holds {type(text).__name__}"
                    " values, not text; set data.text_column to a text column."
                )
            if split == "train" and len(named) == 1:
                split_here = (
                    "validation"
                    if in_validation(index, settings.validation_fraction, settings.split_seed)
                    else "train"
                )
            else:
                split_here = split
            index += 1
            yield split_here, text


def _open_streaming(settings: SourceSettings) -> datasets.IterableDatasetDict:
    source = settings.source
    if is_local_source(source, "data.source"):
        files = local_files(Path(source))
        builder = _BUILDERS[files[0].suffix]
        root = Path(source).expanduser()
        if root.is_file():
            data_files: Any = {"train": [str(root)]}
        else:
            by_split: dict[str, list[str]] = {"train": [], "validation": []}
            for path in files:
                name = path.stem.lower()
                split = "validation" if name.startswith(("validation", "valid", "val", "dev")) else "train"
                by_split[split].append(str(path))
            data_files = {k: v for k, v in by_split.items() if v}
        kwargs = {"sample_by": "line"} if builder == "text" else {}
        try:
            return datasets.load_dataset(builder, data_files=data_files, streaming=True, **kwargs)
        except UnicodeDecodeError as error:
            raise DataError(f"data.source={source!r} holds a file that is not UTF-8 text; convert it.") from error
    problem = hub_problem()
    if problem is not None and offline_setting() is None:
        raise DataError(
            f"data.source={source!r} is a hub dataset, not a local path, and {problem}; pass a local path, "
            "or use data=shakespeare (the bundled corpus)."
        )
    return datasets.load_dataset(source, settings.hf_config, streaming=True)
