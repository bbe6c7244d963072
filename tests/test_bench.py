"""eval.bench: one tiny run measures every variant (simulated link, upper bound, real gloo ranks) and writes
a well-formed report (results.json, README.md tables, PNGs, an offline W&B run); the hidden-fraction and
speed-up arithmetic on hand values; each architecture's bench config, layout check and collectives come
from its registry entry. No test asserts a speed-up: timings on a shared CPU are noise."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import models
from eval.bench import check_settings, model_config
from eval.bench_report import add_comparisons, hidden_fraction
from eval.report import format_value, write_markdown_table

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("llama", "ladder", "parallel", "kraken")  # conf/bench.yaml's default archs
ROW_KEYS = {
    "arch", "degrees", "variant", "link", "batch",
    "prefill_ms", "prefill_ms_min", "prefill_ms_max",
    "decode_ms_per_step", "decode_tok_s", "decode_tok_s_min", "decode_tok_s_max", "total_tok_s",
    "prefill_comm_calls", "prefill_comm_bytes", "decode_comm_calls", "decode_comm_bytes",
    "speedup_prefill", "speedup_decode", "hidden_fraction_prefill", "hidden_fraction_decode",
}  # fmt: skip


def test_hidden_fraction_on_hand_values():
    # Baseline 10 ms, upper bound 6 ms: 4 ms of exposed communication; an arch at 8 ms hides half of it.
    assert hidden_fraction(10.0, 8.0, 6.0) == pytest.approx(0.5)
    assert hidden_fraction(10.0, 6.0, 6.0) == pytest.approx(1.0)
    assert hidden_fraction(10.0, 11.0, 6.0) == pytest.approx(-0.25)  # slower than the baseline
    # No communication overhead to hide (gap below 1% of the baseline, or negative): n/a, not a ratio of noise.
    assert hidden_fraction(10.0, 9.0, 9.95) is None
    assert hidden_fraction(10.0, 9.0, 10.5) is None
    assert hidden_fraction(10.0, 9.0, 9.5, min_comm_fraction=0.1) is None


def test_speedups_and_hidden_fractions_from_rows():
    def row(arch, variant, link, prefill_ms, step_ms):
        return {"arch": arch, "degrees": {"tp": 2}, "variant": variant, "link": link, "batch": 1, "prefill_ms": prefill_ms,
                "decode_ms_per_step": step_ms, "decode_tok_s": 1e3 / step_ms}  # fmt: skip

    rows = [
        row("llama", "simulated", "pcie4", 20.0, 10.0),
        row("ladder", "simulated", "pcie4", 15.0, 7.0),
        row("llama", "upper_bound", None, 12.0, 6.0),
        row("ladder", "upper_bound", None, 12.5, 6.0),
    ]
    add_comparisons(rows, "llama", 0.01)
    ladder = rows[1]
    assert ladder["speedup_decode"] == pytest.approx(10 / 7)
    assert ladder["speedup_prefill"] == pytest.approx(20 / 15)
    assert ladder["hidden_fraction_decode"] == pytest.approx((10 - 7) / (10 - 6))
    assert ladder["hidden_fraction_prefill"] == pytest.approx((20 - 15) / (20 - 12))
    assert rows[0]["speedup_decode"] == 1 and rows[0]["hidden_fraction_decode"] is None  # the baseline itself
    assert rows[3]["hidden_fraction_decode"] is None  # upper-bound rows have no upper bound of their own


def bench_settings(*overrides: str) -> dict:
    """The settings `python -m eval.bench bench_shape=tiny real.tp=[2] *overrides` hands to run_bench."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("bench", overrides=["bench_shape=tiny", "real.tp=[2]", "logger=none", *overrides])
    plain = OmegaConf.to_container(cfg, resolve=False)
    return {k: v for k, v in plain.items() if k not in ("logger", "paths", "hydra")}


def test_bench_configs_come_from_each_architectures_entry():
    cfg = bench_settings()
    shape = cfg["bench_shape"]
    llama = model_config(cfg, "llama", {"tp": 2})
    assert type(llama) is models.ZooLlamaConfig and llama.hidden_size == shape["hidden_size"]
    # Ladder ladders every layer (the paper's speed benchmark) unless config_overrides says otherwise.
    assert model_config(cfg, "ladder", {"tp": 2}).ladder_layers == shape["num_hidden_layers"]
    fewer = bench_settings("+config_overrides.ladder.ladder_layers=1")
    assert model_config(fewer, "ladder", {"tp": 4}).ladder_layers == 1
    # Kraken: one stream per rank, the parameter count of the shape's llama.
    for tp in (2, 4):
        kraken = model_config(cfg, "kraken", {"tp": tp})
        assert kraken.kraken_degree == tp
        assert kraken.num_parameters_formula() == pytest.approx(llama.num_parameters_formula(), rel=0.05)
    check_settings(cfg)  # every default arch fits the tiny shape at TP 2 and 4


def test_bench_refuses_degrees_an_architecture_cannot_take():
    # The architectures' own check_layout: TP 3 splits none of the tiny shape's head counts.
    with pytest.raises(ValueError, match=r"TP degree 3 does not divide num_attention_heads=8; TP degrees that fit"):
        check_settings(bench_settings("tp=[3]"))
    with pytest.raises(ValueError, match=r"config_overrides names 'nope', which is not in archs"):
        check_settings(bench_settings("+config_overrides.nope={}"))


def test_markdown_table_formatting():
    table = write_markdown_table([{"a": 1, "b": 0.123456, "c": None}], ["a", ("b", "B value"), "c"])
    assert table.splitlines() == ["| a | B value | c |", "|---|---|---|", "| 1 | 0.1235 | n/a |"]
    assert format_value(123456) == "123,456" and format_value(2.5e-5) == "2.500e-05"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One CLI run of the tiny shape in every variant: TP 2, one link preset, real gloo with 2 ranks."""
    out = tmp_path_factory.mktemp("bench")
    cmd = [
        sys.executable, "-m", "eval.bench", f"hydra.run.dir={out}",
        "bench_shape=tiny", "tp=[2]", "batch_sizes=[1]", "prompt_len=16", "new_tokens=4", "warmup=1", "repeats=2",
        "simulated.links=[nvlink-h100]", "real.enabled=true", "real.tp=[2]",
    ]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_bench_runs_every_variant_and_writes_results(tiny_run):
    results = json.loads((tiny_run / "results.json").read_text())
    rows = results["rows"]
    got = {(r["arch"], r["variant"], r["link"]) for r in rows}
    for arch in ARCHS:
        for variant, link in [("simulated", "nvlink-h100"), ("upper_bound", None), ("real", None), ("upper_bound_real", None)]:
            assert (arch, variant, link) in got
    assert len(rows) == 4 * len(ARCHS)
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["prefill_ms"] > 0 and r["decode_tok_s"] > 0
        assert r["prefill_ms_min"] <= r["prefill_ms"] <= r["prefill_ms_max"]
    # Communication per prefill and per decode step, from the counters, is what each architecture's entry
    # declares (collectives_per_forward, of fp32 values); none at all without collectives.
    settings = results["settings"]
    by = {(r["arch"], r["variant"]): r for r in rows}
    for arch in ARCHS:
        declared = models.ZOO[arch].collectives_per_forward(model_config(settings, arch, {"tp": 2}), {"tp": 2})
        calls = sum(c.calls for c in declared.values())
        values = sum(c.values_per_token for c in declared.values())
        assert calls > 0
        for variant in ("simulated", "real"):
            row = by[(arch, variant)]
            assert row["degrees"] == {"tp": 2}
            assert row["decode_comm_calls"] == calls and row["decode_comm_bytes"] == values * 1 * 4  # batch 1
            assert row["prefill_comm_calls"] == calls and row["prefill_comm_bytes"] == values * 16 * 4  # prompt
    assert by[("llama", "upper_bound")]["decode_comm_calls"] == 0
    sim = by[("ladder", "simulated")]
    assert sim["decode_exposed_ms"] >= 0 and sim["decode_comm_busy_ms"] > 0
    assert by[("llama", "real")]["backend"] == "gloo"
    # Everything needed to read the numbers later is recorded with them.
    assert results["degrees"] == [{"tp": 2}] and results["settings"]["bench_shape"]["hidden_size"] == 128
    assert {"cpu", "torch", "transformers", "cpu_cores"} <= set(results["hardware"])
    assert {link["name"] for link in results["links"]} >= {"nvlink-h100", "pcie4"}


def test_bench_writes_markdown_and_plots(tiny_run):
    readme = (tiny_run / "README.md").read_text()
    for section in ("## simulated:nvlink-h100", "## upper_bound", "## real", "## upper_bound_real", "## Link presets"):
        assert section in readme
    assert "| arch | degrees | batch | prefill ms |" in readme and "| llama | tp=2 | 1 |" in readme
    assert "gloo's communication thread has no free core" in readme
    for name in ("speedup_vs_batch.png", "speedup_vs_degree.png", "hidden_fraction.png", "hidden_fraction_exposed.png"):
        data = (tiny_run / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
        assert f"]({name})" in readme


def test_bench_logs_an_offline_wandb_run(tiny_run):
    runs = sorted((tiny_run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    # wandb 0.31 writes no wandb-summary.json offline: the run's records (config, history, summary) are
    # in run-<id>.wandb, media (tables, images) under files/media.
    records = next(runs[0].glob("run-*.wandb")).read_bytes()
    for key in (b"bench/results", b"ladder/tp2/simulated:nvlink-h100/b1/hidden_fraction_decode", b"decode_tok_s"):
        assert key in records, key
    media = runs[0] / "files" / "media"
    assert list((media / "table").glob("bench/results_*.table.json"))
    assert len(list((media / "images").glob("bench/*.png"))) == 4
