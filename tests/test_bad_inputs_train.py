"""Bad inputs and misuses of a training run (`train.pretrain`): nothing lost, nothing silent.

Each case asserts the message a user now gets, or the data that is now preserved:

- a run directory that holds another run is not overwritten unless `overwrite=true`;
- out-of-range optimizer / trainer values, a sequence length that sp does not divide and torchrun with the
  wrong number of processes are refused before anything is built;
- resuming past `trainer.max_steps` says so; continuing a finished run (2 steps, then up to 4) is the run that
  never stopped, weight for weight;
- SIGTERM writes the checkpoint and exits 143, and the run resumes from it exactly;
- a checkpoint (or init_from) with NaN weights is refused, naming the tensors;
- config errors and an unwritable run directory are one sentence at the console (a traceback with
  HYDRA_FULL_ERROR=1);
- a rank that stops (SIGSTOP) is named and killed, and rank 0 says what it waits for (slow).

Tiny llama, a few steps, CPU. The in-process runs share the interpreter's imports; each subprocess pays
~8 s of them.
"""

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_train import REPO, TINY, compose_pretrain, subprocess_env
from tests.test_train_safety import start_wrapped
from train.cli import explain
from train.module import Interrupted, TrainingError
from train.pretrain import check_config, checkpoint_on_disk, train

FAST = [*TINY, "trainer=cpu", "logger=none", "callbacks.progress_bar=null", "trainer.val_check_interval=2"]


def run(tmp: Path, *overrides: str) -> dict:
    return train(compose_pretrain([*FAST, *overrides], tmp))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A 4-step run never stopped: the reference for the continued and the SIGTERM-ed ones."""
    directory = tmp_path_factory.mktemp("straight")
    result = train(compose_pretrain([*FAST, "trainer.max_steps=4", "optimizer.warmup_steps=3"], directory))
    return result, load_file(directory / "hf" / "model.safetensors")


def assert_same_weights(hf_dir: Path, expected: dict) -> None:
    actual = load_file(hf_dir / "model.safetensors")
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=0, msg=name)


# ------------------------------------------------------------------------------------- run directories


def test_resume_never_does_not_overwrite_another_run(tmp_path):
    run(tmp_path, "trainer.max_steps=2")
    last, weights = tmp_path / "checkpoints" / "last.ckpt", tmp_path / "hf" / "model.safetensors"
    kept = digest(last), digest(weights)
    held = r"checkpoints/last\.ckpt of llama at step 2 and hf/ \(zoo_llama\)"
    # another model, and the same one started afresh: both would replace the run that is there
    for model in ("model=parallel", "model=llama"):
        with pytest.raises(ValueError, match=rf"already holds another run \({held}\).*resume=never starts a new run\); "
                           r"pass overwrite=true to replace it on purpose, or choose another hydra\.run\.dir"):
            run(tmp_path, model, "resume=never", "trainer.max_steps=1")
    assert (digest(last), digest(weights)) == kept

    # asked for: the old run is removed first, the new one written
    result = run(tmp_path, "model=parallel", "resume=never", "overwrite=true", "trainer.max_steps=1")
    assert result["global_step"] == 1
    saved = torch.load(last, map_location="cpu", weights_only=False)
    assert saved["hyper_parameters"]["model_name"] == "parallel" and saved["global_step"] == 1
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "zoo_parallel"


def test_resume_auto_over_an_hf_dir_without_checkpoint_is_refused(tmp_path):
    run(tmp_path, "callbacks.model_checkpoint=null", "trainer.max_steps=1")  # hf/ but no last.ckpt
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()
    with pytest.raises(ValueError, match=r"holds another run \(hf/ \(zoo_llama\)\).*resume=auto finds no checkpoint"):
        run(tmp_path, "trainer.max_steps=1")


# --------------------------------------------------------------------------- values refused up front

RANGE_CASES = [
    ("optimizer.warmup_steps=-1", r"optimizer\.warmup_steps=-1 must be an integer >= 0"),
    ("optimizer.warmup_steps=2.5", r"optimizer\.warmup_steps=2\.5 must be an integer >= 0"),
    ("optimizer.lr=0", r"optimizer\.lr=0 must be a positive number"),
    ("optimizer.lr=-1e-3", r"optimizer\.lr=-0\.001 must be a positive number"),
    ("optimizer.min_lr_ratio=1.5", r"optimizer\.min_lr_ratio=1\.5 must be in \[0, 1\]"),
    ("optimizer.weight_decay=-0.1", r"optimizer\.weight_decay=-0\.1 must be a number >= 0"),
    ("optimizer.betas=[0.9,1.5]", r"optimizer\.betas=\[0\.9, 1\.5\] must be two numbers in \[0, 1\)"),
    ("+optimizer.lrr=1e-3", r"Unknown optimizer setting optimizer\.lrr \(did you mean optimizer\.lr\?\)"),
    ("trainer.max_steps=0", r"trainer\.max_steps=0 must be an integer >= 1"),
    ("trainer.max_steps=-1", r"trainer\.max_steps=-1 must be an integer >= 1"),
    ("trainer.accumulate_grad_batches=0", r"trainer\.accumulate_grad_batches=0 must be an integer >= 1"),
    ("trainer.val_check_interval=0", r"trainer\.val_check_interval=0 must be an integer >= 1 .* or a fraction"),
    ("trainer.gradient_clip_val=-1", r"trainer\.gradient_clip_val=-1 must be a number >= 0"),
    ("nonfinite_loss=ignore", r"nonfinite_loss='ignore'; use one of stop, skip"),
    ("overwrite=maybe", r"overwrite='maybe' must be true or false"),
    # sequence parallelism splits every sequence into sp chunks
    ("data.seq_len=31 parallel=sp2", r"data\.seq_len=31 does not split over parallel\.sp=2 ranks .*data\.seq_len=30 or 32"),
]


@pytest.mark.parametrize("override, message", RANGE_CASES, ids=[c[0] for c in RANGE_CASES])
def test_out_of_range_values_are_refused(tmp_path, override, message):
    cfg = compose_pretrain([*TINY, *override.split()], tmp_path)
    with pytest.raises(ValueError, match=message):
        check_config(cfg)


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        ([], 2, r"torchrun started 2 processes \(WORLD_SIZE=2\), but parallel=none trains in one.*parallel\.dp=2"),
        (["parallel=dp2_tp2"], 2, r"torchrun started 2 processes .* but parallel\.dp=2 x parallel\.tp=2 needs 4"),
        (["parallel=tp2"], 4, r"torchrun started 4 processes .* but parallel\.tp=2 needs 2"),
    ],
)
def test_torchrun_with_the_wrong_number_of_processes_is_refused(tmp_path, monkeypatch, overrides, world, message):
    # what torchrun sets in every process it starts (torch.distributed.is_torchelastic_launched reads it)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = compose_pretrain([*[o.replace("num_key_value_heads=1", "num_key_value_heads=2") for o in TINY], *overrides], tmp_path)
    with pytest.raises(ValueError, match=message):
        check_config(cfg)
    monkeypatch.setenv("WORLD_SIZE", "4" if "parallel=dp2_tp2" in overrides else "2" if overrides else "1")
    check_config(cfg)  # the right number passes


@pytest.mark.slow  # two interpreters under torchrun: ~25 s
def test_torchrun_with_parallel_none_is_refused_once(tmp_path):
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2", "-m", "train.pretrain",
         f"hydra.run.dir={tmp_path / 'run'}", *FAST],
        cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=180,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    sentence = "Error: torchrun started 2 processes (WORLD_SIZE=2), but parallel=none trains in one"
    assert output.count(sentence) == 1, output[-3000:]  # by local rank 0 only
    assert "parallel.dp=2" in output and not (tmp_path / "run" / "hf").exists()


# -------------------------------------------------------------------------------- resume and continue


def test_resume_past_max_steps_says_so(tmp_path):
    run(tmp_path, "trainer.max_steps=4")
    weights = digest(tmp_path / "hf" / "model.safetensors")
    with pytest.raises(TrainingError, match=r"last\.ckpt is at step 4, already past trainer\.max_steps=2; pass "
                       r"trainer\.max_steps>=4 to continue it"):
        run(tmp_path, "trainer.max_steps=2")
    assert digest(tmp_path / "hf" / "model.safetensors") == weights


def test_continuing_a_finished_run_is_the_run_that_never_stopped(tmp_path, straight, caplog):
    expected_result, expected = straight
    # warm-up 3 > max_steps 2: the first part ends inside the warm-up, which is not shortened to fit it
    first = run(tmp_path, "trainer.max_steps=2", "optimizer.warmup_steps=3")
    assert first["global_step"] == 2
    caplog.set_level("INFO", logger="train.module")
    continued = run(tmp_path, "trainer.max_steps=4", "optimizer.warmup_steps=3")
    assert continued["global_step"] == 4 and continued["resumed_from"] == str(tmp_path / "checkpoints" / "last.ckpt")
    assert "trainer.max_steps changed 2 -> 4 on resume" in caplog.text
    # same data position (the rest of epoch 0, not a new epoch) and the same lr at every step
    assert continued["val_at_end"] == expected_result["val_at_end"]
    assert_same_weights(tmp_path / "hf", expected)
    # and a rerun of the finished run has nothing left to do
    caplog.set_level("INFO", logger="train.pretrain")
    again = run(tmp_path, "trainer.max_steps=4", "optimizer.warmup_steps=3")
    assert again["global_step"] == 4 and "is already at trainer.max_steps=4: nothing left to train" in caplog.text
    assert_same_weights(tmp_path / "hf", expected)


class SendSigterm(L.Callback):
    """Sends SIGTERM to this process during the batch of step `AT_STEP` (what a scheduler does)."""

    AT_STEP = 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.AT_STEP:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_writes_the_checkpoint_and_resumes_exactly(tmp_path, straight):
    _, expected = straight
    common = ["trainer.max_steps=4", "optimizer.warmup_steps=3"]
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted, match=r"Stopped by SIGTERM at step 2, after writing .*last\.ckpt: the same "
                       r"command with hydra\.run\.dir=.* resumes from it \(exit status 143\)"):
        run(tmp_path, *common, f"+callbacks.sigterm._target_={__name__}.SendSigterm")
    assert Interrupted.exit_code == 143
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 2
    assert not (tmp_path / "hf").exists()  # not a finished run
    assert signal.getsignal(signal.SIGTERM) is before  # the handler of before the run is back
    resumed = run(tmp_path, *common)
    assert resumed["global_step"] == 4
    assert_same_weights(tmp_path / "hf", expected)


SIGTERM_AT_STEP_3 = """
import signal
from train.module import CausalLMModule

_training_step = CausalLMModule.training_step


def training_step(self, batch, batch_idx):
    if self.global_step == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return _training_step(self, batch, batch_idx)


CausalLMModule.training_step = training_step
"""


def test_sigterm_exit_status_is_143(tmp_path):
    run_dir = tmp_path / "run"
    proc, out = start_wrapped(tmp_path, SIGTERM_AT_STEP_3, run_dir, *FAST, "trainer.max_steps=50")
    assert proc.wait(timeout=120) == 143, out.read_text()[-3000:]
    output = out.read_text()
    assert f"Stopped by SIGTERM at step 4, after writing {run_dir / 'checkpoints' / 'last.ckpt'}" in output
    assert "Traceback" not in output and "pretrain summary" not in output
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 4
    assert not (run_dir / "hf").exists()


# Rank 0 alone gets SIGTERM (as from `kill <its pid>`) at the start of step 3.
SIGTERM_RANK_0_AT_STEP_3 = """
import signal
from train.module import CausalLMModule

_training_step = CausalLMModule.training_step


def training_step(self, batch, batch_idx):
    if self.global_rank == 0 and self.global_step == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return _training_step(self, batch, batch_idx)


CausalLMModule.training_step = training_step
"""


@pytest.mark.slow  # two processes, twice: ~50 s
def test_sigterm_to_rank_0_stops_every_rank_at_the_same_step_and_resumes(tmp_path):
    from tests.test_train_safety import assert_group_ends

    run_dir = tmp_path / "run"
    overrides = [
        *[o.replace("num_key_value_heads=1", "num_key_value_heads=2") for o in FAST], "parallel=tp2",
        "trainer.max_steps=6", "logger=csv",
    ]
    proc, out = start_wrapped(tmp_path, SIGTERM_RANK_0_AT_STEP_3, run_dir, *overrides)
    assert proc.wait(timeout=180) == 143, out.read_text()[-3000:]
    assert_group_ends(proc.pid, timeout=30)  # rank 1 stopped too
    output = out.read_text()
    assert output.count("Stopped by SIGTERM at step 4, after writing") == 2, output[-3000:]  # both ranks, one step
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 4
    assert not (run_dir / "hf").exists()

    proc, out = start_wrapped(tmp_path, "", run_dir, *overrides)
    assert proc.wait(timeout=180) == 0, out.read_text()[-3000:]
    assert "Resuming from" in out.read_text()
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 6


def test_what_a_failed_run_says_is_on_disk(tmp_path):
    assert checkpoint_on_disk(tmp_path).startswith(f"No checkpoint was written yet ({tmp_path}/checkpoints/last.ckpt")
    (tmp_path / "checkpoints").mkdir()
    torch.save({"global_step": 6}, tmp_path / "checkpoints" / "last.ckpt")
    assert checkpoint_on_disk(tmp_path).startswith(
        f"The last checkpoint, {tmp_path}/checkpoints/last.ckpt (step 6), is intact: the same command"
    )


# ------------------------------------------------------------------------------------ non-finite weights


def test_checkpoint_with_nan_weights_is_refused_naming_them(tmp_path):
    run(tmp_path, "trainer.max_steps=2")
    last = tmp_path / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=False)
    name = "model.model.embed_tokens.weight"
    ckpt["state_dict"][name][3, :5] = float("nan")
    torch.save(ckpt, last)
    # (the embedding is tied to the LM head: both names hold the NaNs)
    with pytest.raises(TrainingError, match=rf"Cannot train from .*last\.ckpt \(step 2\): its weights hold non-finite "
                       rf"values \({name} \(5 NaN of \d+\).*\); every loss from them is NaN"):
        run(tmp_path, "trainer.max_steps=4")


def test_init_from_with_nan_weights_is_refused_naming_them(tmp_path):
    run(tmp_path / "source", "trainer.max_steps=1")
    hf = tmp_path / "source" / "hf"
    state = load_file(hf / "model.safetensors")
    name = next(k for k in state if k.endswith("layers.0.mlp.up_proj.weight"))
    state[name][0, 0] = float("inf")
    save_file(state, hf / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TrainingError, match=rf"Cannot train from init_from=.*hf: its weights hold non-finite values "
                       rf"\({name.replace('.', '[.]')} \(1 inf of \d+\)\)"):
        run(tmp_path / "run", f"+model.init_from={hf}", "trainer.max_steps=1")


def test_init_from_with_a_config_typo_is_refused_naming_the_field(tmp_path):
    # model.config is compared against the loaded checkpoint's config; a field no config has used to pass unseen.
    run(tmp_path / "source", "trainer.max_steps=1")
    hf = tmp_path / "source" / "hf"
    with pytest.raises(ValueError, match=r"has no field 'num_attention_head' \(did you mean 'num_attention_heads'\?\)"):
        run(tmp_path / "run", f"+model.init_from={hf}", "+model.config.num_attention_head=4", "trainer.max_steps=1")


# ----------------------------------------------------------------------------------- at the console


def run_main(monkeypatch, capsys, *args: str, full_error: bool = False):
    """`python -m train.pretrain <args>` in this process (an interpreter start saved): (exit status, stdout,
    stderr). Hydra's logging set-up is undone afterwards."""
    import train.pretrain

    monkeypatch.setattr(sys, "argv", ["train/pretrain.py", *args])
    # Hydra finds conf/ relative to the task's file when it runs as __main__, as under `python -m`
    monkeypatch.setattr(train.pretrain.main.__wrapped__.__wrapped__, "__module__", "__main__")
    # restored by monkeypatch afterwards, whatever the wrapper sets
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1" if full_error else "0")
    monkeypatch.setenv("OVERLAP_ZOO_ONE_SENTENCE_ERRORS", "")
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    capsys.readouterr()
    try:
        with pytest.raises(BaseException) as caught:
            train.pretrain.main()
    finally:
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
                handler.close()
        root.setLevel(level)
    captured = capsys.readouterr()
    error = caught.value
    return (error.code if isinstance(error, SystemExit) else error), captured.out, captured.err


def test_config_error_is_one_sentence(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    code, out, err = run_main(monkeypatch, capsys, f"hydra.run.dir={run_dir}", *TINY, "optimizer.warmup_steps=-1")
    assert code == 1
    assert err.splitlines() == [
        "Error: optimizer.warmup_steps=-1 must be an integer >= 0 (optimizer steps of linear warm-up; 0: none).",
        "(Set HYDRA_FULL_ERROR=1 for the full traceback.)",
    ], err
    assert "Traceback" not in out + err and "Error executing job" not in out + err
    assert "optimizer.warmup_steps=-1 must be" in (run_dir / "pretrain.log").read_text()  # in the run's log too

    # a Hydra error (an override of a key that does not exist): one sentence with the nearest names
    code, out, err = run_main(monkeypatch, capsys, f"hydra.run.dir={run_dir}", "trainer.max_step=4")
    assert code == 1 and err.splitlines()[0] == (
        "Error: trainer.max_step is not a setting of this config; did you mean trainer.max_steps or trainer.max_epochs?"
    ), err

    # asked for: the exception itself, for Hydra's full traceback
    error, _, _ = run_main(monkeypatch, capsys, f"hydra.run.dir={run_dir}", *TINY, "optimizer.warmup_steps=-1", full_error=True)
    assert isinstance(error, ValueError) and "warmup_steps=-1" in str(error)


def test_unwritable_run_directory_is_one_sentence(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if os.geteuid() == 0:  # root writes anywhere: a directory where the log file goes cannot be opened either
        (run_dir / "pretrain.log").mkdir()
    else:
        run_dir.chmod(0o555)
    code, out, err = run_main(monkeypatch, capsys, f"hydra.run.dir={run_dir}", *TINY)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"Error: Cannot write the run directory {run_dir} ("), err
    assert "hydra.run.dir=<dir>" in lines[0] and "Traceback" not in out + err


def hydra_error(*overrides: str) -> Exception:
    from hydra import compose, initialize_config_dir

    with pytest.raises(Exception) as caught, initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        compose("pretrain", overrides=list(overrides))
    return caught.value


def test_hydra_errors_are_one_sentence():
    assert explain(hydra_error("optimizer.lrr=1")) == (
        "optimizer.lrr is not a setting of this config; did you mean optimizer.lr?"
    )
    assert explain(hydra_error("trainer=gpux")) == (
        "In 'pretrain': Could not find 'trainer/gpux'; the options in 'trainer' are cpu, ddp, default."
    )
    assert explain(KeyError("a bug")) is None  # not a bad input: keeps its traceback


# ------------------------------------------------------------------------------------ a stopped rank

# Rank 1 stops itself (SIGSTOP: it cannot run or exit) at the start of step 2, before any checkpoint.
STOP_RANK_1_AT_STEP_2 = """
import signal
from train.module import CausalLMModule

_training_step = CausalLMModule.training_step


def training_step(self, batch, batch_idx):
    if self.global_rank == 1 and self.global_step == 2:
        with open(os.environ["STOPPED_PID"], "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
    return _training_step(self, batch, batch_idx)


CausalLMModule.training_step = training_step
"""


@pytest.mark.slow
def test_stopped_rank_is_named_killed_and_waited_for_aloud(tmp_path):
    run_dir, pid_file = tmp_path / "run", tmp_path / "stopped_pid"
    overrides = [
        *[o.replace("num_key_value_heads=1", "num_key_value_heads=2") for o in FAST],
        "parallel=tp2", "parallel.timeout_s=12", "trainer.max_steps=50",
    ]
    proc, out = start_wrapped(tmp_path, STOP_RANK_1_AT_STEP_2, run_dir, *overrides, env={"STOPPED_PID": str(pid_file)})
    try:
        returncode = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = out.read_text()
    stopped = int(pid_file.read_text())
    assert returncode == 1, output[-3000:]
    # said while waiting (at half the timeout), then the failure naming the rank and what is on disk
    assert "Rank 0 has finished no batch for 6 s (at step 2): it is waiting for the other ranks" in output
    assert "parallel.timeout_s=12 s" in output
    assert f"rank 1 (pid {stopped}) is stopped (SIGSTOP or a debugger)" in output, output[-3000:]
    assert f"Killed the ranks still running (pids {stopped})" in output
    assert "No checkpoint was written yet" in output and "is intact" not in output
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.kill(stopped, 0)  # not left behind


@pytest.mark.parametrize(
    "overrides, why",
    [
        (["parallel.param_dtype=bfloat16"], r"parallel=none has no dp, ep or sp rank"),
        (["parallel=tp2", "parallel.param_dtype=bfloat16"], r"parallel.tp=2 has no dp, ep or sp rank"),
        (["parallel.dp=2", "parallel.fsdp=false", "parallel.param_dtype=float16"], r"parallel.fsdp=false"),
    ],
)
def test_a_param_dtype_that_would_do_nothing_is_refused(overrides, why):
    cfg = compose_pretrain(["trainer=cpu", *overrides], Path("unused"))
    with pytest.raises(ValueError, match=rf"parallel.param_dtype=.* is FSDP's mixed precision.*\({why}.*bf16-mixed"):
        check_config(cfg)


def test_a_run_directory_holds_one_run(tmp_path, caplog):
    from train.run_lock import RunDirectoryInUse, hold_run_directory

    with hold_run_directory(tmp_path):  # another run, alive, holds the directory
        with pytest.raises(RunDirectoryInUse, match=r"is in use by another run \(pid \d+, started .*\)"):
            run(tmp_path, "trainer.max_steps=1")
        assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "hf").exists()
    # A lock file left by a process that has ended: taken over, said in one line.
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / ".run.lock").write_text(f"pid {ended.stdout.strip()}, started earlier\n")
    caplog.set_level(logging.INFO, logger="train.pretrain")
    run(tmp_path, "trainer.max_steps=1")
    assert "has ended; this run takes it over" in caplog.text
    assert (tmp_path / "hf").is_dir()
