"""End-to-end runs of `python -m train.pretrain` on CPU with a tiny model and a few steps.

- fast_dev_run in this process: trains, saves `hf/`, which loads with `AutoModelForCausalLM`;
- DDP with 2 gloo processes started by Lightning from the real command line;
- resume after SIGKILL: a run killed after its first checkpoint, started again with the same command,
  continues from `last.ckpt` and ends with exactly the weights of a run that was never interrupted;
  that uninterrupted run also logs to W&B offline, whose run directory is checked.

Each subprocess pays ~8 s of imports (torch, lightning, transformers) on a 2-core machine.
"""

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import models  # noqa: F401  (registers the zoo with the Auto classes)
from train.pretrain import train

REPO = Path(__file__).resolve().parents[1]

# A 2-layer, 64-wide llama on 32-token blocks: a step takes milliseconds, so the runs below are
# dominated by process start-up, not training.
TINY = [
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
    "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=2",
    "model.config.num_key_value_heads=1",
    "data.seq_len=32",
    "data.batch_size=4",
    "trainer.limit_val_batches=2",
    "optimizer.warmup_steps=2",
]


@pytest.fixture(autouse=True)
def wandb_offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def compose_pretrain(overrides: list[str], output_dir: Path):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("pretrain", overrides=[*overrides, f"paths.output_dir={output_dir}"])


def pretrain_command(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "train.pretrain", f"hydra.run.dir={run_dir}", *TINY, *overrides]


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def run_pretrain(run_dir: Path, *overrides: str, timeout: float = 240) -> str:
    """Runs the entry point to completion (cwd: a temp dir, so nothing lands in the repo); its output."""
    proc = subprocess.run(
        pretrain_command(run_dir, *overrides),
        cwd=run_dir.parent,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output


def test_fast_dev_run_saves_loadable_model(tmp_path):
    cfg = compose_pretrain([*TINY, "debug=fdr"], tmp_path)
    result = train(cfg)

    assert result["global_step"] == 1
    assert math.isfinite(result["train_loss"])
    assert math.isfinite(result["val_at_start"]["ppl"]) and math.isfinite(result["val_at_end"]["ppl"])
    hf_dir = tmp_path / "hf"
    assert Path(result["hf_dir"]) == hf_dir
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    assert model.config.hidden_size == 64 and model.config.vocab_size == len(tokenizer)
    assert result["num_parameters"] == sum(p.numel() for p in model.parameters())
    input_ids = tokenizer("To be, or not to be", return_tensors="pt")["input_ids"]
    loss = model(input_ids=input_ids, labels=input_ids).loss
    assert torch.isfinite(loss)


def test_ddp_two_gloo_processes(tmp_path):
    run_dir = tmp_path / "ddp"
    output = run_pretrain(
        run_dir,
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "logger=csv",
        "callbacks.model_checkpoint.every_n_train_steps=2",
    )
    assert "distributed_backend=gloo" in output
    assert "Starting with 2 processes" in output
    assert "[val] step      4" in output
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 4
    AutoModelForCausalLM.from_pretrained(run_dir / "hf")


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.is_file():
        assert proc.poll() is None, f"the run ended (rc={proc.returncode}) before writing {path}"
        assert time.monotonic() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.02)


def test_resume_after_kill_matches_uninterrupted_run(tmp_path):
    max_steps = 24
    # every_n_train_steps=3 and a slow-enough run, so the kill lands well before the end.
    overrides = [
        f"trainer.max_steps={max_steps}",
        "trainer.val_check_interval=6",
        "callbacks.model_checkpoint.every_n_train_steps=3",
        "trainer=cpu",
    ]

    # Uninterrupted reference run (in this process, to save an interpreter start), logging to W&B offline.
    reference = tmp_path / "reference"
    result = train(compose_pretrain([*TINY, *overrides, "logger=wandb"], reference))
    assert result["global_step"] == max_steps and result["resumed_from"] is None
    wandb_runs = list((reference / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 1
    # Offline runs keep their history in a binary record file (no summary json); the keys are in it.
    # wandb's writer process may still be flushing it when finish() returns: give it a few seconds.
    keys = (b"train/loss", b"train/lr", b"train/grad_norm", b"train/tokens_per_s", b"val/loss", b"val/ppl")
    deadline = time.monotonic() + 30
    while True:
        records = b"".join(p.read_bytes() for p in wandb_runs[0].glob("run-*.wandb"))
        missing = [k for k in keys if k not in records]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not missing, f"W&B offline record lacks {missing}"

    # The same job, killed (SIGKILL: no chance to clean up) right after its first checkpoint ...
    interrupted = tmp_path / "interrupted"
    command = pretrain_command(interrupted, *overrides, "logger=csv")
    last = interrupted / "checkpoints" / "last.ckpt"
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(
            command,
            cwd=tmp_path,
            env=subprocess_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_for_file(last, proc, timeout=240)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    killed_at = torch.load(last, weights_only=False)["global_step"]
    assert 0 < killed_at < max_steps
    assert not (interrupted / "hf").exists()

    # ... and started again with the very same command: it continues from last.ckpt.
    output = run_pretrain(interrupted, *overrides, "logger=csv")
    assert f"Resuming from {last}" in output
    resumed_metrics = (interrupted / "csv" / "version_1" / "metrics.csv").read_text().splitlines()
    header = resumed_metrics[0].split(",")
    first_step = int(resumed_metrics[1].split(",")[header.index("step")])
    assert first_step == killed_at  # the first step logged after the restart is the one after the checkpoint
    assert torch.load(last, weights_only=False)["global_step"] == max_steps

    # Nothing is lost: every weight equals the uninterrupted run's, bit for bit. Same code, same
    # data order (the train loader's position is in the checkpoint), same optimizer and schedule
    # state, no dropout and the same thread count on CPU, so fp32 results are identical.
    expected = load_file(reference / "hf" / "model.safetensors")
    actual = load_file(interrupted / "hf" / "model.safetensors")
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=0, msg=name)


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path):
    from train.module import CausalLMModule
    from train.pretrain import check_checkpoint_fits

    config = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    optimizer = {
        "lr": 1e-3,
        "betas": [0.9, 0.95],
        "weight_decay": 0.0,
        "warmup_steps": 1,
        "min_lr_ratio": 0.1,
    }
    module = CausalLMModule("llama", config, vocab_size=100, optimizer=optimizer)
    ckpt = tmp_path / "last.ckpt"
    torch.save({"hyper_parameters": dict(module.hparams)}, ckpt)
    check_checkpoint_fits(str(ckpt), module)  # its own checkpoint fits

    torch.save({"hyper_parameters": {**module.hparams, "model_config": {**config, "hidden_size": 64}}}, ckpt)
    with pytest.raises(ValueError, match="model.config.hidden_size=64 there but 32 here"):
        check_checkpoint_fits(str(ckpt), module)


@pytest.mark.parametrize("val_every", [3, 4], ids=["last-step-validated", "validated-after-fit"])
def test_the_final_checkpoint_keeps_the_data_position(tmp_path, val_every):
    """A finished run continued to a higher max_steps goes on with the epoch's next batch, whether or not its
    last step was a validation step (if not, train.pretrain validates after fit, outside the fit loop)."""
    common = [*TINY, "trainer=cpu", "logger=none", f"trainer.val_check_interval={val_every}"]
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"

    def position():
        checkpoint = torch.load(last, weights_only=False)
        (state,) = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
        return checkpoint["global_step"], state["epoch"], state["batches_consumed"]

    train(compose_pretrain([*common, "trainer.max_steps=6"], tmp_path / "run"))
    assert position() == (6, 0, 6)
    train(compose_pretrain([*common, "trainer.max_steps=10"], tmp_path / "run"))
    assert position() == (10, 0, 10)  # 4 more batches of the same epoch, not a restarted one


def test_a_continued_run_logs_its_steps_at_the_uninterrupted_numbers(tmp_path):
    common = [*TINY, "trainer=cpu", "logger=csv", "trainer.val_check_interval=4"]

    def train_steps(run: Path, version: int) -> list[int]:
        rows = (run / "csv" / f"version_{version}" / "metrics.csv").read_text().splitlines()
        header = rows[0].split(",")
        return [int(r.split(",")[header.index("step")]) for r in rows[1:] if r.split(",")[header.index("train/loss")]]

    train(compose_pretrain([*common, "trainer.max_steps=8"], tmp_path / "once"))
    train(compose_pretrain([*common, "trainer.max_steps=4"], tmp_path / "twice"))
    train(compose_pretrain([*common, "trainer.max_steps=8"], tmp_path / "twice"))
    assert train_steps(tmp_path / "once", 0) == list(range(8))
    assert train_steps(tmp_path / "twice", 0) + train_steps(tmp_path / "twice", 1) == list(range(8))
