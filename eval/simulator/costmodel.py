"""Validation of the speed simulator against the Ladder paper's 70B table: `python -m eval.costmodel`.

The simulator (`eval.simulator.replay`) runs each architecture's own `forward()` at the table's shape on the meta
device, sharded on a fake process group, every aten op charged to a device model (`eval.simulator.device`) and
every collective to a link model (`parallel.link`). Nothing here knows an architecture: each column of the
published table names a zoo architecture (`columns` in conf/costmodel.yaml: standard = llama, ladder,
parallel), the upper bound is the standard column's run replayed with free communication, and the schedule
(which collective is waited where) is whatever the architecture's `forward()` does.

The record it is checked against is the reference benchmark's own (eval/simulator/ladder_reference.json, read from
the logs of mayank31398/ladder-residual-inference, final-results-512/): every cell's tokens/s (the paper's table)
and its prefill latency. The prefill is run as the reference's is: logits at every prompt position
(`prefill_logits: 0`), attending over the static cache's buffer under a mask.

Each (column, batch, TP) cell is recorded once (about 2 s each at 70B on 2 CPU cores), then replayed under
candidate constants, so fitting is cheap. The constants named in `fitted_constants` (at most six) are fitted once
for the whole record (`fit: true`; or used as given), the others held at the config's values: the FLOP/s and HBM
efficiencies, the per-kernel overhead, the NVLink link's base and per-hop latencies (held at the nvlink-h100
preset's in the committed config), and the contention (the fraction of overlapped communication time still paid)
in the latency-bound regime (decode's 16-256 KB all-reduces) and in the bandwidth-bound one (prefill's 17-270 MB
ones), a collective's link time split between the two by the link model's own terms. The fit minimises a soft maximum (the power mean of order 4) of every
cell's error over its target (`targets`), so that no cell is traded for the mean. The P2P-off column uses its own
link preset (not fitted) with the same device constants.

Reported: every fitted value, every cell's predicted / published ratio (tokens/s and prefill), the ladder
speed-ups, the all-reduce latency the table implies beside the fitted link's, and a plot of predicted vs published.
"""

import json
import math
import time
from dataclasses import asdict, replace
from pathlib import Path

import models
from eval import report
from eval.simulator.costmodel_report import COLUMNS, markdown, plot_predicted_vs_published, prefill_ratios
from eval.simulator.device import DeviceModel, get_device
from eval.simulator.replay import NO_COMM, build_meta, record_generation, release
from parallel.link import get_link

# The reference's record of the Ladder paper's 70B table (H100 NVLink, fp16, prompt 1024, 512 generated tokens):
# tokens/s and prefill latency per cell, read from its logs (eval/simulator/ladder_reference.json: repository,
# commit, paths, the rule for warm-up runs). "p2p_off_speedup" is ladder's speed-up over standard with
# NCCL_P2P_DISABLE=1 (the paper's table; not in these logs).
REFERENCE = json.loads((Path(__file__).with_name("ladder_reference.json")).read_text())
PUBLISHED_70B_SOURCE = (
    "Zhang, Mishra et al., Ladder-residual (2025), 70B speed table; tokens/s and prefill "
    f"latencies from the reference's logs: {REFERENCE['source'].split(' ')[0]} at commit {REFERENCE['commit']}, "
    f"{REFERENCE['folder']}<folder>/bs_<B>_tp_<P>.log (eval/simulator/ladder_reference.json)"
)
P2P_OFF_SPEEDUP = {(1, 8): 1.599, (4, 8): 1.566, (16, 8): 1.351, (1, 4): 1.248}


def _published(cell: dict) -> dict:
    row = {"batch": cell["batch"], "tp": cell["tp"]}
    for col in COLUMNS:
        row[col] = cell[col]["tok_s"]
        row[f"{col}_prefill_ms"] = cell[col].get("prefill_ms")
    row["ladder_speedup"] = round(row["ladder"] / row["standard"], 3)
    row["p2p_off_speedup"] = P2P_OFF_SPEEDUP[(cell["batch"], cell["tp"])]
    return row


PUBLISHED_70B: list[dict] = [_published(cell) for cell in REFERENCE["cells"]]

# The constants a fit may move, with the bounds of its search (the device model's and the link's fields).
FITTED = {
    "eff_flops": (0.2, 1.0),
    "eff_hbm": (0.3, 1.0),
    "kernel_overhead_us": (0.0, 10.0),
    "link_base_us": (0.0, 30.0),
    "link_alpha_us": (0.0, 5.0),
    "contention": (0.0, 1.0),
    "contention_bw": (0.0, 1.0),
    "collective_launch_us": (0.0, 100.0),
}
MAX_FITTED = 6


def constants_from(cfg: dict) -> dict:
    c = {k: float(v) for k, v in cfg["constants"].items()}
    missing = sorted(set(FITTED) - set(c))
    if missing:
        raise ValueError(f"conf/costmodel.yaml constants lack {missing}; it needs {sorted(FITTED)}.")
    for name, value in c.items():
        if name in FITTED and not FITTED[name][0] <= value <= FITTED[name][1]:
            raise ValueError(f"constants.{name}={value} is outside {FITTED[name]}.")
    return c


def fitted_names(cfg: dict) -> list[str]:
    names = list(cfg.get("fitted_constants") or FITTED)
    unknown = sorted(set(names) - set(FITTED))
    if unknown:
        raise ValueError(f"fitted_constants names {unknown}; choose among {sorted(FITTED)}.")
    if len(names) > MAX_FITTED:
        raise ValueError(f"fitted_constants names {len(names)} constants; at most {MAX_FITTED} are fitted.")
    return names


def device_model(cfg: dict, c: dict) -> DeviceModel:
    return DeviceModel.from_config(
        cfg["device"], eff_flops=c["eff_flops"], eff_hbm=c["eff_hbm"], kernel_overhead_us=c["kernel_overhead_us"],
        contention=c["contention"], contention_bw=c["contention_bw"], wave_quantisation=cfg["wave_quantisation"],
        collective_launch_us=c["collective_launch_us"], matmul_table=cfg["matmul_table"],
    )


def fitted_link(cfg: dict, c: dict):
    """The NVLink preset with the fitted base and per-hop latencies (its bandwidth as the preset has it)."""
    return replace(get_link(cfg["links"]["nvlink"]), base_s=c["link_base_us"] * 1e-6, alpha_s=c["link_alpha_us"] * 1e-6)


def check(cfg: dict) -> None:
    get_device(cfg["device"])
    constants_from(cfg)
    fitted_names(cfg)
    for key, name in cfg["links"].items():
        try:
            get_link(name)
        except ValueError as err:
            raise ValueError(f"links.{key}: {err}") from None
    for column in ("standard", "ladder", "parallel"):
        arch = cfg["columns"].get(column)
        if arch not in models.ZOO and arch not in models.variants():
            raise ValueError(
                f"columns.{column}={arch!r} is not a zoo architecture; choose one of {sorted(models.ZOO)} or a "
                f"ladder variant ({', '.join(models.variants())})."
            )


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
                            static_cache=cfg["static_cache"], attention_program=cfg["attention_program"],
                            prefill_logits=cfg.get("prefill_logits", 1),
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
        for col in COLUMNS:
            row[f"{col}_prefill_published"] = pub[f"{col}_prefill_ms"]
            row[f"{col}_prefill_predicted"] = 1e3 * pred[col]["prefill"]["time"]
            row[f"{col}_prefill_ratio"] = (
                None if pub[f"{col}_prefill_ms"] is None else row[f"{col}_prefill_predicted"] / pub[f"{col}_prefill_ms"]
            )
        row["ladder_prefill_speedup_predicted"] = pred["standard"]["prefill"]["time"] / pred["ladder"]["prefill"]["time"]
        if pub["ladder_prefill_ms"] is None:
            row["ladder_prefill_speedup_published"] = row["ladder_prefill_speedup_error"] = None
        else:
            row["ladder_prefill_speedup_published"] = pub["standard_prefill_ms"] / pub["ladder_prefill_ms"]
            row["ladder_prefill_speedup_error"] = row["ladder_prefill_speedup_predicted"] - row["ladder_prefill_speedup_published"]
        row["prefill_bandwidth_share"] = pred["standard"]["prefill"]["bandwidth_share"]
        # The prefill's cost of one all-reduce (llama waits each: (T_standard - T_upper) / all-reduces) and the
        # fraction of it the ladder column still pays ((T_ladder - T_upper) / (T_standard - T_upper)), logged and predicted.
        ars = sum(1 for name, _, _ in cells[("standard", *key)].phases["prefill"].recorder.calls if name == "issue")
        for kind, values in (("published", {c: pub[f"{c}_prefill_ms"] for c in COLUMNS}),
                             ("predicted", {c: row[f"{c}_prefill_predicted"] for c in COLUMNS})):  # fmt: skip
            comm = values["standard"] - values["upper_bound"]
            row[f"prefill_ar_us_{kind}"] = 1e3 * comm / ars
            row[f"ladder_prefill_paid_{kind}"] = None if values["ladder"] is None else (values["ladder"] - values["upper_bound"]) / comm
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


# Sensitivity run: the bandwidth-bound contention swept, every other constant as fitted.
SENSITIVITY_BW = (0.5, 0.6, 0.8, 0.95)


def _sensitivity_row(rows: list[dict], value: float) -> dict:
    out = {"contention_bw": value, "worst_prefill_error": max(abs(x - 1) for x in prefill_ratios(rows))}
    for r in rows:
        if r["ladder_prefill_speedup_error"] is not None:
            out[f"ladder_prefill_speedup_error_{r['setting']}"] = r["ladder_prefill_speedup_error"]
    return out


def mean_abs_log_ratio(ratios) -> float:
    ratios = list(ratios)
    return sum(abs(math.log(r)) for r in ratios) / len(ratios)


TARGETS = {"decode": 0.10, "prefill": 0.15, "speedup": 0.05}  # conf/costmodel.yaml `targets` overrides


def cell_errors(rows: list[dict], targets: dict | None = None) -> list[float]:
    """Every cell's error over its target: |log ratio| / target for tokens/s (decode) and prefill, |predicted -
    published| / target for the ladder speed-ups (tokens/s and prefill); cells without a logged value skipped."""
    t = {**TARGETS, **(targets or {})}
    out = [abs(math.log(r[f"{col}_ratio"])) / t["decode"] for r in rows for col in COLUMNS]
    out += [abs(math.log(r[f"{col}_prefill_ratio"])) / t["prefill"] for r in rows for col in COLUMNS
            if r[f"{col}_prefill_ratio"] is not None]  # fmt: skip
    out += [abs(r["ladder_speedup_error"]) / t["speedup"] for r in rows]
    out += [abs(r["ladder_prefill_speedup_error"]) / t["speedup"] for r in rows if r["ladder_prefill_speedup_error"] is not None]
    return out


def loss(rows: list[dict], targets: dict | None = None, order: int = 4) -> float:
    """What the fit minimises: the power mean of order 4 of `cell_errors` (a soft maximum: 1 = every cell at
    its target), so that the worst cells lead rather than the mean."""
    errors = cell_errors(rows, targets)
    return (sum(e**order for e in errors) / len(errors)) ** (1 / order)


def fit(cells: dict, cfg: dict, start: dict, rounds: int = 6, points: int = 21) -> dict:
    """Coordinate descent over the constants named in `fitted_constants`: each round scans every one over a
    grid around its current value (the grid narrows each round), keeping the best; deterministic."""
    targets = cfg.get("targets")
    names = fitted_names(cfg)
    c, best = dict(start), loss(predict_rows(cells, cfg, start), targets)
    width = {k: FITTED[k][1] - FITTED[k][0] for k in names}
    for _ in range(rounds):
        for name in names:
            lo, hi = FITTED[name]
            centre = c[name]
            for i in range(points):
                value = min(hi, max(lo, centre + width[name] * (i / (points - 1) - 0.5)))
                trial = {**c, name: value}
                err = loss(predict_rows(cells, cfg, trial), targets)
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
    sensitivity = [_sensitivity_row(predict_rows(cells, cfg, {**c, "contention_bw": v}), v) for v in SENSITIVITY_BW]
    errors = {
        "all_tok_s": mean_abs_log_ratio(r[f"{col}_ratio"] for r in rows for col in COLUMNS),
        **{col: mean_abs_log_ratio(r[f"{col}_ratio"] for r in rows) for col in COLUMNS},
        "ladder_speedup": mean_abs_log_ratio(r["ladder_speedup_predicted"] / r["ladder_speedup_published"] for r in rows),
        "p2p_off_speedup": mean_abs_log_ratio(r["p2p_off_speedup_ratio"] for r in rows),
        "all_prefill": mean_abs_log_ratio(prefill_ratios(rows)),
        "ladder_prefill_speedup": mean_abs_log_ratio(
            r["ladder_prefill_speedup_predicted"] / r["ladder_prefill_speedup_published"] for r in rows
            if r["ladder_prefill_speedup_published"] is not None
        ),
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
        "worst_prefill_error": max(abs(x - 1) for x in prefill_ratios(rows)),
        "worst_ladder_prefill_speedup_error": max(
            abs(r["ladder_prefill_speedup_error"]) for r in rows if r["ladder_prefill_speedup_error"] is not None
        ),
        "fitted_constants": fitted_names(cfg),
        "targets": {**TARGETS, **(cfg.get("targets") or {})},
        "loss": loss(rows, cfg.get("targets")),
        "sensitivity_contention_bw": sensitivity,
        "recorded_s": recorded_s,
        "elapsed_s": time.perf_counter() - started,
        "rows": rows,
    }
    report.write_json(out_dir / "costmodel.json", result)
    image = plot_predicted_vs_published(out_dir / "costmodel_ratio.png", rows)
    (out_dir / "README.md").write_text(markdown(result, image))
    return result
