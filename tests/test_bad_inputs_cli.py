"""Bad inputs at the command line: every Hydra entry point says a bad input in ONE `Error:` line
naming the value and what would fit, exits 1 (README, "Runs, resume and exit codes"), prints neither Hydra's
"Error executing job with overrides" line nor a traceback, and changes nothing on disk; and one "output
directory already holds results" rule for every command that writes a report or a model.

A few cases run as real subprocesses (`python -m ...`); the rest run the same `__main__` path in this process
(`one_sentence_errors(main)()` with the command line in sys.argv), which is what `python -m` runs, minus the
interpreter's start-up.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import models
from models.checkpoint import save_checkpoint
from train.cli import results_in
from train.data import load_tokenizer

REPO = Path(__file__).resolve().parents[1]


def one_error_line(text: str) -> str:
    """The one `Error:` line of a command's output (asserting there is exactly one, and no traceback)."""
    assert "Traceback" not in text, text
    assert "Error executing job" not in text, text
    errors = [line for line in text.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, text
    return errors[0]


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` (but Hydra's own .hydra/ and log files, and a run directory's lock) and its bytes."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".hydra" not in p.parts and p.suffix != ".log" and p.name != ".run.lock"
    }


def run_cli(args: list[str], **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "WANDB_MODE": "offline", **env}
    if "HYDRA_FULL_ERROR" not in env:
        environment.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120, env=environment
    )


@pytest.fixture
def in_process(monkeypatch, capsys):
    """run(module, argv) -> (exit status, stderr): `python -m <module> *argv` in this process."""
    import importlib

    from train.cli import one_sentence_errors

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.delenv("OVERLAP_ZOO_ONE_SENTENCE_ERRORS", raising=False)

    def run(module_name: str, argv: list[str]) -> tuple[int, str]:
        module = importlib.import_module(module_name)
        main = module.main if module_name == "train.pretrain" else one_sentence_errors(module.main)
        monkeypatch.setattr(sys, "argv", [module.__file__, f"--config-path={REPO / 'conf'}", *argv])
        capsys.readouterr()
        try:
            main()
            code = 0
        except SystemExit as exited:
            code = exited.code
        finally:
            # the wrapper's HYDRA_FULL_ERROR stays set in this process: put it back for the next command
            os.environ.pop("HYDRA_FULL_ERROR", None)
            os.environ.pop("OVERLAP_ZOO_ONE_SENTENCE_ERRORS", None)
        captured = capsys.readouterr()
        return code, captured.out + captured.err

    return run


# ------------------------------------------------------------------------------------------ checkpoints


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    tokenizer = load_tokenizer()
    torch.manual_seed(0)
    model = models.ZOO["llama"].model_class(models.ZOO["llama"].tiny(vocab_size=len(tokenizer))).eval()
    out = tmp_path_factory.mktemp("llama") / "hf"
    save_checkpoint(model, tokenizer, out)
    return out


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> Path:
    """A tiny Mixtral of 512 tokens, saved without a tokenizer (as a bare hub download of weights)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("mixtral") / "hf"
    MixtralForCausalLM(config).save_pretrained(out)
    return out


# ------------------------------------------------------------------------------ real subprocesses


def test_convert_missing_source_is_one_line_exit_1(tmp_path):
    proc = run_cli(["-m", "train.convert", f"source={tmp_path / 'nope'}", "ladder_layers=1",
                    f"hydra.run.dir={tmp_path / 'run'}"])  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert str(tmp_path / "nope") in one_error_line(proc.stdout + proc.stderr)
    assert snapshot(tmp_path / "run") == {}


def test_bench_negative_prompt_len_is_one_line_before_any_work(tmp_path):
    proc = run_cli(["-m", "eval.bench", "prompt_len=-4", "logger=none", f"out_dir={tmp_path / 'out'}",
                    f"hydra.run.dir={tmp_path / 'run'}"])  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "prompt_len=-4" in one_error_line(proc.stdout + proc.stderr)
    assert snapshot(tmp_path / "out") == {}


def test_gpu_check_unknown_architecture_refused_before_measuring(tmp_path):
    out = tmp_path / "report"
    proc = run_cli(["-m", "eval.gpu_check", "--device", "cpu", "--quick", "--archs", "llama,lama", "--out", str(out)])
    assert proc.returncode == 1, proc.stderr
    line = one_error_line(proc.stdout + proc.stderr)
    assert "'lama'" in line and "llama" in line
    assert not out.exists()


def test_replicate_without_seeds_is_refused(tmp_path):
    out = tmp_path / "report"
    proc = run_cli(["-m", "eval.replicate", "seeds=[]", f"out_dir={out}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode == 1, proc.stderr
    assert "seeds=[]" in one_error_line(proc.stdout + proc.stderr)
    assert not out.exists()


# --------------------------------------------------------------------- the same path, in this process


def test_full_error_still_gives_the_exception(monkeypatch, tmp_path):
    """HYDRA_FULL_ERROR=1 (the user's): the exception propagates, as Hydra documents (a traceback)."""
    from train import convert
    from train.cli import one_sentence_errors

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    monkeypatch.delenv("OVERLAP_ZOO_ONE_SENTENCE_ERRORS", raising=False)
    monkeypatch.setattr(sys, "argv", [convert.__file__, f"--config-path={REPO / 'conf'}", f"source={tmp_path / 'nope'}",
                                      "ladder_layers=1", f"hydra.run.dir={tmp_path / 'run'}"])  # fmt: skip
    with pytest.raises(FileNotFoundError, match="nope"):
        one_sentence_errors(convert.main)()


def test_config_validator_error_is_one_line(in_process, tmp_path):
    code, text = in_process("train.pretrain", ["model=llama", "model.config.hidden_size=30",
                                               f"hydra.run.dir={tmp_path / 'run'}"])  # fmt: skip
    assert code == 1
    line = one_error_line(text)
    assert "hidden size (30)" in line and "(4)" in line
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "hf").exists()


def test_init_from_without_plus_says_how_to_add_it(in_process, tmp_path):
    code, text = in_process("train.pretrain", [f"model.init_from={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert code == 1
    assert "+model.init_from=" in one_error_line(text)


def test_readme_spells_init_from_with_a_plus():
    # The docs (README.md and docs/*.md) spell the key the way Hydra accepts it.
    readme = "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    assert "+model.init_from=" in readme
    assert " model.init_from=" not in readme.replace("+model.init_from=", "")


@pytest.mark.parametrize(
    "override, named",
    [
        ("converter=llama_to_nothing", "llama_to_nothing"),
        ("num_local_experts=4", "num_local_experts=4"),  # an option of llama_to_moe, given to llama_to_ladder
    ],
)
def test_convert_refusals_are_one_line(in_process, tmp_path, llama_dir, override, named):
    run = tmp_path / "run"
    code, text = in_process("train.convert", [f"source={llama_dir}", "ladder_layers=1", override,
                                              f"hydra.run.dir={run}"])  # fmt: skip
    assert code == 1
    assert named in one_error_line(text)
    assert snapshot(run) == {}


def test_mixtral_given_to_llama_to_moe_points_to_mixtral_to_moe(in_process, tmp_path, mixtral_dir):
    code, text = in_process("train.convert", ["converter=llama_to_moe", f"source={mixtral_dir}",
                                              f"hydra.run.dir={tmp_path / 'run'}"])  # fmt: skip
    assert code == 1
    line = one_error_line(text)
    assert "'mixtral'" in line and "converter=mixtral_to_moe" in line
    assert snapshot(tmp_path / "run") == {}


def test_mixtral_vocabulary_smaller_than_the_tokenizer_refused_before_writing(in_process, tmp_path, mixtral_dir):
    run = tmp_path / "run"
    code, text = in_process("train.convert", ["converter=mixtral_to_moe", f"source={mixtral_dir}",
                                              f"hydra.run.dir={run}"])  # fmt: skip
    assert code == 1
    line = one_error_line(text)
    assert "512" in line and "8,192" in line and "data.tokenizer=" in line
    assert snapshot(run) == {}  # no converted model written


def test_convert_twice_into_one_run_directory_is_refused_unless_overwrite(in_process, tmp_path, llama_dir):
    run = tmp_path / "run"
    argv = [f"source={llama_dir}", "evaluate.enabled=false", f"hydra.run.dir={run}"]
    assert in_process("train.convert", [*argv, "ladder_layers=2"])[0] == 0
    first = snapshot(run / "ladder")
    assert json.loads(first["config.json"])["ladder_layers"] == 2

    code, text = in_process("train.convert", [*argv, "ladder_layers=1"])
    assert code == 1
    line = one_error_line(text)
    assert str(run / "ladder") in line and "overwrite=true" in line
    assert snapshot(run / "ladder") == first  # the first conversion is untouched

    assert in_process("train.convert", [*argv, "ladder_layers=1", "overwrite=true"])[0] == 0
    assert json.loads((run / "ladder" / "config.json").read_text())["ladder_layers"] == 1


@pytest.mark.parametrize(
    "override, named",
    [
        ("prompt_len=0", "prompt_len=0"),
        ("new_tokens=-1", "new_tokens=-1"),
        ("batch_sizes=[1,-2]", "batch_sizes=[1, -2]"),
        ("batch_sizes=[]", "batch_sizes=[]"),
        ("warmup=-1", "warmup=-1"),
        ("repeats=0", "repeats=0"),
    ],
)
def test_bench_numbers_refused_before_any_work(in_process, tmp_path, override, named):
    out = tmp_path / "out"
    code, text = in_process("eval.bench.__main__", [override, "logger=none", f"out_dir={out}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert code == 1
    assert named in one_error_line(text)
    assert not out.exists()


# ----------------------------------------------------------------- one rule for output directories

REPORT_APPS = ["eval.quality", "eval.bench.__main__", "eval.plan", "eval.validation", "eval.costmodel", "eval.at_scale",
               "eval.bench_data"]


@pytest.mark.parametrize("module", REPORT_APPS)
def test_report_directory_with_results_is_refused(in_process, tmp_path, module):
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("an earlier report\n")
    extra = {"eval.quality": ["checkpoint=/nowhere", "logger=none"], "eval.bench_data": [f"work_dir={tmp_path / 'work'}"]}
    code, text = in_process(module, [*extra.get(module, ["logger=none"]), f"out_dir={out}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert code == 1 and not (tmp_path / "work").exists()
    line = one_error_line(text)
    assert str(out) in line and "overwrite=true" in line
    assert snapshot(out) == {"README.md": b"an earlier report\n"}


def test_a_fresh_hydra_run_directory_holds_no_results(tmp_path):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("{}")
    (tmp_path / "__main__.log").write_text("")
    assert results_in(tmp_path) == []
    assert results_in(tmp_path / "absent") == []
    (tmp_path / "results.json").write_text("{}")
    assert results_in(tmp_path) == ["results.json"]


@pytest.mark.parametrize("command", ["gqla_regroup", "gqla_rank_sweep"])
def test_the_gqla_sweeps_never_replace_a_report(command, tmp_path):
    import importlib

    main = importlib.import_module(f"eval.{command}").main
    out = tmp_path / "report"
    out.mkdir()
    (out / "sweep.md").write_text("the first sweep\n")
    choice = ["--groups", "1"] if command == "gqla_regroup" else ["--ranks", "8"]
    with pytest.raises(SystemExit) as exited:  # refused before the source is read: it need not exist
        main([str(tmp_path / "no-checkpoint"), str(out), *choice])
    message = str(exited.value.code)
    assert message.startswith("Error:") and str(out) in message and "--overwrite" in message
    assert snapshot(out) == {"sweep.md": b"the first sweep\n"}


def test_gpu_check_never_replaces_a_report(tmp_path, capsys):
    from eval import gpu_check

    out = tmp_path / "report"
    out.mkdir()
    (out / "README.md").write_text("the first GPU run\n")
    with pytest.raises(SystemExit) as exited:
        gpu_check.main(["--device", "cpu", "--quick", "--out", str(out)])
    message = str(exited.value.code)
    assert message.startswith("Error:") and str(out) in message and "--overwrite" in message
    assert snapshot(out) == {"README.md": b"the first GPU run\n"}


def test_replicate_resumes_its_own_report_and_refuses_anything_else(tmp_path):
    from hydra import compose, initialize_config_dir

    from eval.replicate import check_out_dir
    from train.cli import OutputExistsError

    out = tmp_path / "report"
    (out / "seeds").mkdir(parents=True)
    (out / "seeds" / "llama-seed42.json").write_text("{}")
    (out / "results.json").write_text(json.dumps({"settings": {"seeds": [42]}}))
    (out / "README.md").write_text("report\n")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("replicate", overrides=[f"out_dir={out}"])
    check_out_dir(cfg)  # its own finished runs: resumed

    (out / "notes.txt").write_text("something else\n")
    with pytest.raises(OutputExistsError, match="overwrite=true"):
        check_out_dir(cfg)
    (out / "notes.txt").unlink()
    (out / "results.json").write_text(json.dumps({"rows": []}))  # a bench's results.json, not a replicate report
    with pytest.raises(OutputExistsError):
        check_out_dir(cfg)
    cfg.overwrite = True
    check_out_dir(cfg)


def test_an_output_path_that_is_a_file_is_refused_without_advising_overwrite(tmp_path):
    from eval import gpu_check

    out = tmp_path / "report.txt"
    out.write_text("not a folder\n")
    for flags in ([], ["--overwrite"]):  # --overwrite cannot turn a file into a folder: the same one line
        with pytest.raises(SystemExit) as exited:
            gpu_check.main(["--device", "cpu", "--quick", "--out", str(out), *flags])
        message = str(exited.value.code)
        assert message.startswith("Error:") and "exists and is not a directory; choose another --out <dir>" in message
        assert "--overwrite" not in message and out.read_text() == "not a folder\n"


def test_the_advice_for_an_unreadable_checkpoint_works_as_given(tmp_path):
    """`Cannot resume: ... start over with resume=never overwrite=true`: that command starts over."""
    from tests.test_train import TINY, compose_pretrain
    from train.pretrain import train

    common = [*TINY, "trainer=cpu", "logger=none", "trainer.max_steps=2"]
    train(compose_pretrain(common, tmp_path))
    last = tmp_path / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:1000])  # cut short
    with pytest.raises(Exception, match=r"start over with resume=never overwrite=true") as refused:
        train(compose_pretrain([*common, "resume=" + str(last)], tmp_path))
    advice = re.search(r"start over with (resume=never overwrite=true)", str(refused.value)).group(1).split()
    assert train(compose_pretrain([*common, *advice], tmp_path))["global_step"] == 2
