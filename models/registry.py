"""The zoo's registries: architecture name -> what shared code needs to know about it; checkpoint converters.

`import models` fills `ZOO` and registers every architecture with `AutoConfig`, `AutoModel` and
`AutoModelForCausalLM`, so `AutoModelForCausalLM.from_pretrained(dir)` loads any zoo checkpoint. Besides
its classes, an entry carries the facts the bench, the tests and the trainer need, each stated in the
architecture's own folder (`sharding.py`, `entry.py`), so that no shared code names an architecture:

- `degrees`: the mesh dimensions it shards over (the keys of its sharding.py PLAN, `model_class.shard_plan`);
- `check_layout(config, degrees)`: its sharding.py check, one clear error for degrees that do not fit
  (every zoo model's `check_layout(degrees)`, which `parallel.parallelize` asks, is this one);
- `fit_degrees(degrees)`: config fields it needs to run at those degrees (Kraken: kraken_degree = tp);
- `bench_config(shape, degrees, **overrides)`: how a bench shape (Llama field names) becomes its config;
- `collectives_per_forward(config, degrees)`: the collectives one forward issues, per kind;
- `expert_mix(config)`: for an architecture whose tokens may run fewer routed experts than its top-k (MoE++'s
  zero-computation experts), its experts in words with the FFN experts a token runs at the balanced load, as
  reports quote it.

An architecture whose config has the `residual` field takes the ladder residual schedule (models/common/
residual.py): that field is its opt-in, and `entry.residuals` lists the schedules. Its ladder variant is named
`<name>_ladder` ("gqla_ladder"): `get` resolves the name to the same classes with the schedule set (`variant`), so
the bench, the tests and the planner take it wherever they take an architecture's name; `variants()` names them.
They are not in `ZOO`, whose entries are the architectures.

`CONVERTERS` maps a converter name to how `train.convert` turns one kind of checkpoint into another.
"""

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import NamedTuple

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel

from parallel.overlap import check_overlap


class Collectives(NamedTuple):
    """One kind of collective in one forward: how many calls, and the values they carry per token, summed
    over the calls (bytes = values_per_token x tokens x bytes per value)."""

    calls: int
    values_per_token: int


CollectivesHook = Callable[[PreTrainedConfig, dict[str, int]], dict[str, Collectives]]


def no_config_fields(degrees: dict[str, int]) -> dict:
    """Most architectures run at any degree their shapes divide with no change of config."""
    return {}


@dataclass(frozen=True)
class ZooEntry:
    name: str
    config_class: type[PreTrainedConfig]
    model_class: type[PreTrainedModel]  # the ...ForCausalLM
    base_model_class: type[PreTrainedModel]
    # Config fields of a tiny instance (seconds to train on a CPU): for tests, smoke runs and benches.
    tiny_config: dict = field(default_factory=dict)
    # Its sharding.py (PLAN and check_layout); None: no shard layout.
    sharding: ModuleType | None = None
    # Hooks from models/<name>/entry.py (see the module docstring); None: not declared.
    fit_degrees: Callable[[dict[str, int]], dict] = no_config_fields
    bench_config: Callable[..., PreTrainedConfig] | None = None
    collectives_per_forward: CollectivesHook | None = None
    expert_mix: Callable[[PreTrainedConfig], str] | None = None

    @property
    def degrees(self) -> tuple[str, ...]:
        """Mesh dimensions the architecture shards over ("tp", "ep", "sp"): what `parallelize` applies."""
        return tuple(getattr(self.model_class, "shard_plan", None) or ())

    @property
    def residuals(self) -> tuple[str, ...]:
        """The residual schedules its config takes: ("standard", "ladder") where the config has the `residual`
        field (models/common/residual.py), else ("standard",)."""
        fields = {f.name for f in dataclasses.fields(self.config_class)}
        return ("standard", "ladder") if "residual" in fields else ("standard",)

    def check_layout(self, config: PreTrainedConfig, degrees: dict[str, int]) -> None:
        """One clear error if `config` cannot be sharded at `degrees` ({"tp": 2}), before building anything."""
        if self.sharding is not None:
            self.sharding.check_layout(config, degrees)
            return
        # dp replicates every model; any other dimension needs a layout.
        sharded = {d: n for d, n in degrees.items() if n > 1 and d != "dp"}
        if sharded:
            raise ValueError(f"{self.name} has no shard layout, so {sharded} does not fit; run it unsharded.")

    def tiny(self, **overrides) -> PreTrainedConfig:
        return self.config_class(**{**self.tiny_config, **overrides})

    def tiny_at(self, degrees: dict[str, int], **overrides) -> PreTrainedConfig:
        """The tiny config as it runs at `degrees` (e.g. Kraken with one stream per TP rank)."""
        return self.tiny(**{**self.fit_degrees(degrees), **overrides})


ZOO: dict[str, ZooEntry] = {}


# The hooks an architecture's entry.py may define (see the module docstring).
ENTRY_HOOKS = ("fit_degrees", "bench_config", "collectives_per_forward", "expert_mix")


def folder_hooks(package: str) -> dict:
    """The hooks stated in architecture folder `package` (e.g. "models.llama"): its sharding.py module and
    whichever of `ENTRY_HOOKS` its entry.py defines."""
    hooks = {}
    for module_name, names in (("sharding", None), ("entry", ENTRY_HOOKS)):
        try:
            module = importlib.import_module(f"{package}.{module_name}")
        except ModuleNotFoundError as error:
            if error.name != f"{package}.{module_name}":
                raise  # the module exists but one of its own imports is missing
            continue
        if names is None:
            hooks[module_name] = module
        else:
            hooks.update({name: getattr(module, name) for name in names if hasattr(module, name)})
    return hooks


def register(
    name: str,
    config_class,
    model_class,
    base_model_class,
    tiny_config: dict | None = None,
    **hooks,
) -> None:
    """Add `name` to `ZOO` and register its classes with the Auto classes. The hooks (sharding, fit_degrees,
    bench_config, collectives_per_forward, expert_mix) come from the folder that defines `model_class`
    (`folder_hooks`); `hooks` given here override them (one folder may serve two entries)."""
    hooks = {**folder_hooks(model_class.__module__.rsplit(".", 1)[0]), **hooks}
    ZOO[name] = ZooEntry(name, config_class, model_class, base_model_class, dict(tiny_config or {}), **hooks)
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModel.register(config_class, base_model_class, exist_ok=True)
    AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)


def entry_for(model_type: str | None) -> ZooEntry | None:
    """The entry of the architecture whose config has `model_type` ("zoo_llama"), or None. Entries that share
    a config class (linear, linear_hybrid) share its folder, hence its layout: the first is as good as any."""
    return next((entry for entry in ZOO.values() if entry.config_class.model_type == model_type), None)


LADDER_SUFFIX = "_ladder"


def variants() -> list[str]:
    """The names of the architectures' ladder variants (`<name>_ladder`), in `ZOO`'s order."""
    return [name + LADDER_SUFFIX for name, entry in ZOO.items() if "ladder" in entry.residuals]


def standard_sibling(name: str) -> str | None:
    """The architecture whose ladder variant `name` is ("gqla_ladder" -> "gqla"), or None when `name` is no ladder
    variant."""
    return name.removesuffix(LADDER_SUFFIX) if name in variants() else None


def variant(entry: ZooEntry) -> ZooEntry:
    """`entry` under the ladder schedule, named `<name>_ladder`. Its tiny config ladders the upper half of the
    layers (laddered and standard layers both run, as in the tiny ladder); its bench config every layer (the
    paper's Ladder Transformer at scale) unless the bench's overrides say otherwise."""
    bench = entry.bench_config

    def bench_config(shape: dict, degrees: dict[str, int], **overrides) -> PreTrainedConfig:
        return bench(shape, degrees, **{"residual": "ladder", **overrides})

    half = entry.tiny_config["num_hidden_layers"] // 2
    return dataclasses.replace(
        entry,
        name=entry.name + LADDER_SUFFIX,
        tiny_config={**entry.tiny_config, "residual": "ladder", "ladder_layers": half},
        bench_config=None if bench is None else bench_config,
    )


# `<name>+<schedule>`: an architecture run under a system-level overlap schedule (parallel/overlap.py), as the
# benches and the simulator name one (`archs=[llama,llama+token_split]`); the entry is the architecture's own.
SCHEDULE_SEP = "+"


def schedule_of(name: str) -> str:
    """The overlap schedule a name asks for ("llama+token_split" -> "token_split"; "llama" -> "none")."""
    return name.split(SCHEDULE_SEP, 1)[1] if SCHEDULE_SEP in name else "none"


def get(name: str) -> ZooEntry:
    """The registry entry of architecture `name`, of its ladder variant (`<name>_ladder`), or of either run under an
    overlap schedule (`<name>+<schedule>`, refused where the architecture does not take it)."""
    if name in ZOO:
        return ZOO[name]
    if SCHEDULE_SEP in name:
        base, schedule = name.split(SCHEDULE_SEP, 1)
        entry = get(base)
        check_overlap(entry.model_class, schedule, entry.tiny_config.get("residual", "standard"))
        return entry
    base = name.removesuffix(LADDER_SUFFIX)
    if name.endswith(LADDER_SUFFIX) and base in ZOO and "ladder" in ZOO[base].residuals:
        return variant(ZOO[base])
    known = ", ".join(sorted(ZOO))
    if name.endswith(LADDER_SUFFIX) and base in ZOO:
        why = getattr(ZOO[base].config_class, "residual_refusal", "")
        raise ValueError(
            f"Unknown architecture {name!r}: {base} takes no ladder residual schedule. {why} The ladder variants "
            f"are {', '.join(variants())}."
        )
    raise ValueError(f"Unknown architecture {name!r}; the zoo has: {known} (and the ladder variants {', '.join(variants())}).")


def build_config(name: str, **kwargs) -> PreTrainedConfig:
    """The config of architecture `name` with fields `kwargs`; a ladder variant's is its sibling's under the
    ladder schedule (`residual="ladder"`, every layer unless `ladder_layers` says otherwise)."""
    entry = get(name)
    sibling = standard_sibling(name)
    if sibling is not None:
        if kwargs.get("residual", "ladder") != "ladder":
            raise ValueError(
                f"{name} is {sibling} under the ladder residual schedule, but its config says residual="
                f"{kwargs['residual']!r}: set residual='ladder' (model.config.residual=ladder), or use {sibling} for "
                "the standard residual."
            )
        kwargs = {**kwargs, "residual": "ladder"}
    return entry.config_class(**kwargs)


def build_model(name: str, **kwargs) -> PreTrainedModel:
    """A randomly initialised `...ForCausalLM` of architecture `name` with config fields `kwargs`."""
    return get(name).model_class(build_config(name, **kwargs))


# --- converters -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Converter:
    """How `train.convert` turns a checkpoint of one kind into a zoo architecture.

    `convert(source_dir, **options)` returns the converted model; `check(source_dir, **options)` fails
    with one clear error before anything is loaded or written (after train.convert's own checks that the
    source is a saved checkpoint of one of `source_types`). `options` name the converter's settings,
    read from train.convert's config (`ladder_layers=N`); `summary(model)` gives the fields its report
    records about the result.
    """

    name: str
    source: str  # the architecture converted from, as the report names it ("llama")
    source_types: tuple[str, ...]  # config.json model_type values it reads
    source_title: str  # "Llama", for messages and the report's title
    target: str  # the zoo architecture produced ("ladder")
    target_title: str  # "Ladder"
    convert: Callable[..., PreTrainedModel]
    options: tuple[str, ...] = ()
    check: Callable[..., None] | None = None
    summary: Callable[[PreTrainedModel], dict] = lambda model: {}
    # > 0: the conversion is calibrated on data. train.convert then calls convert(source_dir, batches, **options)
    # with that many training batches of token ids (or its `calibration_batches` option's count), tokenized as
    # the source is: the converter reads data without knowing where it comes from.
    calibration: int = 0


def config_summary(*fields: str, **computed: Callable) -> Callable[[PreTrainedModel], dict]:
    """A Converter's `summary`: the converted model's config `fields` by name, then each `computed` field as a
    function of the config, in that order (the report's order)."""

    def summary(model: PreTrainedModel) -> dict:
        c = model.config
        return {**{f: getattr(c, f) for f in fields}, **{name: fn(c) for name, fn in computed.items()}}

    return summary


LLAMA_TYPES = ("llama", "zoo_llama")  # a Hugging Face Llama checkpoint, or the zoo's llama


def from_llama(target: str, target_title: str, convert: Callable, summary: Callable, *, check: Callable | None = None,
               options: tuple[str, ...] = (), source_types: tuple[str, ...] = LLAMA_TYPES,
               calibration: int = 0) -> Converter:
    """The converter `llama_to_<target>`: a Llama checkpoint (`source_types`) into the zoo architecture `target`."""
    return Converter(name=f"llama_to_{target}", source="llama", source_types=source_types, source_title="Llama",
                     target=target, target_title=target_title, convert=convert, options=options, check=check,
                     summary=summary, calibration=calibration)  # fmt: skip


CONVERTERS: dict[str, Converter] = {}


def register_converter(converter: Converter) -> None:
    CONVERTERS[converter.name] = converter


def get_converter(name: str) -> Converter:
    if name not in CONVERTERS:
        raise ValueError(f"Unknown converter {name!r}; the zoo has: {', '.join(sorted(CONVERTERS))}.")
    return CONVERTERS[name]
