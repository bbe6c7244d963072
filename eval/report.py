"""Report helpers shared by the speed and quality evaluations: Markdown tables, line/bar plots, W&B.

Everything an evaluation reports is written as files under its run directory (JSON, Markdown, PNG)
and, optionally, logged to Weights & Biases. The helpers know nothing about what is measured: rows
are plain dicts, columns are keys, plots take {label: (xs, ys)} series. One formula is shared too, so that
the bench's rows and the simulator's validation mean the same by it: `hidden_fraction`.

Two rules hold for every file written here:

- JSON is valid JSON: NaN and infinities become null (`json_safe`; Python's json would write bare `NaN`,
  which other readers refuse), and a path inside the repository is written relative to its root
  (`repo_relative`), so that a committed report holds no path of the machine it ran on;
- a series has one look in every figure of a report: its colour (and marker) come from the architecture or
  method its label names (`series_style`, a fixed table: `STYLES`), not from the order it was plotted in;
  several series of one architecture in one panel differ by line style.
"""

import glob
import json
import math
import os
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

Column = str | tuple[str, str]  # a key, or (key, header)
REPO_ROOT = Path(__file__).resolve().parents[1]


def hidden_fraction(t_base: float, t_arch: float, t_upper: float, min_comm_fraction: float = 0.01) -> float | None:
    """(T_base - T_arch) / (T_base - T_upper): the share of the baseline's communication overhead that
    the architecture removes (T_upper: the same run with free communication). None when the baseline has (almost)
    no overhead to hide: a denominator below `min_comm_fraction` of T_base is noise, not communication."""
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


def json_safe(obj):
    """`obj` with every NaN / infinite float replaced by None (null), through dicts, lists and tuples."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {key: json_safe(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(value) for value in obj]
    return obj


def repo_relative(obj, root: Path = REPO_ROOT):
    """`obj` with every string that names a path inside `root` (alone or within a value such as
    `a.b=/root/x`) rewritten relative to it, through dicts, lists and tuples."""
    prefix = str(root) + os.sep
    if isinstance(obj, Path):
        obj = str(obj)
    if isinstance(obj, str):
        return obj.replace(prefix, "")
    if isinstance(obj, dict):
        return {key: repo_relative(value, root) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [repo_relative(value, root) for value in obj]
    return obj


def write_json(path: str | Path, obj) -> Path:
    """`obj` as indented, valid JSON (NaN / inf as null; other non-JSON values as their str; paths inside the
    repository relative to its root)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(repo_relative(json_safe(obj)), indent=2, sort_keys=False, default=_json_default, allow_nan=False)
    path.write_text(text + "\n")
    return path


def _json_default(value):
    # numpy scalars and 0-d tensors carry numbers: keep them numbers (and NaN as null); the rest as str
    if hasattr(value, "item") and callable(value.item):
        try:
            return json_safe(value.item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


# ------------------------------------------------------------------------------------------ styles

# One colour and marker per architecture (models.ZOO's names) and per sequence-parallel method, in every
# figure. LASP-1 and LASP-2 often move the same bytes: different markers and line styles keep the one
# drawn second from hiding the other. A ladder variant (`gqla_ladder`, models.variants()) is drawn in its
# standard sibling's colour and marker, hollow and dashed (`VARIANT_STYLE`): `table_style`.
STYLES: dict[str, dict] = {
    "llama": {"color": "#1f77b4", "marker": "o"},
    "parallel": {"color": "#ff7f0e", "marker": "s"},
    "ladder": {"color": "#2ca02c", "marker": "^"},
    "kraken": {"color": "#d62728", "marker": "v"},
    "moe": {"color": "#9467bd", "marker": "D"},
    "scmoe": {"color": "#8c564b", "marker": "P"},
    "moepp": {"color": "#e377c2", "marker": "X"},
    "linear": {"color": "#7f7f7f", "marker": "<"},
    "linear_hybrid": {"color": "#bcbd22", "marker": ">"},
    "gqla": {"color": "#17becf", "marker": "h"},
    "LASP-2": {"color": "#d62728", "marker": "x", "linestyle": "--", "markersize": 8},
    "LASP-1": {"color": "#1f77b4", "marker": "o", "markerfacecolor": "none", "markersize": 7},
    "LASP-2H": {"color": "#ff7f0e", "marker": "+", "linestyle": "-.", "markersize": 9},
    "ring attention": {"color": "#2ca02c", "marker": "s", "markerfacecolor": "none"},
}
# Where a label names nothing in STYLES: a colour of this palette chosen by the label's own text (not its
# position), so that it is the same in every figure too.
FALLBACK_COLOURS = ("#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354")
LINE_STYLES = ("-", "--", ":", "-.")
# What a ladder variant's series changes in its sibling's style.
VARIANT_STYLE = {"linestyle": "--", "markerfacecolor": "none"}


def standard_sibling(name: str) -> str | None:
    """models.registry.standard_sibling (imported here, not at the top: the other helpers need no model code)."""
    from models.registry import standard_sibling as sibling

    return sibling(name)


def table_style(key: str) -> dict | None:
    """The fixed style of series key `key`: its STYLES entry, or for a ladder variant its sibling's entry drawn
    hollow and dashed; None for a key the table does not know."""
    if key in STYLES:
        return dict(STYLES[key])
    sibling = standard_sibling(key)
    return {**STYLES[sibling], **VARIANT_STYLE} if sibling in STYLES else None


def series_key(label: str) -> str:
    """The name in STYLES that `label` starts with (longest first: "linear_hybrid tp2" is linear_hybrid,
    "LASP-2H (last)" is LASP-2H), else the label's first word."""
    for key in sorted(STYLES, key=len, reverse=True):
        if label == key or (label.startswith(key) and not (label[len(key)].isalnum() or label[len(key)] in "_-")):
            return key
    return label.split(" ")[0]


def series_style(label: str) -> dict:
    """matplotlib keyword arguments (color, marker, ...) of the series `label`: the same in every figure."""
    key = series_key(label)
    style = table_style(key)
    if style is not None:
        return style
    return {"color": FALLBACK_COLOURS[zlib.crc32(key.encode()) % len(FALLBACK_COLOURS)], "marker": "o"}


def _styled(labels: Sequence[str]) -> dict[str, dict]:
    """The style of each label of one panel: `series_style`, except that the 2nd, 3rd, ... series of one key
    get other line styles, and two keys outside STYLES never share a fallback colour in one panel."""
    seen: dict[str, int] = {}
    fallback: dict[str, str] = {}  # key -> its colour in this panel
    styles = {}
    for label in labels:
        style = series_style(label)
        key = series_key(label)
        if table_style(key) is None:
            if key not in fallback:
                taken = set(fallback.values())
                start = FALLBACK_COLOURS.index(style["color"])
                free = [FALLBACK_COLOURS[(start + i) % len(FALLBACK_COLOURS)] for i in range(len(FALLBACK_COLOURS))]
                fallback[key] = next((c for c in free if c not in taken), style["color"])
            style["color"] = fallback[key]
        if seen.get(key, 0):
            first = LINE_STYLES.index(style.get("linestyle", "-"))
            style["linestyle"] = LINE_STYLES[(first + seen[key]) % len(LINE_STYLES)]
        seen[key] = seen.get(key, 0) + 1
        styles[label] = style
    return styles


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
    ylim: tuple[float, float] | None = None,
) -> Path:
    """One subplot per panel, one line per series ({label: (xs, ys)}); None values are skipped.

    `ylim`: the y range shown. A value outside it is drawn on the edge as an open triangle, and the panel
    says how many such values there are and their range: one far outlier (a hidden fraction of -15 beside
    values in 0..1) then no longer flattens every other line."""
    plt = pyplot()
    path = Path(path)
    n = max(1, len(panels))
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.6), squeeze=False, sharey=True)
    for ax, (panel_title, series) in zip(axes[0], panels.items(), strict=False):
        styles = _styled(list(series))
        outside = []
        for label, (xs, ys) in series.items():
            points = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None and not _nan(y)]
            if not points:
                continue
            style = styles[label]
            if ylim is not None:
                outside += [y for _, y in points if not ylim[0] <= y <= ylim[1]]
                edge = [(x, min(max(y, ylim[0]), ylim[1])) for x, y in points if not ylim[0] <= y <= ylim[1]]
                points = [(x, min(max(y, ylim[0]), ylim[1])) for x, y in points]
                if edge:
                    ax.plot(*zip(*edge, strict=True), linestyle="none", color=style["color"], markersize=9,
                            marker="v" if edge[0][1] <= ylim[0] else "^", markerfacecolor="none")  # fmt: skip
            ax.plot(*zip(*points, strict=True), label=label, **style)
        if hline is not None:
            ax.axhline(hline, color="grey", linewidth=0.8, linestyle="--")
        if logx:
            ax.set_xscale("log", base=2)
        if ylim is not None:
            pad = 0.04 * (ylim[1] - ylim[0])
            ax.set_ylim(ylim[0] - pad, ylim[1] + pad)
            if outside:
                panel_title += (
                    f"\n{len(outside)} value(s) outside {ylim[0]:g}..{ylim[1]:g} "
                    f"({min(outside):.3g}..{max(outside):.3g}) drawn on the edge"
                )
        ax.set_title(panel_title, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel(ylabel)
    return _save(fig, Path(path), title)


def _nan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


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
    colours = {label: style["color"] for label, style in _styled(list(bars)).items()}
    for i, (label, values) in enumerate(bars.items()):
        xs = [g + (i - (len(bars) - 1) / 2) * width for g in range(len(groups))]
        points = [(x, v) for x, v in zip(xs, values, strict=True) if v is not None]
        if points:
            ax.bar(*zip(*points, strict=True), width=width, label=label, color=colours[label])
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
    """Panels of lines on log2 x (and log y if asked); a series whose label ends in '(formula)' is dotted, in
    the colour of the series it is the formula of."""
    plt = pyplot()
    nrows = max(1, -(-len(panels) // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (panel_title, series) in zip(axes.flat, panels, strict=False):
        styles = _styled([name for name in series if not name.endswith("(formula)")])
        for name, (xs, ys) in series.items():
            points = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None and (y > 0 or not logy)]
            if not points:
                continue
            if name.endswith("(formula)"):
                colour = series_style(name.removesuffix("(formula)").strip())["color"]
                ax.plot(*zip(*points, strict=True), linestyle=":", color=colour, linewidth=1.2, label=name)
            else:
                ax.plot(*zip(*points, strict=True), label=name, **styles[name])
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


def refuse_wandb_logger(cfg, app: str) -> None:
    """For the apps that write files only (eval.at_scale, eval.costmodel, eval.validation): they take the
    `logger` group as every entry point does, so `logger=none` works, but `logger=wandb` would be ignored."""
    logger = cfg.get("logger") or {}
    if "wandb" in logger:
        raise ValueError(
            f"logger=wandb, but python -m {app} writes files only (its README.md and JSON in the run "
            "directory) and logs nothing to W&B; drop the option or pass logger=none."
        )


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
