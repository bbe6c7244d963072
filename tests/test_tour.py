"""Smoke test of the zoo tour (`make demo`) at toy sizes: every stage runs (the prediction step at the tiny
shape), the report leads with quality beside predicted speed-up and is written under
the run directory, and nothing else is written into the checkout (the tour runs in a copy of it).
Slow (3-5 minutes on 2 cores): excluded from `make test`; run with `pytest -m slow`."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What a checkout holds besides the sources (and what `make clean` removes); not copied.
NOT_COPIED = (".git", ".venv", "outputs", "logs", "wandb", "__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache")

OVERRIDES = [
    "archs=[llama,parallel,ladder,moe,scmoe,linear_hybrid,gqla]",
    "pretrain_overrides=['experiment=demo','trainer.max_steps=4','trainer.val_check_interval=2',"
    "'trainer.limit_val_batches=2','data.seq_len=32','data.batch_size=4','logger=csv','sample.num_lines=0']",
    "convert.retrain_overrides=['trainer.max_steps=2','trainer.limit_val_batches=2','trainer.val_check_interval=2',"
    "'data.seq_len=32','data.batch_size=4','logger=none','callbacks=none']",
    "quality_overrides=['logger=none','threads=1','perplexity.max_batches=2','tasks.limit=5','tasks.bootstrap_iters=0']",
    "benches.tensor_parallel.overrides=['bench_shape=tiny','batch_sizes=[1]','repeats=1','logger=none','tp=[2]']",
    "benches.expert_parallel.overrides=['bench_preset=moe','bench_shape=tiny','ep=[2]','batch_sizes=[1]','repeats=1',"
    "'logger=none','real.enabled=false','expert_throughput.tokens=64','expert_throughput.repeats=1']",
    # linear is not trained here (the hybrid is): the sequence-parallel bench, whose baseline it is, is skipped
    "benches.gqla.overrides=['bench_preset=gqla','bench_shape=tiny','tp=[2]','batch_sizes=[1]','repeats=1',"
    "'real.enabled=false','decode_paths.batch_sizes=[1]','decode_paths.q_lens=[1]','decode_paths.steps=2',"
    "'decode_paths.repeats=1','decode_paths.accounting_shape=null','logger=none']",
    # the prediction step at the tiny shape (the tour's: Llama 3 8B)
    "predict.common=['compute=h100-sxm','bench_shape=tiny','prompt_len=16','new_tokens=4','batch_sizes=[1,16]',"
    "'simulated.links=[nvlink-h100]','upper_bound.enabled=false','logger=none']",
    "predict.families.tensor_parallel.overrides=['tp=[2]']",
    "predict.families.expert_parallel.overrides=['bench_preset=moe','ep=[2]','expert_throughput.enabled=false']",
    "predict.families.sequence_parallel.overrides=['bench_preset=sp','bench_shape.num_hidden_layers=1',"
    "'sequence_parallel.lengths=[512]','sequence_parallel.sp=[4]','sequence_parallel.ranks=[last]',"
    "'sequence_parallel.links=[nvlink-h100]','sequence_parallel.device_points=[]','sequence_parallel.bytes.lengths=[512]',"
    "'sequence_parallel.bytes.sp=[4]','sequence_parallel.bytes.extra_points=[]']",
]


def snapshot(root: Path) -> dict[Path, tuple[int, int]]:
    """(size, mtime) of every file under `root` but Python's byte-code caches."""
    return {
        path.relative_to(root): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in root.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


@pytest.mark.slow
def test_tour_writes_report_under_outputs_and_nothing_else(tmp_path):
    # The tour runs as `make demo` does, from the checkout's root with the default run and report
    # directories, in a copy of the checkout (its modules imported from there: cwd comes first on
    # sys.path), so that whatever it writes can be told from the other files.
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO, checkout, ignore=shutil.ignore_patterns(*NOT_COPIED))
    before = snapshot(checkout)
    env = dict(os.environ, WANDB_MODE="offline", PYTHONPATH=str(checkout))
    command = [sys.executable, "-m", "eval.tour", *OVERRIDES]
    proc = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]

    after = snapshot(checkout)
    written = sorted(str(p) for p in after if p not in before and p.parts[0] != "outputs")
    changed = sorted(str(p) for p in before if after.get(p) != before[p])
    assert not written and not changed, f"the tour wrote into the checkout: {written + changed}"

    (run,) = (checkout / "outputs" / "tour").iterdir()
    report = run / "report"
    text = (report / "README.md").read_text()
    for heading in ("## At a glance", "## Quality at equal tokens", "## Llama -> Ladder conversion",
                    "## Llama -> GQLA conversion", "## Every schedule runs: tensor parallelism",
                    "## Every schedule runs: expert parallelism", "## Every schedule runs: GQLA", "### Decode paths"):
        assert heading in text
    assert text.index("## At a glance") < text.index("## Quality at equal tokens") < text.index("## Every schedule runs")
    assert "## Every schedule runs: sequence parallelism" not in text  # its baseline, linear, was not trained
    assert not list(report.glob("*hidden_fraction*.png"))  # timing noise at a tiny shape on a CPU: not plotted
    for arch in ("llama", "parallel", "ladder", "ladder (converted from llama)", "moe", "scmoe", "linear_hybrid",
                 "gqla", "gqla (converted from llama)"):
        assert f"| {arch} |" in text
    # total and active parameters: equal for the dense ones, fewer active for the MoE ones
    glance = json.loads((report / "tour.json").read_text())["glance"]
    counts = {row["arch"]: (row["params"], row["active params"]) for row in glance}
    assert counts["llama"][0] == counts["llama"][1] and counts["moe"][1] < counts["moe"][0]
    assert {row["arch"]: row["quality against"] for row in glance} == {
        "llama": "llama", "parallel": "llama", "ladder": "llama", "moe": "moe", "scmoe": "moe", "linear_hybrid": "llama",
        "gqla": "llama",
    }
    # every architecture predicted (tiny shape here): a speed-up at batch 1, each baseline at 1
    assert all(row["speed-up, batch 1"] is not None for row in glance)
    assert {row["arch"]: row["speed-up, batch 1"] for row in glance if row["arch"] in ("llama", "moe")} == {"llama": 1.0, "moe": 1.0}
    assert (report / "loss_curves.png").stat().st_size > 0
    assert list((run / "wandb").glob("offline-run-*"))
