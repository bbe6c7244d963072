"""eval.bench: one tiny run measures every variant (simulated link, upper bound, real gloo ranks) and writes
a well-formed report (results.json, README.md tables, PNGs, an offline W&B run); the hidden-fraction and
speed-up arithmetic on hand values; each architecture's bench config, layout check and collectives come
from its registry entry. The MoE preset: degree points over ep (an architecture without an ep layout
skipped there and listed), per-dimension links, all-to-all bytes per layer counted == the dropless formula,
exposure per layer from the virtual clock, the expert-layer throughput rows. With `compute` a device preset
the simulated and upper-bound rows are the device model's prediction (deterministic, any shape, the same
columns, MoE all-to-alls included) and the real variant is off. No test asserts a speed-up: timings on a
shared CPU are noise."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import models
from eval.bench import check_settings, model_config, run_bench, sp_config, sp_formula_bytes
from eval.bench_report import add_comparisons, degree_points, hidden_fraction
from eval.report import format_value, write_markdown_table
from parallel.link import LINK_PRESETS, ClockRecorder, VirtualClock

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
    # The architectures' own check_layout: TP 3 splits none of the tiny shape's head counts. An architecture
    # refused at a point is skipped there (and listed); a point no architecture fits is an error.
    with pytest.raises(ValueError, match=r"TP degree 3 does not divide num_attention_heads=8; TP degrees that fit"):
        check_settings(bench_settings("tp=[3]", "archs=[llama,ladder]"))
    # Kraken runs one stream per rank, so it fits TP 3; the others are skipped there.
    archs_at, skipped = check_settings(bench_settings("tp=[2,3]"))
    assert archs_at[(("tp", 3),)] == ["kraken"] and archs_at[(("tp", 2),)] == list(ARCHS)
    assert skipped[0] == "tp=3: llama: TP degree 3 does not divide num_attention_heads=8; TP degrees that fit this model: [1, 2, 4]."
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
    assert results["compute"] == {"setting": "measured"}


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


# --- degree points other than tp, and the MoE comparison ------------------------------------------------


def test_degree_points_over_any_mesh_dimension():
    assert degree_points([2, 4]) == [{"tp": 2}, {"tp": 4}]  # `tp: [2, 4]` as before
    assert degree_points([], [2, 4]) == [{"ep": 2}, {"ep": 4}]
    # One dimension at a time, then points of several dimensions as given; a repeated point once.
    assert degree_points([2], [2], [{"ep": 2, "tp": 2}, {"tp": 2}]) == [{"tp": 2}, {"ep": 2}, {"ep": 2, "tp": 2}]


def test_architectures_without_a_layout_at_a_point_are_skipped_not_an_error():
    archs_at, skipped = check_settings(bench_settings("bench_preset=moe", "archs=[llama,moe]", "tp=[2]", "ep=[2]"))
    assert archs_at[(("ep", 2),)] == ["moe"] and archs_at[(("tp", 2),)] == ["llama", "moe"]
    assert len(skipped) == 1 and skipped[0].startswith("ep=2: llama: no ep layout")
    # ... unless nothing can run at a point.
    with pytest.raises(ValueError, match=r"No architecture of archs=\['llama'\] fits the degrees ep=2\. llama: no ep"):
        check_settings(bench_settings("archs=[llama]", "tp=[]", "ep=[2]"))
    with pytest.raises(ValueError, match=r"No degree point to measure"):
        check_settings(bench_settings("tp=[]"))


def test_links_per_mesh_dimension_must_cover_the_points():
    cfg = bench_settings("bench_preset=moe", "ep=[2]", "simulated.links=[{tp: nvlink-h100}]")
    with pytest.raises(ValueError, match=r"names no link for \['ep'\], which the point \{'ep': 2\} communicates over"):
        check_settings(cfg)
    check_settings(bench_settings("bench_preset=moe", "ep=[2]", "simulated.links=[pcie4,{tp: nvlink-h100, ep: pcie4}]"))
    with pytest.raises(ValueError, match=r"Unknown link preset 'pcie9'"):
        check_settings(bench_settings("bench_preset=moe", "simulated.links=[{ep: pcie9}]"))


def test_moe_preset_compares_like_with_like():
    cfg = bench_settings("bench_preset=moe", "bench_shape=moe-small")
    assert cfg["archs"] == ["moe", "scmoe", "moepp"] and cfg["baseline"] == "moe"
    assert cfg["tp"] == [] and cfg["ep"] == [2, 4] and cfg["expert_throughput"]["enabled"]
    shape = cfg["bench_shape"]
    assert shape["intermediate_size"] % 8 == 0 and shape["hidden_size"] % 8 == 0  # grouped_mm
    moe, scmoe = (model_config(cfg, a, {"ep": 2}) for a in ("moe", "scmoe"))
    # moe's MoE layers are scmoe's MoE blocks (moe_layer_freq=2 against Position-2 pairs) ...
    layers = range(shape["num_hidden_layers"])
    assert [moe.is_moe_layer(i) for i in layers] == [scmoe.is_moe_layer(i) for i in layers]
    assert moe.num_moe_layers == scmoe.num_moe_layers == shape["num_hidden_layers"] // 2
    # ... with the same expert compute per token: top-2 vs top-1 + a shared expert, all as wide.
    assert moe.num_experts_per_tok * moe.intermediate_size == (
        scmoe.num_experts_per_tok * scmoe.intermediate_size + scmoe.shared_expert_intermediate_size
    )
    assert moe.num_local_experts == scmoe.num_local_experts == model_config(cfg, "moepp", {}).num_local_experts
    archs_at, skipped = check_settings(cfg)
    assert archs_at[(("ep", 4),)] == ["moe", "scmoe", "moepp"] and not skipped


def test_virtual_clock_keeps_exposure_per_label():
    # Compute is a hand clock. A (all-to-all, 2 us of link) issued at 0 and waited at 1: 1 exposed;
    # B (count exchange) issued at 2, waited at once: all of it exposed, under its own label.
    t = [0.0]
    clock = VirtualClock(LINK_PRESETS["pcie4"], 2, now=lambda: t[0])
    clock.start()
    a = clock.issue("all_to_all", 0, peer_bytes=(int(24e3 * 1e-3 * 1e3), 0))  # 10 us alpha + 1 us
    t[0] = 5e-6
    clock.wait(a)
    b = clock.issue("all_to_all", 0, label="exchange_splits")  # 10 us alpha
    clock.wait(b)
    assert clock.busy_by == pytest.approx({"all_to_all": 11e-6, "exchange_splits": 10e-6})
    assert clock.exposed_by == pytest.approx({"all_to_all": 6e-6, "exchange_splits": 10e-6})
    assert clock.exposed == pytest.approx(16e-6)


MOE_ARCHS = ("moe", "scmoe", "moepp")


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """The MoE preset at the tiny shape with llama added: ep 2 (llama skipped there), a preset link and a
    per-dimension one, real gloo at ep 2, and the expert-layer throughput on a few tokens."""
    out = tmp_path_factory.mktemp("bench_moe")
    cmd = [
        sys.executable, "-m", "eval.bench", f"out_dir={out}", "logger=none", "bench_preset=moe",
        "bench_shape=tiny", "archs=[llama,moe,scmoe,moepp]", "ep=[2]", "batch_sizes=[1]", "prompt_len=16",
        "new_tokens=3", "warmup=1", "repeats=1", "simulated.links=[pcie4,{ep: nvlink-h100}]",
        "real.enabled=true", "real.ep=[2]", "expert_throughput.tokens=128", "expert_throughput.repeats=1",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, json.loads((out / "results.json").read_text())


def test_moe_run_measures_the_ep_point_and_skips_llama(moe_run):
    out, results = moe_run
    rows = results["rows"]
    assert results["degrees"] == [{"ep": 2}] and results["real_degrees"] == [{"ep": 2}]
    got = {(r["arch"], r["variant"], r["link"]) for r in rows}
    for arch in MOE_ARCHS:
        for variant, link in [("simulated", "pcie4"), ("simulated", "ep=nvlink-h100"), ("upper_bound", None),
                              ("real", None), ("upper_bound_real", None)]:  # fmt: skip
            assert (arch, variant, link) in got
    assert len(rows) == 5 * len(MOE_ARCHS) and all(r["degrees"] == {"ep": 2} for r in rows)
    assert not any(r["arch"] == "llama" for r in rows)
    assert len(results["skipped"]) == 1 and "llama: no ep layout" in results["skipped"][0]
    readme = (out / "README.md").read_text()
    assert "## Skipped" in readme and "- ep=2: llama: no ep layout" in readme


def test_moe_all_to_all_bytes_per_layer_match_the_formula(moe_run):
    _, results = moe_run
    shape = results["settings"]["bench_shape"]
    h, prompt = shape["hidden_size"], 16
    by = {(r["arch"], r["variant"], r["link"]): r for r in results["rows"]}
    moe = by[("moe", "simulated", "pcie4")]
    k = model_config(results["settings"], "moe", {"ep": 2}).num_experts_per_tok
    # Dropless, fp32: every all-to-all carries T_local * k * h * 4 bytes (own chunk included), exactly;
    # the spec's (P-1)/P of it leaves the rank at balanced routing.
    for phase, tokens in (("prefill", prompt), ("decode", 1)):
        assert moe[f"{phase}_a2a_bytes"] == tokens * k * h * 4 == moe[f"{phase}_a2a_formula_bytes"]
        assert moe[f"{phase}_a2a_link_bytes_formula"] == tokens * k * h * 4 / 2
        assert moe[f"{phase}_a2a_rows_per_token"] == k
        assert moe[f"{phase}_moe_layers"] == model_config(results["settings"], "moe", {"ep": 2}).num_moe_layers
    assert by[("scmoe", "simulated", "pcie4")]["prefill_a2a_bytes"] == prompt * 1 * h * 4  # top-1
    # MoE++'s zero-computation experts never enter the all-to-all: fewer bytes than moe's top-2.
    moepp = by[("moepp", "simulated", "pcie4")]
    assert 0 < moepp["prefill_a2a_bytes"] < moe["prefill_a2a_bytes"]
    assert moepp["prefill_a2a_rows_per_token_formula"] == pytest.approx(2 * 0.75 * 8 / (0.75 * 8 + 4))  # k_eff
    # No collective, nothing counted, without communication.
    assert by[("moe", "upper_bound", None)].get("prefill_a2a_bytes") is None


def test_moe_all_to_all_exposure_from_the_virtual_clock(moe_run):
    _, results = moe_run
    by = {(r["arch"], r["variant"], r["link"]): r for r in results["rows"]}
    for arch in MOE_ARCHS:
        for link in ("pcie4", "ep=nvlink-h100"):
            r = by[(arch, "simulated", link)]
            for phase in ("prefill", "decode"):
                link_ms, exposed = r[f"{phase}_a2a_link_ms_per_layer"], r[f"{phase}_a2a_exposed_ms_per_layer"]
                assert link_ms > 0 and 0 <= exposed <= link_ms + 1e-9
                assert r[f"{phase}_a2a_hidden_share"] == pytest.approx(1 - exposed / link_ms)
                assert r[f"{phase}_count_exchange_exposed_ms_per_layer"] > 0  # blocking: never hidden
    # The published share is printed beside ours, by the preset of the ep link.
    assert by[("scmoe", "simulated", "pcie4")]["a2a_hidden_anchor"] == 0.7
    assert by[("scmoe", "simulated", "ep=nvlink-h100")]["a2a_hidden_anchor"] == 1.0
    assert by[("moe", "simulated", "pcie4")]["a2a_hidden_anchor"] is None
    assert by[("moe", "simulated", "pcie4")]["prefill_a2a_exposed_vs_baseline"] in (1.0, None)


def test_expert_throughput_rows_and_moe_report(moe_run):
    out, results = moe_run
    rows = results["expert_throughput"]
    assert [r["label"] for r in rows] == ["moe", "moepp tau=0.75", "moepp tau=0.25"]
    assert rows[0]["speedup"] == 1 and rows[0]["target_rows_per_token"] == 2
    for r, tau in zip(rows[1:], (0.75, 0.25), strict=True):
        assert r["target_rows_per_token"] == pytest.approx(2 * tau * 8 / (tau * 8 + 4))
        # The router is pushed to that load (bisection over 128 tokens: within a few assignments).
        assert r["ffn_rows_per_token"] == pytest.approx(r["target_rows_per_token"], abs=0.05)
    for r in rows:
        assert r["tokens"] == 128 and r["tokens_per_s"] > 0 and r["ms_min"] <= r["ms"] <= r["ms_max"]
    readme = (out / "README.md").read_text()
    for text in ("## MoE all-to-all per layer", "### simulated:pcie4", "### simulated:ep=nvlink-h100",
                 "## Expert-layer throughput (real, one device)", "| moepp tau=0.75 | 128 |", "pcie4 70%"):  # fmt: skip
        assert text in readme, text
    for name in ("a2a_exposed.png", "expert_throughput.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({name})" in readme


# --- sequence parallelism of the linear model over long sequences (bench_preset=sp) ---------------------

SP_METHODS = ("lasp2", "lasp1", "lasp2h", "ring")


def test_sp_section_is_off_by_default_and_the_preset_runs_only_it():
    default = bench_settings()
    assert default["sequence_parallel"]["enabled"] is False and default["archs"] == list(ARCHS)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        composed = compose("bench", overrides=["bench_preset=sp", "logger=none"])
    cfg = {k: v for k, v in OmegaConf.to_container(composed, resolve=False).items() if k not in ("logger", "paths", "hydra")}
    sp = cfg["sequence_parallel"]
    assert sp["enabled"] and sp["methods"] == list(SP_METHODS) and max(sp["sp"]) == 64
    assert cfg["bench_shape"]["name"] == "linear-long" and cfg["tp"] == [] and not cfg["simulated"]["enabled"]
    assert check_settings(cfg) == ({}, [])  # no generation point, nothing skipped
    # The spec's formula at the preset's largest point: LASP-2 one all-gather of 4 heads' 64 x 64 fp32 states.
    config = sp_config(cfg, "lasp2", 64)
    assert config.layer_pattern == "L" and config.head_dim == 64
    assert sp_formula_bytes(config, "lasp2", "fwd", 65536, 64, 1, torch.float32) == 63 * 4 * 64 * 64 * 4
    ring = sp_config(cfg, "ring", 64)
    assert ring.layer_pattern == "N" and ring.sp_method == "lasp1"
    assert sp_formula_bytes(ring, "ring", "fwd", 65536, 64, 1, torch.float32) == 63 * 1024 * 2 * 1 * 64 * 4


def test_sp_settings_fail_fast():
    with pytest.raises(ValueError, match=r"N=100 does not split over P=16 ranks"):
        check_settings(bench_settings("bench_preset=sp", "sequence_parallel.lengths=[100]"))
    with pytest.raises(ValueError, match=r"sequence_parallel.methods \['ulysses'\] must name some of"):
        check_settings(bench_settings("bench_preset=sp", "sequence_parallel.methods=[ulysses]"))
    with pytest.raises(ValueError, match=r"No \(N, P\) point .* within max_chunk=8"):
        check_settings(bench_settings("bench_preset=sp", "sequence_parallel.max_chunk=8"))


def test_clock_recorder_replays_a_run_on_any_link():
    # A hand clock: 2 us of compute, an all-gather issued and waited after 1 us more, 4 us of compute, a mark.
    t = [0.0]
    clock = VirtualClock(LINK_PRESETS["pcie4"], 4, now=lambda: t[0])
    recorder = ClockRecorder(clock)
    clock.start()
    t[0] = 2e-6
    ready = clock.issue("all_gather", 4096, 4)
    t[0] = 3e-6
    clock.wait(ready)
    t[0] = 7e-6
    assert clock.elapsed() == pytest.approx(7e-6 + 30e-6 + 3 / 4 * 4096 / 24e9 - 1e-6)
    (same,) = recorder.replay("pcie4")
    assert same["time"] == clock.clock and same["exposed"] == clock.exposed and same["busy"] == clock.comm_busy
    # the same compute, another link: 4.9 us + 3 hops of 1.5 us + 3/4 of 4096 B, less the 1 us of compute
    (fast,) = recorder.replay("nvlink-h100")
    assert fast["exposed"] == pytest.approx(4.9e-6 + 3 * 1.5e-6 + 3 / 4 * 4096 / 360e9 - 1e-6)
    assert fast["time"] - fast["exposed"] == pytest.approx(same["time"] - same["exposed"])


@pytest.fixture(scope="module")
def sp_run(tmp_path_factory):
    """The sp preset at the tiny shape: N 64 and 128 on P 2 and 4, both ranks, two links; softmax methods skipped
    where the rank would score more than 4096 (query, key) pairs (N 128, P 2, last rank)."""
    out = tmp_path_factory.mktemp("bench_sp")
    cmd = [
        sys.executable, "-m", "eval.bench", f"out_dir={out}", "logger=none", "bench_preset=sp", "bench_shape=tiny",
        "sequence_parallel.lengths=[64,128]", "sequence_parallel.sp=[2,4]", "sequence_parallel.max_attended=4096",
        "sequence_parallel.bytes.lengths=[64,128]", "sequence_parallel.bytes.sp=[2,4]",
        "sequence_parallel.bytes.extra_points=[{n: 1024, sp: 4}]", "sequence_parallel.warmup=0",
        "sequence_parallel.repeats=1", "sequence_parallel.links=[nvlink-h100,pcie4]",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, json.loads((out / "results.json").read_text())


def test_sp_rows_exist_per_method_point_rank_and_link(sp_run):
    _, results = sp_run
    sp = results["sequence_parallel"]
    assert results["rows"] == [] and list(sp["methods"]) == list(SP_METHODS)
    got = {(r["method"], r["n"], r["p"], r["rank"], r["link"]) for r in sp["timed"]}
    skipped = {(m, 128, 2, "last") for m in ("lasp2h", "ring")}
    for m in SP_METHODS:
        for n in (64, 128):
            for p in (2, 4):
                for rank in ("first", "last"):
                    for link in ("nvlink-h100", "pcie4"):
                        assert ((m, n, p, rank, link) in got) == ((m, n, p, rank) not in skipped)
    assert len(sp["skipped"]) == 2 and all("over max_attended=4,096" in s for s in sp["skipped"])
    by = {(r["method"], r["n"], r["p"], r["rank"], r["link"]): r for r in sp["timed"]}
    for r in sp["timed"]:
        assert r["rank_index"] == (0 if r["rank"] == "first" else r["p"] - 1) and r["chunk"] == r["n"] // r["p"]
        assert 0 < r["fwd_ms"] < r["fwd_bwd_ms"] and r["fwd_bwd_ms_min"] <= r["fwd_bwd_ms"] <= r["fwd_bwd_ms_max"]
        assert 0 <= r["exposed_ms"] <= r["link_ms"] + 1e-9 and r["link_ms"] > 0
        # Replayed on each preset from one recorded run: the same compute, a slower link takes longer.
        other = by[(r["method"], r["n"], r["p"], r["rank"], "pcie4")]
        assert other["compute_ms"] == pytest.approx(r["compute_ms"], rel=1e-9)
        assert other["link_ms"] >= r["link_ms"] and other["link_bytes"] == r["link_bytes"]
    # LASP-2 over the others, where both ran, beside the paper's numbers (no assertion on any speed-up).
    assert {(h["rank"], h["link"], h["n"], h["p"]) for h in sp["headline"]} == {
        ("first", "nvlink-h100", 128, 4), ("first", "pcie4", 128, 4), ("last", "nvlink-h100", 128, 4), ("last", "pcie4", 128, 4)
    }  # fmt: skip
    assert all(h["anchor_over_lasp1"] == 0.152 and h["anchor_over_ring"] == 0.366 for h in sp["headline"])
    assert all(c["speedup_over_ring"] is None for c in sp["compare"] if (c["n"], c["p"], c["rank"]) == (128, 2, "last"))


def test_sp_bytes_lasp2_flat_ring_linear_and_formulas_exact(sp_run):
    _, results = sp_run
    sp = results["sequence_parallel"]
    rows = sp["bytes"] + sp["timed"]
    for r in rows:  # every counted row, meta (bytes) and timed alike, is the spec's formula to the byte
        assert r["fwd_link_bytes"] == r["fwd_link_bytes_formula"] and r["bwd_link_bytes"] == r["bwd_link_bytes_formula"]
    by = {(r["method"], r["n"], r["p"]): r for r in sp["bytes"]}
    grid = {(m, n, p) for m in SP_METHODS for n in (64, 128) for p in (2, 4)}
    assert by.keys() == grid | {(m, 1024, 4) for m in SP_METHODS}
    for phase in ("fwd", "bwd"):
        key = f"{phase}_link_bytes"
        for p in (2, 4):
            for m in ("lasp2", "lasp1"):  # flat in N
                assert by[(m, 64, p)][key] == by[(m, 128, p)][key] > 0
            for m in ("ring", "lasp2h"):  # linear in N
                assert by[(m, 128, p)][key] == 2 * by[(m, 64, p)][key] > 0
        assert by[("lasp2", 1024, 4)][key] == by[("lasp2", 64, 4)][key]
        assert by[("ring", 1024, 4)][key] == 16 * by[("ring", 64, 4)][key]
    # Per layer at P=4 (tiny: 8 heads of 16, 4 KV heads, 4 layers, fp32): LASP-2 one all-gather each way,
    # LASP-1 P-1 hops each way, ring 3P-2 shifts in all.
    state = 8 * 16 * 16 * 4
    lasp2, lasp1, ring = by[("lasp2", 64, 4)], by[("lasp1", 64, 4)], by[("ring", 64, 4)]
    assert lasp2["layers"] == 4 and lasp2["fwd_link_bytes"] == 3 * state
    assert lasp2["fwd_comm"] == lasp2["bwd_comm"] == {"all_gather": {"calls": 1, "bytes": 4 * state}}
    assert lasp1["fwd_comm"] == {"send_recv": {"calls": 3, "bytes": 3 * state}}
    assert ring["fwd_calls"] + ring["bwd_calls"] == 3 * 4 - 2
    assert by[("lasp2h", 64, 4)]["bwd_comm"].keys() == {"reduce_scatter"}
    assert all(r["link_ms:pcie4"] > r["link_ms:nvlink-h100"] > 0 for r in sp["bytes"])


def test_sp_report_has_its_section_and_plots(sp_run):
    out, _ = sp_run
    readme = (out / "README.md").read_text()
    for text in ("## Sequence parallelism: LASP-2 vs LASP-1 vs ring attention over long sequences",
                 "Counted == formula, forward and backward: **20 of 20**", "#### nvlink-h100", "#### pcie4",
                 "### LASP-2's speed-up at the largest point, beside the paper", "+15.2% over LASP-1",
                 "Only the communication side is comparable"):  # fmt: skip
        assert text in readme, text
    for name in ("sp_bytes.png", "sp_time.png", "sp_exposed.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({name})" in readme


# --- decode paths (bench_preset=gqla): one device, per path / batch / query length ------------------------


def test_decode_paths_section_is_off_by_default_and_on_in_the_gqla_preset():
    assert not bench_settings()["decode_paths"]["enabled"]
    cfg = bench_settings("bench_preset=gqla")
    assert cfg["decode_paths"]["enabled"] and cfg["archs"] == ["llama", "gqla"]
    assert cfg["decode_paths"]["paths"] == {"gqla": ["absorb", "gqa"]} and cfg["decode_paths"]["q_lens"] == [1, 2]
    # The TP rows stay on the gqa path (the absorb path does not shard).
    assert model_config(cfg, "gqla", {"tp": 2}).attn_path == "gqa"


def test_decode_paths_settings_fail_fast():
    with pytest.raises(ValueError, match="q_lens"):
        check_settings(bench_settings("bench_preset=gqla", "decode_paths.q_lens=[0]"))
    with pytest.raises(ValueError, match="not in archs"):
        check_settings(bench_settings("bench_preset=gqla", "archs=[llama]"))
    with pytest.raises(ValueError, match="decode path"):
        check_settings(bench_settings("bench_preset=gqla", "decode_paths.paths={gqla: [nope]}"))


@pytest.fixture(scope="module")
def gqla_run(tmp_path_factory):
    """The gqla preset at the tiny shape: the decode-path section at batch 1 and 2, and the TP 2 rows on one link."""
    out = tmp_path_factory.mktemp("bench_gqla")
    cmd = [
        sys.executable, "-m", "eval.bench", f"out_dir={out}", "logger=none", "bench_preset=gqla", "bench_shape=tiny",
        "tp=[2]", "batch_sizes=[1]", "prompt_len=8", "new_tokens=3", "warmup=0", "repeats=1",
        "simulated.links=[nvlink-h100]", "real.enabled=false", "decode_paths.batch_sizes=[1,2]",
        "decode_paths.steps=2", "decode_paths.warmup=0", "decode_paths.repeats=1",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, json.loads((out / "results.json").read_text())


def test_decode_path_rows_exist_per_path_batch_and_query_length(gqla_run):
    _, results = gqla_run
    rows = results["decode_paths"]["rows"]
    keys = {(r["arch"], r["path"], r["batch"], r["q_len"]) for r in rows}
    variants = [("llama", None), ("gqla", "absorb"), ("gqla", "gqa")]
    assert keys == {(a, p, b, q) for a, p in variants for b in (1, 2) for q in (1, 2)}
    assert len(rows) == len(keys)
    for r in rows:
        assert r["variant"] == "measured" and r["decode_tok_s"] > 0 and r["decode_ms_per_step"] > 0
        assert r["decode_tok_s_min"] <= r["decode_tok_s"] <= r["decode_tok_s_max"]
    # The baseline's own rows: speed-up and KV fraction 1.
    assert all(r["speedup_decode"] == 1.0 and r["kv_fraction"] == 1.0 for r in rows if r["arch"] == "llama")
    # The TP rows of the preset are still measured: gqla (gqa path) beside llama at TP 2.
    tp_rows = [r for r in results["rows"] if r["degrees"] == {"tp": 2}]
    assert {r["arch"] for r in tp_rows} == {"llama", "gqla"}
    assert {r["variant"] for r in tp_rows} == {"simulated", "upper_bound"}


def test_decode_path_kv_bytes_match_the_models_own_accounting(gqla_run):
    _, results = gqla_run
    cfg, dp = results["settings"], results["decode_paths"]
    dtype = getattr(torch, dp["dtype"])
    size = torch.empty((), dtype=dtype).element_size()
    measured = {(r["arch"], r["path"]): r["kv_bytes_per_token"] for r in dp["rows"]}
    for path in ("absorb", "gqa"):
        config = model_config(cfg, "gqla", {}, attn_path=path)
        model = models.get("gqla").model_class(config).to(dtype)
        assert measured[("gqla", path)] == model.kv_bytes_per_token() == config.kv_bytes_per_token(path, dtype)
    llama = model_config(cfg, "llama", {})
    assert measured[("llama", None)] == 2 * llama.num_key_value_heads * llama.head_dim * size
    # The gqa path caches what Llama does at this shape; absorb caches d_c + d_r values.
    assert measured[("gqla", "gqa")] == measured[("llama", None)]
    # At the Llama-3-8B shape (config accounting only): 512 + 64 over 2 x 8 x 128 = 28.125%.
    acc = {(a["arch"], a["path"]): a for a in dp["accounting"]}
    assert acc[("gqla", "absorb")]["kv_fraction"] == pytest.approx(0.28125)
    assert acc[("gqla", "gqa")]["kv_fraction"] == 1.0 and acc[("llama", None)]["kv_bytes_per_token"] == 4096


def test_decode_path_report_has_its_section_and_plot(gqla_run):
    out, _ = gqla_run
    readme = (out / "README.md").read_text()
    assert "## Decode paths (one device, measured)" in readme and "gqla (absorb)" in readme
    assert "28.12" in readme and "llama3-8b" in readme
    assert (out / "decode_paths.png").stat().st_size > 0


# --- compute=<device preset>: the simulated and upper-bound rows predicted by the device model ----------------


def run_predicted(out: Path, *overrides: str) -> dict:
    """run_bench in this process with compute=h100-sxm (the bench sets torch's thread count: put it back)."""
    threads = torch.get_num_threads()
    try:
        return run_bench(bench_settings("compute=h100-sxm", *overrides), out)
    finally:
        torch.set_num_threads(threads)


def test_device_preset_rows_are_deterministic_predictions(tmp_path):
    overrides = ("archs=[llama,ladder]", "tp=[2]", "batch_sizes=[1,2]", "simulated.links=[nvlink-h100,pcie4]")
    results = run_predicted(tmp_path / "a", *overrides)
    again = run_predicted(tmp_path / "b", *overrides)
    rows = results["rows"]
    assert rows == again["rows"]  # every column, numbers included: nothing is timed
    got = {(r["arch"], r["variant"], r["link"], r["batch"]) for r in rows}
    for arch in ("llama", "ladder"):
        for batch in (1, 2):
            for variant, link in [("simulated", "nvlink-h100"), ("simulated", "pcie4"), ("upper_bound", None)]:
                assert (arch, variant, link, batch) in got
    assert len(rows) == 12 and not any(r["variant"].startswith("real") or r["variant"] == "upper_bound_real" for r in rows)
    assert results["real_degrees"] == []
    settings = results["settings"]
    by = {(r["arch"], r["variant"], r["link"], r["batch"]): r for r in rows}
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["prefill_ms_min"] == r["prefill_ms"] == r["prefill_ms_max"] > 0
        assert r["decode_tok_s_min"] == pytest.approx(r["decode_tok_s"]) == r["decode_tok_s_max"]
        # Per decode step and per prefill, as measured rows count them (bfloat16 values: 2 bytes each).
        if r["variant"] == "simulated":
            declared = models.ZOO[r["arch"]].collectives_per_forward(model_config(settings, r["arch"], {"tp": 2}), {"tp": 2})
            values = sum(c.values_per_token for c in declared.values())
            assert r["decode_comm_calls"] == pytest.approx(sum(c.calls for c in declared.values()))
            assert r["decode_comm_bytes"] == pytest.approx(values * r["batch"] * 2)
            assert r["prefill_comm_bytes"] == pytest.approx(values * r["batch"] * settings["prompt_len"] * 2)
            assert r["decode_comm_busy_ms"] > 0 and r["decode_exposed_ms"] >= 0
            assert set(r["decode_comm_busy_ms_by_kind"]) == {"all_reduce"}
        else:
            assert r["decode_comm_calls"] == 0 and r.get("decode_exposed_ms") is None
    for link in ("nvlink-h100", "pcie4"):
        for batch in (1, 2):
            # llama waits each all-reduce right after issuing it: all its link time is exposed; ladder hides some.
            assert by[("llama", "simulated", link, batch)]["decode_exposed_share"] == pytest.approx(1, abs=1e-9)
            assert by[("ladder", "simulated", link, batch)]["decode_exposed_share"] < 1
            assert by[("ladder", "simulated", link, batch)]["hidden_fraction_decode"] is not None
    compute = results["compute"]
    assert compute["setting"] == "h100-sxm" and compute["device"]["name"] == "h100-sxm" and compute["dtype"] == "bfloat16"
    assert (compute["eff_flops"], compute["eff_hbm"], compute["kernel_overhead_us"], compute["contention"]) == (
        settings["device_model"]["eff_flops"], settings["device_model"]["eff_hbm"],
        settings["device_model"]["kernel_overhead_us"], settings["device_model"]["contention"],
    )  # fmt: skip
    assert len(results["notes"]) == 1 and "device model's prediction for h100-sxm" in results["notes"][0]
    readme = (tmp_path / "a" / "README.md").read_text()
    assert "compute predicted for h100-sxm by the device model" in readme and "gloo" not in readme
    assert "## simulated:pcie4" in readme and "## real" not in readme


def test_device_preset_runs_a_gpu_shape_on_meta(tmp_path):
    # Llama 3 8B at TP 8 on a 2-core CPU: nothing is allocated, so it takes seconds.
    results = run_predicted(
        tmp_path, "bench_shape=llama3-8b", "archs=[llama,ladder]", "tp=[8]", "batch_sizes=[1]", "new_tokens=4",
        "simulated.links=[nvlink-h100]",
    )  # fmt: skip
    rows = results["rows"]
    assert {(r["arch"], r["variant"]) for r in rows} == {(a, v) for a in ("llama", "ladder") for v in ("simulated", "upper_bound")}
    for r in rows:
        assert 20 < r["decode_tok_s"] < 2000, r  # tokens/s of one sequence on an H100: plausible
        assert r["prefill_ms"] > 0 and r["degrees"] == {"tp": 8}


def test_an_unknown_compute_is_one_clear_error():
    with pytest.raises(ValueError, match=r"Unknown compute='tpu'; choose 'measured' .* \['a100-sxm', 'h100-sxm', 'h200'\]"):
        check_settings(bench_settings("compute=tpu"))
    with pytest.raises(ValueError, match=r"eff_hbm=0.0 must be in \(0, 1\]"):
        check_settings(bench_settings("compute=h100-sxm", "device_model.eff_hbm=0"))
    check_settings(bench_settings("compute=a100-sxm"))


def test_device_preset_moe_rows_carry_the_all_to_all_columns(tmp_path):
    results = run_predicted(
        tmp_path, "bench_preset=moe", "bench_shape=tiny", "ep=[2]", "real.enabled=false", "expert_throughput.enabled=false",
        "batch_sizes=[1]", "simulated.links=[pcie4,{ep: nvlink-h100}]",
    )  # fmt: skip
    settings, rows = results["settings"], results["rows"]
    h, prompt = settings["bench_shape"]["hidden_size"], settings["prompt_len"]
    by = {(r["arch"], r["variant"], r["link"]): r for r in rows}
    predicted = {r["arch"] for r in rows}
    # MoE++ selects its FFN assignments by boolean masks: on meta they take the load its balance loss aims for.
    assert predicted == {"moe", "scmoe", "moepp"}
    for arch in predicted:
        k = model_config(settings, arch, {"ep": 2}).num_experts_per_tok if arch != "moepp" else None
        for link in ("pcie4", "ep=nvlink-h100"):
            r = by[(arch, "simulated", link)]
            for phase, tokens in (("prefill", prompt), ("decode", 1)):
                # Balanced routing on meta, bfloat16: the counted bytes are the dropless formula's (MoE++: its
                # k_eff rows per token, rounded to whole rows per layer).
                assert r[f"{phase}_a2a_bytes"] == pytest.approx(r[f"{phase}_a2a_formula_bytes"], abs=h * 2 / 2)
                if k is not None:
                    assert r[f"{phase}_a2a_bytes"] == tokens * k * h * 2
                link_ms, exposed = r[f"{phase}_a2a_link_ms_per_layer"], r[f"{phase}_a2a_exposed_ms_per_layer"]
                assert link_ms > 0 and 0 <= exposed <= link_ms + 1e-12
                assert r[f"{phase}_a2a_hidden_share"] == pytest.approx(1 - exposed / link_ms)
                assert r[f"{phase}_count_exchange_exposed_ms_per_layer"] > 0
        assert by[(arch, "upper_bound", None)].get("prefill_a2a_bytes") is None
    assert by[("scmoe", "simulated", "pcie4")]["a2a_hidden_anchor"] == 0.7
    assert "## MoE all-to-all per layer" in (tmp_path / "README.md").read_text()


# --- sequence parallelism with compute=<device preset>: the device model's compute, any N and P ---------------

SP_PREDICTED = (
    "bench_preset=sp", "sequence_parallel.lengths=[64,128]", "sequence_parallel.sp=[2,4]",
    "sequence_parallel.device_points=[{n: 1024, sp: 8}]", "sequence_parallel.links=[nvlink-h100,pcie4]",
    "sequence_parallel.bytes.lengths=[64]", "sequence_parallel.bytes.sp=[4]", "sequence_parallel.bytes.extra_points=[]",
    # CPU-time limits that every point is over: a device preset computes nothing, so they do not apply.
    "sequence_parallel.max_chunk=16", "sequence_parallel.max_attended=1",
)  # fmt: skip


@pytest.fixture(scope="module")
def sp_predicted(tmp_path_factory):
    """The sp preset at the tiny shape with compute=h100-sxm, run twice, and once with device_kernels=as_run."""
    out = tmp_path_factory.mktemp("bench_sp_predicted")
    runs = [run_predicted(out / name, *SP_PREDICTED) for name in ("a", "b")]
    as_run = run_predicted(out / "as_run", *SP_PREDICTED, "sequence_parallel.device_kernels=as_run")
    return out, runs, as_run


def test_sp_predicted_rows_cover_every_point_and_are_deterministic(sp_predicted):
    _, (results, again), _ = sp_predicted
    sp = results["sequence_parallel"]
    assert results["rows"] == [] and sp["skipped"] == [] and sp["dtype"] == "bfloat16"
    assert sp["device_kernels"]["setting"] == "gpu" and results["compute"]["setting"] == "h100-sxm"
    got = {(r["method"], r["n"], r["p"], r["rank"], r["link"]) for r in sp["timed"]}
    points = [(n, p) for n in (64, 128) for p in (2, 4)] + [(1024, 8)]
    assert got == {(m, n, p, rank, link) for m in SP_METHODS for n, p in points for rank in ("first", "last")
                   for link in ("nvlink-h100", "pcie4")}  # fmt: skip
    # Nothing is timed: every number of the second run is the first's.
    assert sp["timed"] == again["sequence_parallel"]["timed"] and sp["compare"] == again["sequence_parallel"]["compare"]
    by = {(r["method"], r["n"], r["p"], r["rank"], r["link"]): r for r in sp["timed"]}
    for r in sp["timed"]:
        assert r["fwd_bwd_ms_min"] == r["fwd_bwd_ms"] == r["fwd_bwd_ms_max"] > r["fwd_ms"] > 0
        assert 0 <= r["exposed_ms"] <= r["link_ms"] + 1e-12 and r["fwd_link_bytes"] == r["fwd_link_bytes_formula"]
        # The backward's ops are charged too: about twice the forward's FLOPs (matmuls: dX and dW per product;
        # fla's backward ~2.75x, flash attention's 2.5x).
        assert r["bwd_kernels"] > 0 and 1.8 < r["bwd_flops"] / r["fwd_flops"] < 3.1, r
        # The compute is the same on every link; contention is paid for overlapped communication only.
        other = by[(r["method"], r["n"], r["p"], r["rank"], "pcie4")]
        assert other["compute_ms"] == pytest.approx(r["compute_ms"], rel=1e-12) and r["contention_ms"] >= 0
    # At the largest P, LASP-2's one all-gather per pass (one fixed latency, in flight during the intra-chunk
    # kernel) leaves less exposed than LASP-1's P-1 serial hops (a fixed latency each). On pcie4 the per-hop
    # latency is most of either and this tiny layer's compute hides little of it: no worse there.
    for rank in ("first", "last"):
        lasp2, lasp1 = by[("lasp2", 1024, 8, rank, "nvlink-h100")], by[("lasp1", 1024, 8, rank, "nvlink-h100")]
        assert lasp2["exposed_ms"] < 0.5 * lasp1["exposed_ms"] and lasp2["fwd_bwd_ms"] < lasp1["fwd_bwd_ms"]
        lasp2, lasp1 = by[("lasp2", 1024, 8, rank, "pcie4")], by[("lasp1", 1024, 8, rank, "pcie4")]
        assert lasp2["exposed_ms"] <= lasp1["exposed_ms"] + 1e-9
        assert lasp2["compute_ms"] == pytest.approx(lasp1["compute_ms"], rel=0.1)  # the same layer's compute
    assert {(h["n"], h["p"]) for h in sp["headline"]} == {(1024, 8)}


def test_sp_predicted_kernels_setting_changes_only_the_compute(sp_predicted):
    _, (results, _), as_run = sp_predicted
    gpu = {(r["method"], r["n"], r["p"], r["rank"], r["link"]): r for r in results["sequence_parallel"]["timed"]}
    for r in as_run["sequence_parallel"]["timed"]:
        g = gpu[(r["method"], r["n"], r["p"], r["rank"], r["link"])]
        assert r["link_ms"] == g["link_ms"] and r["fwd_comm"] == g["fwd_comm"]
        if r["method"] in ("lasp2", "lasp1"):
            # The CPU chunked kernel as it runs on meta: several kernels per 64-token chunk, not fla's two.
            assert r["fwd_kernels"] > g["fwd_kernels"]
        if r["method"] == "ring":  # no kernel of ring attention is replaced
            assert r["fwd_bwd_ms"] == g["fwd_bwd_ms"]


def test_sp_predicted_report_says_the_compute_is_predicted(sp_predicted):
    out, _, _ = sp_predicted
    readme = (out / "a" / "README.md").read_text()
    for text in ("## Sequence parallelism: LASP-2 vs LASP-1 vs ring attention over long sequences",
                 "compute **predicted by the device model for h100-sxm**", "One recorded run per row, deterministic",
                 "### LASP-2's speed-up at the largest point, beside the paper", "+15.2% over LASP-1",
                 "+36.6% over ring attention", "Compute here is the device model's prediction for h100-sxm",
                 "The device model's compute per layer at N=1,024, P=8 (ms"):  # fmt: skip
        assert text in readme, text
    assert "Only the communication side is comparable" not in readme and "Not timed" not in readme
