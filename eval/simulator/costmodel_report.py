"""The report of `python -m eval.costmodel`: the predicted-vs-published plot and README.md.

eval/simulator/costmodel.py records the Ladder record's cells, fits the constants and predicts; this file writes
what it found.
"""

import math
from pathlib import Path

from eval import report
from eval.simulator.attention import ATTENTION_PROGRAMS

# The published table's columns as the costmodel names them (each a zoo architecture by conf/costmodel.yaml's
# `columns`; the upper bound is the standard column with free communication).
COLUMNS = ("standard", "ladder", "parallel", "upper_bound")


def prefill_ratios(rows: list[dict]) -> list[float]:
    """Every logged prefill cell's predicted / logged ratio."""
    return [r[f"{col}_prefill_ratio"] for r in rows for col in COLUMNS if r[f"{col}_prefill_ratio"] is not None]


def plot_predicted_vs_published(path: Path, rows: list[dict]) -> Path:
    """Predicted vs published tokens/s (left) and predicted vs logged prefill latency (right), every cell."""
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 5))
    panels = (("", "tokens/s", 0.10), ("_prefill", "prefill ms", 0.15))
    for ax, (part, unit, band) in zip(axes, panels, strict=True):
        pairs = []
        for col, marker in zip(COLUMNS, "osD^", strict=True):
            xy = [(r[f"{col}{part}_published"], r[f"{col}{part}_predicted"]) for r in rows
                  if r[f"{col}{part}_published"] is not None]  # fmt: skip
            pairs += xy
            ax.scatter([x for x, _ in xy], [y for _, y in xy], marker=marker, label=col)
        lo = min(min(xy) for xy in pairs) * 0.8
        hi = max(max(xy) for xy in pairs) * 1.25
        ax.plot([lo, hi], [lo, hi], color="grey", lw=1)
        ax.fill_between([lo, hi], [lo * (1 - band), hi * (1 - band)], [lo * (1 + band), hi * (1 + band)],
                        color="grey", alpha=0.15, label=f"±{band:.0%}")  # fmt: skip
        ax.set(xscale="log", yscale="log", xlabel=f"published {unit}", ylabel=f"predicted {unit}",
               title=f"Ladder 70B: {unit}, simulator vs reference")  # fmt: skip
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


VALIDATION_COLUMNS = [
    ("setting", "batch/TP"),
    *[(f"{a}_{k}", f"{a} {label}") for a in COLUMNS for k, label in (("published", "pub"), ("predicted", "pred"), ("ratio", "ratio"))],
]
SPEEDUP_COLUMNS = [
    ("setting", "batch/TP"),
    ("ladder_speedup_published", "ladder speed-up pub"),
    ("ladder_speedup_predicted", "pred"),
    ("ladder_speedup_error", "pred - pub"),
    ("hidden_published", "hidden pub"),
    ("hidden_predicted", "hidden pred"),
    ("p2p_off_speedup_published", "P2P-off speed-up pub"),
    ("p2p_off_speedup_predicted", "pred"),
    ("p2p_off_speedup_ratio", "ratio"),
    ("ar_us_published", "us/all-reduce pub-implied"),
    ("ar_us_predicted", "pred"),
]
PREFILL_COLUMNS = [
    ("setting", "batch/TP"),
    *[(f"{a}_prefill_{k}", f"{a} {label}") for a in COLUMNS for k, label in (("published", "logged ms"), ("predicted", "pred ms"), ("ratio", "ratio"))],
    ("ladder_prefill_speedup_published", "ladder prefill speed-up logged"),
    ("ladder_prefill_speedup_predicted", "pred"),
    ("ladder_prefill_speedup_error", "pred - logged"),
    ("prefill_bandwidth_share", "bandwidth-bound share of llama's prefill link time"),
]
PREFILL_COMM_COLUMNS = [
    ("setting", "batch/TP"),
    ("prefill_ar_us_published", "us/all-reduce logged-implied"),
    ("prefill_ar_us_predicted", "pred"),
    ("ladder_prefill_paid_published", "ladder pays of it, logged-implied"),
    ("ladder_prefill_paid_predicted", "pred"),
]
CONSTANT_NOTES = {
    "eff_flops": "fraction of peak FLOP/s a compute-bound kernel reaches",
    "eff_hbm": "fraction of HBM bandwidth a memory-bound kernel reaches",
    "kernel_overhead_us": "per kernel (launch gap and tail under CUDA graphs)",
    "link_base_us": "NVLink: fixed latency of one collective",
    "link_alpha_us": "NVLink: latency per ring hop (an all-reduce at TP P has 2 (P-1) hops)",
    "contention": "fraction of the overlapped communication time still paid, latency-bound collectives (decode)",
    "contention_bw": "the same, bandwidth-bound collectives (prefill's 17-270 MB all-reduces)",
    "collective_launch_us": "compute-stream time per collective launched outside a CUDA graph (the prefill's)",
}


def markdown(result: dict, image: Path) -> str:
    d, c, errors, rows = result["device"], result["constants"], result["mean_abs_log_ratio"], result["rows"]
    nv = result["links"]["nvlink"]

    def pct(x):
        return f"{math.exp(x) - 1:.1%}"

    how = "fitted once to the whole record (`fit: true`)" if result["fitted"] else "as given in the config (`fit: false`)"
    names = result["fitted_constants"]
    constants = [{"constant": k, "value": v, "start": result["start"][k], "fitted": "yes" if k in names else "no (held)",
                  "what": CONSTANT_NOTES[k]} for k, v in c.items()]  # fmt: skip
    t = result["targets"]
    lines = [
        "# Speed simulator vs the Ladder paper's 70B table",
        "",
        f"`{result['command'] or 'eval.costmodel.run_costmodel(...)'}`",
        "",
        f"Source of the published numbers: {result['source']}.",
        "",
        "Every number predicted here comes from the architectures' own `forward()` (columns: "
        + ", ".join(f"{k} = `{v}`" for k, v in result["columns"].items())
        + "; upper bound = the standard column's run with free communication), run at the "
        f"`{result['shape']['name']}` shape on the meta device and a fake {'/'.join(str(t) for t in sorted({r['tp'] for r in rows}))}-way "
        "process group, each aten op charged to the device model (`eval.simulator.device`), each collective to the link "
        "model (`parallel.link`), with no copy of any schedule (`eval.simulator.replay`). Generation as the reference "
        f"benchmark: prompt {result['config']['prompt_len']}, {result['config']['new_tokens']} new tokens, a static KV "
        "cache of prompt + new tokens read in full at every step"
        + f"; attention charged as `{result['config']['attention_program']}` "
        f"({ATTENTION_PROGRAMS[result['config']['attention_program']]})"
        + "; tokens/s = batch x new tokens / (prefill + (new tokens - 1) decode steps).",
        "",
        "The prefill as the reference runs it: logits at every prompt position (gpt-fast's `model(x, input_pos)`), "
        "elementwise ops fused (its prefill is compiled, `--compile_prefill`, without CUDA graphs: each collective pays "
        "`collective_launch_us`; the decode step is a CUDA graph and pays none). Prefill latency = the replayed prefill "
        "forward; published = the mean of the log's 10 timed runs (warm-ups excluded: eval/simulator/ladder_reference.json).",
        "",
        f"Device `{d['device']['name']}` ({d['device']['note']}). Constants ({how}; {len(names)} fitted: the fit "
        f"minimises the power mean of order 4 of every cell's error over its target: decode {t['decode']:.0%}, "
        f"prefill {t['prefill']:.0%}, ladder speed-ups {t['speedup']}; loss {result['loss']:.3f}, 1 = every cell at its target):",
        "",
        report.write_markdown_table(constants, ["constant", "value", "start", "fitted", "what"]),
        "",
        f"NVLink link: base {nv['base_s'] * 1e6:.2f} us + {nv['alpha_s'] * 1e6:.2f} us per hop, "
        f"{nv['beta_Bps'] / 1e9:g} GB/s (preset `{nv['name']}`'s bandwidth): one all-reduce at TP 8 costs "
        f"{result['all_reduce_us_tp8']:.1f} us of latency. P2P-off column: preset `{result['links']['p2p_off']['name']}` "
        "as it is (not fitted).",
        "",
        f"Recorded in {result['recorded_s']:.0f} s (12 cells: 3 architectures x 4 settings, prefill + one decode "
        f"step each); {result['elapsed_s']:.0f} s with the fit.",
        "",
        "## Tokens/s",
        "",
        "ratio = predicted / published.",
        "",
        report.write_markdown_table(rows, VALIDATION_COLUMNS),
        "",
        f"Largest |ratio - 1| over the 16 cells: **{result['worst_tok_s_error']:.1%}**; largest |ladder speed-up "
        f"error|: **{result['worst_ladder_speedup_error']:.3f}**.",
        "",
        "## Prefill latency",
        "",
        "ratio = predicted / logged; n/a where the reference's log is not in the stored copy (ladder, batch 16).",
        "",
        report.write_markdown_table(rows, PREFILL_COLUMNS),
        "",
        f"Largest |ratio - 1| over the {len(prefill_ratios(rows))} logged prefill cells: "
        f"**{result['worst_prefill_error']:.1%}**; largest |ladder prefill speed-up error|: "
        f"**{result['worst_ladder_prefill_speedup_error']:.3f}**.",
        "",
        "The prefill's communication: the cost of one all-reduce (llama waits every one: (T_standard - "
        "T_upper_bound) / all-reduces per prefill) and the fraction of that time the ladder column still pays "
        "((T_ladder - T_upper_bound) / (T_standard - T_upper_bound)), as the logs imply them and as predicted:",
        "",
        report.write_markdown_table(rows, PREFILL_COMM_COLUMNS),
        "",
        f"Sensitivity: `contention_bw` swept (fitted: {c['contention_bw']:.3g}), every other constant as above; the "
        "ladder prefill speed-up's error per setting and the largest prefill error:",
        "",
        report.write_markdown_table(
            result["sensitivity_contention_bw"],
            [("contention_bw", "contention_bw"),
             *[(f"ladder_prefill_speedup_error_{r['setting']}", f"speed-up error {r['setting']}") for r in rows
               if r["ladder_prefill_speedup_error"] is not None],
             ("worst_prefill_error", "largest prefill error")],
        ),  # fmt: skip
        "",
        "## Speed-ups",
        "",
        report.write_markdown_table(rows, SPEEDUP_COLUMNS),
        "",
        "us/all-reduce = (T_standard - T_upper_bound) / (all-reduces per forward x forwards): the exposed cost of "
        "one all-reduce that the published table implies, beside the simulator's.",
        "",
        "## Error",
        "",
        "Mean |log(predicted / published)| (and the equivalent typical % error):",
        "",
        report.write_markdown_table(
            [{"what": k, "mean_abs_log_ratio": v, "typical_error": pct(v)} for k, v in errors.items()],
            [("what", "cells"), ("mean_abs_log_ratio", "mean abs log ratio"), ("typical_error", "~ error")],
        ),
        "",
        f"![predicted vs published]({image.name})",
        "",
    ]
    return "\n".join(lines)
