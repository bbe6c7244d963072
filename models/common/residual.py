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
None on one device).
"""

import json
from pathlib import Path

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
    x = hidden_states
    attn_pending = mlp_pending = None  # collectives in flight from the previous laddered layer
    for i, layer in enumerate(layers):
        if i not in laddered:
            x = _add(_add(x, attn_pending), mlp_pending)
            attn_pending = mlp_pending = None
            x = _collect(layer(x, position_embeddings, attention_mask, cache), aux)
            continue
        x = _add(x, attn_pending)  # wait for layer i-1's attention output
        attn_out = layer.attention_block(x, position_embeddings, attention_mask, cache)
        attn_pending = comm.all_reduce(attn_out, layer.tp_group)  # overlaps this layer's MLP
        x = _add(x, mlp_pending)  # wait for layer i-1's MLP output
        mlp_pending = _collect(layer.mlp_in_flight(x), aux)  # overlaps the next attention
    return _add(_add(x, attn_pending), mlp_pending)


def _collect(out, aux: list | None):
    """`out`, or its first part where a layer returned (value, aux dict), the dict appended to `aux`."""
    if not isinstance(out, tuple):
        return out
    value, extra = out
    if aux is not None:
        aux.append(extra)
    return value


def _add(x, pending: "comm.Handle | None"):
    return x if pending is None else x + pending.wait()


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
    """The config's own checks of `ladder_layers` for this checkpoint's layers, from its config alone."""
    config_class.from_pretrained(source, residual="ladder", ladder_layers=ladder_layers)


class ResidualSchedule:
    """Trunk mixin (before ZooDecoderModel in the bases): `run_layers` under the config's `residual` schedule."""

    @property
    def runs_layers_whole(self) -> bool:
        # Under the ladder schedule the trunk calls the layers' sub-blocks itself (FSDP units, AC regions follow).
        return self.config.residual != "ladder"

    def run_layers(self, hidden_states, position_embeddings, attention_mask, cache):
        return self.run_schedule(hidden_states, position_embeddings, attention_mask, cache)

    def run_schedule(self, hidden_states, position_embeddings, attention_mask, cache, aux=None):
        """The layers under the config's schedule; layers returning `(x, aux dict)` have the dicts appended to
        `aux` (for a trunk that pools auxiliary losses over its layers)."""
        if self.config.residual == "ladder":
            laddered = laddered_indices(self.config.ladder_layers, self.config.num_hidden_layers)
            return run_ladder(self.layers, laddered, hidden_states, position_embeddings, attention_mask, cache, aux)
        for layer in self.layers:
            hidden_states = _collect(layer(hidden_states, position_embeddings, attention_mask, cache), aux)
        return hidden_states
