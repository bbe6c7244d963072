"""Validation of the speed simulator against the Ladder paper's 70B table: `python -m eval.costmodel`.

The simulator (`eval.simulator.replay`) runs each architecture's own `forward()` at the table's shape on the meta
device, sharded on a fake process group, every aten op charged to a device model (`eval.simulator.device`) and
every collective to a link model (`parallel.link`). Nothing here knows an architecture: each column of the
published table names a zoo architecture (`columns` in conf/costmodel.yaml: standard = llama, ladder,
parallel), the upper bound is the standard column's run replayed with free communication, and the schedule
(which collective is waited where) is whatever the architecture's `forward()` does.

Each (column, batch, TP) cell is recorded once (about 2 s each at 70B on 2 CPU cores), then replayed under
candidate constants, so fitting is cheap. At most five constants are fitted once for the whole table
(`fit: true`; or used as given): the HBM efficiency, the per-kernel overhead, the NVLink link's base latency
and per-hop latency, and the contention (the fraction of overlapped communication time still paid). The
FLOP/s efficiency is set a priori (prefill is a small part of these tokens/s; it is not identifiable here).
The P2P-off column uses its own link preset (not fitted) with the same device constants.

Reported: every fitted value, every cell's predicted / published ratio, the ladder speed-ups, the
all-reduce latency the table implies beside the fitted link's, and a plot of predicted vs published.
"""

import math
import time
from dataclasses import asdict, replace
from pathlib import Path

import models
from eval import report
from eval.simulator.device import DeviceModel, get_device
from eval.simulator.replay import NO_COMM, build_meta, record_generation, release
from parallel.link import get_link

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
COLUMNS = ("standard", "ladder", "parallel", "upper_bound")

# The constants a fit may move, with the bounds of its search (the device model's and the link's fields).
FITTED = {
    "eff_hbm": (0.3, 1.0),
    "kernel_overhead_us": (0.0, 10.0),
    "link_base_us": (0.0, 30.0),
    "link_alpha_us": (0.0, 5.0),
    "contention": (0.0, 1.0),
}


def constants_from(cfg: dict) -> dict:
    c = {k: float(v) for k, v in cfg["constants"].items()}
    missing = sorted(set(FITTED) - set(c))
    if missing:
        raise ValueError(f"conf/costmodel.yaml constants lack {missing}; it needs {sorted(FITTED)}.")
    for name, value in c.items():
        if name in FITTED and not FITTED[name][0] <= value <= FITTED[name][1]:
            raise ValueError(f"constants.{name}={value} is outside {FITTED[name]}.")
    return c


def device_model(cfg: dict, c: dict) -> DeviceModel:
    return DeviceModel.from_config(
        cfg["device"], eff_flops=cfg["eff_flops"], eff_hbm=c["eff_hbm"], kernel_overhead_us=c["kernel_overhead_us"],
        contention=c["contention"],
    )


def fitted_link(cfg: dict, c: dict):
    """The NVLink preset with the fitted base and per-hop latencies (its bandwidth as the preset has it)."""
    return replace(get_link(cfg["links"]["nvlink"]), base_s=c["link_base_us"] * 1e-6, alpha_s=c["link_alpha_us"] * 1e-6)


def check(cfg: dict) -> None:
    get_device(cfg["device"])
    constants_from(cfg)
    for key, name in cfg["links"].items():
        try:
            get_link(name)
        except ValueError as err:
            raise ValueError(f"links.{key}: {err}") from None
    for column in ("standard", "ladder", "parallel"):
        arch = cfg["columns"].get(column)
        if arch not in models.ZOO:
            raise ValueError(f"columns.{column}={arch!r} is not a zoo architecture; choose one of {sorted(models.ZOO)}.")


def record_cells(cfg: dict) -> dict[tuple, object]:
    """{(column, batch, tp): Recording} for every published setting and every architecture column."""
    shape = {k: v for k, v in cfg["bench_shape"].items() if k != "name"}
    out = {}
    for column in ("standard", "ladder", "parallel"):
        arch = cfg["columns"][column]
        for tp in sorted({p["tp"] for p in PUBLISHED_70B}):
            degrees = {"tp": tp}
            model = build_meta(arch, models.get(arch).bench_config(shape, degrees), degrees)
            try:
                for pub in PUBLISHED_70B:
                    if pub["tp"] == tp:
                        out[(column, pub["batch"], tp)] = record_generation(
                            model, pub["batch"], cfg["prompt_len"], cfg["new_tokens"],
                            static_cache=cfg["static_cache"], gqa_expand=cfg["gqa_expand"],
                        )
            finally:
                release()
    return out


def predict_rows(cells: dict, cfg: dict, c: dict) -> list[dict]:
    device = device_model(cfg, c)
    nvlink, p2p_off = fitted_link(cfg, c), get_link(cfg["links"]["p2p_off"])
    rows = []
    for pub in PUBLISHED_70B:
        key = (pub["batch"], pub["tp"])
        pred = {col: cells[(col, *key)].predict(device, nvlink) for col in ("standard", "ladder", "parallel")}
        pred["upper_bound"] = cells[("standard", *key)].predict(device, NO_COMM)
        row = {"setting": f"{pub['batch']}/{pub['tp']}", "batch": pub["batch"], "tp": pub["tp"]}
        for col in COLUMNS:
            row[f"{col}_published"] = pub[col]
            row[f"{col}_predicted"] = pred[col]["tok_s"]
            row[f"{col}_ratio"] = pred[col]["tok_s"] / pub[col]
        row["ladder_speedup_published"] = pub["ladder_speedup"]
        row["ladder_speedup_predicted"] = pred["ladder"]["tok_s"] / pred["standard"]["tok_s"]
        row["ladder_speedup_error"] = row["ladder_speedup_predicted"] - pub["ladder_speedup"]
        row["hidden_published"] = _hidden(pub["standard"], pub["ladder"], pub["upper_bound"])
        row["hidden_predicted"] = _hidden(*(pred[a]["tok_s"] for a in ("standard", "ladder", "upper_bound")))
        # The exposed cost of one all-reduce the table implies: (T_standard - T_upper) over the standard
        # model's all-reduces in all forwards (counted by the run: its waits per decode step).
        calls = cells[("standard", *key)].phases["decode"].recorder.calls
        per_step = sum(1 for name, _, _ in calls if name == "issue")
        tokens, forwards = pub["batch"] * cfg["new_tokens"], cfg["new_tokens"]
        row["ar_us_published"] = 1e6 * (tokens / pub["standard"] - tokens / pub["upper_bound"]) / (per_step * forwards)
        row["ar_us_predicted"] = 1e6 * (tokens / pred["standard"]["tok_s"] - tokens / pred["upper_bound"]["tok_s"]) / (per_step * forwards)
        p2p = {col: cells[(col, *key)].predict(device, p2p_off)["tok_s"] for col in ("standard", "ladder")}
        row["p2p_off_speedup_published"] = pub["p2p_off_speedup"]
        row["p2p_off_speedup_predicted"] = p2p["ladder"] / p2p["standard"]
        row["p2p_off_speedup_ratio"] = row["p2p_off_speedup_predicted"] / pub["p2p_off_speedup"]
        row["decode_ms"] = {col: 1e3 * pred[col]["decode"]["time"] for col in COLUMNS}
        row["decode_exposed_ms"] = {col: 1e3 * pred[col]["decode"]["exposed"] for col in COLUMNS}
        rows.append(row)
    return rows


def _hidden(std_tok_s: float, arch_tok_s: float, ub_tok_s: float) -> float | None:
    """Hidden fraction (eval.report.hidden_fraction) from tokens/s: times are 1 / tokens/s."""
    return report.hidden_fraction(1 / std_tok_s, 1 / arch_tok_s, 1 / ub_tok_s, min_comm_fraction=0.0)


def mean_abs_log_ratio(ratios) -> float:
    ratios = list(ratios)
    return sum(abs(math.log(r)) for r in ratios) / len(ratios)


def loss(rows: list[dict]) -> float:
    """What the fit minimises: the mean squared log ratio over the 16 tokens/s cells, plus the ladder
    speed-ups' squared log ratios (so that the ratio the paper is about is not traded for absolute speed)."""
    cells = [math.log(r[f"{col}_ratio"]) ** 2 for r in rows for col in COLUMNS]
    speedups = [math.log(r["ladder_speedup_predicted"] / r["ladder_speedup_published"]) ** 2 for r in rows]
    return sum(cells) / len(cells) + sum(speedups) / len(speedups)


def fit(cells: dict, cfg: dict, start: dict, rounds: int = 6, points: int = 21) -> dict:
    """Coordinate descent over the FITTED constants: each round scans every constant over a grid around
    its current value (the grid narrows each round), keeping the best; deterministic."""
    c, best = dict(start), loss(predict_rows(cells, cfg, start))
    width = {k: hi - lo for k, (lo, hi) in FITTED.items()}
    for _ in range(rounds):
        for name, (lo, hi) in FITTED.items():
            centre = c[name]
            for i in range(points):
                value = min(hi, max(lo, centre + width[name] * (i / (points - 1) - 0.5)))
                trial = {**c, name: value}
                err = loss(predict_rows(cells, cfg, trial))
                if err < best - 1e-15:
                    best, c = err, trial
            width[name] /= 3
    return c


def run_costmodel(cfg: dict, out_dir: Path, command: str = "") -> dict:
    """Record the 70B cells, fit (or take) the constants, compare with the published table, write
    README.md, costmodel.json and costmodel_ratio.png under `out_dir`."""
    check(cfg)
    started = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    cells = record_cells(cfg)
    recorded_s = time.perf_counter() - started
    start = constants_from(cfg)
    c = fit(cells, cfg, start) if cfg["fit"] else start
    rows = predict_rows(cells, cfg, c)
    errors = {
        "all_tok_s": mean_abs_log_ratio(r[f"{col}_ratio"] for r in rows for col in COLUMNS),
        **{col: mean_abs_log_ratio(r[f"{col}_ratio"] for r in rows) for col in COLUMNS},
        "ladder_speedup": mean_abs_log_ratio(r["ladder_speedup_predicted"] / r["ladder_speedup_published"] for r in rows),
        "p2p_off_speedup": mean_abs_log_ratio(r["p2p_off_speedup_ratio"] for r in rows),
    }
    worst = max(abs(r[f"{col}_ratio"] - 1) for r in rows for col in COLUMNS)
    link = fitted_link(cfg, c)
    result = {
        "command": command,
        "source": PUBLISHED_70B_SOURCE,
        "shape": cfg["bench_shape"],
        "columns": cfg["columns"],
        "device": asdict(device_model(cfg, c)),
        "constants": c,
        "fitted": bool(cfg["fit"]),
        "start": start,
        "links": {"nvlink": asdict(link), "p2p_off": asdict(get_link(cfg["links"]["p2p_off"]))},
        "all_reduce_us_tp8": 1e6 * (link.base_s + 14 * link.alpha_s),
        "config": cfg,
        "mean_abs_log_ratio": errors,
        "worst_tok_s_error": worst,
        "worst_ladder_speedup_error": max(abs(r["ladder_speedup_error"]) for r in rows),
        "recorded_s": recorded_s,
        "elapsed_s": time.perf_counter() - started,
        "rows": rows,
    }
    report.write_json(out_dir / "costmodel.json", result)
    image = plot_predicted_vs_published(out_dir / "costmodel_ratio.png", rows)
    (out_dir / "README.md").write_text(_markdown(result, image))
    return result


def plot_predicted_vs_published(path: Path, rows: list[dict]) -> Path:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for col, marker in zip(COLUMNS, "osD^", strict=True):
        xs = [r[f"{col}_published"] for r in rows]
        ys = [r[f"{col}_predicted"] for r in rows]
        ax.scatter(xs, ys, marker=marker, label=col)
    lo = min(min(r[f"{c}_published"], r[f"{c}_predicted"]) for r in rows for c in COLUMNS) * 0.8
    hi = max(max(r[f"{c}_published"], r[f"{c}_predicted"]) for r in rows for c in COLUMNS) * 1.25
    ax.plot([lo, hi], [lo, hi], color="grey", lw=1)
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="grey", alpha=0.15, label="±15%")
    ax.set(xscale="log", yscale="log", xlabel="published tokens/s", ylabel="predicted tokens/s",
           title="Ladder 70B table: simulator vs paper")  # fmt: skip
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
CONSTANT_NOTES = {
    "eff_hbm": "fraction of HBM bandwidth a memory-bound kernel reaches",
    "kernel_overhead_us": "per kernel (launch gap and tail under CUDA graphs)",
    "link_base_us": "NVLink: fixed latency of one collective",
    "link_alpha_us": "NVLink: latency per ring hop (an all-reduce at TP P has 2 (P-1) hops)",
    "contention": "fraction of the overlapped communication time still paid",
}


def _markdown(result: dict, image: Path) -> str:
    d, c, errors, rows = result["device"], result["constants"], result["mean_abs_log_ratio"], result["rows"]
    nv = result["links"]["nvlink"]

    def pct(x):
        return f"{math.exp(x) - 1:.1%}"

    how = "fitted once to the whole table (`fit: true`)" if result["fitted"] else "as given in the config (`fit: false`)"
    constants = [{"constant": k, "value": v, "start": result["start"][k], "what": CONSTANT_NOTES[k]} for k, v in c.items()]
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
        + (", K and V repeated to every query head before attention (`gqa_expand`: the reference's "
           "repeat_interleave; the zoo's own attention reads each KV head once)" if result["config"].get("gqa_expand") else "")
        + "; tokens/s = batch x new tokens / (prefill + (new tokens - 1) decode steps).",
        "",
        f"Device `{d['device']['name']}` ({d['device']['note']}); FLOP/s efficiency {d['eff_flops']:.0%} (set a "
        f"priori). Constants ({how}; {len(c)} in all):",
        "",
        report.write_markdown_table(constants, ["constant", "value", "start", "what"]),
        "",
        f"Fitted NVLink link: base {nv['base_s'] * 1e6:.2f} us + {nv['alpha_s'] * 1e6:.2f} us per hop, "
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
