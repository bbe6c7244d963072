"""What regrouping a GQLA costs: validation loss on the bundled corpus at each group count, calibrated
(models/gqla/regroup.py's weighted merge), uncalibrated (identity weights) and, for scale, the naive merge
(each new group's up-projections the mean of its old groups', nothing folded into query or output), from one
checkpoint.

    python -m eval.gqla_regroup SOURCE OUT_DIR --groups 2 1 [--calibration-batches 8] [--val-batches 8] [--overwrite]

SOURCE: a zoo gqla checkpoint or a DeepSeek-V2 / V3 one (converted exactly first, deepseek_to_gqla). The
calibration batches are train.convert's (`calibration_batches`), so the numbers are what
`python -m train.convert converter=deepseek_to_gqla num_kv_groups=N` gives. Writes regroup.md (a table) and
regroup.json into OUT_DIR (one that already holds results is refused without --overwrite).
"""

import json
from pathlib import Path

import torch
from transformers import AutoConfig

from eval.gqla_rank_sweep import sweep_arguments
from models.gqla import ZooGQLAConfig, ZooGQLAForCausalLM
from models.gqla.deepseek import DEEPSEEK_TYPES, DEFAULT_CALIBRATION_BATCHES, convert_deepseek, load_deepseek
from models.gqla.regroup import attention_statistics, check_groups, regroup
from train.cli import exit_if_output_exists
from train.convert import calibration_batches, source_data
from train.metrics import evaluate_loss


def load(source: str | Path) -> ZooGQLAForCausalLM:
    if AutoConfig.from_pretrained(str(source)).model_type in DEEPSEEK_TYPES:
        return convert_deepseek(load_deepseek(source))
    return ZooGQLAForCausalLM.from_pretrained(source).eval()


@torch.no_grad()
def mean_merge(model: ZooGQLAForCausalLM, num_kv_groups: int) -> ZooGQLAForCausalLM:
    """The naive baseline: each new group's W_UK, W_UV the mean of its old groups' (no folds)."""
    config = ZooGQLAConfig(**{**model.config.to_dict(), "num_key_value_heads": num_kv_groups})
    state = dict(model.state_dict())
    for name in [n for n in state if n.endswith(("k_up", "v_up"))]:
        w = state[name]
        state[name] = w.view(num_kv_groups, -1, *w.shape[1:]).mean(1)
    out = ZooGQLAForCausalLM(config).to(model.dtype)
    out.load_state_dict(state)
    return out.eval()


def regroup_costs(
    source: str | Path,
    groups: list[int],
    out_dir: str | Path,
    calibration_batches_n: int = DEFAULT_CALIBRATION_BATCHES,
    val_batches: int = 8,
) -> list[dict]:
    source, out_dir = Path(source), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = load(source)
    for g in groups:
        check_groups(model.config, g)
    stats = attention_statistics(model, calibration_batches(source, calibration_batches_n))
    data = source_data(source, "validate")

    def val(m) -> float:
        return evaluate_loss(m, data.val_dataloader(), val_batches)["loss"]

    c = model.config
    rows = [{"num_kv_groups": c.num_kv_groups, "calibrated": None, "val_loss": val(model),
             "gqa_values_per_token": c.kv_bytes_per_token("gqa") // 2}]
    for g in groups:
        for calibrated in (True, False, "mean"):
            merged = mean_merge(model, g) if calibrated == "mean" else regroup(model, g, stats if calibrated else None)
            rows.append({"num_kv_groups": g, "calibrated": calibrated, "val_loss": val(merged),
                         "gqa_values_per_token": merged.config.kv_bytes_per_token("gqa") // 2})
            print(f"[regroup] n_g={g} calibrated={calibrated} val/loss {rows[-1]['val_loss']:.4f}", flush=True)
    lines = ["| groups | merge | gqa cache values / token / layer | val loss | change |", "|---|---|---|---|---|"]
    base = rows[0]["val_loss"]
    for r in rows:
        merge = {None: "source", True: "calibrated", False: "identity weights", "mean": "mean, no folds"}[r["calibrated"]]
        lines.append(f"| {r['num_kv_groups']} | {merge} | {r['gqa_values_per_token']} | {r['val_loss']:.4f} | "
                     f"{r['val_loss'] - base:+.5f} |")
    (out_dir / "regroup.md").write_text("\n".join(lines) + "\n")
    (out_dir / "regroup.json").write_text(json.dumps({"source": str(source), "rows": rows}, indent=2))
    print("\n".join(lines), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = sweep_arguments(__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, nargs="+", required=True)
    args = parser.parse_args(argv)
    exit_if_output_exists(args.out_dir, args.overwrite, flag="--overwrite", other="OUT_DIR")
    regroup_costs(args.source, args.groups, args.out_dir, args.calibration_batches, args.val_batches)


if __name__ == "__main__":
    main()
