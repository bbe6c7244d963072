"""The MoE section: all-to-all bytes and exposure per MoE layer, and one expert layer's throughput.

- `all_to_all_columns`: per MoE layer of a generation row with expert-parallel all-to-alls, the bytes counted
  beside the entry's dropless formula and (simulated) the link time, the part left exposed and the share
  hidden;
- `expert_throughput` (off by default): one MoE layer's forward timed for real on this device, no
  communication, each router pushed to the load its balance loss aims for (MoE++ at tau), tokens/s of each
  layer beside the first's.
"""

import inspect
import statistics
import time

import torch

import models
from eval.bench.degrees import link_of
from eval.bench.settings import ExpertThroughputSettings
from models.common.moe import GroupedExperts, TopKRouter
from parallel import comm


def all_to_all_columns(
    row: dict, arch: str, config, degrees: dict[str, int], dtype: torch.dtype, prompt_len: int, anchors: dict
) -> dict:
    """Per MoE layer, for a row of `arch` (its `config` at `degrees`) whose forward sent token all-to-alls (expert
    parallelism), per phase (prefill = one forward of batch x `prompt_len` tokens, decode = one step of batch tokens):

    - `{phase}_moe_layers`: all-to-all calls / 2 (dispatch and combine per MoE layer, models/common/moe.py);
    - `{phase}_a2a_bytes`: bytes per token all-to-all, counted by comm.counters (the rows this rank hands
      to the all-to-all, its own chunk included; the count exchange is counted apart);
    - `{phase}_a2a_formula_bytes`: the same from the architecture's declared collectives_per_forward, which
      is the spec's dropless T_local * k * h * bytes (MoE++: k_eff at the balanced load, not an integer);
      `{phase}_a2a_link_bytes_formula` = that * (P-1)/P, the part that leaves the rank;
      `{phase}_a2a_rows_per_token` and `..._formula`: the same two as rows (experts) per token, k;
    - simulated rows: `{phase}_a2a_link_ms_per_layer` (the link model's time of the layer's two token
      all-to-alls), `{phase}_a2a_exposed_ms_per_layer` (the part of it the rank waited for, from the
      virtual clock), `{phase}_a2a_hidden_share` = 1 - exposed / link time, and
      `{phase}_count_exchange_exposed_ms_per_layer` (the blocking exchange of per-expert counts);
      `a2a_hidden_anchor`: the published share for this architecture on the ep link (`anchors`: settings
      `anchors.a2a_hidden_share`).
    """
    out = {}
    p = degrees.get("ep", 1)  # the expert-parallel all-to-alls run over ep
    d, elem = config.hidden_size, torch.empty((), dtype=dtype).element_size()
    declared = (models.get(arch).collectives_per_forward or (lambda c, g: {}))(config, degrees).get("all_to_all")
    tokens = {"prefill": row["batch"] * prompt_len, "decode": row["batch"]}
    for phase, n in tokens.items():
        a2a = row[f"{phase}_comm_by_kind"].get("all_to_all")
        if not a2a or not a2a["calls"]:
            continue
        layers = a2a["calls"] / 2
        per_call = a2a["bytes"] / a2a["calls"]
        out[f"{phase}_moe_layers"] = layers
        out[f"{phase}_a2a_bytes"] = per_call
        out[f"{phase}_a2a_rows_per_token"] = per_call / (n * d * elem)
        if declared is not None and declared.calls:
            formula = declared.values_per_token / declared.calls * n * elem
            out[f"{phase}_a2a_formula_bytes"] = formula
            out[f"{phase}_a2a_link_bytes_formula"] = formula * (p - 1) / p
            out[f"{phase}_a2a_rows_per_token_formula"] = declared.values_per_token / declared.calls / d
        busy, exposed = row.get(f"{phase}_comm_busy_ms_by_kind"), row.get(f"{phase}_exposed_ms_by_kind")
        if busy is not None:
            link_ms = busy.get("all_to_all", 0.0) / layers
            exposed_ms = exposed.get("all_to_all", 0.0) / layers
            out[f"{phase}_a2a_link_ms_per_layer"] = link_ms
            out[f"{phase}_a2a_exposed_ms_per_layer"] = exposed_ms
            out[f"{phase}_a2a_hidden_share"] = 1 - exposed_ms / link_ms if link_ms > 0 else None
            out[f"{phase}_count_exchange_exposed_ms_per_layer"] = exposed.get("exchange_splits", 0.0) / layers
    if out and row.get("links") is not None:
        out["a2a_hidden_anchor"] = (anchors.get(arch) or {}).get(link_of(row["links"], "ep"))
    return out


# --- MoE: one expert layer's throughput, for real on one device ---------------------------------


def expert_layer_label(spec: dict) -> str:
    """`moepp tau=0.75`: the architecture and the config fields set for this entry."""
    overrides = spec.get("overrides") or {}
    return " ".join([spec["arch"], *(f"{k}={v}" for k, v in overrides.items())])


def check_expert_throughput(et: ExpertThroughputSettings) -> None:
    if not et.layers:
        raise ValueError("expert_throughput.layers is empty: list the MoE layers to time, the baseline first.")
    if et.tokens < 1 or et.repeats < 1:
        raise ValueError(f"expert_throughput needs tokens >= 1 and repeats >= 1, got {et.tokens}, {et.repeats}.")
    for spec in et.layers:
        entry = models.get(spec["arch"])
        config = et.model.config(spec["arch"], {}, **(spec.get("overrides") or {}))
        declared = entry.collectives_per_forward(config, {"ep": 2}) if entry.collectives_per_forward else {}
        if "all_to_all" not in declared:
            raise ValueError(
                f"expert_throughput times MoE layers, but {spec['arch']!r} declares no expert-parallel all-to-all "
                "(collectives_per_forward at ep 2); list MoE architectures only."
            )


def first_moe_layer(model: torch.nn.Module) -> torch.nn.Module:
    """The first module with a top-k `router` and grouped `experts` (models/common/moe.py): an MoE layer."""
    for module in model.modules():
        if isinstance(getattr(module, "router", None), TopKRouter) and isinstance(
            getattr(module, "experts", None), GroupedExperts
        ):
            return module
    raise ValueError(f"{type(model).__name__} has no MoE layer (a module with a TopKRouter and GroupedExperts).")


def _ffn_rows_per_token(layer, x: torch.Tensor, offset: float) -> float:
    """Rows per token the router sends to the grouped (FFN) experts when the experts past them
    (MoE++'s zero-computation experts) get `offset` added to their logits."""
    n_ffn, n = layer.experts.num_experts, layer.router.num_experts
    bias = torch.zeros(n, device=x.device)
    bias[n_ffn:] = offset
    routing = layer.router(x, extra_logits=bias.expand(x.shape[0], n))
    return (routing.expert_idx < n_ffn).sum().item() / x.shape[0]


def route_at_target(layer, x: torch.Tensor, target: float) -> float:
    """Push `layer`'s router to the load its balance loss aims for: `target` rows per token to the grouped
    experts (the entry's declared all-to-all rows per token, k_eff for MoE++). Random weights route about
    uniformly over ALL experts whatever tau is, so without this tau would change nothing; trained routers
    reach that load through the heterogeneous balance loss. A logit offset on the experts past the grouped
    ones (none in a plain MoE) is found by bisection and added on every call by a forward pre-hook on the
    router (no model code changes). Returns the offset (0 without such experts)."""
    if layer.router.num_experts == layer.experts.num_experts:
        return 0.0
    lo, hi = -30.0, 30.0  # rows per token fall as the offset grows
    for _ in range(40):
        mid = (lo + hi) / 2
        if _ffn_rows_per_token(layer, x, mid) > target:
            lo = mid
        else:
            hi = mid
    offset = (lo + hi) / 2
    n_ffn, n = layer.experts.num_experts, layer.router.num_experts
    bias = torch.zeros(n, device=x.device)
    bias[n_ffn:] = offset

    def add_bias(module, args, kwargs):
        extra = kwargs.get("extra_logits")
        kwargs["extra_logits"] = bias if extra is None else extra + bias
        return args, kwargs

    layer.router.register_forward_pre_hook(add_bias, with_kwargs=True)
    return offset


def expert_throughput(et: ExpertThroughputSettings, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Tokens/s of one MoE layer's forward (router, experts, combine; no communication: every expert on this
    device), for each entry of `expert_throughput.layers` at the bench shape, timed for real, interleaved
    over repeats like the generation bench; the first entry is the baseline of `speedup`. Each router is
    pushed to the load its balance loss aims for (`route_at_target`)."""
    gen = torch.Generator().manual_seed(et.seed)
    layers, rows = {}, []
    for spec in et.layers:
        label, arch = expert_layer_label(spec), spec["arch"]
        entry = models.get(arch)
        config = et.model.config(arch, {}, **(spec.get("overrides") or {}))
        with torch.device("meta"):
            model = entry.model_class(config)  # on meta: only the layer timed is materialised
        layer = first_moe_layer(model)
        layer.to(dtype)
        layer.to_empty(device=device)
        torch.manual_seed(et.seed)
        with torch.no_grad():
            layer.apply(model._init_weights)
        layer.eval()
        declared = entry.collectives_per_forward(config, {"ep": 2})["all_to_all"]
        target = declared.values_per_token / declared.calls / config.hidden_size
        x = torch.randn(et.tokens, config.hidden_size, generator=gen).to(device, dtype)
        with torch.no_grad():
            offset = route_at_target(layer, x, target)
            realised = _ffn_rows_per_token(layer, x, 0.0)  # the hook adds the offset now
        # MoE layers take the tokens first; anything else they take (MoE++: the previous layer's router
        # logits, for its gating residual) is None, as for a first layer.
        extra = [None] * (sum(1 for q in inspect.signature(layer.forward).parameters.values() if q.default is q.empty) - 1)
        layers[label] = (layer, x, extra)
        rows.append({"label": label, "arch": arch, "overrides": dict(spec.get("overrides") or {}),
                     "anchor": spec.get("anchor"), "tokens": et.tokens, "target_rows_per_token": target,
                     "ffn_rows_per_token": realised, "router_offset": offset})  # fmt: skip
        del model

    def run_once(label):
        layer, x, extra = layers[label]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        layer(x, *extra)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    times = {label: [] for label in layers}
    with torch.no_grad(), comm.use_mode("none"):
        for label in layers:
            for _ in range(et.warmup):
                run_once(label)
        for _ in range(et.repeats):
            for label in layers:
                times[label].append(run_once(label))
    for row in rows:
        t = times[row["label"]]
        row.update(ms=1e3 * statistics.median(t), ms_min=1e3 * min(t), ms_max=1e3 * max(t))
        row["tokens_per_s"] = row["tokens"] / statistics.median(t)
    base = rows[0]
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
        # What the speed-up would be if the grouped experts were all the time: the ratio of their rows.
        row["expert_rows_ratio"] = base["ffn_rows_per_token"] / row["ffn_rows_per_token"] if row["ffn_rows_per_token"] else None
    return rows


