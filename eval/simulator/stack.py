"""A decoder of L layers predicted from replays of a few shallower stacks of the same layers.

A training step's time and memory on the meta device are sums over the model's ops, and the layers of a decoder
repeat: after the first few, each further layer adds the same ops, the same collectives and the same bytes (FSDP's
prefetch and the link's queue reach their steady state within a layer or two). So a quantity that adds up over the
step (the replay's clock, the link time, the FLOPs, the bytes alive at the peak) is, for a stack of `n` repeated
layers, `a + n b`: two replays of shallow stacks give it at any depth. Replaying every layer costs time linear in L
(the training replay) or worse (the memory replay's tracker walks every tensor alive at each op: quadratic), which
is what made a 70B plan take minutes.

`stack_terms(arch, config)` finds the repetition and writes the full model as a combination of shallow configs,
`[(config_i, c_i)]` with `value(full) = sum_i c_i value(config_i)`:

- the layers are compared by what they are (each sub-module's class and its parameters' shapes, built on the meta
  device) and by the residual schedule (which layers are laddered): a stack is one segment, or with `residual:
  ladder` over the last N layers two (standard, then laddered); each segment is periodic with the smallest period
  p that its layers take after their first few (an MoE layer every other layer: p = 2; a hybrid's `layer_pattern`:
  its length; MoE++'s first layer, without the gating residual, sits in the part that does not repeat);
- a shallow config keeps every setting but `num_hidden_layers` (and `ladder_layers`): each segment shortened to
  one period past its first layers that differ and `settle` more (FSDP's prefetch settles within them: one layer
  for the time, two for the memory), at its own phase (the same layer kinds at the same positions), and one more
  config per segment with one period more. Each shallow stack is built and its layers compared with the full one's
  first layers of each segment: if they differ (a setting that depends on the depth), or a segment is too short to
  shorten, the full config is replayed as it is.

`combine(values, coefficients)` adds numbers (and dicts of numbers, key by key) with the coefficients. The simulator's
tests replay full stacks against the combinations at a small shape for every architecture.
"""

import math
from functools import cache

import torch

import models
from models.common.residual import laddered_indices
from train.flops import flops_per_token

# A segment's first layers may differ from the rest (MoE++'s first layer has no gating residual): at most MAX_LEAD
# of them; the repeating part's period is at most MAX_PERIOD layers. Then `settle` layers more before the repeating
# part, where FSDP's prefetch and the link's queue reach their steady state: one for the step's time; two for its
# memory (in the backward the gather of the layer after next is issued while a layer's gradients are reduced: at
# two layers the temporaries at the peak are not yet those of a deep stack).
MAX_LEAD = 2
MAX_PERIOD = 8
TIME_SETTLE = 1
MEMORY_SETTLE = 2


def _layer_signatures(arch: str, config) -> list[tuple]:
    """Per layer: each sub-module's class and its own parameters' shapes, and whether the layer is laddered."""
    with torch.device("meta"):
        model = models.get(arch).model_class(config)
    layers = model.model.layers
    laddered = _laddered(config)
    out = []
    for i, layer in enumerate(layers):
        parts = tuple(
            (name, type(m).__name__, tuple(tuple(p.shape) for p in m.parameters(recurse=False)))
            for name, m in layer.named_modules()
        )
        out.append((i in laddered, parts))
    return out


def _is_ladder(config) -> bool:
    """Whether the config runs the ladder schedule: `residual: ladder`, or Ladder's own config (no `residual`)."""
    return (
        getattr(config, "residual", "ladder" if hasattr(config, "ladder_layers") else "standard") == "ladder"
    )


def _laddered(config) -> frozenset[int]:
    if not _is_ladder(config):
        return frozenset()
    return laddered_indices(config.ladder_layers, config.num_hidden_layers)


def _segments(config) -> list[tuple[bool, int]] | None:
    """The stack's segments, (laddered, length): the standard layers, then the laddered ones; None where the
    laddered layers are not the last N."""
    n = config.num_hidden_layers
    laddered = _laddered(config)
    if laddered != frozenset(range(n - len(laddered), n)):
        return None
    return [(kind, length) for kind, length in ((False, n - len(laddered)), (True, len(laddered))) if length]


def _shallow(config, segments: list[tuple[bool, int]]):
    """`config` with its segments at the given lengths (standard first, the laddered ones last)."""
    fields = {**config.to_dict(), "num_hidden_layers": sum(n for _, n in segments)}
    if _is_ladder(config):
        fields["ladder_layers"] = sum(n for laddered, n in segments if laddered)
    return type(config).from_dict(fields)


def _period(signatures: list[tuple]) -> tuple[int, int] | None:
    """(p, lead): the smallest period p <= MAX_PERIOD, and the fewest first layers left out, with signature[i] ==
    signature[i + p] for every i >= lead (lead <= MAX_LEAD); None if there is none."""
    for p in range(1, MAX_PERIOD + 1):
        for lead in range(MAX_LEAD + 1):
            if all(signatures[i] == signatures[i + p] for i in range(lead, len(signatures) - p)):
                return p, lead
    return None


def stack_terms(arch: str, config, settle: int = MEMORY_SETTLE) -> list[tuple[object, float]]:
    """`[(config_i, c_i)]`: the full `config` as a combination of shallow ones (module docstring), each segment's
    repeating part starting `settle` layers after its first layers that differ (TIME_SETTLE is enough for the
    step's time, MEMORY_SETTLE for its memory too); `[(config, 1)]` where the layers do not repeat in a way
    shallow stacks reproduce."""
    whole = [(config, 1.0)]
    segments = _segments(config)
    if segments is None:
        return whole
    signatures = _layer_signatures(arch, config)
    lengths = [n for _, n in segments]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    pieces = [signatures[s : s + n] for s, n in zip(starts, lengths, strict=True)]
    found = [_period(piece) for piece in pieces]
    if any(f is None for f in found):
        return whole
    period = math.lcm(*(p for p, _ in found))
    # Each segment: its first layers that differ, `settle` layers more, then one period, at the segment's own phase
    # (its length less a multiple of p).
    base = []
    for n, (_, lead) in zip(lengths, found, strict=True):
        lead += settle
        short = lead + period + (n - lead) % period
        base.append(n if short + period >= n else short)  # too short to gain anything: kept whole
    if base == lengths:
        return whole
    kinds = [laddered for laddered, _ in segments]
    try:
        terms = [[_shallow(config, list(zip(kinds, base, strict=True))), 1.0]]
        if not _reproduces(arch, terms[0][0], pieces, base):
            return whole
        for i, (n, short) in enumerate(zip(lengths, base, strict=True)):
            if short == n:
                continue
            deeper = [*base]
            deeper[i] += period
            shallow = _shallow(config, list(zip(kinds, deeper, strict=True)))
            if not _reproduces(arch, shallow, pieces, deeper):
                return whole
            k = (n - short) // period
            terms.append([shallow, float(k)])
            terms[0][1] -= k
    except ValueError:  # a setting that does not take the shallower depth
        return whole
    return [tuple(term) for term in terms]


def _reproduces(arch: str, shallow, pieces: list[list[tuple]], lengths: list[int]) -> bool:
    """Whether each segment of the shallow stack is the full stack's segment's first layers."""
    signatures = _layer_signatures(arch, shallow)
    if len(signatures) != sum(lengths):
        return False
    start = 0
    for piece, n in zip(pieces, lengths, strict=True):
        if signatures[start : start + n] != piece[:n]:
            return False
        start += n
    return True


def combine(values: list, coefficients: list[float]):
    """sum_i c_i values[i]: numbers, or dicts of them (recursively, key by key; a key missing from one counts 0)."""
    first = values[0]
    if isinstance(first, dict):
        keys = {k for v in values for k in v}
        return {k: combine([v.get(k, 0.0) for v in values], coefficients) for k in keys}
    return sum(c * v for c, v in zip(coefficients, values, strict=True))


def time_parts(arch: str, config, layout, device, link) -> dict:
    """One shallow config's `TrainingRecording.parts` (with its model FLOPs per token, counted once per config)."""
    from eval.simulator.training import record_training

    found = record_training(arch, config, layout, model_flops=False).parts(device, link)
    found["model_flops_per_token"] = train_flops(arch, config, layout.seq_len)
    return found


def predict_from_parts(parts: list[dict], terms, layout, device, link) -> dict:
    """The step of the full config of `terms` from its shallow configs' `time_parts`, combined."""
    from eval.simulator.training import predict_step

    return predict_step(combine(parts, [c for _, c in terms]), layout, device, link, layout.world_size)


def predict_training(arch: str, terms, layout, device, link) -> dict:
    """`record_training(arch, config, layout).predict(device, link)` of the full config of `terms` (`stack_terms`),
    from the replays of its shallow configs: their `parts` combined, then the step predicted from them."""
    parts = [time_parts(arch, config, layout, device, link) for config, _ in terms]
    return predict_from_parts(parts, terms, layout, device, link)


def train_flops(arch: str, config, seq_len: int) -> float:
    """The model FLOPs per token of a training step (train.flops), counted once per config and length in a
    process (they do not depend on the layout; the planner counts them before its workers fork)."""
    return _train_flops(arch, config.to_json_string(), seq_len)


@cache
def _train_flops(arch: str, config_json: str, seq_len: int) -> float:
    import json

    config_class = models.get(arch).config_class
    return flops_per_token(arch, config_class.from_dict(json.loads(config_json)), seq_len).train


def memory_of(arch: str, config, layout):
    """One shallow config's `eval.simulator.memory.predict_training_memory`."""
    from eval.simulator.memory import predict_training_memory as replay

    return replay(arch, config, layout)


def memory_from_parts(found: list, terms):
    """The `TrainingMemory` of the full config of `terms` from its shallow configs' (`memory_of`), combined."""
    from eval.simulator.memory import TrainingMemory

    numbers = [{k: v for k, v in vars(m).items() if k != "peak_phase"} for m in found]
    combined = combine(numbers, [c for _, c in terms])
    return TrainingMemory(**{k: round(v) for k, v in combined.items()}, peak_phase=found[-1].peak_phase)


def predict_training_memory(arch: str, terms, layout):
    """`eval.simulator.memory.predict_training_memory` of the full config of `terms`, from its shallow configs'."""
    return memory_from_parts([memory_of(arch, config, layout) for config, _ in terms], terms)
