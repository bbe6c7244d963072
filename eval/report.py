"""Report helpers shared by the speed and quality evaluations: Markdown tables, line/bar plots, W&B.

Everything an evaluation reports is written as files under its run directory (JSON, Markdown, PNG)
and, optionally, logged to Weights & Biases. The helpers know nothing about what is measured: rows
are plain dicts, columns are keys, plots take {label: (xs, ys)} series. One formula is shared too, so that
the bench's rows and the simulator's validation mean the same by it: `hidden_fraction`.
"""

import glob
import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

Column = str | tuple[str, str]  # a key, or (key, header)


def hidden_fraction(t_base: float, t_arch: float, t_upper: float, min_comm_fraction: float = 0.01) -> float | None:
    """(T_base - T_arch) / (T_base - T_upper): the share of the baseline's communication overhead that
    the architecture removes (DESIGN.md, "Measuring speed honestly"). None when the baseline has (almost) no
    overhead to hide: a denominator below `min_comm_fraction` of T_base is noise, not communication."""
    gap = t_base - t_upper
    if gap <= min_comm_fraction * t_base:
        return None
    return (t_base - t_arch) / gap


def pyplot():
    # Imported on first use: processes that only measure (e.g. spawned benchmark ranks) skip matplotlib.
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def format_value(value) -> str:
    """Numbers with 4 significant digits, None/NaN as n/a, everything else as str."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.3e}"
        return f"{value:.4g}"
    return str(value)


def write_markdown_table(
    rows: Iterable[dict], columns: Sequence[Column], fmt: Callable[[object], str] = format_value
) -> str:
    """A GitHub Markdown table of `rows` (dicts) restricted to `columns`; missing keys show n/a."""
    keys = [c if isinstance(c, str) else c[0] for c in columns]
    headers = [c if isinstance(c, str) else c[1] for c in columns]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        cells = [fmt(row.get(k)).replace("|", "\\|") for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_json(path: str | Path, obj) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    return path


Series = dict[str, tuple[Sequence[float], Sequence[float | None]]]


def plot_lines(
    path: str | Path,
    panels: dict[str, Series],
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    hline: float | None = None,
    logx: bool = False,
) -> Path:
    """One subplot per panel, one line per series ({label: (xs, ys)}); None values are skipped."""
    plt = pyplot()
    path = Path(path)
    n = max(1, len(panels))
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.6), squeeze=False, sharey=True)
    for ax, (panel_title, series) in zip(axes[0], panels.items(), strict=False):
        for label, (xs, ys) in series.items():
            points = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=label)
        if hline is not None:
            ax.axhline(hline, color="grey", linewidth=0.8, linestyle="--")
        if logx:
            ax.set_xscale("log", base=2)
        ax.set_title(panel_title, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel(ylabel)
    return _save(fig, Path(path), title)


def plot_bars(
    path: str | Path,
    groups: Sequence[str],
    bars: dict[str, Sequence[float | None]],
    *,
    ylabel: str,
    title: str = "",
    hline: float | None = None,
) -> Path:
    """Grouped bar chart: one group per entry of `groups`, one bar per key of `bars` (None = no bar)."""
    plt = pyplot()
    path = Path(path)
    fig, ax = plt.subplots(figsize=(min(12.0, max(4.5, 1.5 + 0.35 * len(groups) * max(1, len(bars)))), 3.6))
    width = 0.8 / max(1, len(bars))
    for i, (label, values) in enumerate(bars.items()):
        xs = [g + (i - (len(bars) - 1) / 2) * width for g in range(len(groups))]
        points = [(x, v) for x, v in zip(xs, values, strict=True) if v is not None]
        if points:
            ax.bar(*zip(*points, strict=True), width=width, label=label)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    if hline is not None:
        ax.axhline(hline, color="grey", linewidth=0.8, linestyle="--")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_panels(path: Path, panels: list[tuple[str, dict]], *, xlabel: str, ylabel: str, logy: bool, ncols: int,
                title: str = "") -> Path:  # fmt: skip
    """Panels of lines on log2 x (and log y if asked); a series whose label ends in '(formula)' is dotted."""
    plt = pyplot()
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
    return _save(fig, Path(path), title)


def _save(fig, path: Path, title: str = "") -> Path:
    """A figure (with a suptitle if given) to PNG at `path`, closed."""
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    pyplot().close(fig)
    return path


def log_to_wandb(
    run_dir: str | Path,
    *,
    project: str,
    name: str,
    config: dict,
    summary: dict | None = None,
    tables: dict[str, tuple[Sequence[str], Sequence[dict]]] | None = None,
    images: dict[str, str | Path] | None = None,
    tags: Sequence[str] = (),
) -> Path:
    """Log one finished evaluation as a W&B run under `run_dir`/wandb; returns the run's local directory.

    Offline unless WANDB_MODE says otherwise. `tables` maps a name to (columns, rows as dicts).
    """
    import wandb  # imported here: W&B start-up is only paid by runs that log to it

    run = wandb.init(
        mode=os.environ.get("WANDB_MODE", "offline"),
        dir=str(run_dir),
        project=project,
        name=name,
        config=config,
        tags=list(tags),
        reinit="finish_previous",
    )
    try:
        payload = {}
        for key, (columns, rows) in (tables or {}).items():
            payload[key] = wandb.Table(columns=list(columns), data=[[row.get(c) for c in columns] for row in rows])
        for key, image in (images or {}).items():
            payload[key] = wandb.Image(str(image))
        if payload:
            run.log(payload)
        for key, value in (summary or {}).items():
            run.summary[key] = value
        local_dir = Path(run.dir).parent
    finally:
        run.finish()
    return local_dir


def find_offline_runs(run_dir: str | Path) -> list[Path]:
    """The offline W&B runs written under `run_dir` (newest last)."""
    return sorted(Path(p) for p in glob.glob(os.path.join(str(run_dir), "wandb", "offline-run-*")))
