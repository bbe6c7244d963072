"""What the speed benchmark's rows mean and how they are shown: comparisons, tables, plots, notes, W&B.

`eval.bench` measures and hands its rows here. A row is one architecture at one set of mesh degrees
(`{"tp": 2}`, `{"ep": 2}`), one variant (simulated link, upper bound, real, real upper bound) and one
batch size. This module adds the speed-up over the baseline architecture and the hidden fraction
(T_base - T_arch) / (T_base - T_upper_bound) to each row (and, for rows with expert-parallel
all-to-alls, the all-to-all exposure against the baseline's), and writes README.md (tables, the MoE
all-to-all and expert-throughput sections when measured), PNG plots and, if asked, a W&B run. It
knows nothing about any architecture: archs are names in the rows, anchors come from the settings.
"""

import math
from pathlib import Path

from eval import report

# --- degrees -----------------------------------------------------------------------------------


def degrees_key(degrees: dict[str, int]) -> tuple:
    """A hashable, order-free form of a degrees dict, to index rows by."""
    return tuple(sorted(degrees.items()))


def degrees_label(degrees: dict[str, int], sep: str = "=") -> str:
    """`tp=2` (tables), `tp2` (W&B keys, with sep=""); several dimensions joined by commas / dashes."""
    return ("," if sep else "-").join(f"{dim}{sep}{n}" for dim, n in sorted(degrees.items()))


def ranks(degrees: dict[str, int]) -> int:
    """Processes a run at these degrees takes (the product of the degrees)."""
    return math.prod(degrees.values())


def degree_points(tp=(), ep=(), degrees=()) -> list[dict[str, int]]:
    """The mesh degree points of the settings: {"tp": P} per TP degree and {"ep": P} per EP degree (one
    dimension at a time, so each is compared on its own), then each point of `degrees` as given
    ({"ep": 2, "tp": 2}); a point listed twice is measured once."""
    points = [{"tp": p} for p in tp or ()] + [{"ep": p} for p in ep or ()] + [dict(d) for d in degrees or ()]
    first = {}
    for d in points:
        first.setdefault(degrees_key(d), d)
    return list(first.values())


# --- derived numbers --------------------------------------------------------------------------


def hidden_fraction(t_base: float, t_arch: float, t_upper: float, min_comm_fraction: float = 0.01) -> float | None:
    """(T_base - T_arch) / (T_base - T_upper): the share of the baseline's communication overhead that
    the architecture removes. None when the baseline has (almost) no overhead to hide: a denominator
    below `min_comm_fraction` of T_base is noise, not communication."""
    gap = t_base - t_upper
    if gap <= min_comm_fraction * t_base:
        return None
    return (t_base - t_arch) / gap


UPPER_BOUND_OF = {"simulated": "upper_bound", "real": "upper_bound_real"}


def add_comparisons(rows: list[dict], baseline: str, min_comm_fraction: float) -> None:
    """Speed-up over the baseline arch in the same variant, and hidden fractions, added in place."""

    def key(arch, r, variant, link):
        return (arch, degrees_key(r["degrees"]), variant, link, r["batch"])

    index = {key(r["arch"], r, r["variant"], r["link"]): r for r in rows}
    for r in rows:
        base = index.get(key(baseline, r, r["variant"], r["link"]))
        r["speedup_prefill"] = base["prefill_ms"] / r["prefill_ms"] if base else None
        r["speedup_decode"] = r["decode_tok_s"] / base["decode_tok_s"] if base else None
        r["hidden_fraction_prefill"] = r["hidden_fraction_decode"] = None
        r["exposed_hidden_fraction_decode"] = None
        upper = index.get(key(baseline, r, UPPER_BOUND_OF.get(r["variant"]), None))
        if base is None or upper is None or r["arch"] == baseline:
            continue
        r["hidden_fraction_prefill"] = hidden_fraction(
            base["prefill_ms"], r["prefill_ms"], upper["prefill_ms"], min_comm_fraction
        )
        r["hidden_fraction_decode"] = hidden_fraction(
            base["decode_ms_per_step"], r["decode_ms_per_step"], upper["decode_ms_per_step"], min_comm_fraction
        )
        # Simulated only: the same question asked of the virtual clock's exposed communication, which
        # does not depend on compute-time noise between architectures.
        if r.get("decode_exposed_ms") is not None and base.get("decode_exposed_ms"):
            r["exposed_hidden_fraction_decode"] = 1 - r["decode_exposed_ms"] / base["decode_exposed_ms"]
    # MoE: the token all-to-all time exposed per layer against the baseline's (both from the virtual clock).
    # Against `moe` this mixes the schedule with the bytes sent (ScMoE routes top-1, moe top-2).
    for r in rows:
        base = index.get(key(baseline, r, r["variant"], r["link"]))
        for phase in ("prefill", "decode"):
            mine, theirs = r.get(f"{phase}_a2a_exposed_ms_per_layer"), (base or {}).get(f"{phase}_a2a_exposed_ms_per_layer")
            if mine is not None and theirs:
                r[f"{phase}_a2a_exposed_vs_baseline"] = mine / theirs


# --- tables and plots -------------------------------------------------------------------------

TABLE_COLUMNS = [
    ("arch", "arch"),
    ("degrees", "degrees"),
    ("batch", "batch"),
    ("prefill_ms", "prefill ms"),
    ("prefill_spread", "prefill min-max"),
    ("decode_tok_s", "decode tok/s"),
    ("decode_spread", "decode tok/s min-max"),
    ("speedup_decode", "decode speed-up"),
    ("speedup_prefill", "prefill speed-up"),
    ("hidden_fraction_decode", "hidden (decode)"),
    ("hidden_fraction_prefill", "hidden (prefill)"),
    ("decode_comm_calls", "calls/step"),
    ("decode_comm_bytes", "bytes/step"),
    ("prefill_comm_bytes", "bytes/prefill"),
]
SIMULATED_COLUMNS = [
    ("decode_exposed_ms", "exposed ms/step"),
    ("decode_comm_busy_ms", "link busy ms/step"),
    ("decode_exposed_share", "exposed / link busy"),
    ("exposed_hidden_fraction_decode", "hidden (exposed, decode)"),
]
# MoE: all-to-all bytes per call (counted, beside the declared dropless formula) and exposure per layer.
MOE_BYTES_COLUMNS = [
    ("arch", "arch"),
    ("degrees", "degrees"),
    ("batch", "batch"),
    ("prefill_moe_layers", "MoE layers"),
    ("prefill_a2a_bytes", "bytes/a2a (prefill, counted)"),
    ("prefill_a2a_formula_bytes", "T k h bytes (formula)"),
    ("prefill_a2a_link_bytes_formula", "x (P-1)/P: off-rank (spec)"),
    ("prefill_a2a_rows_per_token", "k counted"),
    ("prefill_a2a_rows_per_token_formula", "k formula"),
    ("decode_a2a_bytes", "bytes/a2a (decode step, counted)"),
    ("decode_a2a_formula_bytes", "decode formula"),
]
MOE_EXPOSED_COLUMNS = [
    ("arch", "arch"),
    ("degrees", "degrees"),
    ("batch", "batch"),
    ("prefill_a2a_link_ms_per_layer", "a2a link ms/layer (prefill)"),
    ("prefill_a2a_exposed_ms_per_layer", "a2a exposed ms/layer (prefill)"),
    ("prefill_a2a_hidden_share", "hidden share (prefill)"),
    ("decode_a2a_link_ms_per_layer", "a2a link ms/layer (decode)"),
    ("decode_a2a_exposed_ms_per_layer", "a2a exposed ms/layer (decode)"),
    ("decode_a2a_hidden_share", "hidden share (decode)"),
    ("a2a_hidden_anchor", "hidden share, published"),
    ("prefill_a2a_exposed_vs_baseline", "exposed / baseline's (prefill)"),
    ("decode_a2a_exposed_vs_baseline", "exposed / baseline's (decode)"),
    ("prefill_count_exchange_exposed_ms_per_layer", "count exchange ms/layer (prefill)"),
]
EXPERT_COLUMNS = [
    ("label", "layer"),
    ("tokens", "tokens"),
    ("target_rows_per_token", "expert rows/token (target)"),
    ("ffn_rows_per_token", "expert rows/token (routed)"),
    ("ms", "ms/forward"),
    ("ms_spread", "ms min-max"),
    ("tokens_per_s", "tokens/s"),
    ("speedup", "speed-up"),
    ("expert_rows_ratio", "rows ratio (compute-bound speed-up)"),
    ("anchor", "published"),
]
# Plots: the files `make_plots` writes (eval.tour copies some of them into its report).
PLOTS = ("speedup_vs_batch", "speedup_vs_degree", "hidden_fraction", "hidden_fraction_exposed")


def variant_key(row: dict) -> str:
    return f"{row['variant']}:{row['link']}" if row["link"] else row["variant"]


def display_rows(rows: list[dict]) -> list[dict]:
    """Rows as tables show them: degrees as `tp=2`, min-max spreads as one cell."""
    shown = []
    for r in rows:
        d = dict(r)
        d["degrees"] = degrees_label(r["degrees"])
        d["prefill_spread"] = f"{r['prefill_ms_min']:.4g}-{r['prefill_ms_max']:.4g}"
        d["decode_spread"] = f"{r['decode_tok_s_min']:.4g}-{r['decode_tok_s_max']:.4g}"
        shown.append(d)
    return shown


def _degree_axis(rows: list[dict]) -> str:
    dims = sorted({dim for r in rows for dim in r["degrees"]})
    return f"{dims[0]} degree" if len(dims) == 1 else f"ranks ({' x '.join(dims)})"


def make_plots(rows: list[dict], archs: list[str], baseline: str, out_dir: Path) -> dict[str, Path]:
    """Decode speed-up vs batch and vs degree (ranks), hidden fraction per architecture vs batch; one panel
    per variant (upper-bound variants are the reference, not plotted)."""
    if not rows:  # only the sequence-parallel section ran
        return {}
    variants = [v for v in dict.fromkeys(variant_key(r) for r in rows) if not v.startswith("upper_bound")]
    others = [a for a in archs if a != baseline]

    def pick(sel, arch, degrees, batch, key):
        for r in sel:
            if r["arch"] == arch and degrees_key(r["degrees"]) == degrees and r["batch"] == batch:
                return r.get(key)
        return None

    def panels(key, x_axis, only=None):
        out = {}
        for v in variants:
            if only and not v.startswith(only):
                continue
            sel = [r for r in rows if variant_key(r) == v]
            points = sorted({degrees_key(r["degrees"]) for r in sel}, key=lambda k: ranks(dict(k)))
            batches = sorted({r["batch"] for r in sel})
            if x_axis == "batch":
                out[v] = {
                    f"{a} {degrees_label(dict(d))}": (batches, [pick(sel, a, d, b, key) for b in batches])
                    for a in others
                    for d in points
                }
            else:
                xs = [ranks(dict(d)) for d in points]
                out[v] = {f"{a} b{b}": (xs, [pick(sel, a, d, b, key) for d in points]) for a in others for b in batches}
        return out

    plots = {
        "speedup_vs_batch": (panels("speedup_decode", "batch"), "batch size", f"decode speed-up over {baseline}"),
        "speedup_vs_degree": (panels("speedup_decode", "degree"), _degree_axis(rows), f"decode speed-up over {baseline}"),
        "hidden_fraction": (
            panels("hidden_fraction_decode", "batch"),
            "batch size",
            f"hidden fraction (decode) vs {baseline}",
        ),
        "hidden_fraction_exposed": (
            panels("exposed_hidden_fraction_decode", "batch", only="simulated"),
            "batch size",
            "hidden fraction of exposed comm (decode)",
        ),
    }
    images = {}
    for name, (data, xlabel, ylabel) in plots.items():
        if data:
            images[name] = report.plot_lines(
                out_dir / f"{name}.png", data, xlabel=xlabel, ylabel=ylabel, hline=1.0, logx=True
            )
    # MoE: the token all-to-all time left exposed per layer, per link and phase, each arch at each point.
    moe = [r for r in rows if r["variant"] == "simulated" and r.get("prefill_a2a_exposed_ms_per_layer") is not None]
    if moe:
        data = {}
        for link in dict.fromkeys(r["link"] for r in moe):
            for phase in ("prefill", "decode"):
                sel = [r for r in moe if r["link"] == link]
                series = {}
                for a in dict.fromkeys(r["arch"] for r in sel):
                    for d in sorted({degrees_key(r["degrees"]) for r in sel}, key=lambda k: ranks(dict(k))):
                        pts = sorted((r["batch"], r.get(f"{phase}_a2a_exposed_ms_per_layer")) for r in sel
                                     if r["arch"] == a and degrees_key(r["degrees"]) == d)  # fmt: skip
                        if pts:
                            series[f"{a} {degrees_label(dict(d))}"] = ([b for b, _ in pts], [y for _, y in pts])
                data[f"{phase}, {link}"] = series
        images["a2a_exposed"] = report.plot_lines(
            out_dir / "a2a_exposed.png", data, xlabel="batch size", ylabel="all-to-all exposed ms per MoE layer",
            logx=True,
        )  # fmt: skip
    return images


def plot_expert_throughput(experts: list[dict], out_dir: Path) -> Path:
    """Measured speed-up of each expert layer over the first, beside the ratio of expert rows per token."""
    labels = [e["label"] for e in experts]
    bars = {
        "measured tokens/s speed-up": [e["speedup"] for e in experts],
        "expert rows ratio (compute-bound)": [e["expert_rows_ratio"] for e in experts],
    }
    return report.plot_bars(
        out_dir / "expert_throughput.png", labels, bars, ylabel=f"over {labels[0]}", hline=1.0,
        title="one MoE layer's forward, real, one device",
    )  # fmt: skip


# --- notes ------------------------------------------------------------------------------------


def device_model_note(cfg: dict) -> str:
    """What rows predicted by a device model (`compute` a device preset) are."""
    compute, dm = cfg["compute"], cfg.get("device_model") or {}
    cache = (
        "a static KV cache of prompt + new tokens, read in full at every step as gpt-fast's"
        if cfg.get("static_cache", True)
        else "the architecture's default growing cache"
    )
    return (
        f"Simulated and upper-bound rows are the device model's prediction for {compute}, not timings: each aten op "
        f"of the model's own forward (built on the meta device in bfloat16, rank 0's shards) is charged to {compute}'s "
        f"roofline, max(FLOPs / (peak x {dm.get('eff_flops')}), bytes / (HBM x {dm.get('eff_hbm')})) + "
        f"{dm.get('kernel_overhead_us')} us per kernel (elementwise ops fused), contention {dm.get('contention')} "
        "(eval.costmodel's constants, settings `device_model`), and the link model's collectives are placed where "
        "forward() issues and waits them. Prefill is one recorded forward; a decode step is one recorded step with "
        f"the cache filled to the middle of the generation ({cache}), times the decode steps. Nothing is timed on "
        "this machine: the rows are deterministic (min = max = median, no warm-up or repeats) and any shape runs. "
        "The upper bound is the same prediction with free communication. The real variant is not run with a "
        "device preset (it measures this machine)."
    )


def notes_for(cfg: dict, device_type: str, hw: dict, rows: list[dict] = ()) -> list[str]:
    if (cfg.get("compute") or "measured") != "measured":
        # No CPU compute, no gloo ranks, no shared load in these rows: only the device model's note applies (to
        # the generation rows; the sequence-parallel section, alone in bench_preset=sp, says its own).
        return [device_model_note(cfg)] if rows else []
    notes = [
        "Simulated rows time one rank's real compute on this machine plus the link model's communication; "
        "they show what each schedule hides on that link, not what this machine would do with P devices."
    ]
    if any(r.get("prefill_a2a_link_ms_per_layer") is not None for r in rows):
        notes.append(
            "What an MoE schedule hides depends on how long the compute issued before each wait takes: here it "
            "is this machine's compute, beside a link model of GPU interconnects. The published shares (ScMoE: "
            "70% on PCIe, 100% on NVLink) come from GPUs whose compute is orders of magnitude faster, so the "
            "comparable link time per layer is a larger share of the layer there; read the hidden shares as what "
            "the schedule can cover, and compare 'a2a link ms/layer' with the time per layer before reading more."
        )
    real = cfg["real"]
    points = degree_points(real.get("tp"), real.get("ep"), real.get("degrees")) if real["enabled"] else []
    real_ranks = [ranks(d) for d in points]
    if real_ranks and device_type == "cpu":
        p, cores, threads = max(real_ranks), hw["cpu_cores"], hw["torch_threads"]
        if cores < p * (threads + 1):
            notes.append(
                f"Real rows ran up to {p} gloo processes of {threads} compute thread(s) each on {cores} CPU cores. "
                "gloo's communication thread has no free core here, so an asynchronous collective cannot run "
                "while the next sub-block computes: these rows measure gloo's cost on this box, not what an "
                "architecture can hide, and claim nothing about overlap."
            )
        else:
            notes.append(
                f"Real rows ran up to {p} gloo processes of {threads} compute thread(s) each on {cores} CPU cores, "
                "leaving a core per rank for gloo's communication thread; gloo on CPU is still no model of NCCL."
            )
    if hw["load_average_1m"] > 0.5 * hw["cpu_cores"]:
        notes.append(
            f"The machine was shared (load average {hw['load_average_1m']:.2f} on {hw['cpu_cores']} cores at "
            "the start): timings are noisy; compare the min-max spreads before reading small differences."
        )
    return notes


def clock_note(rows: list[dict], baseline: str) -> str | None:
    """A warning when the virtual clock let the baseline hide communication it waits for at once."""
    shares = [
        r["decode_exposed_share"]
        for r in rows
        if r["arch"] == baseline and r["variant"] == "simulated" and r.get("decode_exposed_share") is not None
    ]
    if not shares or min(shares) >= 0.9:
        return None
    return (
        f"On the virtual clock `{baseline}` left only {min(shares):.0%}-{max(shares):.0%} of its link time exposed "
        "(decode), though it waits for each collective right after issuing it (should be near 100%): the clock "
        "counted the Python time between issuing a collective and waiting for it as compute, which covers short "
        "transfers. The "
        "simulated rows understate the baseline's communication cost, so their speed-ups and hidden fractions "
        "are too small (or n/a)."
    )


# --- sequence parallelism (linear model, long sequences) ---------------------------------------------


def add_sp_comparisons(sp: dict, cfg: dict) -> None:
    """Per (N, P, rank, link) where LASP-2 was timed, a `compare` row: each method's forward + backward ms and
    exposed ms per layer, LASP-2's speed-up over each other = T_other / T_lasp2 - 1 (the paper's throughput
    gain: the same tokens in less time), and over LASP-1 from the exposed communication alone
    (T_lasp2 - exposed_lasp2 + exposed_lasp1) / T_lasp2 - 1: LASP-1 runs the same local compute, so this is
    its schedule's cost without the compute-time noise between runs. `headline`: per rank and link, the
    largest (N, P) where LASP-2, LASP-1 and ring attention all ran, beside the published anchors."""
    methods = list(sp["methods"])
    index = {(r["n"], r["p"], r["rank"], r["link"], r["method"]): r for r in sp["timed"]}
    compare = []
    for (n, p, rank, link, method), base in index.items():
        if method != "lasp2":
            continue
        row = {"n": n, "p": p, "chunk": base["chunk"], "rank": rank, "link": link}
        for m in methods:
            other = index.get((n, p, rank, link, m))
            row[f"{m}_ms"] = other["fwd_bwd_ms"] if other else None
            row[f"{m}_exposed_ms"] = other["exposed_ms"] if other else None
            row[f"{m}_link_ms"] = other["link_ms"] if other else None
        lasp1, ring = index.get((n, p, rank, link, "lasp1")), index.get((n, p, rank, link, "ring"))
        row["speedup_over_lasp1"] = lasp1["fwd_bwd_ms"] / base["fwd_bwd_ms"] - 1 if lasp1 else None
        row["speedup_over_ring"] = ring["fwd_bwd_ms"] / base["fwd_bwd_ms"] - 1 if ring else None
        row["comm_speedup_over_lasp1"] = (
            (base["fwd_bwd_ms"] - base["exposed_ms"] + lasp1["exposed_ms"]) / base["fwd_bwd_ms"] - 1 if lasp1 else None
        )
        # The softmax layers of a hybrid: LASP-2H against ring attention, the same layer's compute.
        lasp2h = index.get((n, p, rank, link, "lasp2h"))
        row["lasp2h_speedup_over_ring"] = ring["fwd_bwd_ms"] / lasp2h["fwd_bwd_ms"] - 1 if ring and lasp2h else None
        compare.append(row)
    sp["compare"] = compare
    anchor = (cfg.get("anchors") or {}).get("sp_speedup") or {}
    headline = []
    for rank in dict.fromkeys(r["rank"] for r in compare):
        full = [r for r in compare if r["rank"] == rank and r.get("lasp1_ms") is not None and r.get("ring_ms") is not None]
        if not full:
            continue
        n, p = max((r["n"], r["p"]) for r in full)
        for r in full:
            if (r["n"], r["p"]) == (n, p):
                over = anchor.get("over") or {}
                headline.append({**r, "anchor_over_lasp1": over.get("lasp1"), "anchor_over_ring": over.get("ring"),
                                 "anchor_n": anchor.get("n"), "anchor_p": anchor.get("sp")})  # fmt: skip
    sp["headline"] = headline


def _percent(row: dict) -> dict:
    """Speed-ups (and their published anchors) as signed percentages for the tables."""
    return {k: f"{v:+.1%}" if ("speedup" in k or k.startswith("anchor_over")) and isinstance(v, float) else v
            for k, v in row.items()}  # fmt: skip


def _method_label(sp: dict, method: str) -> str:
    return sp["methods"][method]["label"]


SP_BYTES_NOTE = (
    "Bytes per layer per rank that cross the link (what the rank receives; it sends as much), from "
    "`comm.counters` over one forward + backward on the meta device (the real code path without values): an "
    "all-gather's or reduce-scatter's counter holds the whole gathered tensor, of which (P-1)/P crosses; a ring "
    "shift's holds what is sent. **formula**: the spec's (specs/linear.md): LASP-2 (P-1) B H d_k d_v per "
    "all-gather (one forward, one backward; fp32 states); LASP-1 P-1 hops of one rank's B H d_k d_v states each "
    "way; ring attention (P-1) B (N/P) 2 H_kv d_h forward, backward those shifts again plus P hops of each K/V "
    "block's gradient accumulator (fp32); LASP-2H the same (P-1) B (N/P) 2 H_kv d_h in one all-gather of K and "
    "V, and as many in the backward's reduce-scatter of dK, dV."
)


MEASURED_HEADLINE_NOTE = (
    "> Only the communication side is comparable with the paper. Our compute is this machine's at a small "
    "shape: a layer's forward + backward here takes orders of magnitude longer than its link time on any "
    "preset, so every schedule hides almost everything and the measured speed-ups are compute and noise "
    "(a shared CPU), not communication; against ring attention they also compare a softmax layer's compute "
    "with a linear layer's. What carries over is the exposed communication per layer (and the bytes and "
    "link times above) and how it grows with P and N. At small chunks LASP-1 also pays on the compute side: "
    "each of its 2 (P-1) serial hops is a call of its own (Python here, a kernel launch and a NCCL call on "
    "GPUs), which the clock counts as compute. Paper-scale compute: `compute=h100-sxm` (the device model's "
    "prediction, any N and P, the paper's point included)."
)


def sp_device_model_text(compute: dict) -> str:
    """The device model's constants, in words, for the sequence-parallel section."""
    d = compute["device"]
    return (
        f"{d['peak_flops'] / 1e12:.0f} TFLOP/s, {d['hbm_Bps'] / 1e12:.2f} TB/s HBM; every aten op of the forward and "
        f"the backward of the trunk, built on the meta device in {compute['dtype']}, charged max(FLOPs / (peak x "
        f"{compute['eff_flops']}), bytes / (HBM x {compute['eff_hbm']})) + {compute['kernel_overhead_us']:.3g} us per "
        f"kernel, elementwise ops fused; contention {compute['contention']} of every overlapped second of "
        "communication added; nothing timed on this machine"
    )


def sp_kernels(sp: dict) -> str:
    return (sp.get("device_kernels") or {}).get("setting", "as_run")


def sp_predicted_headline(sp: dict, compute: dict) -> list[str]:
    """Below the headline table with a device preset: what the compute is, and the device model's compute per
    layer of each method at the headline point (forward and backward apart: the backward's ops are charged too)."""
    h0 = sp["headline"][0]
    n, p, link = h0["n"], h0["p"], h0["link"]
    ranks = list(dict.fromkeys(h["rank"] for h in sp["headline"]))
    sel = [r for rank in ranks for r in sp["timed"] if (r["n"], r["p"], r["rank"], r["link"]) == (n, p, rank, link)]
    table = [
        {"rank": r["rank"], "method": _method_label(sp, r["method"]), "fwd_ms": r["fwd_compute_ms"], "bwd_ms": r["bwd_compute_ms"],
         "fwd_kernels": r["fwd_kernels"], "bwd_kernels": r["bwd_kernels"], "fwd_gflop": r["fwd_flops"] / 1e9,
         "bwd_gflop": r["bwd_flops"] / 1e9, "bwd_over_fwd": r["bwd_flops"] / r["fwd_flops"] if r["fwd_flops"] else None,
         "link_ms": r["link_ms"], "exposed_ms": r["exposed_ms"], "contention_ms": r["contention_ms"]}
        for r in sel
    ]  # fmt: skip
    return [
        f"> **Compute here is the device model's prediction for {compute['setting']}, not a measurement** "
        f"({sp_device_model_text(compute)}; kernels `{sp_kernels(sp)}`). The link side is the same alpha-beta model "
        "as in the measured rows. "
        "The model is this bench shape's (see the top of the section), not the paper's Linear-Llama3, so the "
        "share of communication in a step, hence the speed-ups, differ with the shape; against ring attention "
        "they compare a softmax layer with a linear layer, as the paper's throughput does. Ring attention's blocks "
        "are PyTorch ops here (parallel/sequence.py: each block's C x C scores materialised in fp32, no flash "
        "kernel), charged as such, so its time is this implementation's, HBM-bound on the scores, not that of a "
        "ring of flash-attention blocks.",
        "",
        f"The device model's compute per layer at N={n:,}, P={p} (ms, kernels, GFLOP; link and exposed ms on {link}):",
        "",
        report.write_markdown_table(
            table,
            [("rank", "rank"), ("method", "method"), ("fwd_ms", "fwd compute ms"), ("bwd_ms", "bwd compute ms"), ("fwd_kernels", "fwd kernels"),
             ("bwd_kernels", "bwd kernels"), ("fwd_gflop", "fwd GFLOP"), ("bwd_gflop", "bwd GFLOP"),
             ("bwd_over_fwd", "bwd / fwd FLOPs"), ("link_ms", "link ms"), ("exposed_ms", "exposed ms"),
             ("contention_ms", "contention ms")],
        ),  # fmt: skip
    ]



def sp_section(results: dict, images: dict[str, Path]) -> list[str]:
    """The README section of the sequence-parallel rows: bytes vs N and P, simulated time and exposure per
    link, LASP-2's speed-ups beside the paper's."""
    sp, cfg = results.get("sequence_parallel") or {}, results["settings"]
    if not sp:
        return []
    s, shape = cfg["sequence_parallel"], cfg["bench_shape"]
    methods = list(sp["methods"])
    label = {m: _method_label(sp, m) for m in methods}
    lines = [
        "## Sequence parallelism: LASP-2 vs LASP-1 vs ring attention over long sequences",
        "",
        f"Linear-Llama at the `{shape['name']}` shape (hidden {shape['hidden_size']}, {shape['num_attention_heads']} "
        f"heads of {shape['hidden_size'] // shape['num_attention_heads']}, {shape['num_key_value_heads']} KV head(s) "
        f"in softmax layers, {shape['num_hidden_layers']} layer(s), batch {s['batch']}, dtype {sp.get('dtype', results['dtype'])}), "
        "one process playing one rank of a P-way fake process group, collectives on the simulated link "
        "(parallel/sequence.py through parallel.comm). Methods:",
        "",
    ]
    lines += [f"- **{label[m]}** (`{m}`): {sp['methods'][m]['what']}." for m in methods]
    lines += ["", "### Bytes per layer vs sequence length", "", SP_BYTES_NOTE, ""]
    rows = sp["bytes"]
    exact = sum(r["fwd_link_bytes"] == r["fwd_link_bytes_formula"] and r["bwd_link_bytes"] == r["bwd_link_bytes_formula"]
                for r in rows)  # fmt: skip
    lines += [f"Counted == formula, forward and backward: **{exact} of {len(rows)}** (N, P, method) rows.", ""]
    by = {(r["n"], r["p"], r["method"]): r for r in rows}
    points = sorted({(r["p"], r["n"]) for r in rows})
    table = []
    for p, n in points:
        entry = {"p": p, "n": n, "chunk": n // p}
        for m in methods:
            r = by.get((n, p, m))
            entry[f"{m}_fwd"] = r["fwd_link_bytes"] if r else None
            entry[f"{m}_bwd"] = r["bwd_link_bytes"] if r else None
        table.append(entry)
    cols = [("p", "P"), ("n", "N"), ("chunk", "N/P")]
    cols += [(f"{m}_{ph}", f"{label[m]} {ph}") for m in methods for ph in ("fwd", "bwd")]
    lines += [report.write_markdown_table(table, cols)]
    if "sp_bytes" in images:
        lines += [f"![sp_bytes]({images['sp_bytes'].name})", ""]
    big = max(points, key=lambda pn: (pn[1], pn[0]))
    paper = [by[(big[1], big[0], m)] for m in methods if (big[1], big[0], m) in by]
    link_cols = [(f"link_ms:{link}", f"link ms, {link}") for link in s["links"]]
    lines += [
        f"Link time per layer per rank at N={big[1]:,}, P={big[0]} (forward + backward, the alpha-beta model of each "
        "preset on the counted collectives, nothing hidden; LASP-2's all-gather costs base + (P-1) (alpha + state / "
        "beta), LASP-1's P-1 serial hops (P-1) (base + alpha + state / beta): the same bytes, LASP-2 pays the fixed "
        "latency once, and wins mostly by overlapping the rest):",
        "",
        report.write_markdown_table(
            [{**r, "method": label[r["method"]]} for r in paper],
            [("method", "method"), ("fwd_link_bytes", "bytes fwd"), ("bwd_link_bytes", "bytes bwd"), *link_cols],
        ),
    ]
    # Timed rows.
    compute = results.get("compute") or {"setting": "measured"}
    predicted = compute["setting"] != "measured"
    if predicted:
        how = (
            f"Per layer, on the virtual clock: this rank's compute **predicted by the device model for "
            f"{compute['setting']}** ({sp_device_model_text(compute)}; `device_kernels={sp_kernels(sp)}`: "
            f"{(sp.get('device_kernels') or {}).get('what', '')}), each collective on the link preset, "
            "**exposed** = the part of the link time the rank waited for"
        )
        runs = (
            "One recorded run per row, deterministic (no warm-up, no repeats: min = max), replayed on every "
            "preset, so the presets see the same compute; no max_chunk / max_attended limit (nothing is computed). "
        )
    else:
        how = (
            f"Per layer, on the virtual clock: this rank's compute measured for real on this machine "
            f"({results['hardware'].get('gpu', results['hardware']['cpu'])}), each collective on the link preset, "
            "**exposed** = the part of the link time the rank waited for"
        )
        runs = (
            f"{s['warmup']} warm-up + {s['repeats']} repeats interleaved across methods (median; min-max per row in "
            "results.json, `fwd_bwd_ms_min` / `_max`); each run is recorded "
            "once and replayed on every preset, so the presets see the same compute. "
        )
    lines += [
        "### Simulated forward + backward time vs N and P",
        "",
        how
        + ". Ranks played: "
        + ", ".join(f"`{r}` ({'0' if r == 'first' else 'P-1'})" for r in s["ranks"])
        + ". A causal softmax layer costs rank r (r+1) blocks of attention: the last rank sets the step time, while "
        "rank 0 computes one block and waits for ring attention's shifts with nothing left to compute (its ring "
        "exposure is the worst case, its compute the least). Linear layers cost every rank the same. "
        + runs
        + "**LASP-2 over X** = T_X / T_LASP-2 - 1 "
        "(throughput gain; LASP-2H over ring: T_ring / T_LASP-2H - 1, the softmax layers of a hybrid); **over LASP-1, comm only** = (T_LASP-2 - exposed_LASP-2 + exposed_LASP-1) / "
        "T_LASP-2 - 1: LASP-1's schedule on LASP-2's compute, free of the noise between runs.",
        "",
    ]
    ms_cols = [(f"{m}_ms", f"{label[m]} ms") for m in methods] + [(f"{m}_exposed_ms", f"{label[m]} exposed") for m in methods]
    cmp_cols = [("rank", "rank"), ("n", "N"), ("p", "P"), ("chunk", "N/P"), *ms_cols]
    cmp_cols += [("speedup_over_lasp1", "LASP-2 over LASP-1"), ("comm_speedup_over_lasp1", "over LASP-1, comm only"),
                 ("speedup_over_ring", "LASP-2 over ring"), ("lasp2h_speedup_over_ring", "LASP-2H over ring")]  # fmt: skip
    for link in s["links"]:
        sel = sorted((r for r in sp["compare"] if r["link"] == link), key=lambda r: (r["rank"], r["n"], r["p"]))
        lines += [f"#### {link}", "", report.write_markdown_table([_percent(r) for r in sel], cmp_cols)]
    for name in ("sp_time", "sp_exposed"):
        if name in images:
            lines += [f"![{name}]({images[name].name})", ""]
    # Headline beside the paper.
    if sp.get("headline"):
        h0 = sp["headline"][0]
        lines += [
            "### LASP-2's speed-up at the largest point, beside the paper",
            "",
            f"Published (LASP-2 paper, Linear-Llama3 on {h0['anchor_p']} GPUs at {h0['anchor_n']:,} tokens): "
            f"**{h0['anchor_over_lasp1']:+.1%} over LASP-1, {h0['anchor_over_ring']:+.1%} over ring attention** "
            "(throughput).",
            "",
            report.write_markdown_table(
                [_percent(h) for h in sp["headline"]],
                [("rank", "rank"), ("link", "link"), ("n", "N"), ("p", "P"), ("speedup_over_lasp1", "over LASP-1"),
                 ("comm_speedup_over_lasp1", "over LASP-1, comm only"), ("anchor_over_lasp1", "published"),
                 ("speedup_over_ring", "over ring"), ("anchor_over_ring", "published"),
                 ("lasp2_exposed_ms", "LASP-2 exposed ms"), ("lasp1_exposed_ms", "LASP-1 exposed ms"),
                 ("ring_exposed_ms", "ring exposed ms"), ("lasp2_ms", "LASP-2 ms")],
            ),  # fmt: skip
        ]
        lines += sp_predicted_headline(sp, compute) if predicted else [MEASURED_HEADLINE_NOTE, ""]
    if sp.get("skipped"):
        lines += ["Not timed (the bytes above cover every point):", ""] + [f"- {x}" for x in sp["skipped"]] + [""]
    return lines


def _plot_panels(path: Path, panels: list[tuple[str, dict]], *, xlabel: str, ylabel: str, logy: bool, ncols: int,
                 title: str = "") -> Path:  # fmt: skip
    """Panels of lines on log2 x (and log y if asked); a series whose label ends in '(formula)' is dotted."""
    plt = report._pyplot()
    nrows = max(1, -(-len(panels) // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (panel_title, series) in zip(axes.flat, panels, strict=False):
        for name, (xs, ys) in series.items():
            points = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None and (y > 0 or not logy)]
            if not points:
                continue
            if name.endswith("(formula)"):
                ax.plot(*zip(*points, strict=True), linestyle=":", color="black", linewidth=1, label=name)
            else:
                ax.plot(*zip(*points, strict=True), marker="o", label=name)
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_title(panel_title, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def sp_plots(results: dict, out_dir: Path) -> dict[str, Path]:
    """sp_bytes: link bytes per layer vs N (counted and formula) at the smallest and largest P; sp_time:
    forward + backward ms per layer vs N (largest P) and vs P (the N timed at the most degrees) per rank
    played, first preset; sp_exposed: exposed ms per layer vs P at that N, one panel per preset."""
    sp = results.get("sequence_parallel") or {}
    if not sp:
        return {}
    s = results["settings"]["sequence_parallel"]
    methods, images = list(sp["methods"]), {}
    label = {m: _method_label(sp, m) for m in methods}
    grid = [r for r in sp["bytes"] if r["n"] in s["bytes"]["lengths"] and r["p"] in s["bytes"]["sp"]]
    if grid:
        panels = []
        for p in sorted({min(r["p"] for r in grid), max(r["p"] for r in grid)}):
            series = {}
            for m in methods:
                sel = sorted((r["n"], r["link_bytes"], r["link_bytes_formula"]) for r in grid if r["p"] == p and r["method"] == m)
                series[label[m]] = ([n for n, _, _ in sel], [b for _, b, _ in sel])
                series[f"{label[m]} (formula)"] = ([n for n, _, _ in sel], [f for _, _, f in sel])
            panels.append((f"P={p}", series))
        images["sp_bytes"] = _plot_panels(
            out_dir / "sp_bytes.png", panels, xlabel="sequence length N", ylabel="bytes per layer per rank (fwd + bwd)",
            logy=True, ncols=len(panels), title="communication per layer: counted (markers) and the spec's formula",
        )  # fmt: skip
    timed = sp["timed"]
    setting = (results.get("compute") or {}).get("setting", "measured")
    whose = "this machine's" if setting == "measured" else f"the device model's ({setting})"
    if timed:
        first_link = s["links"][0]
        # Across P: the N timed at the most degrees (the largest such N); across N: the largest P.
        degrees_at = {n: len({r["p"] for r in timed if r["n"] == n}) for n in {r["n"] for r in timed}}
        big_n = max(degrees_at, key=lambda n: (degrees_at[n], n))
        big_p = max(r["p"] for r in timed)
        panels = []
        for rank in s["ranks"]:
            for axis, fixed in (("n", ("p", big_p)), ("p", ("n", big_n))):
                series = {}
                for m in methods:
                    sel = sorted((r[axis], r["fwd_bwd_ms"]) for r in timed if r["link"] == first_link and r["rank"] == rank
                                 and r["method"] == m and r[fixed[0]] == fixed[1])  # fmt: skip
                    if sel:
                        series[label[m]] = ([x for x, _ in sel], [y for _, y in sel])
                panels.append((f"rank {rank}, {fixed[0].upper()}={fixed[1]}, {first_link}", series))
        images["sp_time"] = _plot_panels(
            out_dir / "sp_time.png", panels, xlabel="N (left) / P (right)", ylabel="fwd + bwd ms per layer (virtual clock)",
            logy=True, ncols=2, title=f"simulated-link time of one rank: {whose} compute + exposed communication",
        )  # fmt: skip
        panels = []
        for link in s["links"]:
            series = {}
            for m in methods:
                for rank in s["ranks"]:
                    sel = sorted((r["p"], r["exposed_ms"]) for r in timed if r["link"] == link and r["rank"] == rank
                                 and r["method"] == m and r["n"] == big_n)  # fmt: skip
                    if sel:
                        series[f"{label[m]} ({rank})"] = ([x for x, _ in sel], [y for _, y in sel])
            panels.append((f"{link}, N={big_n}", series))
        images["sp_exposed"] = _plot_panels(
            out_dir / "sp_exposed.png", panels, xlabel="sp degree P", ylabel="exposed communication ms per layer",
            logy=False, ncols=len(panels), title="communication left exposed (fwd + bwd), by rank played",
        )  # fmt: skip
    return images


# --- files and W&B ------------------------------------------------------------------------------


def write_readme(results: dict, images: dict[str, Path], out_dir: Path) -> Path:
    cfg, hw, rows = results["settings"], results["hardware"], results["rows"]
    points = ", ".join(degrees_label(d) for d in results["degrees"])
    if results.get("real_degrees"):
        points += f" (real: {', '.join(degrees_label(d) for d in results['real_degrees'])})"
    lines = [
        f"# Speed benchmark: {cfg['bench_shape']['name']} shape",
        "",
        f"`{results['command'] or 'eval.bench.run_bench(...)'}`",
        "",
    ]
    if rows:
        lines += generation_intro(results, points)
    else:  # only the sequence-parallel section ran
        setting = (results.get("compute") or {}).get("setting", "measured")
        machine = "Hardware" if setting == "measured" else f"Compute predicted for {setting} by the device model, on"
        lines += [
            f"{machine}: {hw.get('gpu', hw['cpu'])} ({hw['cpu_cores']} CPU cores, load average "
            f"{hw['load_average_1m']:.2f} at start, {hw['torch_threads']} torch threads), torch {hw['torch']}, "
            f"transformers {hw['transformers']}. Elapsed {results['elapsed_s']:.0f} s.",
            "",
        ]
    for note in results["notes"]:
        lines.append(f"> {note}")
        lines.append("")
    for v in dict.fromkeys(variant_key(r) for r in rows):
        sel = [r for r in rows if variant_key(r) == v]
        cols = TABLE_COLUMNS + (SIMULATED_COLUMNS if v.startswith("simulated") else [])
        lines += [f"## {v}", "", report.write_markdown_table(display_rows(sel), cols)]
    lines += moe_sections(results, images)
    lines += sp_section(results, images)
    lines += decode_paths_section(results, images)
    lines += ["## Link presets", ""]
    lines.append(
        report.write_markdown_table(
            results["links"], [("name", "preset"), ("base_us", "base us"), ("alpha_us", "alpha us/hop"), ("beta_GBps", "beta GB/s"), "note"]
        )
    )
    for name, path in images.items():
        if name not in MOE_PLOTS + SP_PLOTS + DECODE_PATH_PLOTS:  # shown in their own sections
            lines += [f"![{name}]({path.name})", ""]
    if results["skipped"]:
        lines += ["## Skipped", "", "Architectures not measured at a degree point (a layout that refuses it, or a "
                  "forward the device model cannot run):", ""]  # fmt: skip
        lines += [f"- {s}" for s in results["skipped"]] + [""]
    path = out_dir / "README.md"
    path.write_text("\n".join(lines))
    return path


def generation_intro(results: dict, points: str) -> list[str]:
    """What the generation bench's rows are: settings, compute, hardware, the columns."""
    cfg, hw = results["settings"], results["hardware"]
    compute = results.get("compute") or {"setting": "measured"}
    if compute["setting"] == "measured":
        how = (
            f"compute measured on this machine: {cfg['warmup']} warm-up + {cfg['repeats']} timed repeats "
            f"(median, min-max), dtype {results['dtype']}, compile={cfg['compile']}."
        )
        machine = f"Hardware: {hw.get('gpu', hw['cpu'])} ({hw['cpu_cores']} CPU cores, load average "
    else:
        d = compute["device"]
        how = (
            f"compute predicted for {d['name']} by the device model ({d['peak_flops'] / 1e12:.0f} TFLOP/s, "
            f"{d['hbm_Bps'] / 1e12:.2f} TB/s HBM; eff_flops {compute['eff_flops']}, eff_hbm {compute['eff_hbm']}, "
            f"{compute['kernel_overhead_us']:.3g} us per kernel, contention {compute['contention']}), dtype "
            f"{compute['dtype']}, {'static' if compute['static_cache'] else 'growing'} KV cache: one deterministic "
            "prediction per row."
        )
        machine = f"Predicted on: {hw['cpu']} ({hw['cpu_cores']} CPU cores, load average "
    return [
        f"Architectures {', '.join(cfg['archs'])} (baseline `{cfg['baseline']}`), degrees {points}, "
        f"batch {cfg['batch_sizes']}, prompt {cfg['prompt_len']} tokens, {cfg['new_tokens']} generated "
        f"({cfg['new_tokens'] - 1} decode steps), {how}",
        "",
        f"{machine}{hw['load_average_1m']:.2f} at start), torch {hw['torch']}, transformers {hw['transformers']}.",
        "",
        "- **decode tok/s** = batch x decode steps / decode time; **prefill ms** = time to first token.",
        f"- **speed-up** = the architecture over `{cfg['baseline']}` in the same variant, degrees and batch.",
        "- **hidden** = (T_base - T_arch) / (T_base - T_upper_bound), T = prefill time or time per decode "
        f"step, T_upper_bound = `{cfg['baseline']}` without collectives (`upper_bound` for simulated rows, "
        "`upper_bound_real` for real rows); n/a when T_base - T_upper_bound is below "
        f"{cfg['min_comm_fraction']:.0%} of T_base.",
        "- **hidden (exposed)** (simulated only) = 1 - exposed_arch / exposed_base on the virtual clock: "
        "the same question without compute-time noise between architectures.",
        "- **exposed / link busy** (simulated only): the share of the link's time that was not covered by compute. "
        f"`{cfg['baseline']}` waits each collective right after issuing it, so its share should be near 1"
        + (
            ": a lower value is Python time between issuing a collective and waiting for it that the virtual clock "
            "counted as compute."
            if compute["setting"] == "measured"
            else " (with the device model only ops placed between issue and wait count as compute)."
        ),
        "- Communication counts are per forward (prefill) and per decode step, summed over collective kinds.",
        "",
    ]


MOE_PLOTS = ("a2a_exposed", "expert_throughput")
SP_PLOTS = ("sp_bytes", "sp_time", "sp_exposed")


def moe_sections(results: dict, images: dict[str, Path]) -> list[str]:
    """The MoE all-to-all tables (when rows carry them) and the expert-layer throughput table."""
    cfg, lines = results["settings"], []
    moe = [r for r in results["rows"] if r.get("prefill_a2a_bytes") is not None]
    if moe:
        first_link = next((r["link"] for r in moe if r["variant"] == "simulated"), None)
        counted = [r for r in moe if r["variant"] == "simulated" and r["link"] == first_link]
        anchors = (cfg.get("anchors") or {}).get("a2a_hidden_share") or {}
        lines += [
            "## MoE all-to-all per layer",
            "",
            "Token all-to-alls of expert parallelism (dispatch + combine per MoE layer; the blocking exchange of "
            "per-expert counts apart). **bytes/a2a** = bytes this rank hands to one all-to-all, counted by "
            "`comm.counters` (its own chunk included); **T k h bytes** = the same from the architecture's declared "
            "dropless formula (T = tokens of the rank, k = experts per token, h = hidden size; MoE++: k_eff = "
            "k tau N_FFN / (tau N_FFN + N_ZC) at the load its balance loss aims for, while random weights route "
            "about uniformly); **off-rank** = x (P-1)/P, the spec's bytes per all-to-all that leave the rank at "
            "balanced routing. Simulated rows (the link of the first preset for bytes, which do not depend on it):",
            "",
            report.write_markdown_table(display_rows(counted), MOE_BYTES_COLUMNS),
            "**a2a link ms/layer** = the link model's time of a layer's two token all-to-alls; **exposed** = the part "
            "the rank waited for on the virtual clock; **hidden share** = 1 - exposed / link time (a schedule that "
            "waits right after issuing still hides the compute issued in between: the shared dispatch computes the "
            "received rows' expert-major permutation after issuing its all-to-all). **published**: "
            + ("; ".join(f"{a}: " + ", ".join(f"{k} {v:.0%}" for k, v in m.items()) for a, m in anchors.items()) or "none")
            + f". **exposed / baseline's**: against `{cfg['baseline']}` at the same point, link and batch (this mixes "
            "the schedule with the bytes: ScMoE routes top-1, `moe` top-2).",
            "",
        ]
        for link in dict.fromkeys(r["link"] for r in moe if r["variant"] == "simulated"):
            sel = [r for r in moe if r["variant"] == "simulated" and r["link"] == link]
            lines += [f"### simulated:{link}", "", report.write_markdown_table(display_rows(sel), MOE_EXPOSED_COLUMNS)]
        if "a2a_exposed" in images:
            lines += [f"![a2a_exposed]({images['a2a_exposed'].name})", ""]
    experts = results.get("expert_throughput") or []
    if experts:
        et = cfg["expert_throughput"]
        shown = [{**e, "ms_spread": f"{e['ms_min']:.4g}-{e['ms_max']:.4g}"} for e in experts]
        lines += [
            "## Expert-layer throughput (real, one device)",
            "",
            f"One MoE layer's forward (router, experts, combine; every expert on this device, no communication) "
            f"on {et['tokens']} random tokens at the bench shape, timed for real: {et['warmup']} warm-up + "
            f"{et['repeats']} repeats interleaved across layers (median, min-max). Each router is pushed to the load "
            "its balance loss aims for (a logit offset on the zero-computation experts, found by bisection, so that "
            "the grouped experts get the declared k_eff rows per token): with random weights MoE++ would route "
            "about uniformly over all its experts whatever tau is. **speed-up** = tokens/s over "
            f"`{experts[0]['label']}`; **rows ratio** = the speed-up if the grouped experts were all the time.",
            "",
            report.write_markdown_table(shown, EXPERT_COLUMNS),
        ]
        if "expert_throughput" in images:
            lines += [f"![expert_throughput]({images['expert_throughput'].name})", ""]
    return lines


# --- decode paths (one device) ---------------------------------------------------------------------

DECODE_PATH_COLUMNS = [
    ("label", "arch (path)"),
    ("batch", "batch"),
    ("q_len", "q len"),
    ("decode_ms_per_step", "ms/step"),
    ("decode_tok_s", "decode tok/s"),
    ("tok_s_spread", "tok/s min-max"),
    ("speedup_decode", "over baseline"),
    ("kv_bytes_per_token", "KV bytes/token/layer"),
    ("kv_percent", "KV of baseline's"),
]
ACCOUNTING_COLUMNS = [("label", "arch (path)"), ("kv_bytes_per_token", "KV bytes/token/layer"), ("kv_percent", "KV of baseline's")]
DECODE_PATH_PLOTS = ("decode_paths",)


def path_label(row: dict) -> str:
    """`arch` or `arch (path)` for an architecture measured on several decode paths."""
    return row["arch"] if row.get("path") is None else f"{row['arch']} ({row['path']})"


def plot_decode_paths(paths: dict, out_dir: Path) -> Path:
    """Decode tokens/s vs batch size, one panel per query length, one line per architecture and path."""
    rows, panels = paths["rows"], []
    for q_len in dict.fromkeys(r["q_len"] for r in rows):
        series = {}
        for r in (r for r in rows if r["q_len"] == q_len):
            xs, ys = series.setdefault(path_label(r), ([], []))
            xs.append(r["batch"])
            ys.append(r["decode_tok_s"])
        panels.append((f"query length {q_len}", series))
    return _plot_panels(out_dir / "decode_paths.png", panels, xlabel="batch", ylabel="decode tokens/s", logy=True,
                        ncols=len(panels), title="one device, measured")  # fmt: skip


def decode_paths_section(results: dict, images: dict[str, Path]) -> list[str]:
    paths = results.get("decode_paths") or {}
    if not paths.get("rows"):
        return []
    cfg = results["settings"]
    dp = cfg["decode_paths"]
    shown = [{**r, "label": path_label(r), "kv_percent": f"{100 * r['kv_fraction']:.3f}%", "tok_s_spread": f"{r['decode_tok_s_min']:.4g}-{r['decode_tok_s_max']:.4g}"}
             for r in paths["rows"]]  # fmt: skip
    lines = [
        "## Decode paths (one device, measured)",
        "",
        f"Each architecture on each of its decode paths (`decode_paths.paths`; the same weights on every path), on "
        f"one device with no mesh: a {cfg['prompt_len']}-token prompt (not timed), then {dp['steps']} decode steps of "
        f"`q len` new tokens each with the cache, timed for real in {paths['dtype']}: {dp['warmup']} warm-up + "
        f"{dp['repeats']} repeats interleaved across models (median, min-max). **over baseline** = tokens/s over "
        f"`{cfg['baseline']}` at the same batch and query length. **KV bytes/token/layer** = the model's own "
        "`kv_bytes_per_token` where it has one, else 2 x KV heads x head_dim values.",
        "",
        report.write_markdown_table(shown, DECODE_PATH_COLUMNS),
    ]
    if paths.get("accounting"):
        acc = [{**a, "label": path_label(a), "kv_percent": f"{100 * a['kv_fraction']:.3f}%"} for a in paths["accounting"]]
        lines += [
            f"KV accounting at the {acc[0]['shape']} shape ({acc[0]['dtype']}, from the configs alone, nothing built):",
            "",
            report.write_markdown_table(acc, ACCOUNTING_COLUMNS),
        ]
    if "decode_paths" in images:
        lines += [f"![decode_paths]({images['decode_paths'].name})", ""]
    return lines


def write_files(results: dict, out_dir: Path) -> dict[str, Path]:
    """results.json, the plots and README.md under `out_dir`; returns the plots {name: path}."""
    report.write_json(out_dir / "results.json", results)
    cfg = results["settings"]
    images = make_plots(results["rows"], list(cfg["archs"]), cfg["baseline"], out_dir)
    if results.get("expert_throughput"):
        images["expert_throughput"] = plot_expert_throughput(results["expert_throughput"], out_dir)
    images.update(sp_plots(results, out_dir))
    if (results.get("decode_paths") or {}).get("rows"):
        images["decode_paths"] = plot_decode_paths(results["decode_paths"], out_dir)
    write_readme(results, images, out_dir)
    return images


def log_to_wandb(results: dict, images: dict[str, Path], out_dir: Path, wandb_cfg: dict) -> None:
    rows = display_rows(results["rows"])
    columns = ["variant", "link"] + [k for k, _ in TABLE_COLUMNS + SIMULATED_COLUMNS]
    summary = {}
    for r in results["rows"]:
        key = f"{r['arch']}/{degrees_label(r['degrees'], sep='')}/{variant_key(r)}/b{r['batch']}"
        for m in ("decode_tok_s", "prefill_ms", "speedup_decode", "hidden_fraction_decode"):
            summary[f"{key}/{m}"] = r[m]
        for m in ("prefill_a2a_exposed_ms_per_layer", "prefill_a2a_hidden_share", "prefill_a2a_bytes"):
            if r.get(m) is not None:
                summary[f"{key}/{m}"] = r[m]
    for e in results.get("expert_throughput") or []:
        summary[f"expert_throughput/{e['label']}/tokens_per_s"] = e["tokens_per_s"]
        summary[f"expert_throughput/{e['label']}/speedup"] = e["speedup"]
    for r in (results.get("decode_paths") or {}).get("rows") or []:
        key = f"decode_paths/{r['arch']}/{r['path'] or 'default'}/b{r['batch']}/q{r['q_len']}"
        summary[f"{key}/decode_tok_s"] = r["decode_tok_s"]
        summary[f"{key}/kv_bytes_per_token"] = r["kv_bytes_per_token"]
    for h in (results.get("sequence_parallel") or {}).get("headline") or []:
        key = f"sequence_parallel/{h['rank']}/{h['link']}/N{h['n']}-P{h['p']}"
        for m in ("speedup_over_lasp1", "comm_speedup_over_lasp1", "speedup_over_ring", "lasp2_exposed_ms", "lasp1_exposed_ms"):
            summary[f"{key}/{m}"] = h.get(m)
    report.log_to_wandb(
        out_dir,
        project=wandb_cfg.get("project", "overlap-zoo"),
        name=wandb_cfg.get("name", "bench"),
        tags=wandb_cfg.get("tags") or [],
        config={
            k: v
            for k, v in results.items()
            if k in ("settings", "hardware", "dtype", "compute", "links", "degrees", "real_degrees")
        },
        summary=summary,
        tables={"bench/results": (columns, rows)},
        images={f"bench/{k}": v for k, v in images.items()},
    )
