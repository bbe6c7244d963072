"""Llama -> Ladder conversion: same weights, the last `ladder_layers` layers rewired.

Works from a Hugging Face `LlamaForCausalLM` directory or a zoo `llama` (or `ladder`) checkpoint:
the state-dict names are identical, so nothing is renamed; only the config changes. `LLAMA_TO_LADDER`
is the converter `train.convert` runs (`python -m train.convert source=DIR ladder_layers=N`).
"""

import json
from pathlib import Path

from models.ladder.configuration import ZooLadderConfig
from models.ladder.modeling import ZooLadderForCausalLM
from models.registry import config_summary, from_llama

CONVERTIBLE = ("llama", "zoo_llama", "zoo_ladder")


def llama_to_ladder(source: str | Path, ladder_layers: int | list[int], **kwargs) -> ZooLadderForCausalLM:
    """Load a Llama checkpoint directory as a Ladder model with `ladder_layers` laddered."""
    config_file = Path(source) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"No config.json in {source}; pass the directory of a saved Llama checkpoint."
        )
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type not in CONVERTIBLE:
        raise ValueError(
            f"Checkpoint {source} has model_type={model_type!r}; Ladder converts from {CONVERTIBLE}."
        )
    return ZooLadderForCausalLM.from_pretrained(source, ladder_layers=ladder_layers, **kwargs)


def check_ladder_layers(source: str | Path, ladder_layers: int | list[int]) -> None:
    """The Ladder config's own checks (ladder_layers in range for this checkpoint's layers), from the
    checkpoint's config alone: nothing is loaded."""
    ZooLadderConfig.from_pretrained(source, ladder_layers=ladder_layers)


summary = config_summary("ladder_layers", "num_hidden_layers")


LLAMA_TO_LADDER = from_llama("ladder", "Ladder", llama_to_ladder, summary, check=check_ladder_layers,
                             options=("ladder_layers",), source_types=CONVERTIBLE)
