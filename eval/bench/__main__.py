"""`python -m eval.bench [key=value ...]`: the bench as a Hydra app on conf/bench.yaml (eval/bench/app.py runs it)."""

from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from eval.bench.app import rows_written, run_bench, settings_of


@hydra.main(config_path="../../conf", config_name="bench", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from train.cli import refuse_existing_output

    out_dir = Path(cfg.out_dir) if cfg.out_dir else Path(HydraConfig.get().runtime.output_dir)
    refuse_existing_output(out_dir, bool(cfg.get("overwrite")))  # one rule: a report is not replaced unasked
    plain = OmegaConf.to_container(cfg, resolve=False)
    wandb_cfg = None
    if cfg.get("logger") and "wandb" in cfg.logger:
        wandb_cfg = {
            "project": cfg.logger.wandb.get("project", "overlap-zoo"),
            "name": cfg.task_name,
            "tags": list(cfg.get("tags") or []),
        }
    settings = settings_of({k: v for k, v in plain.items() if k != "overwrite"})
    command = " ".join(["python -m eval.bench", *HydraConfig.get().overrides.task])
    results = run_bench(settings, out_dir, wandb_cfg, command)
    print(f"[bench] {rows_written(results)} -> {out_dir}/README.md, results.json, *.png", flush=True)


if __name__ == "__main__":
    # a bad input: one line and exit status 1 (HYDRA_FULL_ERROR=1: the full traceback)
    from train.cli import one_sentence_errors

    one_sentence_errors(main)()
