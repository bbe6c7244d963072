"""The zoo tour: train, convert, evaluate, run and predict every architecture, then write one report.

    python -m eval.tour                          # what `make demo` runs (about 13 minutes on 2 CPU cores)
    python -m eval.tour report_dir=reports/demo  # ... and rewrite the committed example report

Each step is the zoo's own entry point called in-process with its Hydra config (pretrain, convert,
quality, bench), so the tour shows exactly what those commands do. The report (eval/tour_report.py;
`report_dir`, default `<run dir>/report/README.md`, under outputs/) leads with one row per architecture:
its quality against its family's baseline (validation perplexity of the tiny model trained here) beside
its speed-up over that baseline predicted by the speed simulator at the Llama 3 8B shape
(eval/tour_predict.py, `predict`). Then quality in full (bundled lm-eval tasks, loss curves; total and
active parameters), the conversions, and the tiny benches on this CPU (`benches`: one per family), which
check that every schedule runs; their numbers are within this CPU's noise, not speed results.
"""

import time
from pathlib import Path

import hydra
from hydra import compose
from omegaconf import DictConfig
from transformers import AutoConfig

import models  # noqa: F401  registers the zoo's configs with AutoConfig
from eval.tour_predict import predict_all
from eval.tour_report import quality_rows as quality_rows  # noqa: I001 (re-exported: tests read it from here)
from eval.tour_report import write_report


def _compose(name: str, overrides: list[str]) -> DictConfig:
    return compose(config_name=name, overrides=list(overrides))


def pretrain_all(cfg: DictConfig, run_dir: Path) -> dict[str, dict]:
    from train.pretrain import train

    results = {}
    for arch in cfg.archs:
        print(f"[tour] pretraining {arch}", flush=True)
        started = time.perf_counter()
        model = (cfg.get("model_configs") or {}).get(arch, arch)
        c = _compose("pretrain", [f"model={model}", *cfg.pretrain_overrides, f"seed={cfg.seed}"])
        c.paths.output_dir = str(run_dir / "pretrain" / arch)
        results[arch] = train(c)
        results[arch]["num_active_parameters"] = active_parameters(results[arch]["hf_dir"], results[arch]["num_parameters"])
        print(f"[tour] pretrained {arch} in {time.perf_counter() - started:.0f} s", flush=True)
    return results


def active_parameters(checkpoint: str, total: int) -> int:
    """Parameters one token's forward uses: the MoE configs' `num_active_parameters_formula()` (all but the
    experts a token is not routed to; MoE++: an upper bound), the total for dense architectures."""
    formula = getattr(AutoConfig.from_pretrained(checkpoint), "num_active_parameters_formula", None)
    return formula() if formula is not None else total


def convert_all(cfg: DictConfig, run_dir: Path, checkpoints: dict[str, str]) -> dict[str, dict]:
    """Every converter of `convert.converters` applied to the trained `convert.source` architecture and
    retrained briefly (train.convert): {converter name: its result}."""
    from train.convert import convert

    retrain = ",".join(f"'{o}'" for o in cfg.convert.retrain_overrides)
    results = {}
    for name, options in cfg.convert.converters.items():
        print(f"[tour] converting {cfg.convert.source} with {name} and retraining", flush=True)
        started = time.perf_counter()
        c = _compose(
            "convert",
            [f"converter={name}", f"source={checkpoints[cfg.convert.source]}",
             *[f"{key}={value}" for key, value in (options or {}).items()],
             "retrain.enabled=true", f"retrain.overrides=[{retrain}]"],
        )
        c.paths.output_dir = str(run_dir / "convert" / name)
        results[name] = convert(c)
        print(f"[tour] converted with {name} in {time.perf_counter() - started:.0f} s", flush=True)
    return results


def converted_name(result: dict, source: str) -> str:
    """The converted checkpoint's name in the report, e.g. "ladder (converted from llama)"."""
    return f"{result['target']} (converted from {source})"


def evaluate_all(cfg: DictConfig, run_dir: Path, checkpoints: dict[str, str]) -> dict[str, dict]:
    from eval.quality import run

    results = {}
    for name, path in checkpoints.items():
        print(f"[tour] evaluating {name}", flush=True)
        started = time.perf_counter()
        c = _compose("quality", [f"checkpoint={path}", *cfg.quality_overrides])
        c.out_dir = str(run_dir / "quality" / name.replace(" ", "_").replace(",", ""))
        results[name] = run(c)
        print(f"[tour] evaluated {name} in {time.perf_counter() - started:.0f} s", flush=True)
    return results


def bench_all(cfg: DictConfig, run_dir: Path) -> dict[str, dict]:
    """One bench per entry of `benches` whose baseline (its first arch) the tour trains, over the
    architectures of `archs` it lists, at a tiny shape on this CPU: a check that every schedule runs (its
    numbers are within this CPU's noise): {bench name: results, with "title" and "out_dir" added}."""
    from eval.bench import run_bench_overrides

    results = {}
    for name, spec in cfg.benches.items():
        archs = [a for a in spec.archs if a in cfg.archs]
        if not archs or archs[0] != spec.archs[0]:
            print(f"[tour] bench {name} skipped: its baseline {spec.archs[0]} is not in archs", flush=True)
            continue
        print(f"[tour] benchmarking {name}: {', '.join(archs)}", flush=True)
        started = time.perf_counter()
        overrides = [f"archs=[{','.join(archs)}]", f"baseline={archs[0]}", *spec.overrides]
        out_dir = run_dir / "bench" / name
        results[name] = run_bench_overrides(overrides, out_dir)
        results[name].update(title=spec.title, out_dir=str(out_dir))
        print(f"[tour] benchmarked {name} in {time.perf_counter() - started:.0f} s", flush=True)
    return results


def tour(cfg: DictConfig) -> Path:
    started = time.perf_counter()
    run_dir = Path(cfg.paths.output_dir).resolve()
    pretrained = pretrain_all(cfg, run_dir)
    checkpoints = {arch: r["hf_dir"] for arch, r in pretrained.items()}
    converted = {}
    if cfg.convert.enabled and cfg.convert.source in pretrained:
        converted = convert_all(cfg, run_dir, checkpoints)
        for result in converted.values():
            checkpoints[converted_name(result, cfg.convert.source)] = result["retrain"]["hf_dir"]
    quality = evaluate_all(cfg, run_dir, checkpoints)
    benches = bench_all(cfg, run_dir)
    predicted = predict_all(cfg, run_dir) if cfg.predict.enabled else None
    path = write_report(cfg, Path(cfg.report_dir), pretrained, converted, quality, benches, predicted,
                        time.perf_counter() - started)
    print(f"[tour] report: {path} ({(time.perf_counter() - started) / 60:.1f} minutes)", flush=True)
    print(path.read_text(), flush=True)
    return path


@hydra.main(config_path="../conf", config_name="tour", version_base="1.3")
def main(cfg: DictConfig) -> None:
    tour(cfg)


if __name__ == "__main__":
    # a bad input: one line and exit status 1 (HYDRA_FULL_ERROR=1: the full traceback)
    from train.cli import one_sentence_errors

    one_sentence_errors(main)()
