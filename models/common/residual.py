"""Residual schedules: when a layer's sub-block outputs join the residual stream.

- standard: each sub-block's output (under TP a partial sum) is reduced and added at once, because the next
  sub-block reads it (`PreNormDecoderLayer.forward`).
- ladder (Ladder Residual, Zhang, Mishra et al. 2025): a laddered layer's sub-block reads the stream WITHOUT the
  previous sub-block's output, whose reduction is still in flight; it is added one sub-block later. In one-stream
  form, with `a_prev`, `m_prev` the handles of the previous laddered sub-blocks' collectives:

      x = x + a_prev.wait();  a_prev = reduce_async(Attn_i(LN1_i(x)))
      x = x + m_prev.wait();  m_prev = reduce_async(MLP_i(LN2_i(x)))

  so each collective runs while the next sub-block computes. Non-laddered layers run the standard block.

`ladder_layers` names the laddered layers: an int N (the LAST N layers; 0 = the standard architecture,
`num_hidden_layers` = every layer) or a list of layer indices; None (every layer) is resolved to the number when
the config is built, so a config.json always states it.

An architecture takes the schedule as a config field, `residual: standard | ladder` (with `ladder_layers`), checked
by `check_residual`, and its trunk class `ResidualSchedule` (which picks the schedule in `run_layers`). A layer the
ladder schedule runs has two sub-blocks, `attention_block(x, position_embeddings, attention_mask,
cache)` and `mlp_block(x)`, each returning its output before its reduction, and `tp_group` (the all-reduce's group;
None on one device). A layer whose MLP reads a value the previous layer passes down (MoE++'s router logits, its
gating residual) says so with `passes_down = True`: it takes that value (None at the first layer) as the last
argument of `forward` and of `mlp_in_flight`, and returns the value to pass on as the last element of their results.
"""

import json
from functools import partial
from pathlib import Path

from models.common.decoder import add_pending, run_split, runs_split
from models.registry import Converter, config_summary
from parallel import comm

RESIDUALS = ("standard", "ladder")


def check_ladder_layers(ladder_layers, num_hidden_layers: int):
    """`ladder_layers` resolved (None -> every layer) and checked; one error naming the value and what fits."""
    n = num_hidden_layers
    if ladder_layers is None:
        return n  # the default: the paper's Ladder Transformer, every layer laddered
    if isinstance(ladder_layers, bool) or not isinstance(ladder_layers, (int, list, tuple)):
        raise ValueError(
            f"ladder_layers={ladder_layers!r} must be an int in 0..{n} (the number of last layers "
            f"to ladder), a list of layer indices in 0..{n - 1}, or None (every layer, the default)."
        )
    if isinstance(ladder_layers, int):
        if not 0 <= ladder_layers <= n:
            raise ValueError(
                f"ladder_layers={ladder_layers} is out of range; use 0..{n} (the number of last "
                f"layers to ladder) or a list of layer indices in 0..{n - 1}."
            )
    else:
        bad = [i for i in ladder_layers if isinstance(i, bool) or not (isinstance(i, int) and 0 <= i < n)]
        if bad or len(set(ladder_layers)) != len(ladder_layers):
            raise ValueError(f"ladder_layers={list(ladder_layers)} must list distinct layer indices in 0..{n - 1}.")
    return ladder_layers


def check_residual(residual, ladder_layers, num_hidden_layers: int):
    """`ladder_layers` as the config should hold it for `residual`: resolved under the ladder schedule, None under
    the standard one (where it means nothing: set it and the schedule is refused in one line)."""
    if residual not in RESIDUALS:
        raise ValueError(f"residual={residual!r} is not a residual schedule; use one of {list(RESIDUALS)}.")
    if residual == "standard":
        if ladder_layers is not None:
            raise ValueError(
                f"ladder_layers={ladder_layers!r} is read only with residual='ladder'; set residual='ladder' "
                "or leave ladder_layers out."
            )
        return None
    return check_ladder_layers(ladder_layers, num_hidden_layers)


def laddered_indices(ladder_layers, num_hidden_layers: int) -> frozenset[int]:
    """Indices of the laddered layers (None: every layer)."""
    if ladder_layers is None:
        return frozenset(range(num_hidden_layers))
    if isinstance(ladder_layers, int):
        return frozenset(range(num_hidden_layers - ladder_layers, num_hidden_layers))
    return frozenset(ladder_layers)


def run_ladder(layers, laddered: frozenset[int], hidden_states, position_embeddings, attention_mask, cache, aux=None):
    """The ladder schedule over `layers`: each laddered sub-block's last collective is waited one sub-block later.

    The attention's collective is the TP all-reduce of its partial output; the MLP's is what the layer's
    `mlp_in_flight(x) -> (pending, aux)` issues (PreNormDecoderLayer: the TP all-reduce; an MoE layer: the combine
    all-to-all); `pending.wait()` gives the output to add. Aux dicts (MoE layers) are appended to `aux`."""
    stack = _Stack(aux)
    x = hidden_states
    attn_pending = mlp_pending = None  # collectives in flight from the previous laddered layer
    for i, layer in enumerate(layers):
        if i not in laddered:
            x = add_pending(add_pending(x, attn_pending), mlp_pending)
            attn_pending = mlp_pending = None
            x = stack.call(layer, layer, x, position_embeddings, attention_mask, cache)
            continue
        x = add_pending(x, attn_pending)  # wait for layer i-1's attention output
        attn_out = layer.attention_block(x, position_embeddings, attention_mask, cache)
        attn_pending = comm.all_reduce(attn_out, layer.tp_group)  # overlaps this layer's MLP
        x = add_pending(x, mlp_pending)  # wait for layer i-1's MLP output
        mlp_pending = stack.call(layer, layer.mlp_in_flight, x)  # overlaps the next attention
    return add_pending(add_pending(x, attn_pending), mlp_pending)


def run_standard(layers, hidden_states, position_embeddings, attention_mask, cache, aux=None):
    """The standard schedule: each layer whole (its forward waits its collectives at once)."""
    stack = _Stack(aux)
    for layer in layers:
        hidden_states = stack.call(layer, layer, hidden_states, position_embeddings, attention_mask, cache)
    return hidden_states


class _Stack:
    """What goes down the layers besides the residual stream: the aux dicts (appended to `aux`, which the trunk
    pools) and the value a `passes_down` layer hands to the next."""

    def __init__(self, aux: list | None):
        self.aux, self.passed = aux, None

    def call(self, layer, fn, *args):
        """`fn(*args)` (the layer or one of its sub-blocks) with the passed-down value where the layer takes it;
        returns its first result, the aux dict appended and the value to pass on kept."""
        out = fn(*args, self.passed) if layer.passes_down else fn(*args)
        if layer.passes_down:
            *out, self.passed = out
            out = tuple(out)
        if not isinstance(out, tuple):
            return out
        value, extra = out
        if self.aux is not None:
            self.aux.append(extra)
        return value


def to_ladder(model_class, source: str | Path, ladder_layers=None, **kwargs):
    """A checkpoint trained under the standard schedule, loaded under the ladder one: the same weights, the schedule
    changed (as Llama -> Ladder), `ladder_layers` as the config's (None: every layer). `model_class`: the
    architecture's ...ForCausalLM, whose config has the `residual` field; a checkpoint of another type is refused."""
    config_file = Path(source) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"No config.json in {source}; pass the directory of a saved checkpoint.")
    model_type, wanted = json.loads(config_file.read_text()).get("model_type"), model_class.config_class.model_type
    if model_type != wanted:
        raise ValueError(f"Checkpoint {source} has model_type={model_type!r}; this conversion reads {wanted!r}.")
    return model_class.from_pretrained(source, residual="ladder", ladder_layers=ladder_layers, **kwargs)


def check_to_ladder(config_class, source: str | Path, ladder_layers=None) -> None:
    """The config's own checks of `ladder_layers` for this checkpoint's layers, from its config alone; a source
    already under the ladder schedule is refused (converting it would only move which layers are laddered: a
    change of the function that the report would call a conversion of the standard model)."""
    saved = config_class.from_pretrained(source)
    if getattr(saved, "residual", "standard") == "ladder":
        raise ValueError(
            f"{source} is already under the ladder residual schedule (ladder_layers={saved.ladder_layers!r}); its "
            f"{config_class.model_type}_to_ladder conversion reads a checkpoint trained under the standard one. Train "
            "it on as it is (model.init_from), or convert its standard-schedule checkpoint."
        )
    config_class.from_pretrained(source, residual="ladder", ladder_layers=ladder_layers)


def ladder_converter(name: str, model_class) -> Converter:
    """`train.convert converter=<name>_to_ladder`: a checkpoint of architecture `name` (whose config has the
    `residual` field) trained under the standard schedule, under the ladder one: the same weights, validation loss
    before / after (/ retrained), as llama_to_ladder does for Llama."""
    config_class = model_class.config_class
    return Converter(
        name=f"{name}_to_ladder",
        source=name,
        source_types=(config_class.model_type,),
        source_title=name,
        target=name,
        target_title=f"{name} under the ladder residual schedule",
        convert=partial(to_ladder, model_class),
        options=("ladder_layers",),
        check=partial(check_to_ladder, config_class),
        summary=config_summary("residual", "ladder_layers", "num_hidden_layers"),
    )


class ResidualSchedule:
    """Trunk mixin (before ZooDecoderModel in the bases): `run_layers` under the config's `residual` schedule."""

    @property
    def runs_layers_whole(self) -> bool:
        # Under the ladder schedule (and a splitting overlap schedule) the trunk calls the layers' sub-blocks
        # itself (FSDP units, AC regions follow).
        return self.config.residual != "ladder" and super().runs_layers_whole

    def run_layers(self, hidden_states, position_embeddings, attention_mask, cache):
        return self.run_schedule(hidden_states, position_embeddings, attention_mask, cache)

    def run_schedule(self, hidden_states, position_embeddings, attention_mask, cache, aux=None):
        """The layers under the config's schedule; layers returning `(x, aux dict)` have the dicts appended to
        `aux` (for a trunk that pools auxiliary losses over its layers)."""
        if runs_split(self.overlap, hidden_states):  # parallel/overlap.py (refused under the ladder schedule)
            return run_split(self.layers, self.overlap, hidden_states, position_embeddings, attention_mask, cache, aux)
        if self.config.residual == "ladder":
            laddered = laddered_indices(self.config.ladder_layers, self.config.num_hidden_layers)
            return run_ladder(self.layers, laddered, hidden_states, position_embeddings, attention_mask, cache, aux)
        return run_standard(self.layers, hidden_states, position_embeddings, attention_mask, cache, aux)
