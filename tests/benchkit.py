"""What the bench's tests share: the settings `python -m eval.bench` composes, and a device-preset run."""

from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from eval.bench import run_bench

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("llama", "ladder", "parallel", "kraken")  # conf/bench.yaml's default archs


def bench_settings(*overrides: str) -> dict:
    """The settings `python -m eval.bench bench_shape=tiny real.tp=[2] *overrides` hands to run_bench."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("bench", overrides=["bench_shape=tiny", "real.tp=[2]", "logger=none", *overrides])
    plain = OmegaConf.to_container(cfg, resolve=False)
    return {k: v for k, v in plain.items() if k not in ("logger", "paths", "hydra")}



def run_predicted(out: Path, *overrides: str) -> dict:
    """run_bench in this process with compute=h100-sxm (the bench sets torch's thread count: put it back)."""
    threads = torch.get_num_threads()
    try:
        return run_bench(bench_settings("compute=h100-sxm", *overrides), out)
    finally:
        torch.set_num_threads(threads)

