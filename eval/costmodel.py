"""Roofline + link cost model of tensor-parallel decoding at paper scale: `python -m eval.costmodel`.

Predicts tokens/s of the standard (`llama`), `ladder`, `parallel` and upper-bound (no collectives)
architectures from the model's shapes, a device preset, a link preset (`parallel.link`) and each
architecture's schedule, and sets the predictions beside the Ladder paper's published 70B table.

Per rank and per sub-block (attention, MLP; the final norm + LM head once), with P the TP degree:
    FLOPs  = 2 x tokens x (sharded weights) + attention scores/values over the KV cache
    bytes  = sharded weights + KV cache read (+ the GQA-expanded copy, see below) + activations in/out
    time   = max(FLOPs / (peak_flops x eff_flops), bytes / (hbm_bandwidth x eff_hbm))
Each sub-block's output is all-reduced (B x T x d elements); the architecture decides where that
all-reduce is waited (the same schedules as the models' forward()):
    standard:     waited at once, after every sub-block (2 per layer, all exposed)
    parallel:     one all-reduce per layer of attention + MLP, waited at once
    ladder:       waited one sub-block later, so it overlaps the next sub-block;
                  exposed = max(0, comm - next compute) with a FIFO link
    upper bound:  no collectives
The schedule runs on `parallel.link.VirtualClock` (FIFO link, alpha-beta ring times) with modelled
compute durations instead of measured ones. Overlap is not free on a GPU: NCCL kernels take SMs and
memory bandwidth from the compute they overlap, so
    time = schedule time + contention x (communication time that was overlapped)
with `contention` the model's one free parameter: set in the config or fitted (`contention: fit`)
to the published NVLink hidden fractions, and reported either way.

Benchmark facts of the reference implementation (gpt-fast fork of the Ladder paper, read in its
code and logs): prompt 1024, 512 generated tokens, static KV cache of prompt + generated tokens
(rounded up to 8) that attention reads in full at every step, GQA implemented by
`repeat_interleave` of K/V to every query head (a written and re-read expanded copy), logits for
every prompt position in prefill, LM head replicated (not sharded), tokens/s = batch x 512 /
(prefill + decode time).
"""

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from eval import report
from parallel.link import LINK_PRESETS, VirtualClock, get_link


@dataclass(frozen=True)
class DevicePreset:
    name: str
    peak_flops: float  # dense bf16/fp16 tensor-core FLOP/s
    hbm_Bps: float  # HBM bandwidth, bytes/s
    note: str = ""


DEVICES: dict[str, DevicePreset] = {
    "h100-sxm": DevicePreset("h100-sxm", 989e12, 3.35e12, "H100 SXM5 80GB datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3"),
    "h200": DevicePreset("h200", 989e12, 4.8e12, "H200 SXM 141GB datasheet: 989 TFLOP/s dense bf16, 4.8 TB/s HBM3e"),
    "a100-sxm": DevicePreset("a100-sxm", 312e12, 2.039e12, "A100 SXM 80GB datasheet: 312 TFLOP/s dense bf16, 2.04 TB/s"),
}

ARCHS = ("standard", "ladder", "parallel", "upper_bound")


# Ladder Residual paper, 70B table (H100 NVLink, fp16, prompt 1024, 512 generated tokens, compiled
# with CUDA graphs); tokens/s. "p2p_off" is ladder's speed-up over standard with NCCL_P2P_DISABLE=1.
PUBLISHED_70B_SOURCE = (
    "Zhang, Mishra et al., Ladder-residual (2025), 70B speed table; copied from ../shared/specs/ladder.md "
    "(reference logs: mayank31398/ladder-residual-inference final-results-512/)"
)
PUBLISHED_70B: list[dict] = [
    {"batch": 1, "tp": 8, "standard": 77.39, "ladder": 101.22, "parallel": 94.22, "upper_bound": 110.59,
     "ladder_speedup": 1.308, "p2p_off_speedup": 1.599},
    {"batch": 4, "tp": 8, "standard": 258.56, "ladder": 331.45, "parallel": 307.34, "upper_bound": 355.8,
     "ladder_speedup": 1.282, "p2p_off_speedup": 1.566},
    {"batch": 16, "tp": 8, "standard": 843.15, "ladder": 1003.52, "parallel": 973.74, "upper_bound": 1109.65,
     "ladder_speedup": 1.190, "p2p_off_speedup": 1.351},
    {"batch": 1, "tp": 4, "standard": 59.41, "ladder": 67.51, "parallel": 65.4, "upper_bound": 69.04,
     "ladder_speedup": 1.136, "p2p_off_speedup": 1.248},
]  # fmt: skip


@dataclass(frozen=True)
class Shape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, cfg: dict) -> "Shape":
        return cls(**{k: int(cfg[k]) for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Settings:
    device: DevicePreset
    eff_flops: float = 0.6  # fraction of peak FLOP/s reached by compute-bound GEMMs (prefill)
    eff_hbm: float = 0.7  # fraction of HBM bandwidth reached by memory-bound kernels (decode)
    dtype_bytes: int = 2
    contention: float = 0.0
    gqa_expand: bool = True  # K/V repeated to every query head before attention (gpt-fast SDPA path)
    static_kv: bool = True  # attention reads the whole static cache (prompt + generated), not the filled part
    prefill_logits_all: bool = True  # prefill computes logits at every prompt position


@dataclass
class Cost:
    flops: float = 0.0
    bytes: float = 0.0

    def time(self, s: Settings) -> float:
        return max(self.flops / (s.device.peak_flops * s.eff_flops), self.bytes / (s.device.hbm_Bps * s.eff_hbm))


@dataclass
class Forward:
    """Per-rank costs of one forward of `tokens` new tokens per sequence over a KV cache of `kv_len`."""

    attention: Cost = field(default_factory=Cost)
    mlp: Cost = field(default_factory=Cost)
    head: Cost = field(default_factory=Cost)
    all_reduce_bytes: int = 0


def forward_costs(shape: Shape, tp: int, batch: int, tokens: int, kv_len: int, s: Settings, logits_tokens: int) -> Forward:
    """FLOPs and HBM bytes per rank of each sub-block of one forward (shapes sharded Megatron-style)."""
    b, d, hd, p = s.dtype_bytes, shape.hidden_size, shape.head_dim, tp
    heads, kv_heads = shape.num_attention_heads // p, shape.num_key_value_heads // p
    n = batch * tokens  # new token positions in this forward
    # Attention: q/k/v column-split by heads, o row-split; scores and values over the cache.
    w_attn = d * (heads + 2 * kv_heads) * hd + heads * hd * d
    attn_flops = 2 * n * w_attn + 4 * n * kv_len * heads * hd
    kv_bytes = batch * kv_len * hd * 2 * b * kv_heads  # K and V, this rank's KV heads
    if s.gqa_expand:
        kv_bytes += 2 * batch * kv_len * hd * 2 * b * heads  # expanded copy written, then read by attention
    kv_bytes += n * kv_heads * hd * 2 * b  # the new K/V written to the cache
    attention = Cost(attn_flops, (w_attn + d) * b + kv_bytes + 2 * n * d * b)
    # SwiGLU MLP: gate/up column-split, down row-split.
    w_mlp = 3 * d * shape.intermediate_size // p
    mlp = Cost(2 * n * w_mlp, (w_mlp + d) * b + 2 * n * d * b)
    # Final norm + LM head, replicated on every rank (as in the reference TP code).
    m = batch * logits_tokens
    head = Cost(2 * m * d * shape.vocab_size, (d * shape.vocab_size + d) * b + m * shape.vocab_size * b)
    return Forward(attention, mlp, head, all_reduce_bytes=n * d * b)


def schedule(arch: str, layers: int, t_attn: float, t_mlp: float, t_head: float, ar_bytes: int, tp: int, link) -> dict:
    """Run one forward's schedule on the virtual link clock; {time, exposed, comm_busy, overlapped} in s.

    Compute durations are modelled: the clock's `now` is a counter advanced by each sub-block's time.
    """
    t = [0.0]
    clock = VirtualClock(get_link(link), tp, now=lambda: t[0])
    clock.start()

    def compute(seconds):
        t[0] += seconds

    def all_reduce():
        return clock.issue("all_reduce", ar_bytes)

    if arch == "upper_bound":
        compute(layers * (t_attn + t_mlp))
    elif arch == "standard":
        for _ in range(layers):
            compute(t_attn)
            clock.wait(all_reduce())
            compute(t_mlp)
            clock.wait(all_reduce())
    elif arch == "parallel":
        for _ in range(layers):
            compute(t_attn + t_mlp)  # attention and MLP read the same normed input: one all-reduce of the sum
            clock.wait(all_reduce())
    elif arch == "ladder":
        attn_pending = mlp_pending = None
        for _ in range(layers):
            if attn_pending is not None:
                clock.wait(attn_pending)  # previous layer's attention output, needed by this attention
            compute(t_attn)
            attn_pending = all_reduce()
            if mlp_pending is not None:
                clock.wait(mlp_pending)  # previous layer's MLP output, needed by this MLP
            compute(t_mlp)
            mlp_pending = all_reduce()
        clock.wait(attn_pending)
        clock.wait(mlp_pending)
    else:
        raise ValueError(f"Unknown schedule {arch!r}; choose one of {ARCHS}.")
    compute(t_head)
    total = clock.elapsed()
    return {
        "time": total,
        "exposed": clock.exposed,
        "comm_busy": clock.comm_busy,
        "overlapped": max(0.0, clock.comm_busy - clock.exposed),  # floating-point residue below 0 is 0
    }


def predict(shape: Shape, arch: str, tp: int, batch: int, prompt_len: int, new_tokens: int, link, s: Settings) -> dict:
    """Predicted prefill and decode-step times and tokens/s of `arch` (with contention) at one setting."""
    kv_static = math.ceil((prompt_len + new_tokens) / 8) * 8
    out = {"arch": arch, "tp": tp, "batch": batch}
    phases = {
        # Decode reads the whole static cache every step; otherwise the average filled length.
        "prefill": (prompt_len, kv_static if s.static_kv else prompt_len, prompt_len if s.prefill_logits_all else 1),
        "decode": (1, kv_static if s.static_kv else prompt_len + new_tokens // 2, 1),
    }
    for phase, (tokens, kv_len, logits_tokens) in phases.items():
        f = forward_costs(shape, tp, batch, tokens, kv_len, s, logits_tokens)
        sched = schedule(
            arch, shape.num_hidden_layers, f.attention.time(s), f.mlp.time(s), f.head.time(s), f.all_reduce_bytes, tp, link
        )
        out[f"{phase}_s"] = sched["time"] + s.contention * sched["overlapped"]
        out[f"{phase}_exposed_s"] = sched["exposed"]
        out[f"{phase}_overlapped_s"] = sched["overlapped"]
        out[f"{phase}_flops"] = shape.num_hidden_layers * (f.attention.flops + f.mlp.flops) + f.head.flops
        out[f"{phase}_bytes"] = shape.num_hidden_layers * (f.attention.bytes + f.mlp.bytes) + f.head.bytes
        out[f"{phase}_attention_s"], out[f"{phase}_mlp_s"] = f.attention.time(s), f.mlp.time(s)
    out["decode_tok_s"] = batch / out["decode_s"]
    # The reference benchmark's tokens/s: every generated token over prefill + (new_tokens - 1) decode steps.
    out["tok_s"] = batch * new_tokens / (out["prefill_s"] + (new_tokens - 1) * out["decode_s"])
    return out


# --- validation against the published table --------------------------------------------------


def validation_rows(shape: Shape, cfg: dict, s: Settings) -> list[dict]:
    rows = []
    for pub in PUBLISHED_70B:
        row = {"batch": pub["batch"], "tp": pub["tp"]}
        pred = {
            arch: predict(shape, arch, pub["tp"], pub["batch"], cfg["prompt_len"], cfg["new_tokens"], cfg["links"]["nvlink"], s)
            for arch in ARCHS
        }
        for arch in ARCHS:
            row[f"{arch}_published"] = pub[arch]
            row[f"{arch}_predicted"] = pred[arch]["tok_s"]
            row[f"{arch}_ratio"] = pred[arch]["tok_s"] / pub[arch]
        row["ladder_speedup_published"] = pub["ladder_speedup"]
        row["ladder_speedup_predicted"] = pred["ladder"]["tok_s"] / pred["standard"]["tok_s"]
        row["ladder_speedup_ratio"] = row["ladder_speedup_predicted"] / pub["ladder_speedup"]
        # Exposed cost per all-reduce implied by standard - upper bound, over 2L all-reduces x new_tokens forwards.
        per_ar = 2 * shape.num_hidden_layers * cfg["new_tokens"]
        tokens = pub["batch"] * cfg["new_tokens"]
        row["ar_us_published"] = 1e6 * (tokens / pub["standard"] - tokens / pub["upper_bound"]) / per_ar
        row["ar_us_predicted"] = 1e6 * (tokens / pred["standard"]["tok_s"] - tokens / pred["upper_bound"]["tok_s"]) / per_ar
        row["hidden_published"] = _hidden(pub["standard"], pub["ladder"], pub["upper_bound"])
        row["hidden_predicted"] = _hidden(*(pred[a]["tok_s"] for a in ("standard", "ladder", "upper_bound")))
        p2p = {
            arch: predict(shape, arch, pub["tp"], pub["batch"], cfg["prompt_len"], cfg["new_tokens"], cfg["links"]["p2p_off"], s)
            for arch in ("standard", "ladder")
        }
        row["p2p_off_speedup_published"] = pub["p2p_off_speedup"]
        row["p2p_off_speedup_predicted"] = p2p["ladder"]["tok_s"] / p2p["standard"]["tok_s"]
        row["p2p_off_speedup_ratio"] = row["p2p_off_speedup_predicted"] / pub["p2p_off_speedup"]
        row["details"] = {"nvlink": pred, "p2p_off": p2p}
        rows.append(row)
    return rows


def _hidden(std_tok_s: float, arch_tok_s: float, ub_tok_s: float) -> float:
    """Hidden fraction from tokens/s (times are 1 / tokens/s)."""
    return (1 / std_tok_s - 1 / arch_tok_s) / (1 / std_tok_s - 1 / ub_tok_s)


def mean_abs_log_ratio(ratios) -> float:
    ratios = list(ratios)
    return sum(abs(math.log(r)) for r in ratios) / len(ratios)


def fit_contention(shape: Shape, cfg: dict, s: Settings) -> float:
    """The contention in [0, 1] (step 0.005) whose predicted hidden fractions of the NVLink ladder cells are
    closest (mean absolute difference) to the published ones.

    Fitted on hidden fractions rather than on tokens/s so that the compute and link models' own errors
    (which move standard, ladder and upper bound together) do not leak into the contention.
    """

    def tok_s(arch, pub, settings):
        link = cfg["links"]["nvlink"]
        return predict(shape, arch, pub["tp"], pub["batch"], cfg["prompt_len"], cfg["new_tokens"], link, settings)["tok_s"]

    fixed = [(pub, tok_s("standard", pub, s), tok_s("upper_bound", pub, s)) for pub in PUBLISHED_70B]
    best = None
    for i in range(201):
        trial = replace(s, contention=i / 200)
        err = sum(
            abs(_hidden(std, tok_s("ladder", pub, trial), ub) - _hidden(pub["standard"], pub["ladder"], pub["upper_bound"]))
            for pub, std, ub in fixed
        )
        if best is None or err < best[0]:
            best = (err, i / 200)
    return best[1]


def settings_from(cfg: dict) -> Settings:
    if cfg["device"] not in DEVICES:
        raise ValueError(f"Unknown device preset {cfg['device']!r}; choose one of {sorted(DEVICES)}.")
    for key, name in cfg["links"].items():
        if name not in LINK_PRESETS:
            raise ValueError(f"Unknown link preset {name!r} for {key}; choose one of {sorted(LINK_PRESETS)}.")
    contention = cfg["contention"]
    if contention != "fit" and not (isinstance(contention, (int, float)) and 0 <= contention <= 1):
        raise ValueError(f"contention={contention!r} must be 'fit' or a number in [0, 1].")
    return Settings(
        device=DEVICES[cfg["device"]],
        eff_flops=float(cfg["efficiency"]["flops"]),
        eff_hbm=float(cfg["efficiency"]["hbm"]),
        dtype_bytes=int(cfg["dtype_bytes"]),
        contention=0.0 if contention == "fit" else float(contention),
        gqa_expand=bool(cfg["gqa_expand"]),
        static_kv=bool(cfg["static_kv"]),
        prefill_logits_all=bool(cfg["prefill_logits_all"]),
    )


VALIDATION_COLUMNS = [
    ("setting", "batch/TP"),
    *[(f"{a}_{k}", f"{a} {label}") for a in ARCHS for k, label in (("published", "pub"), ("predicted", "pred"), ("ratio", "ratio"))],
]
SPEEDUP_COLUMNS = [
    ("setting", "batch/TP"),
    ("ladder_speedup_published", "ladder speed-up pub"),
    ("ladder_speedup_predicted", "pred"),
    ("ladder_speedup_ratio", "ratio"),
    ("hidden_published", "hidden pub"),
    ("hidden_predicted", "hidden pred"),
    ("p2p_off_speedup_published", "P2P-off speed-up pub"),
    ("p2p_off_speedup_predicted", "pred"),
    ("p2p_off_speedup_ratio", "ratio"),
    ("ar_us_published", "us/all-reduce pub-implied"),
    ("ar_us_predicted", "pred"),
]


def run_costmodel(cfg: dict, out_dir: Path, command: str = "") -> dict:
    """Predict the shape's table, compare with the published 70B numbers, write costmodel.{md,json,png}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shape = Shape.from_config(cfg["bench_shape"])
    s = settings_from(cfg)
    fitted = cfg["contention"] == "fit"
    if fitted:
        s = replace(s, contention=fit_contention(shape, cfg, s))
    rows = validation_rows(shape, cfg, s)
    no_contention = replace(s, contention=0.0)
    for r in rows:
        r["setting"] = f"{r['batch']}/{r['tp']}"
        r["ladder_no_contention"] = predict(
            shape, "ladder", r["tp"], r["batch"], cfg["prompt_len"], cfg["new_tokens"], cfg["links"]["nvlink"], no_contention
        )["tok_s"]
    errors = {
        "all_tok_s": mean_abs_log_ratio(r[f"{a}_ratio"] for r in rows for a in ARCHS),
        **{a: mean_abs_log_ratio(r[f"{a}_ratio"] for r in rows) for a in ARCHS},
        "ladder_speedup": mean_abs_log_ratio(r["ladder_speedup_ratio"] for r in rows),
        "p2p_off_speedup": mean_abs_log_ratio(r["p2p_off_speedup_ratio"] for r in rows),
    }
    result = {
        "command": command,
        "source": PUBLISHED_70B_SOURCE,
        "shape": asdict(shape),
        "settings": {**asdict(s), "contention_fitted": fitted},
        "links": {k: asdict(get_link(v)) for k, v in cfg["links"].items()},
        "config": cfg,
        "mean_abs_log_ratio": errors,
        "rows": rows,
    }
    report.write_json(out_dir / "costmodel.json", result)
    image = report.plot_bars(
        out_dir / "costmodel_ratio.png",
        [r["setting"] for r in rows],
        {a: [r[f"{a}_ratio"] for r in rows] for a in ARCHS},
        ylabel="predicted / published tokens/s",
        title=f"{shape.num_hidden_layers}-layer d={shape.hidden_size} on {s.device.name}, NVLink",
        hline=1.0,
    )
    (out_dir / "README.md").write_text(_markdown(result, image))
    return result


def _markdown(result: dict, image: Path) -> str:
    s, errors, rows = result["settings"], result["mean_abs_log_ratio"], result["rows"]
    links = result["links"]

    def pct(x):
        return f"{math.exp(x) - 1:.1%}"

    how = "fitted to the published hidden fractions of the 4 NVLink cells: in-sample for the ladder column" if s["contention_fitted"] else "set in the config"
    lines = [
        "# Cost model vs the Ladder paper's 70B table",
        "",
        f"`{result['command'] or 'eval.costmodel.run_costmodel(...)'}`",
        "",
        f"Source of the published numbers: {result['source']}.",
        "",
        f"Device {s['device']['name']} ({s['device']['note']}); efficiencies: {s['eff_flops']:.0%} of peak FLOP/s, "
        f"{s['eff_hbm']:.0%} of HBM bandwidth; {s['dtype_bytes']}-byte weights; "
        f"GQA K/V expanded: {s['gqa_expand']}; static KV cache read in full: {s['static_kv']}; "
        f"prefill logits at every position: {s['prefill_logits_all']}.",
        "",
        "Links: " + "; ".join(f"{k} = `{v['name']}` (alpha {v['alpha_s'] * 1e6:g} us/hop, beta {v['beta_Bps'] / 1e9:g} GB/s)" for k, v in links.items()) + ".",
        "",
        f"**Contention = {s['contention']:.3f}** ({how}): that fraction of every overlapped all-reduce's "
        "time is still paid, because NCCL kernels share SMs and HBM bandwidth with the compute they overlap. "
        "Every other parameter is set a priori (datasheets, link presets, the reference benchmark's settings).",
        "",
        "Tokens/s as the reference benchmark reports it: batch x 512 / (prefill + 511 decode steps). "
        "ratio = predicted / published.",
        "",
        report.write_markdown_table(rows, VALIDATION_COLUMNS),
        report.write_markdown_table(rows, SPEEDUP_COLUMNS),
        "us/all-reduce = (T_standard - T_upper_bound) / (2 x layers x 512 forwards): the exposed cost of one "
        "all-reduce that the published table implies, beside the link model's.",
        "",
        "Ladder without contention (pure overlap model), tokens/s: "
        + ", ".join(f"{r['setting']}: {r['ladder_no_contention']:.1f} (pub {r['ladder_published']})" for r in rows)
        + ".",
        "",
        "## Error",
        "",
        "Mean |log(predicted / published)| (and the equivalent typical % error):",
        "",
    ]
    lines.append(
        report.write_markdown_table(
            [{"what": k, "mean_abs_log_ratio": v, "typical_error": pct(v)} for k, v in errors.items()],
            [("what", "cells"), ("mean_abs_log_ratio", "mean abs log ratio"), ("typical_error", "~ error")],
        )
    )
    lines += [f"![ratio]({image.name})", ""]
    return "\n".join(lines)


@hydra.main(config_path="../conf", config_name="costmodel", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    out_dir = Path(cfg.out_dir) if cfg.out_dir else Path(HydraConfig.get().runtime.output_dir)
    plain = {k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items() if k not in ("paths", "hydra")}
    result = run_costmodel(plain, out_dir, " ".join(["python -m eval.costmodel", *HydraConfig.get().overrides.task]))
    print(json.dumps(result["mean_abs_log_ratio"], indent=2))
    print(f"[costmodel] -> {out_dir}/README.md, costmodel.json, costmodel_ratio.png", flush=True)


if __name__ == "__main__":
    main()
