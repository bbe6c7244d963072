"""`python -m eval.costmodel [key=value ...]`: the speed simulator validated against the Ladder paper's 70B table
and its reference's logged prefill latencies, a Hydra app on conf/costmodel.yaml (eval/simulator/costmodel.py runs it)."""

import json
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from eval.report import refuse_wandb_logger
from eval.simulator.costmodel import run_costmodel


@hydra.main(config_path="../conf", config_name="costmodel", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from train.cli import refuse_existing_output

    refuse_wandb_logger(cfg, "eval.costmodel")
    out_dir = Path(cfg.out_dir) if cfg.out_dir else Path(HydraConfig.get().runtime.output_dir)
    refuse_existing_output(out_dir, bool(cfg.get("overwrite")))  # one rule: a report is not replaced unasked
    plain = {k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items()
             if k not in ("paths", "hydra", "logger")}  # fmt: skip
    result = run_costmodel(plain, out_dir, " ".join(["python -m eval.costmodel", *HydraConfig.get().overrides.task]))
    print(json.dumps({"constants": result["constants"], "mean_abs_log_ratio": result["mean_abs_log_ratio"],
                      "worst_tok_s_error": result["worst_tok_s_error"],
                      "worst_ladder_speedup_error": result["worst_ladder_speedup_error"],
                      "worst_prefill_error": result["worst_prefill_error"],
                      "worst_ladder_prefill_speedup_error": result["worst_ladder_prefill_speedup_error"]}, indent=2))  # fmt: skip
    print(f"[costmodel] -> {out_dir}/README.md, costmodel.json, costmodel_ratio.png", flush=True)


if __name__ == "__main__":
    # a bad input: one line and exit status 1 (HYDRA_FULL_ERROR=1: the full traceback)
    from train.cli import one_sentence_errors

    one_sentence_errors(main)()
