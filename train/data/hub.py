"""Whether the Hugging Face hub can be used now, and whether a name is a local path or a hub name.

Asked before anything is fetched (by the corpus loader, the tokenizer loader and `train.pretrain`'s checks),
so that offline mode or an unreachable hub fails at once with one sentence naming the setting, instead of
the Hugging Face libraries retrying for most of a minute.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit

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
