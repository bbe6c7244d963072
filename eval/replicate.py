"""Quality with error bars: every architecture against its family's baseline, at equal tokens, over seeds.

    python -m eval.replicate out_dir=reports/quality-seeds     # the committed report (hours on 2 CPU cores)
    python -m eval.replicate archs=[llama,kraken] seeds=[42,43] max_steps=40 out_dir=/tmp/smoke
    python -m eval.replicate out_dir=reports/quality-seeds train=false  # the report from the runs done so far

Each label of `archs` (a model config, conf/model/<name>.yaml, or a `variants` entry: a model config plus
pretrain overrides) is pretrained once per seed of `seeds` with the tour's pretraining (train.pretrain called
in-process on pretrain.yaml + experiment=demo + `pretrain_overrides`, as eval/tour.py does), and its baseline
(`baselines`: the MoE family against moe, everything else against llama) with it. The report gives per label the
final validation loss and perplexity as mean, min-max and std (sample std, ddof 1) over the seeds, and the
difference to the baseline as the mean and spread of the PER-SEED PAIRED differences (the same seed gives both
runs the same data order; the held-out plays are the same for every seed: data.split_seed), which is what
tells a real difference from seed noise. The MoE rows also give k_eff, the FFN experts a token runs, counted on
the validation data by hooks on the routers (as eval/bench/moe.py counts rows to the grouped experts), so that
each row says whether it is compared at equal active parameters or at equal expert compute.

Resumable: every finished run is written to `out_dir`/seeds/<label>-seed<N>.json at once and skipped by a rerun
with the same settings; a run killed half-way continues from its last checkpoint under `runs_dir`.
`train=false` trains nothing: the report is written from the finished runs on disk, names the runs still missing,
and computes every spread and paired difference over the seeds that are there (a report while runs are under way,
or from several processes each given its own `seeds`).
"""

import json
import shutil
import time
from pathlib import Path

import hydra
import numpy as np
import torch
from hydra import compose
from omegaconf import DictConfig, OmegaConf

import models  # noqa: F401  (registers the zoo's configs with AutoConfig)
from eval import report

LOSS, PPL = "val_loss", "val_ppl"


# ------------------------------------------------------------------------------------------- runs


def run_specs(cfg: DictConfig) -> dict[str, dict]:
    """{label: {"model", "overrides", "baseline"}} for every label of `archs` and every baseline they need,
    baselines first (so that a partial run has them)."""
    variants = OmegaConf.to_container(cfg.variants, resolve=True) or {}

    def spec(label: str) -> dict:
        v = variants.get(label, {"model": label, "overrides": []})
        model = v["model"]
        baseline = cfg.baselines.get(model, cfg.default_baseline)
        return {"model": model, "overrides": list(v.get("overrides") or []), "baseline": baseline}

    labels = list(cfg.archs)
    baselines = [spec(label)["baseline"] for label in labels]
    ordered = list(dict.fromkeys([b for b in baselines if b is not None] + labels))
    return {label: spec(label) for label in ordered}


def pretrain_overrides(cfg: DictConfig, spec: dict, seed: int) -> list[str]:
    """The pretrain overrides of one run: the tour's, this app's steps and validations, the variant's, the seed."""
    interval = min(int(cfg.val_check_interval), int(cfg.max_steps))
    return [
        f"model={spec['model']}",
        *cfg.pretrain_overrides,
        f"trainer.max_steps={cfg.max_steps}",
        f"trainer.val_check_interval={interval}",
        f"trainer.limit_val_batches={cfg.val_batches}",
        *spec["overrides"],
        f"seed={seed}",
    ]


def record_path(out_dir: Path, label: str, seed: int) -> Path:
    return out_dir / "seeds" / f"{label}-seed{seed}.json"


def done_record(path: Path, overrides: list[str]) -> dict | None:
    """The saved record of a finished run with these very overrides, else None (then it runs again)."""
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return record if record.get("overrides") == overrides else None


def train_one(cfg: DictConfig, label: str, spec: dict, seed: int, out_dir: Path) -> dict:
    """Pretrain one (label, seed) in-process and return its record (also written to `record_path`)."""
    from train.pretrain import train

    overrides = pretrain_overrides(cfg, spec, seed)
    run_dir = Path(cfg.runs_dir) / label / f"steps{cfg.max_steps}-seed{seed}"
    # A run whose hf/ is there without its checkpoint finished but was not recorded: start it afresh
    # (train.pretrain refuses to overwrite it otherwise); with a checkpoint it continues from it.
    fresh = (run_dir / "hf").exists() and not (run_dir / "checkpoints" / "last.ckpt").exists()
    # Composed as eval/tour.py's pretrain_all does (the Hydra app's own config search path).
    c = compose(config_name="pretrain", overrides=[*overrides, *(["overwrite=true"] if fresh else [])])
    c.paths.output_dir = str(run_dir)
    started = time.perf_counter()
    result = train(c)
    train_s = time.perf_counter() - started
    record = {
        "label": label,
        "model": spec["model"],
        "seed": seed,
        "overrides": overrides,
        "global_step": result["global_step"],
        LOSS: result["val_at_end"]["loss"],
        PPL: result["val_at_end"]["ppl"],
        "val_history": [list(point) for point in result["val_history"]],
        "train_s": train_s,
        "num_parameters": result["num_parameters"],
        **moe_counts(c, result["hf_dir"], int(cfg.keff_batches)),
    }
    report.write_json(record_path(out_dir, label, seed), record)
    if not cfg.keep_checkpoints:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return record


def moe_counts(c: DictConfig, hf_dir: str, batches: int) -> dict:
    """Active parameters (the config's `num_active_parameters_formula()`, the total for dense models), and for
    a model with MoE layers k_eff: the rows per token its routers send to the grouped FFN experts, averaged over
    the MoE layers, counted on `batches` validation batches; and the FFN experts' width."""
    from transformers import AutoModelForCausalLM

    from eval.tour import active_parameters
    from models.common.moe import GroupedExperts, TopKRouter

    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    out = {"num_active_parameters": active_parameters(hf_dir, model.num_parameters())}
    layers = [m for m in model.modules()
              if isinstance(getattr(m, "router", None), TopKRouter) and isinstance(getattr(m, "experts", None), GroupedExperts)]  # fmt: skip
    if not layers or batches <= 0:
        return out
    counts = {"rows": 0, "tokens": 0}

    def count(layer):
        def hook(router, args, routing):
            counts["rows"] += (routing.expert_idx < layer.experts.num_experts).sum().item()
            counts["tokens"] += routing.probs.shape[0]

        return hook

    handles = [layer.router.register_forward_hook(count(layer)) for layer in layers]
    datamodule = hydra.utils.instantiate(c.data, _convert_="all")
    datamodule.setup("validate")
    with torch.no_grad():
        for i, batch in enumerate(datamodule.val_dataloader()):
            if i >= batches:
                break
            model(batch["input_ids"])
    for h in handles:
        h.remove()
    out["k_eff"] = counts["rows"] / counts["tokens"]  # tokens counted once per MoE layer
    out["expert_width"] = layers[0].experts.down_proj.shape[-1]
    out["expert_rows_per_token"] = out["k_eff"] * out["expert_width"]
    return out


# ------------------------------------------------------------------------------------------- statistics


def spread(values: list[float]) -> dict:
    """mean, sample std (ddof 1; None for one value), min, max and n of `values`."""
    v = np.asarray(values, dtype=float)
    return {
        "mean": float(v.mean()),
        "std": float(v.std(ddof=1)) if len(v) > 1 else None,
        "min": float(v.min()),
        "max": float(v.max()),
        "n": len(v),
        "values": [float(x) for x in v],
    }


def paired(records: dict, label: str, against: str, key: str) -> dict | None:
    """The spread of the per-seed differences label - against of `key`, over the seeds both have; with
    "same_sign": every seed's difference has the mean's sign (the difference is larger than the seed noise
    in every seed), None for fewer than 2 seeds."""
    seeds = sorted(set(records.get(label, {})) & set(records.get(against, {})))
    if not seeds or label == against:
        return None
    diffs = [records[label][s][key] - records[against][s][key] for s in seeds]
    out = spread(diffs)
    out["seeds"] = seeds
    out["same_sign"] = (all(d > 0 for d in diffs) or all(d < 0 for d in diffs)) if len(diffs) > 1 else None
    return out


def summarise(cfg: DictConfig, specs: dict[str, dict], records: dict[str, dict[int, dict]]) -> dict:
    """results.json: per label its per-seed values, their spread, the paired differences to its baseline (and
    to the `comparisons`), the MoE rows' k_eff."""
    rows = []
    for label, spec in specs.items():
        runs = records.get(label, {})
        if not runs:
            continue
        row = {"arch": label, "model": spec["model"], "baseline": spec["baseline"] if spec["baseline"] != label else None,
               "seeds": sorted(runs), "params": next(iter(runs.values()))["num_parameters"],
               "active_params": next(iter(runs.values()))["num_active_parameters"],
               LOSS: spread([r[LOSS] for r in runs.values()]), PPL: spread([r[PPL] for r in runs.values()]),
               "train_s": spread([r["train_s"] for r in runs.values()])}  # fmt: skip
        if row["baseline"]:
            row["diff_loss"] = paired(records, label, row["baseline"], LOSS)
            row["diff_ppl"] = paired(records, label, row["baseline"], PPL)
        if all("k_eff" in r for r in runs.values()):
            row["k_eff"] = spread([r["k_eff"] for r in runs.values()])
            row["expert_width"] = next(iter(runs.values()))["expert_width"]
            row["expert_rows_per_token"] = spread([r["expert_rows_per_token"] for r in runs.values()])
        rows.append(row)
    comparisons = []
    for label, against in [tuple(p) for p in cfg.comparisons] + [(r["arch"], r["baseline"]) for r in rows if r.get("baseline")]:
        d = paired(records, label, against, LOSS)
        if d is not None and not any(c["arch"] == label and c["against"] == against for c in comparisons):
            comparisons.append({"arch": label, "against": against, "diff_loss": d, "diff_ppl": paired(records, label, against, PPL)})
    by_arch = {r["arch"]: r for r in rows}
    for c in comparisons:  # what the pairing holds equal, measured: active parameters, expert compute
        a, b = by_arch[c["arch"]], by_arch[c["against"]]
        c["active_params_ratio"] = a["active_params"] / b["active_params"]
        c["params_ratio"] = a["params"] / b["params"]
        if "expert_rows_per_token" in a and "expert_rows_per_token" in b:
            c["expert_compute_ratio"] = a["expert_rows_per_token"]["mean"] / b["expert_rows_per_token"]["mean"]
    return {"settings": {"archs": list(cfg.archs), "seeds": list(cfg.seeds), "max_steps": int(cfg.max_steps),
                         "val_batches": int(cfg.val_batches), "keff_batches": int(cfg.keff_batches),
                         "pretrain_overrides": list(cfg.pretrain_overrides)},
            "rows": rows, "comparisons": comparisons,
            "runs": {label: {str(s): r for s, r in runs.items()} for label, runs in records.items()}}  # fmt: skip


# ------------------------------------------------------------------------------------------- report


def plot(path: Path, result: dict) -> Path:
    """Mean final validation loss per label with min-max (thin) and +-std (thick) error bars; beside it the
    paired difference to the baseline, the same way."""
    plt = report.pyplot()
    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 2))

    def bars(ax, entries, title, xlabel):
        y = np.arange(len(entries))
        for i, (_, s) in enumerate(entries):
            ax.plot([s["min"], s["max"]], [i, i], color="grey", lw=1)
            if s["std"] is not None:
                ax.plot([s["mean"] - s["std"], s["mean"] + s["std"]], [i, i], color="C0", lw=4, alpha=0.6)
            ax.plot(s["values"], [i] * len(s["values"]), "k.", ms=4)
            ax.plot([s["mean"]], [i], "D", color="C3", ms=5)
        ax.set_yticks(y, [label for label, _ in entries])
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.grid(axis="x", alpha=0.3)

    bars(axes[0], [(r["arch"], r[LOSS]) for r in rows],
         "final validation loss (diamond: mean; thick: +-std; thin: min-max; dots: seeds)", "nats")
    diffs = [(f"{r['arch']} - {r['baseline']}", r["diff_loss"]) for r in rows if r.get("diff_loss")]
    if diffs:
        bars(axes[1], diffs, "paired difference to the baseline, per seed", "nats (< 0: better than the baseline)")
        axes[1].axvline(0, color="k", lw=0.8)
    else:
        axes[1].axis("off")
    return report._save(fig, path, f"{result['settings']['max_steps']} steps, seeds {result['settings']['seeds']}")


def _pm(s: dict | None, digits: int = 4) -> str:
    if not s:
        return "-"
    std = f" +- {s['std']:.{digits}f}" if s["std"] is not None else ""
    return f"{s['mean']:.{digits}f}{std} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def _signed(s: dict | None, digits: int = 4) -> str:
    if not s:
        return "-"
    std = f" +- {s['std']:.{digits}f}" if s["std"] is not None else ""
    return f"{s['mean']:+.{digits}f}{std} [{s['min']:+.{digits}f}, {s['max']:+.{digits}f}]"


def _resolved(s: dict | None) -> str:
    if not s or s["same_sign"] is None:
        return "-"
    return "yes" if s["same_sign"] else "no"


def markdown(result: dict, elapsed_s: float) -> str:
    st = result["settings"]
    rows = result["rows"]
    quality = [{"arch": r["arch"], "against": r["baseline"] or "-", "seeds": len(r["seeds"]),
                "params": r["params"], "active params": r["active_params"],
                "val loss": _pm(r[LOSS]), "val ppl": _pm(r[PPL], 1),
                "loss - baseline's (paired)": _signed(r.get("diff_loss")),
                "ppl - baseline's (paired)": _signed(r.get("diff_ppl"), 1),
                "every seed agrees": _resolved(r.get("diff_loss"))} for r in rows]  # fmt: skip
    lines = [
        "# Quality at equal tokens, over seeds",
        "",
        f"`python -m eval.replicate` ({elapsed_s / 60:.1f} minutes for the runs this invocation trained; each run's "
        "own time is in results.json). Every architecture pretrained on the bundled corpus with the tour's "
        f"pretraining (`{' '.join(st['pretrain_overrides'])}`) for {st['max_steps']} steps of 16 x 128 tokens, "
        f"once per seed of {st['seeds']} (the seed sets the initialisation and the data order; the held-out plays "
        f"are the same), final validation on {st['val_batches']} batches of the held-out plays.",
        "",
        "Values: mean +- sample std (ddof 1) [min, max] over the seeds. Differences to the baseline are PAIRED: per "
        "seed, the architecture's value minus its baseline's at the same seed, then the spread of those "
        "differences. **every seed agrees**: every seed's difference has the same sign, i.e. the difference is "
        "larger than the seed-to-seed noise at this budget; a weak test with few seeds (a difference of pure "
        f"noise, symmetric about 0, passes it with probability {2 ** (1 - len(st['seeds'])):.2g} at "
        f"{len(st['seeds'])} seeds).",
        "",
        report.write_markdown_table(quality, list(quality[0])) if quality else "(no runs)",
        "",
    ]
    if result.get("missing"):
        by_arch: dict[str, list[int]] = {}
        for m in result["missing"]:
            by_arch.setdefault(m["arch"], []).append(m["seed"])
        lines += [
            f"**Partial report** (`train=false`): {len(result['missing'])} runs of these settings are not trained "
            "yet, and every mean, spread and paired difference above is over the seeds that are: "
            + "; ".join(f"{a} (seeds {', '.join(map(str, s))})" for a, s in by_arch.items())
            + ". The same command without `train=false` trains them (the finished runs are kept).",
            "",
        ]
    lines += [
        "![final validation loss over seeds](quality_seeds.png)",
        "",
    ]
    moe = [r for r in rows if "k_eff" in r]
    if moe:
        base = {r["arch"]: r for r in rows}
        moe_rows = []
        for r in moe:
            b = base.get(r["baseline"] or r["arch"])
            moe_rows.append({
                "arch": r["arch"], "against": r["baseline"] or "-",
                "k_eff (FFN experts/token, measured)": _pm(r["k_eff"], 3),
                "expert width": r["expert_width"],
                "expert rows/token": _pm(r["expert_rows_per_token"], 1),
                "expert compute / baseline's": r["expert_rows_per_token"]["mean"] / b["expert_rows_per_token"]["mean"]
                if b and "expert_rows_per_token" in b else None,
                "active params / baseline's": r["active_params"] / b["active_params"] if b else None,
                "params / baseline's": r["params"] / b["params"] if b else None,
                "loss - baseline's (paired)": _signed(r.get("diff_loss")),
            })  # fmt: skip
        lines += [
            "## The MoE family: what each comparison holds equal",
            "",
            "**k_eff**: rows per token the routers send to the FFN (grouped) experts, averaged over the MoE layers, "
            f"counted on {st['keff_batches']} validation batches of each trained model (moe: its top-k; MoE++: fewer, "
            "a token routed to a zero-computation expert runs one FFN expert or none; ScMoE: its routed top-1, the "
            "shared expert not counted). **expert rows/token** = k_eff x expert width: the FFN expert compute per "
            "token per layer. **active params** counts two FFN experts per token for MoE++ (an upper bound). A row "
            "with active params ~1 and expert compute < 1 is compared at equal active parameters (the paper's "
            "comparison, MoE++ against a vanilla MoE with its FFN experts); a row with expert compute ~1 at equal "
            "expert compute.",
            "",
            report.write_markdown_table(moe_rows, list(moe_rows[0])),
            "",
        ]
    if result["comparisons"]:
        comp = [{"arch": c["arch"], "against": c["against"], "loss difference (paired)": _signed(c["diff_loss"]),
                 "ppl difference (paired)": _signed(c["diff_ppl"], 1), "every seed agrees": _resolved(c["diff_loss"]),
                 "params ratio": c["params_ratio"], "active params ratio": c["active_params_ratio"],
                 "expert compute ratio": c.get("expert_compute_ratio")} for c in result["comparisons"]]  # fmt: skip
        lines += ["## Paired comparisons", "", report.write_markdown_table(comp, list(comp[0])), ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- the app


# What the app writes into out_dir: a directory holding only these is its own report, resumed.
OWN_FILES = ("seeds", "runs", "results.json", "README.md", "quality_seeds.png")


def check_out_dir(cfg: DictConfig) -> None:
    """The one "output directory already holds results" rule (train.cli.refuse_existing_output), where a
    directory of this app's own finished runs is not "other results": it is resumed. Anything else there, or
    a results.json that is not a replicate report, is refused unless overwrite=true."""
    from train.cli import refuse_existing_output

    out_dir = Path(cfg.out_dir)
    overwrite = bool(cfg.get("overwrite"))
    refuse_existing_output(out_dir, overwrite, keep=OWN_FILES)
    results = out_dir / "results.json"
    if results.is_file() and not overwrite:
        try:
            ours = "seeds" in (json.loads(results.read_text()).get("settings") or {})
        except (ValueError, AttributeError):
            ours = False
        if not ours:
            refuse_existing_output(out_dir, overwrite)  # says so, naming what is there


def check_settings(cfg: DictConfig) -> None:
    """Refused before anything is trained or written: no seed or no architecture to run."""
    if not list(cfg.seeds):
        raise ValueError(
            "seeds=[]: no seed to train, so no spread or paired difference to report; give at least one "
            "(e.g. seeds=[42]; the committed report uses seeds=[42,43,44])."
        )
    if not list(cfg.archs):
        raise ValueError("archs=[]: no architecture to train; give at least one (e.g. archs=[llama,kraken]).")


def replicate(cfg: DictConfig) -> dict:
    started = time.perf_counter()
    check_settings(cfg)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specs = run_specs(cfg)
    records: dict[str, dict[int, dict]] = {}
    todo = [(label, seed) for seed in cfg.seeds for label in specs]  # seed-major: a partial run has whole seeds
    missing = []
    for i, (label, seed) in enumerate(todo, 1):
        spec = specs[label]
        record = done_record(record_path(out_dir, label, seed), pretrain_overrides(cfg, spec, seed))
        if record is None and not cfg.train:  # report only: what is on disk, the rest named as missing
            missing.append({"arch": label, "seed": seed})
            continue
        if record is None:
            print(f"[replicate] {i}/{len(todo)}: training {label} seed {seed}", flush=True)
            record = train_one(cfg, label, spec, seed, out_dir)
            print(f"[replicate] {label} seed {seed}: val loss {record[LOSS]:.4f} in {record['train_s']:.0f} s", flush=True)
        else:
            print(f"[replicate] {i}/{len(todo)}: {label} seed {seed} already done, val loss {record[LOSS]:.4f}", flush=True)
        records.setdefault(label, {})[seed] = record
    result = summarise(cfg, specs, records)
    result["missing"] = missing
    if missing:
        print(f"[replicate] train=false: {len(missing)} of {len(todo)} runs not trained yet, left out", flush=True)
    elapsed = time.perf_counter() - started
    result["elapsed_s"] = elapsed
    report.write_json(out_dir / "results.json", result)
    plot(out_dir / "quality_seeds.png", result)
    (out_dir / "README.md").write_text(markdown(result, elapsed), encoding="utf-8")
    return result


@hydra.main(config_path="../conf", config_name="replicate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    check_settings(cfg)
    check_out_dir(cfg)
    result = replicate(cfg)
    print((Path(cfg.out_dir) / "README.md").read_text(), flush=True)
    print(f"[replicate] -> {cfg.out_dir}/README.md ({result['elapsed_s'] / 60:.1f} minutes)", flush=True)


if __name__ == "__main__":
    # a bad input: one line and exit status 1 (HYDRA_FULL_ERROR=1: the full traceback)
    from train.cli import one_sentence_errors

    one_sentence_errors(main)()
