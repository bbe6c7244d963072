"""eval.bench, the sequence-parallel section (bench_preset=sp): off by default, the preset runs only it; settings
fail fast; the clock recorder replays a run on any link; rows per method, point, rank and link; LASP-2's bytes
flat in N, the ring's linear, every count == the spec's formula; its report. With a device preset: every point
predicted, deterministic, the kernel setting changing only the compute."""


import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from eval.bench import check_settings
from eval.bench.sp import sp_formula_bytes
from eval.simulator.sp_methods import sp_config
from parallel.link import LINK_PRESETS, ClockRecorder, VirtualClock
from tests.benchkit import ARCHS, ROOT, bench_settings, run_here, run_predicted

# --- sequence parallelism of the linear model over long sequences (bench_preset=sp) ---------------------

SP_ALGORITHMS = ("lasp2", "lasp1", "lasp2h", "ring")


def test_sp_section_is_off_by_default_and_the_preset_runs_only_it():
    default = bench_settings()
    assert default["sequence_parallel"]["enabled"] is False and default["archs"] == list(ARCHS)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        composed = compose("bench", overrides=["bench_preset=sp", "logger=none"])
    cfg = {k: v for k, v in OmegaConf.to_container(composed, resolve=False).items() if k not in ("logger", "paths", "hydra")}
    sp = cfg["sequence_parallel"]
    assert sp["enabled"] and sp["methods"] == list(SP_ALGORITHMS) and max(sp["sp"]) == 64
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
    results = run_here(
        out, "bench_preset=sp", "bench_shape=tiny",
        "sequence_parallel.lengths=[64,128]", "sequence_parallel.sp=[2,4]", "sequence_parallel.max_attended=4096",
        "sequence_parallel.bytes.lengths=[64,128]", "sequence_parallel.bytes.sp=[2,4]",
        "sequence_parallel.bytes.extra_points=[{n: 1024, sp: 4}]", "sequence_parallel.warmup=0",
        "sequence_parallel.repeats=1", "sequence_parallel.links=[nvlink-h100,pcie4]",
    )  # fmt: skip
    return out, results


def test_sp_rows_exist_per_method_point_rank_and_link(sp_run):
    _, results = sp_run
    sp = results["sequence_parallel"]
    assert results["rows"] == [] and list(sp["methods"]) == list(SP_ALGORITHMS)
    got = {(r["method"], r["n"], r["p"], r["rank"], r["link"]) for r in sp["timed"]}
    skipped = {(m, 128, 2, "last") for m in ("lasp2h", "ring")}
    for m in SP_ALGORITHMS:
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
    grid = {(m, n, p) for m in SP_ALGORITHMS for n in (64, 128) for p in (2, 4)}
    assert by.keys() == grid | {(m, 1024, 4) for m in SP_ALGORITHMS}
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



# --- sequence parallelism with compute=<device preset>: the device model's compute, any N and P ---------------

# One N at two P (the per-point checks hold at each) and the device point: every recorded point is three runs'
# Python-bound work on meta tensors (about a second each on 2 cores).
SP_PREDICTED = (
    "bench_preset=sp", "sequence_parallel.lengths=[128]", "sequence_parallel.sp=[2,4]",
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
    points = [(128, 2), (128, 4), (1024, 8)]
    assert got == {(m, n, p, rank, link) for m in SP_ALGORITHMS for n, p in points for rank in ("first", "last")
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
