"""Bad inputs and silent results of the evaluation side: each case is one that used to pass
without a word, and the message, file or figure it must now give.

- a checkpoint with a NaN weight: refused by eval.quality (and the "zoo" lm-eval model) naming the tensor,
  with a non-zero exit from the command line; every JSON the evaluations write is valid (NaN -> null);
- `tasks.bundled=[<unknown>]`: refused before the model is loaded, naming the bundled tasks;
- the files-only entry points (eval.at_scale, eval.validation, eval.costmodel) take `logger=none` like
  eval.bench and eval.quality, and refuse `logger=wandb` instead of ignoring it;
- checkpoints: weights readable by others (0644 under umask 022), no `local_files_only` in
  tokenizer_config.json, a README that says how lm-eval's CLI finds the bundled tasks and why a stock class
  must not load a zoo checkpoint;
- reports: the tour's cloze column is a log-likelihood, the bench's last line counts every section's rows,
  one colour per architecture in every figure, LASP-1 and LASP-2 told apart, far hidden fractions clipped.

Tiny models only; one subprocess (the quality command line's exit status).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import AutoTokenizer

import models
from eval import quality
from eval import report as plots
from eval.bench import generation_report, sp_report
from eval.bench.app import rows_written
from eval.lm_eval_adapter import ZooLM
from eval.tour import quality_rows
from models.checkpoint import save_checkpoint
from train.data import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
BUNDLED = ["shakespeare_cloze", "shakespeare_next_line", "shakespeare_passages"]


def compose_conf(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(name, overrides=overrides)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tokenizer):
    """{"good": a tiny llama checkpoint, "nan": the same with one embedding row (a prompt token's) NaN}."""
    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    model = models.ZOO["llama"].model_class(models.ZOO["llama"].tiny(vocab_size=len(tokenizer))).eval()
    save_checkpoint(model, tokenizer, root / "good")
    token = tokenizer(" the")["input_ids"][0]
    with torch.no_grad():
        model.model.embed_tokens.weight[token] = float("nan")
    save_checkpoint(model, tokenizer, root / "nan")
    return {"good": root / "good", "nan": root / "nan", "hidden": model.config.hidden_size}


def quality_cfg(checkpoint: Path, out: Path, *overrides: str):
    return compose_conf(
        "quality",
        [f"checkpoint={checkpoint}", f"out_dir={out}", "logger=none", "threads=1", "perplexity.max_batches=1",
         "tasks.limit=2", "tasks.bootstrap_iters=0", *overrides],
    )  # fmt: skip


def strict_json(path: Path):
    """json.load that refuses NaN / Infinity, as JavaScript, jq and most other readers do."""

    def refuse(constant):
        raise ValueError(f"{path} holds {constant}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


# ------------------------------------------------------------------------------- NaN weights, JSON


NAN_MESSAGE = r"checkpoint=.*/nan has non-finite \(NaN or infinite\) weights in 1 tensor\(s\): model\.embed_tokens\.weight \({h} of "


def test_nan_checkpoint_is_refused_by_quality_naming_the_tensor(ckpt, tmp_path):
    with pytest.raises(ValueError, match=NAN_MESSAGE.format(h=ckpt["hidden"])):
        quality.run(quality_cfg(ckpt["nan"], tmp_path))
    assert not (tmp_path / "quality.json").exists()


def test_nan_checkpoint_is_refused_by_the_zoo_lm_eval_model(ckpt):
    with pytest.raises(ValueError, match=r"pretrained=.*/nan has non-finite .*model\.embed_tokens\.weight"):
        ZooLM(str(ckpt["nan"]), device="cpu", batch_size=1)


def test_nan_checkpoint_exits_non_zero_from_the_command_line(ckpt, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "eval.quality", f"checkpoint={ckpt['nan']}", f"out_dir={out}", "logger=none",
           f"hydra.run.dir={tmp_path / 'hydra'}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    # one sentence (train.cli.one_sentence_errors), no traceback
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("Error: ")]
    assert "non-finite (NaN or infinite) weights in 1 tensor(s): model.embed_tokens.weight" in line
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (out / "quality.json").exists()


def test_quality_json_is_valid_with_a_nan_metric(ckpt, tmp_path, monkeypatch):
    """A task metric that comes back NaN (lm-eval's stderr of one example, a perplexity that overflowed) is
    null in quality.json, not a bare NaN; the Markdown shows a blank."""
    ppl = {"source": "shakespeare", "split": "validation", "seq_len": 128, "loss": 5.0, "ppl": math.exp(5.0),
           "tokens": 10}  # fmt: skip
    monkeypatch.setattr(quality, "validation_perplexity", lambda *args: ppl)
    tasks = {"shakespeare_cloze": {"source": "bundled", "status": "ok", "n": 1, "metrics": {
        "perplexity": {"value": float("inf"), "stderr": float("nan"), "higher_is_better": False}}}}  # fmt: skip
    monkeypatch.setattr(quality, "run_lm_eval", lambda *args: tasks)
    quality.run(quality_cfg(ckpt["good"], tmp_path))
    saved = strict_json(tmp_path / "quality.json")
    assert saved["tasks"]["shakespeare_cloze"]["metrics"]["perplexity"] == {
        "value": None, "stderr": None, "higher_is_better": False}  # fmt: skip


def test_non_finite_loss_of_finite_weights_is_an_error_not_na(ckpt, tmp_path, monkeypatch):
    """Finite weights whose activations overflow (fp16): the perplexity pass says so instead of reporting n/a."""
    monkeypatch.setattr(quality, "evaluate_loss", lambda *args: {"loss": float("nan"), "ppl": float("nan"), "tokens": 1})
    with pytest.raises(ValueError, match=r"The validation loss is nan although the weights are finite "
                                         r"\(dtype=float16\): .*evaluate it in dtype=float32"):  # fmt: skip
        quality.run(quality_cfg(ckpt["good"], tmp_path, "dtype=float16"))
    assert not (tmp_path / "quality.json").exists()


def test_write_json_turns_non_finite_numbers_into_null(tmp_path):
    import numpy as np

    obj = {"a": float("nan"), "b": [1.0, float("inf"), (float("-inf"), 2)], "c": {"d": np.float64("nan")},
           "e": torch.tensor(float("nan")), "f": np.float32(1.5), "g": Path("x")}  # fmt: skip
    saved = strict_json(plots.write_json(tmp_path / "x.json", obj))
    assert saved == {"a": None, "b": [1.0, None, [None, 2]], "c": {"d": None}, "e": None, "f": 1.5, "g": "x"}


def test_write_json_writes_repository_paths_relative_to_its_root(tmp_path):
    inside = plots.REPO_ROOT / "reports" / "x"
    obj = {"dir": inside, "cmd": [f"paths.output_dir={inside}/run"], "outside": "/elsewhere/y"}
    saved = strict_json(plots.write_json(tmp_path / "x.json", obj))
    assert saved == {"dir": "reports/x", "cmd": ["paths.output_dir=reports/x/run"], "outside": "/elsewhere/y"}


# --------------------------------------------------------------------------------- bundled tasks


def test_unknown_bundled_task_is_refused_before_any_work(ckpt, tmp_path, monkeypatch):
    def no_work(*args):
        raise AssertionError("the model was loaded before the task names were checked")

    monkeypatch.setattr(quality, "load_model", no_work)
    cfg = quality_cfg(ckpt["good"], tmp_path, "tasks.bundled=[shakespeare_nextline,shakespeare_cloze]")
    with pytest.raises(ValueError) as err:
        quality.run(cfg)
    message = str(err.value)
    assert message.startswith("tasks.bundled=['shakespeare_nextline', 'shakespeare_cloze'] names "
                              "['shakespeare_nextline'], which eval/tasks does not define")  # fmt: skip
    assert f"the bundled tasks are {BUNDLED} (tags: ['shakespeare'])" in message
    assert not (tmp_path / "quality.json").exists()


# ------------------------------------------------------------------------------ common options


@pytest.mark.parametrize("app", ["at_scale", "validation", "costmodel"])
def test_files_only_apps_take_logger_none_and_refuse_wandb(app):
    assert dict(compose_conf(app, ["logger=none"]).logger) == {}
    assert dict(compose_conf(app, []).logger) == {}  # files only by default
    wandb = compose_conf(app, ["logger=wandb"])
    assert "wandb" in wandb.logger
    if app != "validation":  # eval/validation.py's main does not call it (yet): see the docs
        with pytest.raises(ValueError, match=rf"logger=wandb, but python -m eval\.{app} writes files only"):
            plots.refuse_wandb_logger(wandb, f"eval.{app}")


def run_main(module, argv: list[str], tmp_path: Path, monkeypatch) -> None:
    """An entry point's Hydra `main()` in this process, as `python -m <module> *argv` runs it (imported, the
    module would look for its config_path as a package: --config-path gives the folder)."""
    monkeypatch.setattr(sys, "argv", [module.__file__, f"--config-path={REPO / 'conf'}", *argv,
                                      f"hydra.run.dir={tmp_path / 'hydra'}"])  # fmt: skip
    module.main()


@pytest.mark.parametrize("app", ["at_scale", "costmodel"])
def test_files_only_apps_refuse_wandb_from_the_command_line(app, tmp_path, monkeypatch, capsys):
    import importlib

    module = importlib.import_module(f"eval.{app}")
    with pytest.raises(SystemExit) as exited:  # Hydra prints the error and exits 1
        run_main(module, ["logger=wandb", f"out_dir={tmp_path / 'out'}"], tmp_path, monkeypatch)
    assert exited.value.code == 1
    assert f"logger=wandb, but python -m eval.{app} writes files only" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before any work


# ---------------------------------------------------------------------------------- checkpoints


def test_checkpoint_files_follow_the_umask_and_carry_no_loading_options(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(REPO / "train" / "tokenizer", local_files_only=True)
    assert tokenizer.init_kwargs.get("local_files_only") is True  # what used to be saved
    torch.manual_seed(0)
    model = models.ZOO["llama"].model_class(models.ZOO["llama"].tiny(vocab_size=len(tokenizer))).eval()
    for umask, mode in ((0o022, 0o644), (0o027, 0o640)):
        old = os.umask(umask)
        try:
            out = save_checkpoint(model, tokenizer, tmp_path / f"umask{umask:o}")
        finally:
            os.umask(old)
        modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir() if p.is_file()}
        assert modes["model.safetensors"] == mode, modes
        assert set(modes.values()) == {mode}, modes
        assert "local_files_only" not in json.loads((out / "tokenizer_config.json").read_text())


def test_checkpoint_readme_names_the_task_path_and_the_stock_class_trap(ckpt):
    from lm_eval.tasks import TaskManager

    readme = (ckpt["good"] / "README.md").read_text()
    tasks_dir = REPO / "eval" / "tasks"
    assert f"--include_path {tasks_dir}" in readme and '"Tasks not found"' in readme
    # the path the README gives is where lm-eval finds the bundled tasks
    assert TaskManager(include_path=str(tasks_dir), include_defaults=False).all_subtasks == BUNDLED
    assert "LlamaForCausalLM.from_pretrained(PATH)" in readme and "*different function*" in readme
    assert "randomly initialised experts" in readme and "models.export_stock" in readme
    config = json.loads((ckpt["good"] / "config.json").read_text())
    assert config["model_type"] == "zoo_llama" and config["architectures"] == ["ZooLlamaForCausalLM"]


# ---------------------------------------------------------------------------------------- reports


def test_tour_reports_the_cloze_log_likelihood_not_its_zero_accuracy():
    q = {"perplexity": {"loss": 5.0, "ppl": 148.4}, "tasks": {
        "shakespeare_cloze": {"metrics": {"acc": {"value": 0.0}, "perplexity": {"value": math.e ** 6}}}}}  # fmt: skip
    (row,) = quality_rows({"llama": q}, {})
    assert "cloze acc" not in row
    assert row["cloze log-lik/word"] == pytest.approx(-6.0)


def test_bench_last_line_counts_every_section():
    sp_only = {"rows": [], "sequence_parallel": {"timed": [{}] * 24, "bytes": [{}] * 16}}
    assert rows_written(sp_only) == "40 sequence-parallel rows (24 timed, 16 bytes)"
    both = {"rows": [{}] * 3, "decode_paths": {"rows": [{}] * 2}}
    assert rows_written(both) == "3 generation rows, 2 decode-path rows"
    assert rows_written({"rows": []}) == "no rows (every section off or skipped)"


def test_bench_command_prints_the_count_of_every_section(tmp_path, monkeypatch, capsys):
    from eval.bench import __main__ as bench_main

    sp_only = {"rows": [], "sequence_parallel": {"timed": [{}] * 24, "bytes": [{}] * 16}}
    monkeypatch.setattr(bench_main, "run_bench", lambda *args: sp_only)
    run_main(bench_main, ["bench_preset=sp", "logger=none", f"out_dir={tmp_path}"], tmp_path, monkeypatch)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("[bench] 40 sequence-parallel rows (24 timed, 16 bytes) -> "), last


@pytest.fixture
def figures(monkeypatch):
    """Every figure eval.report saves: [{panel title: {label: (hex colour, marker, linestyle), "_ylim": ...}}]."""
    saved = []
    original = plots._save

    def record(fig, path, title=""):
        from matplotlib.colors import to_hex

        entry = {}
        for ax in fig.axes:
            lines = {line.get_label(): (to_hex(line.get_color()), line.get_marker(), line.get_linestyle())
                     for line in ax.get_lines() if not line.get_label().startswith("_")}  # fmt: skip
            bars = {c.get_label(): (to_hex(c.patches[0].get_facecolor()),) for c in ax.containers}
            entry[ax.get_title()] = {**lines, **bars, "_ylim": ax.get_ylim()}
        saved.append(entry)
        return original(fig, path, title)

    monkeypatch.setattr(plots, "_save", record)
    return saved


def generation_rows(hidden: dict[str, float]) -> list[dict]:
    rows = []
    for arch in ("llama", "ladder", "parallel", "kraken"):
        for batch in (1, 4):
            rows.append({"arch": arch, "degrees": {"tp": 2}, "batch": batch, "variant": "simulated", "link": "nvlink",
                         "speedup_decode": 1.1, "hidden_fraction_decode": hidden.get(arch, 0.5) if batch == 1 else 0.4,
                         "exposed_hidden_fraction_decode": 0.3})  # fmt: skip
    return rows


def test_one_colour_per_architecture_in_every_figure(figures, tmp_path):
    # two reports listing the architectures in different orders, and a bar chart
    generation_report.make_plots(generation_rows({}), ["llama", "ladder", "parallel", "kraken"], "llama", tmp_path)
    generation_report.make_plots(generation_rows({}), ["llama", "kraken", "parallel", "ladder"], "llama", tmp_path)
    plots.plot_bars(tmp_path / "bars.png", ["x"], {"parallel": [1.0], "ladder": [2.0]}, ylabel="y")
    colours: dict[str, set] = {}
    for fig in figures:
        for panel in fig.values():
            for label, style in panel.items():
                if label != "_ylim":
                    colours.setdefault(label.split(" ")[0], set()).add(style[0])
    assert len(figures) == 9  # 4 generation plots twice, one bar chart
    for arch in ("ladder", "parallel", "kraken"):
        assert colours[arch] == {plots.STYLES[arch]["color"]}, colours
    assert len({plots.STYLES[a]["color"] for a in models.ZOO}) == len(models.ZOO)  # ten different colours


def test_a_ladder_variant_is_drawn_as_its_sibling_hollow_and_dashed(figures, tmp_path):
    """gqla_ladder keeps gqla's colour and marker (not a fallback colour of its own text), hollow and dashed, in
    every figure; beside gqla in one panel the two still differ."""
    for variant in models.variants():
        sibling = plots.standard_sibling(variant)
        assert sibling in models.ZOO and plots.standard_sibling(sibling) is None
        assert plots.series_style(f"{variant} tp=8") == {**plots.STYLES[sibling], **plots.VARIANT_STYLE}
    plots.plot_bars(tmp_path / "bars.png", ["x"], {"gqla": [1.0], "gqla_ladder": [2.0]}, ylabel="y")
    (panel,) = figures[0].values()
    assert panel["gqla"][0] == panel["gqla_ladder"][0] == plots.STYLES["gqla"]["color"]
    styles = plots._styled(["gqla tp=8", "gqla_ladder tp=8"])
    assert styles["gqla tp=8"] != styles["gqla_ladder tp=8"]


def test_labels_outside_the_table_get_distinct_stable_colours(figures, tmp_path):
    """The expert-throughput bars ("measured ...", "expert rows ...") name no architecture; their text-chosen
    colours would coincide: one panel never shows two such keys in one colour, and each keeps it across figures."""
    bars = {"measured tokens/s speed-up": [1.0], "expert rows ratio (compute-bound)": [2.0]}
    plots.plot_bars(tmp_path / "a.png", ["x"], bars, ylabel="y")
    plots.plot_bars(tmp_path / "b.png", ["x"], bars, ylabel="y")
    first, second = ({k: v for k, v in panel.items() if k != "_ylim"} for fig in figures for panel in fig.values())
    assert first == second and len({style[0] for style in first.values()}) == 2


def test_lasp2_does_not_hide_under_lasp1(figures, tmp_path):
    """sp_bytes: LASP-1 and LASP-2 move the same bytes at P=2; their lines differ in colour, marker and dash."""
    methods = {"lasp2": {"label": "LASP-2"}, "lasp1": {"label": "LASP-1"}}
    byte_rows = [{"n": n, "p": p, "method": m, "link_bytes": 1000 * p, "link_bytes_formula": 1000 * p}
                 for n in (256, 512) for p in (2, 4) for m in methods]  # fmt: skip
    results = {"settings": {"sequence_parallel": {"bytes": {"lengths": [256, 512], "sp": [2, 4]}}},
               "sequence_parallel": {"methods": methods, "bytes": byte_rows, "timed": []}}  # fmt: skip
    images = sp_report.sp_plots(results, tmp_path)
    assert list(images) == ["sp_bytes"]
    panel = figures[0]["P=2"]
    lasp2, lasp1 = panel["LASP-2"], panel["LASP-1"]
    assert lasp2[0] != lasp1[0] and lasp2[1] != lasp1[1] and lasp2[2] != lasp1[2]
    assert panel["LASP-2 (formula)"][0] == lasp2[0]  # the formula in its method's colour, dotted
    assert panel["LASP-2 (formula)"][2] == ":"


def test_far_hidden_fractions_are_clipped_and_said(figures, tmp_path):
    generation_report.make_plots(generation_rows({"ladder": -15.0, "kraken": -12.0}), ["llama", "ladder", "parallel",
                                 "kraken"], "llama", tmp_path)  # fmt: skip
    by_title = {title: panel for fig in figures for title, panel in fig.items()}
    (title,) = [t for t in by_title if t.startswith("simulated:nvlink\n")]
    lo, hi = by_title[title]["_ylim"]
    assert -1.2 < lo < -1.0 and 1.5 < hi < 1.7  # the axis shows -1..1.5, not -15..1
    assert "2 value(s) outside -1..1.5 (-15..-12) drawn on the edge" in title
    # the speed-up plot is not clipped
    assert all("outside" not in t for t in by_title if not t.startswith("simulated:nvlink\n"))
