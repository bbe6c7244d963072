"""eval.bench, the core and the generation section: one tiny run measures every variant (simulated link, upper
bound, real gloo ranks) and writes a well-formed report (results.json, README.md tables, PNGs, an offline W&B
run); the hidden-fraction and speed-up arithmetic on hand values; each architecture's bench config, layout
check and collectives come from its registry entry; degree points over any mesh dimension (an architecture
without a layout at a point skipped there and listed), per-dimension links. With `compute` a device preset the
simulated and upper-bound rows are the device model's prediction (deterministic, any shape, the same columns)
and the real variant is off. No test asserts a speed-up: timings on a shared CPU are noise."""

import json
import os
import subprocess
import sys

import pytest

import models
from eval.bench import check_settings
from eval.bench.generation_report import add_comparisons
from eval.bench.settings import degree_points, model_config
from eval.report import format_value, hidden_fraction, write_markdown_table
from parallel.link import LINK_PRESETS, VirtualClock
from tests.benchkit import ARCHS, ROOT, bench_settings, run_predicted

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


def test_ladder_variants_run_as_archs_and_baseline_with_their_siblings_overrides():
    """`<name>_ladder` (models.variants()) goes wherever an architecture's name goes: archs, baseline; its config is its
    sibling's bench config under the ladder schedule, every layer laddered, its sibling's config_overrides under its
    own (bench_preset=moe's moe_layer_freq for moe is moe_ladder's too); an unknown name is one error naming them."""
    cfg = bench_settings("archs=[gqla,gqla_ladder]", "baseline=gqla_ladder", "tp=[2]")
    archs_at, skipped = check_settings(cfg)
    assert archs_at[(("tp", 2),)] == ["gqla", "gqla_ladder"] and not skipped
    ladder = model_config(cfg, "gqla_ladder", {"tp": 2})
    assert ladder.residual == "ladder" and ladder.ladder_layers == ladder.num_hidden_layers
    assert model_config(cfg, "gqla", {"tp": 2}).residual == "standard"
    moe = bench_settings("bench_preset=moe", "bench_shape=tiny", "archs=[moe_ladder]", "baseline=moe_ladder", "ep=[2]",
                         "+config_overrides.moe_ladder.ladder_layers=1")  # fmt: skip
    check_settings(moe)  # moe's overrides (the preset's) are allowed: moe_ladder takes them
    variant = model_config(moe, "moe_ladder", {"ep": 2})
    assert variant.moe_layer_freq == 2 == moe["config_overrides"]["moe"]["moe_layer_freq"] and variant.ladder_layers == 1
    with pytest.raises(ValueError, match=r"Unknown architecture 'gqla_ladr'.*ladder variants .*gqla_ladder"):
        check_settings(bench_settings("archs=[gqla,gqla_ladr]", "baseline=gqla"))


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




# --- compute=<device preset>: the simulated and upper-bound rows predicted by the device model ----------------




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
    with pytest.raises(ValueError, match=r"Unknown compute='tpu'; choose 'measured' .* \['a100-40gb', 'a100-sxm', 'a30', 'a800', 'h100-sxm', 'h200', 'rtx4090'\]"):
        check_settings(bench_settings("compute=tpu"))
    with pytest.raises(ValueError, match=r"eff_hbm=0.0 must be in \(0, 1\]"):
        check_settings(bench_settings("compute=h100-sxm", "device_model.eff_hbm=0"))
    check_settings(bench_settings("compute=a100-sxm"))


