"""The TransGQLA rank sweep: a Llama converted to GQLA at several latent ranks from one calibration, validation
loss per rank on the bundled corpus (reports/gqla-conversion).

    python -m eval.gqla_rank_sweep SOURCE OUT_DIR --ranks 8 16 32 [--rope-dim 8] [--calibration-batches 8]

The conversion is models/gqla/convert.py's (`calibrate` once, `convert_model` per rank); the calibration
batches are train.convert's (`calibration_batches`), so the sweep sees what `train.convert` would convert.
Writes sweep.png and sweep.md (a table) into OUT_DIR.
"""

import argparse
from pathlib import Path

from eval import report
from models.gqla.convert import DEFAULT_CALIBRATION_BATCHES, calibrate, convert_model, load_source, summary
from train.cli import exit_if_output_exists
from train.convert import calibration_batches, source_data
from train.metrics import evaluate_loss


def rank_sweep(
    source: str | Path,
    ranks: list[int],
    out_dir: str | Path,
    qk_rope_head_dim: int | None = None,
    calibration_batches_n: int = DEFAULT_CALIBRATION_BATCHES,
    val_batches: int = 8,
) -> list[dict]:
    """Validation loss (bundled corpus) of the conversion at each of `ranks`, from one calibration; writes
    sweep.png and sweep.md (a table) into `out_dir`. Returns the rows."""
    source, out_dir = Path(source), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = load_source(source)
    covs = calibrate(model, calibration_batches(source, calibration_batches_n))
    data = source_data(source, "validate")
    base = evaluate_loss(model, data.val_dataloader(), val_batches)["loss"]
    rows = []
    for rank in ranks:
        converted = convert_model(model, covs, rank, qk_rope_head_dim)
        loss = evaluate_loss(converted, data.val_dataloader(), val_batches)["loss"]
        rows.append({"kv_lora_rank": rank, "val_loss": loss, **summary(converted)})
        print(f"[sweep] d_c={rank} val/loss {loss:.4f} (source {base:.4f})", flush=True)
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(
        [r["kv_lora_rank"] for r in rows], [r["val_loss"] for r in rows], "o-", label="GQLA, no retraining"
    )
    ax.axhline(base, color="gray", ls="--", label="source Llama")
    ax.set_xlabel("kv_lora_rank d_c")
    ax.set_ylabel("validation loss")
    ax.set_title(f"TransGQLA rank sweep (d_r={rows[0]['qk_rope_head_dim'] if rows else '?'})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "sweep.png", dpi=120)
    plt.close(fig)
    lines = ["| d_c | d_r | KV cache vs GQA (absorb) | val loss |", "|---|---|---|---|"]
    lines += [f"| source | | 100% | {base:.4f} |"]
    lines += [
        f"| {r['kv_lora_rank']} | {r['qk_rope_head_dim']} | {100 * r['kv_cache_fraction_absorb']:.2f}% | {r['val_loss']:.4f} |"
        for r in rows
    ]
    (out_dir / "sweep.md").write_text("\n".join(lines) + "\n")
    return rows


def sweep_arguments(description: str) -> argparse.ArgumentParser:
    """The GQLA sweeps' command line (this one and eval.gqla_regroup): SOURCE OUT_DIR, the calibration and validation
    batches, and --overwrite (an OUT_DIR that already holds results is refused without it)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("source")
    parser.add_argument("out_dir")
    parser.add_argument("--calibration-batches", type=int, default=DEFAULT_CALIBRATION_BATCHES)
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--overwrite", action="store_true", help="replace the results OUT_DIR already holds")
    return parser


def main(argv: list[str] | None = None) -> None:
    """`python -m eval.gqla_rank_sweep SOURCE OUT_DIR --ranks 8 16 32 [--rope-dim 8] [--overwrite]`: the rank
    sweep (an OUT_DIR that already holds results is refused without --overwrite)."""
    parser = sweep_arguments(main.__doc__)
    parser.add_argument("--ranks", type=int, nargs="+", required=True)
    parser.add_argument("--rope-dim", type=int, default=None)
    args = parser.parse_args(argv)
    exit_if_output_exists(args.out_dir, args.overwrite, flag="--overwrite", other="OUT_DIR")
    rank_sweep(args.source, args.ranks, args.out_dir, args.rope_dim, args.calibration_batches, args.val_batches)


if __name__ == "__main__":
    main()
