"""The ladder residual schedule put on a trained standard model of each architecture that takes it.

    python -m eval.ladder_conversions out_dir=reports/ladder-conversion      # the committed report
    python -m eval.ladder_conversions archs=[moe] out_dir=/tmp/lc             # one architecture

The Ladder paper converts a trained Llama to Ladder Residual and retrains briefly (reports/conversion does it for the
zoo's llama). Here the same for every architecture with a ladder variant (`models.variants()`): its standard model
is pretrained as eval.replicate trains it, then converted by `train.convert converter=<arch>_to_ladder` (the same
weights, the schedule changed) and retrained; and, as the control, converted with ladder_layers=0 (nothing changes)
and retrained for the same steps, so that "retrained" is read against the standard model trained on as long.
Writes `out_dir`/<arch>.json (each conversion's train.convert result) at once, skipped by a rerun, and
`out_dir`/results.json + README.md over the architectures done; the models go to `out_dir`/runs/.
"""

import json
from pathlib import Path

import hydra
from hydra import compose
from omegaconf import DictConfig, OmegaConf

import models
from eval import report

OWN_FILES = ("runs", "results.json", "README.md")


def archs_of(cfg: DictConfig) -> list[str]:
    """`archs`, or every architecture with a ladder variant; one clear error for one without."""
    laddered = [models.registry.standard_sibling(name) for name in models.variants()]
    archs = list(cfg.archs) if cfg.archs is not None else laddered
    wrong = [a for a in archs if a not in laddered]
    if wrong or not archs:
        raise ValueError(f"archs={archs} must name architectures that take the ladder schedule: {laddered}.")
    return archs


def pretrain_source(cfg: DictConfig, arch: str, run_dir: Path) -> str:
    """The standard `arch` pretrained (eval.replicate's recipe); its hf/ directory."""
    from train.pretrain import train

    hf = run_dir / "hf"
    if hf.is_dir() and (hf / "config.json").is_file():
        return str(hf)  # pretrained by an earlier, interrupted call
    c = compose(config_name="pretrain", overrides=[f"model={arch}", *cfg.pretrain_overrides, f"seed={cfg.seed}",
                                                   "overwrite=true"])
    c.paths.output_dir = str(run_dir)
    return train(c)["hf_dir"]


def converter_for(arch: str) -> str:
    """The `<name>_to_ladder` converter that reads `arch`'s checkpoints (one per config class: linear_hybrid's is
    linear_to_ladder)."""
    model_type = models.get(arch).config_class.model_type
    return next(c.name for c in models.CONVERTERS.values() if c.name.endswith("_to_ladder") and model_type in c.source_types)


def convert_one(cfg: DictConfig, source: str, arch: str, ladder_layers: int, run_dir: Path) -> dict:
    """`train.convert converter=<arch's>_to_ladder` with retraining; its result dict."""
    from train.convert import convert

    retrain = "retrain.overrides=[" + ",".join(f"'{o}'" for o in cfg.retrain_overrides) + "]"  # each holds '=': quoted
    c = compose(config_name="convert", overrides=[f"converter={converter_for(arch)}", f"source={source}",
                                                  f"ladder_layers={ladder_layers}", "retrain.enabled=true", retrain,
                                                  f"seed={cfg.seed}", "overwrite=true"])
    c.paths.output_dir = str(run_dir)
    return convert(c)


def row(arch: str, record: dict) -> dict:
    """Validation losses of one architecture: source, right after, retrained, and the control retrained."""
    ladder, control = record["ladder"]["val"], record["control"]["val"]
    name = record["ladder"]["target"]  # the converter's name for the architecture (linear_hybrid's: linear)
    return {
        "arch": arch,
        "ladder_layers": record["ladder"]["ladder_layers"],
        "source": ladder[f"{name} (source)"]["loss"],
        "right_after": ladder[f"{name}, no retraining"]["loss"],
        "retrained": ladder[f"{name}, retrained"]["loss"],
        "control_retrained": control[f"{name}, retrained"]["loss"],
        "retrain_steps": record["ladder"]["retrain"]["global_step"],
    }


def markdown(rows: list[dict], cfg: DictConfig) -> str:
    lines = [
        "# The ladder residual schedule on trained models of every architecture that takes it",
        "",
        "`python -m eval.ladder_conversions` (conf/ladder_conversions.yaml). Each architecture's standard model "
        f"pretrained as eval.replicate trains it (seed {cfg.seed}), converted by `train.convert "
        "converter=<arch>_to_ladder` (the same weights, the upper layers under the ladder schedule) and retrained; "
        "the control is the same conversion with ladder_layers=0 (the standard model unchanged), retrained for the "
        "same steps. Validation loss on the held-out plays (train.convert's evaluate.max_batches).",
        "",
        "| architecture | laddered layers | source | right after | retrained | control retrained | ladder - control |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['arch']} | {r['ladder_layers']} | {r['source']:.4f} | {r['right_after']:.4f} | "
            f"{r['retrained']:.4f} ({r['retrain_steps']} steps) | {r['control_retrained']:.4f} | "
            f"{r['retrained'] - r['control_retrained']:+.4f} |"
        )
    missing = [a for a in archs_of(OmegaConf.create({"archs": None})) if a not in {r["arch"] for r in rows}]
    if missing:
        lines += ["", f"Not in this report: {', '.join(missing)} (`python -m eval.ladder_conversions "
                  f"archs=[{','.join(missing)}] out_dir=...` adds them)."]
    return "\n".join(lines) + "\n"


def ladder_conversions(cfg: DictConfig) -> list[dict]:
    out_dir = Path(cfg.out_dir)
    rows = []
    for arch in archs_of(cfg):
        path = out_dir / f"{arch}.json"
        if path.is_file():
            record = json.loads(path.read_text())
        else:
            runs = out_dir / "runs" / arch
            print(f"[ladder_conversions] {arch}: pretraining the standard model", flush=True)
            source = pretrain_source(cfg, arch, runs / "source")
            record = {
                "ladder": convert_one(cfg, source, arch, int(cfg.ladder_layers), runs / "ladder"),
                "control": convert_one(cfg, source, arch, 0, runs / "control"),
            }
            report.write_json(path, record)
        rows.append(row(arch, record))
        print(f"[ladder_conversions] {arch}: {rows[-1]}", flush=True)
    report.write_json(out_dir / "results.json", {"settings": OmegaConf.to_container(cfg, resolve=True), "rows": rows})
    (out_dir / "README.md").write_text(markdown(rows, cfg), encoding="utf-8")
    return rows


@hydra.main(config_path="../conf", config_name="ladder_conversions", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from train.cli import refuse_existing_output

    archs_of(cfg)  # a wrong name: refused before anything runs
    own = (*OWN_FILES, *[f"{a}.json" for a in archs_of(cfg)])
    refuse_existing_output(Path(cfg.out_dir), bool(cfg.overwrite), keep=own)
    ladder_conversions(cfg)
    print((Path(cfg.out_dir) / "README.md").read_text(), flush=True)


if __name__ == "__main__":
    # a bad input: one line and exit status 1 (HYDRA_FULL_ERROR=1: the full traceback)
    from train.cli import one_sentence_errors

    one_sentence_errors(main)()
