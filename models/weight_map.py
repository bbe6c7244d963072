"""Weight maps: a converter's renaming of one model's state dict into another's, stated as rules.

A map is a list of `Rule`s, each `source name(s) -> target name(s)` with an optional transform:

    Rule("model.layers.{layer}.mlp.gate.weight", "model.layers.{layer}.mlp.router.gate.weight")
    Rule("model.layers.{layer}.mlp.experts.gate_up_proj",
         ("model.layers.{layer}.mlp.experts.gate_proj", "model.layers.{layer}.mlp.experts.up_proj"), chunks(2, dim=1))
    Rule("model.layers.{layer}.mlp.{proj:gate_proj|up_proj|down_proj}.weight",
         "model.layers.{layer}.mlp.experts.{proj}", stack_copies(8), when=lambda fields: fields["layer"] != "0")

Names: `{field}` in a source matches one part of a dotted name (`{field:regex}`: what the regex matches) and
stands for that part in the rule's other names. Several sources are read together: the first is the name the
rule looks for, the others are named from its fields, and the transform gets the tensors in that order. Several
targets: the transform returns one tensor per target. No transform: the one source tensor as it is. No target:
the weight is dropped. `when(fields)` limits a rule to some matches (e.g. the MoE layers' weights).

`map_weights` applies, to each name of a state dict, the first rule that matches it, and keeps under its own
name a weight no rule matches (or refuses it: `keep_rest=False`). Each error is one line naming the weight: a
name no rule maps, a source a rule reads that the state dict lacks, a target written twice. `check_mapped`
compares the mapped names with the target model's; `load_mapped` builds a transformers class from a mapped
state dict, refusing what its loader left unmapped.
"""

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

Transform = Callable[..., torch.Tensor | Sequence[torch.Tensor]]
FIELD = re.compile(r"\{(\w+)(?::([^{}]+))?\}")
# What transformers' loader (output_loading_info=True) reports as left unmapped.
LOADING_GAPS = ("missing_keys", "unexpected_keys", "mismatched_keys")


def _compile(pattern: str) -> re.Pattern:
    """`pattern`'s fields as named groups, everything else literal."""
    parts, end = [], 0
    for match in FIELD.finditer(pattern):
        parts += [re.escape(pattern[end : match.start()]), f"(?P<{match[1]}>{match[2] or '[^.]+'})"]
        end = match.end()
    return re.compile("".join(parts) + re.escape(pattern[end:]))


def _fill(pattern: str, fields: dict[str, str]) -> str:
    """`pattern` with its fields' values (a field without one stays as it is written)."""
    return FIELD.sub(lambda match: fields.get(match[1], match[0]), pattern)


def _names(names: str | Iterable[str]) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else tuple(names)


@dataclass(frozen=True)
class Rule:
    """`source` name(s) -> `target` name(s), through `transform` where given, for the matches `when` accepts."""

    source: str | tuple[str, ...]
    target: str | tuple[str, ...] = ()
    transform: Transform | None = None
    when: Callable[[dict[str, str]], bool] | None = None
    _patterns: tuple[re.Pattern, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        sources, targets = _names(self.source), _names(self.target)
        if not sources or (self.transform is None and (len(sources) > 1 or len(targets) > 1)):
            raise ValueError(f"Rule {sources} -> {targets}: one source, or a transform of several, is needed.")
        unknown = {m[1] for name in sources[1:] + targets for m in FIELD.finditer(name)}
        unknown -= {m[1] for m in FIELD.finditer(sources[0])}
        if unknown:
            raise ValueError(f"Rule {sources} -> {targets} uses {sorted(unknown)}, not fields of {sources[0]}.")
        object.__setattr__(self, "source", sources)
        object.__setattr__(self, "target", targets)
        object.__setattr__(self, "_patterns", tuple(_compile(name) for name in sources))

    def match(self, name: str) -> tuple[int, dict[str, str]] | None:
        """Which of the rule's sources `name` is (0: the one it looks for) and its fields, or None."""
        for i, pattern in enumerate(self._patterns):
            if (found := pattern.fullmatch(name)) and (self.when is None or self.when(found.groupdict())):
                return i, found.groupdict()
        return None

    def apply(self, tensors: Sequence[torch.Tensor], fields: dict[str, str]) -> dict[str, torch.Tensor]:
        """The rule's target names, filled from `fields`, with the tensors it makes of `tensors`."""
        targets = [_fill(name, fields) for name in self.target]
        if not targets:
            return {}  # dropped
        made = self.transform(*tensors) if self.transform is not None else tensors[0]
        made = (made,) if isinstance(made, torch.Tensor) else tuple(made)
        if len(made) != len(targets):
            raise ValueError(f"Rule {self.source[0]} made {len(made)} tensors for the {len(targets)} names {targets}.")
        return dict(zip(targets, made, strict=True))


def map_weights(
    state: dict[str, torch.Tensor],
    rules: Iterable[Rule],
    keep_rest: bool = True,
    consume: bool = False,
) -> dict[str, torch.Tensor]:
    """`state` renamed and reshaped by `rules` (module docstring), in its order; names no rule matches are
    kept as they are (`keep_rest=False`: refused). `consume`: each tensor is popped from `state` as it is
    mapped, so that a large model is not held twice."""
    rules = tuple(rules)
    take = state.pop if consume else state.__getitem__
    out: dict[str, torch.Tensor] = {}
    read_with, read = {}, set()  # a rule's other sources as met -> the name they are read with; those read

    def put(target: str, tensor: torch.Tensor, source: str) -> None:
        if target in out:
            raise ValueError(f"The weight map writes {target} twice (the second time from {source}).")
        out[target] = tensor

    for name in list(state):
        if name not in state:
            continue  # popped with the name it is read with
        rule, found = next(((r, m) for r in rules if (m := r.match(name))), (None, None))
        if rule is None:
            if not keep_rest:
                raise ValueError(f"No rule of the weight map maps {name}.")
            put(name, take(name), name)
            continue
        index, fields = found
        if index:
            read_with[name] = _fill(rule.source[0], fields)
            continue
        sources = [_fill(source, fields) for source in rule.source]
        lacking = [source for source in sources[1:] if source not in state]
        if lacking:
            raise ValueError(f"{name} maps together with {lacking}, which the state dict lacks.")
        for target, tensor in rule.apply([take(source) for source in sources], fields).items():
            put(target, tensor, name)
        read.update(sources[1:])
    unread = sorted(set(read_with) - read)
    if unread:
        raise ValueError(f"{unread[0]} maps only together with {read_with[unread[0]]}, which the state dict lacks.")
    return out


def check_mapped(state: dict[str, torch.Tensor], expected: Iterable[str], what: str) -> None:
    """One error (a mapping bug: never leave target weights random) unless `state` has exactly the names
    `expected`; it names the first few missing and unexpected ones."""
    expected = set(expected)
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        raise RuntimeError(f"{what} mapping bug: missing {missing[:4]}, unexpected {extra[:4]}.")


def loading_gaps(info: dict) -> dict:
    """What transformers' loader (`from_pretrained(..., output_loading_info=True)`) left unmapped, by kind."""
    return {k: v for k, v in info.items() if k in LOADING_GAPS and v}


def load_mapped(model_class, config, state: dict[str, torch.Tensor], dtype, what: str):
    """`model_class` (a transformers ...ForCausalLM) of `config` loaded from the mapped `state`; one error
    naming what the loader left unmapped (a mapping bug: never leave weights random)."""
    model, info = model_class.from_pretrained(
        None, config=config, state_dict=state, dtype=dtype, output_loading_info=True
    )
    if gaps := loading_gaps(info):
        raise RuntimeError(f"{what} left weights unmapped: {gaps}.")
    return model


# --- transforms ----------------------------------------------------------------------------------------------


def concat(dim: int = 0) -> Transform:
    """The sources joined along `dim` (e.g. gate and up projections into one gate_up)."""
    return lambda *tensors: torch.cat(tensors, dim=dim)


def chunks(n: int, dim: int = 0) -> Transform:
    """The source cut into `n` equal contiguous parts along `dim` (the inverse of `concat`)."""
    return lambda tensor: tuple(part.contiguous() for part in tensor.chunk(n, dim=dim))


def stack_copies(n: int) -> Transform:
    """The source copied `n` times along a new first dim: [n, ...] (a dense weight into every expert slot)."""
    return lambda tensor: tensor.unsqueeze(0).expand(n, *tensor.shape).clone()
