"""How the decode-path section is shown: its tables and plot."""

from pathlib import Path

from eval import report

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
    return report.plot_panels(out_dir / "decode_paths.png", panels, xlabel="batch", ylabel="decode tokens/s", logy=True,
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


