"""What the bench's tests share: the settings `python -m eval.bench` composes, a run of it as a command, and a
device-preset run in this process."""

import json
import subprocess
import sys
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



def run_cli(out: Path, *overrides: str) -> dict:
    """`python -m eval.bench out_dir=OUT logger=none *overrides` in a subprocess; its results.json."""
    cmd = [sys.executable, "-m", "eval.bench", f"out_dir={out}", "logger=none", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "results.json").read_text())


def run_here(out: Path, *overrides: str) -> dict:
    """What run_cli(out, *overrides) runs, in this process (an interpreter start fewer); its results.json. The
    command line itself is run by test_bench's tiny_run. (The bench sets torch's thread count: put it back.)"""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("bench", overrides=["logger=none", *overrides])
    plain = OmegaConf.to_container(cfg, resolve=False)
    threads = torch.get_num_threads()
    try:
        run_bench({k: v for k, v in plain.items() if k not in ("logger", "paths", "hydra")}, out)
    finally:
        torch.set_num_threads(threads)
    return json.loads((out / "results.json").read_text())
