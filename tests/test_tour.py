"""Smoke test of the zoo tour (`make demo`) at toy sizes: every stage runs and the report is written.
Slow (about 3 minutes on 2 cores): excluded from `make test`; run with `pytest -m slow`."""

import subprocess
import sys

import pytest

OVERRIDES = [
    "archs=[llama,parallel,ladder]",
    "pretrain_overrides=['experiment=demo','trainer.max_steps=4','trainer.val_check_interval=2',"
    "'trainer.limit_val_batches=2','data.seq_len=32','data.batch_size=4','logger=csv','sample.num_lines=0']",
    "convert.retrain_overrides=['trainer.max_steps=2','trainer.limit_val_batches=2','trainer.val_check_interval=2',"
    "'data.seq_len=32','data.batch_size=4','logger=none','callbacks=none']",
    "quality_overrides=['logger=none','threads=1','perplexity.max_batches=2','tasks.limit=5','tasks.bootstrap_iters=0']",
    "bench_overrides=['bench_shape=tiny','batch_sizes=[1]','repeats=1','logger=none','tp=[2]']",
]


@pytest.mark.slow
def test_tour_writes_report(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    report = tmp_path / "report"
    command = [sys.executable, "-m", "eval.tour", f"hydra.run.dir={tmp_path / 'run'}", f"report_dir={report}", *OVERRIDES]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=900)
    text = (report / "README.md").read_text()
    for heading in ("## Quality at equal tokens", "## Llama -> Ladder conversion", "## Speed"):
        assert heading in text
    for arch in ("llama", "parallel", "ladder", "ladder (converted from llama)"):
        assert f"| {arch} |" in text
    assert (report / "loss_curves.png").stat().st_size > 0
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))
