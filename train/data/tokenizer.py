"""The tokenizer: the bundled byte-level BPE (`train/tokenizer/`, made by `python -m train.train_tokenizer`)
or any Hugging Face tokenizer name or path."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from train.data.hub import hub_problem, is_local_source

TOKENIZER_DIR = Path(__file__).parents[1] / "tokenizer"
# What a folder saved by `save_pretrained` holds for a tokenizer (a fast one's file, or a slow one's config).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_tokenizer(name_or_path: str | os.PathLike | None = None) -> PreTrainedTokenizerFast:
    """The bundled tokenizer (None) or any HF tokenizer name/path, with an eos token and a pad token.

    A hub name is read from the local cache only, failing at once, when the hub cannot be used (offline
    mode, or no answer within `HUB_PROBE_TIMEOUT_S`); transformers would retry for most of a minute.
    """
    name = str(TOKENIZER_DIR if name_or_path is None else name_or_path)
    local = is_local_source(name, "tokenizer")
    problem = None if local else hub_problem()
    folder = Path(name).expanduser()
    if local and (not folder.is_dir() or not any((folder / f).exists() for f in _TOKENIZER_FILES)):
        raise OSError(
            f"tokenizer={name!r} holds no tokenizer ({' / '.join(_TOKENIZER_FILES)}); give a folder written by "
            "save_pretrained (a run's hf/ folder has one), or data.tokenizer=null for the bundled tokenizer."
        )
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


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerFast) -> str:
    """Short hash of everything that decides the token ids a text gets (and so a prepared corpus' tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        payload = backend.to_str()  # the full tokenizer.json: model, vocab, merges, added tokens
    else:
        payload = json.dumps(tokenizer.get_vocab(), sort_keys=True)
    payload += f"|{type(tokenizer).__name__}|eos={tokenizer.eos_token_id}"
    return hashlib.sha256(payload.encode()).hexdigest()[:16]
