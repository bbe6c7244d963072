"""How the MoE section is shown: the all-to-all tables and plot, the expert-throughput table and plot."""

from pathlib import Path

from eval import report
from eval.bench.generation_report import display_rows
from eval.bench.settings import degrees_key, degrees_label, ranks

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


def plot_a2a_exposed(rows: list[dict], out_dir: Path) -> dict[str, Path]:
    """The token all-to-all time left exposed per MoE layer, per link and phase, each arch at each point
    (simulated rows that carry the all-to-all columns); {} without such rows."""
    images = {}
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


MOE_PLOTS = ("a2a_exposed", "expert_throughput")


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


