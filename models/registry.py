"""The zoo's registry: architecture name -> classes, and Auto-class registration.

`import models` fills `ZOO` and registers every architecture with `AutoConfig`, `AutoModel` and
`AutoModelForCausalLM`, so `AutoModelForCausalLM.from_pretrained(dir)` loads any zoo checkpoint.
"""

from dataclasses import dataclass, field

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel


@dataclass(frozen=True)
class ZooEntry:
    name: str
    config_class: type[PreTrainedConfig]
    model_class: type[PreTrainedModel]  # the ...ForCausalLM
    base_model_class: type[PreTrainedModel]
    # Config fields of a tiny instance (seconds to train on a CPU): for tests, smoke runs and benches.
    tiny_config: dict = field(default_factory=dict)

    def tiny(self, **overrides) -> PreTrainedConfig:
        return self.config_class(**{**self.tiny_config, **overrides})


ZOO: dict[str, ZooEntry] = {}


def register(name: str, config_class, model_class, base_model_class, tiny_config: dict | None = None) -> None:
    ZOO[name] = ZooEntry(name, config_class, model_class, base_model_class, dict(tiny_config or {}))
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModel.register(config_class, base_model_class, exist_ok=True)
    AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)


def get(name: str) -> ZooEntry:
    if name not in ZOO:
        raise ValueError(f"Unknown architecture {name!r}; the zoo has: {', '.join(sorted(ZOO))}.")
    return ZOO[name]


def build_config(name: str, **kwargs) -> PreTrainedConfig:
    return get(name).config_class(**kwargs)


def build_model(name: str, **kwargs) -> PreTrainedModel:
    """A randomly initialised `...ForCausalLM` of architecture `name` with config fields `kwargs`."""
    return get(name).model_class(build_config(name, **kwargs))
