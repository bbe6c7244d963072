"""The speed simulator's validation in one report: `python -m eval.validation [out_dir=reports/simulator-validation]`.

Two parts, kept apart because only the first was fitted:

- **In sample: the Ladder paper's 70B record** (eval.costmodel at the committed constants, `fit=false`): every
  tokens/s cell of the published table, every prefill latency the reference's logs give, the ladder speed-ups. The
  device model's constants were fitted to exactly these cells, so agreement here shows the model CAN describe them.
- **Held out: the other papers' headlines** (eval.simulator.heldout: Kraken, ScMoE, MoE++, LASP-2), each predicted at
  the paper's own setting (model shapes, hardware presets from spec sheets, baselines, batch and sequence lengths,
  what is timed) with the same constants, nothing fitted on them. Target: each headline speed-up within 15% of the
  published ratio; a row that misses names the effect the model lacks, with its sensitivity run.

Written under `out_dir`: README.md (every headline and every cell beside its published number), validation.json,
validation.png (predicted / published of every cell and headline, one panel) and the Ladder run's own report
(ladder/). The same numbers come out on any machine (the meta device; nothing is timed).
"""

import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from eval import report
from eval.simulator import costmodel as cm
from eval.simulator import heldout

LADDER_TARGETS = cm.TARGETS  # decode 10%, prefill 15%, speed-ups 0.05


def ladder_cells(result: dict) -> list[dict]:
    """Every cell of the Ladder record as {label, kind, published, predicted, ratio, target}."""
    cells = []
    for r in result["rows"]:
        at = f"batch {r['batch']}, TP {r['tp']}"
        for col in cm.COLUMNS:
            cells.append({"label": f"{col} tokens/s, {at}", "kind": "tokens/s", "published": r[f"{col}_published"],
                          "predicted": r[f"{col}_predicted"], "target": f"within {LADDER_TARGETS['decode']:.0%}"})  # fmt: skip
            if r[f"{col}_prefill_published"] is not None:
                cells.append({"label": f"{col} prefill ms, {at}", "kind": "prefill ms",
                              "published": r[f"{col}_prefill_published"], "predicted": r[f"{col}_prefill_predicted"],
                              "target": f"within {LADDER_TARGETS['prefill']:.0%}"})  # fmt: skip
        cells.append({"label": f"ladder speed-up (tokens/s), {at}", "kind": "speed-up",
                      "published": r["ladder_speedup_published"], "predicted": r["ladder_speedup_predicted"],
                      "target": f"within {LADDER_TARGETS['speedup']} (absolute)"})  # fmt: skip
        if r["ladder_prefill_speedup_published"] is not None:
            cells.append({"label": f"ladder prefill speed-up, {at}", "kind": "speed-up",
                          "published": r["ladder_prefill_speedup_published"],
                          "predicted": r["ladder_prefill_speedup_predicted"],
                          "target": f"within {LADDER_TARGETS['speedup']} (absolute)"})  # fmt: skip
    for c in cells:
        c["ratio"] = c["predicted"] / c["published"]
    return cells


def finish_row(row: dict) -> dict:
    """A held-out row with its ratio (predicted / published) and whether it is within the target, per cell too."""
    missing = [k for k in heldout.ROW_KEYS if k not in row and k not in heldout.OPTIONAL_KEYS]
    if missing:
        raise ValueError(f"A held-out row lacks {missing} (eval/simulator/heldout/__init__.py names the keys).")
    row = dict(row)
    # A quick run (tiny shapes) may leave `published` None: its numbers are not at the paper's setting.
    row["ratio"] = row["predicted"] / row["published"] if row["published"] else None
    row["within"] = None if row["ratio"] is None else abs(row["ratio"] - 1) <= heldout.TARGET
    for c in row["cells"]:
        c["ratio"] = c["predicted"] / c["published"] if c.get("published") else None
    row.setdefault("sensitivity", [])
    row.setdefault("lacks", "")
    row.setdefault("notes", [])
    row.setdefault("comparable", True)  # False: the paper's setting could not be read; the row's is assumed
    return row


def run_validation(cfg: dict, out_dir: Path, command: str = "") -> dict:
    started = time.perf_counter()
    papers = [heldout.module(paper) for paper in cfg["papers"]]  # an unknown paper fails here, before any work
    out_dir.mkdir(parents=True, exist_ok=True)
    ladder = cm.run_costmodel(cfg["ladder"], out_dir / "ladder", command=f"{command} (its Ladder part)")
    rows = []
    for paper, mod in zip(cfg["papers"], papers, strict=True):
        print(f"[validation] {paper} ...", flush=True)
        t0 = time.perf_counter()
        row = finish_row(mod.validate(quick=bool(cfg["quick"])))
        row["key"], row["elapsed_s"] = paper, time.perf_counter() - t0
        rows.append(row)
    result = {
        "command": command,
        "quick": bool(cfg["quick"]),
        "constants": ladder["constants"],
        "target": heldout.TARGET,
        "ladder": {
            "cells": ladder_cells(ladder),
            "worst_tok_s_error": ladder["worst_tok_s_error"],
            "worst_prefill_error": ladder["worst_prefill_error"],
            "worst_ladder_speedup_error": ladder["worst_ladder_speedup_error"],
            "worst_ladder_prefill_speedup_error": ladder["worst_ladder_prefill_speedup_error"],
        },
        "heldout": rows,
        "elapsed_s": time.perf_counter() - started,
    }
    report.write_json(out_dir / "validation.json", result)
    image = plot_ratios(out_dir / "validation.png", result)
    (out_dir / "README.md").write_text(markdown(result, image), encoding="utf-8")
    return result


def plot_ratios(path: Path, result: dict) -> Path:
    """predicted / published of every cell (small markers) and headline (large stars), one column per paper, cells
    that are not the paper's quantity hollow; the grey bands are the targets (Ladder: 10% tokens/s, 15% prefill;
    held out: 15%)."""
    plt = report.pyplot()
    groups = [("Ladder 70B\n(fitted)", [(c["ratio"], False) for c in result["ladder"]["cells"]])]
    for row in result["heldout"]:
        # A cell its module marks `comparable: False` (not the paper's quantity) is drawn apart: hollow.
        points = [(c["ratio"], None if c.get("comparable") is False else False) for c in row["cells"] if c.get("ratio")]
        groups.append((row["key"] + "\n(held out)", points + ([(row["ratio"], True)] if row["ratio"] else [])))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4.5))
    ax.axhspan(1 / 1.15, 1.15, color="grey", alpha=0.12, label="±15%")
    ax.axhspan(0.9, 1.1, color="grey", alpha=0.18, label="±10%")
    ax.axhline(1, color="grey", lw=1)
    for i, (_, points) in enumerate(groups):
        cells = [r for r, head in points if head is False]
        heads = [r for r, head in points if head is True]
        apart = [r for r, head in points if head is None]
        jitter = [i + 0.25 * ((k % 7) / 6 - 0.5) for k in range(len(cells))]
        ax.scatter(jitter, cells, s=14, color=f"C{i}", alpha=0.7)
        if apart:
            ax.scatter([i + 0.3] * len(apart), apart, s=40, facecolors="none", edgecolors=f"C{i}",
                       label="not comparable (see its row)" if not any(h is None for g in groups[:i] for _, h in g[1]) else None)  # fmt: skip
        if heads:
            ax.scatter([i] * len(heads), heads, s=140, marker="*", color=f"C{i}", edgecolor="black", zorder=3,
                       label="headline" if i == 1 else None)  # fmt: skip
    ax.set_xticks(range(len(groups)), [g for g, _ in groups])
    ax.set_yscale("log")
    ax.set_ylabel("predicted / published")
    ax.set_title("Speed simulator: every cell and headline against its published number")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _short(text: str, limit: int = 220) -> str:
    """The first sentence of a row's `lacks` (the whole text is in the paper's own section)."""
    first = text.split(". ")[0].rstrip(".")
    return first if len(first) <= limit else first[: limit - 3].rstrip() + "..."


def _fmt(x) -> str:
    return "n/a" if x is None else report.format_value(x)


def markdown(result: dict, image: Path) -> str:
    lad, rows = result["ladder"], result["heldout"]
    c = result["constants"]
    within = [r["key"] for r in rows if r["within"]]
    missed = [r["key"] for r in rows if r["within"] is False]
    lines = [
        "# Speed simulator validation",
        "",
        f"`{result['command'] or 'eval.validation.run_validation(...)'}`"
        + (" (**quick**: tiny shapes, the plumbing only; the numbers mean nothing)" if result["quick"] else ""),
        "",
        "Predicted, not measured: each architecture's own `forward()` on the meta device at the paper's shapes, "
        "sharded on a fake process group, every aten op charged to the device model (eval/simulator/device.py) and "
        "every collective to the link model (parallel/link.py). One set of device constants, fitted once to the "
        "Ladder paper's 70B record and to nothing else: "
        + ", ".join(f"{k} {v:g}" for k, v in c.items() if k not in ("link_base_us", "link_alpha_us"))
        + f" (conf/bench.yaml `device_model`; NVLink latencies {c['link_base_us']:g} us + {c['link_alpha_us']:g} us "
        "per hop). Hardware presets of the held-out rows come from spec sheets; nothing was tuned to a held-out row.",
        "",
        "## Headlines",
        "",
        f"Held out: the target is each headline speed-up within {result['target']:.0%} of the published ratio "
        f"(ratio = predicted / published). Within: {', '.join(within) or 'none'}; missed: {', '.join(missed) or 'none'}.",
        "",
        report.write_markdown_table(
            [{"paper": r["paper"] + ("" if r["comparable"] else " (**not at its setting**: assumed)"), "headline": r["headline"], "published": r["published"], "predicted": r["predicted"],
              "ratio": _fmt(r["ratio"]), "within": {True: "yes", False: "**no**", None: "n/a"}[r["within"]],
              "lacks": _short(r["lacks"]) + " (below)" if r["lacks"] else "-"} for r in rows],
            ["paper", "headline", "published", "predicted", "ratio", "within", "lacks"],
        ),  # fmt: skip
        "",
        f"In sample (fitted): the Ladder 70B record ([its report](ladder/README.md)): largest tokens/s error "
        f"{lad['worst_tok_s_error']:.1%} (target 10%), largest prefill error {lad['worst_prefill_error']:.1%} (target "
        f"15%), largest ladder speed-up error {lad['worst_ladder_speedup_error']:.3f} (tokens/s) and "
        f"{lad['worst_ladder_prefill_speedup_error']:.3f} (prefill) (target 0.05).",
        "",
        f"![predicted / published]({image.name})",
        "",
        "## What this validates and what it does not",
        "",
        "- The Ladder cells are in sample: they show the device and link model can describe one machine (8 x H100 "
        "NVLink, gpt-fast, compiled, CUDA graphs) at one model family, decode and prefill; they do not show it "
        "predicts anything else.",
        *[f"- {r['paper']}: " + ("no published number beside this run." if r["within"] is None else
          ("headline predicted within the target at its own setting." if r["comparable"] else
           "headline predicted within the target at settings assumed, not the paper's (its section).") + (f" What misses: {_short(r['lacks'])} (its section)." if r["lacks"] else "")
          if r["within"] else f"headline missed ({r['ratio']:.2f}x of the published ratio"
          + ("" if r["comparable"] else ", at settings assumed, not the paper's") + f"): {_short(r['lacks'])} (its section).") for r in rows],  # fmt: skip
        "",
    ]
    for r in rows:
        lines += [
            f"## {r['paper']}",
            "",
            f"**Headline**: {r['headline']}. **Source**: {r['source']}.",
            "",
            f"**Setting**: {r['setting']}",
            "",
            f"Published {_fmt(r['published'])}, predicted {_fmt(r['predicted'])}, ratio {_fmt(r['ratio'])} "
            f"({ {True: 'within', False: 'outside', None: 'no target at'}[r['within']]} {result['target']:.0%}; "
            f"{r['elapsed_s']:.0f} s to compute).",
            "",
            report.write_markdown_table(
                [{**cell, "published": _fmt(cell.get("published")), "ratio": _fmt(cell.get("ratio"))} for cell in r["cells"]],
                ["label", "published", "predicted", "ratio", *(["what"] if any("what" in x for x in r["cells"]) else [])],
            ),
            "",
        ]
        if r.get("regimes"):
            lines += ["By regime (cells within 15% of the logged value):", "",
                      report.write_markdown_table(r["regimes"], ["regime", "cells", "within 15%", "worst ratio"]), ""]  # fmt: skip
        if r["sensitivity"]:
            keys = list(dict.fromkeys(k for s in r["sensitivity"] for k in s))
            lines += ["Sensitivity (evidence, not a fit):", "", report.write_markdown_table(r["sensitivity"], keys), ""]
        if r["lacks"]:
            lines += [f"**What the model lacks**: {r['lacks']}", ""]
        lines += [f"- {n}" for n in r["notes"]] + ([""] if r["notes"] else [])
    lines += [
        "## In sample: the Ladder 70B record, every cell",
        "",
        report.write_markdown_table([{**x, "ratio": x["ratio"]} for x in lad["cells"]],
                                    ["label", "published", "predicted", "ratio", "target"]),
        "",
        f"{result['elapsed_s']:.0f} s in all.",
        "",
    ]
    return "\n".join(lines)


def _plain(cfg) -> dict:
    return {k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items() if k not in ("paths", "hydra")}


@hydra.main(config_path="../conf", config_name="validation", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig

    from train.cli import refuse_existing_output

    report.refuse_wandb_logger(cfg, "eval.validation")
    out_dir = Path(cfg.out_dir) if cfg.out_dir else Path(HydraConfig.get().runtime.output_dir)
    refuse_existing_output(out_dir, bool(cfg.get("overwrite")))  # one rule: a report is not replaced unasked
    ladder_overrides = list(cfg.ladder_overrides) + (list(cfg.quick_ladder_overrides) if cfg.quick else [])
    plain = {**_plain(cfg), "ladder": _plain(compose("costmodel", overrides=ladder_overrides))}
    command = " ".join(["python -m eval.validation", *HydraConfig.get().overrides.task])
    result = run_validation(plain, out_dir, command)
    for r in result["heldout"]:
        print(f"[validation] {r['key']}: published {_fmt(r['published'])}, predicted {_fmt(r['predicted'])}, "
              f"ratio {_fmt(r['ratio'])} (within {heldout.TARGET:.0%}: {r['within']})", flush=True)  # fmt: skip
    print(f"[validation] -> {out_dir}/README.md, validation.json, validation.png", flush=True)


if __name__ == "__main__":
    # a bad input: one line and exit status 1 (HYDRA_FULL_ERROR=1: the full traceback)
    from train.cli import one_sentence_errors

    one_sentence_errors(main)()
