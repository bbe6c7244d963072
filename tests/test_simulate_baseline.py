"""The speed simulator outside the fitted regime, from first principles: TP 1 (the single-GPU baseline: the model
unsharded, nothing sent), attention charged as the program a recording names (flash, gqa_expand, math: the scores
in HBM; inductor: decode by fused reductions), a small prefill paying the per-kernel overhead of every kernel, and a
collective launched outside a CUDA graph paying its host cost. Nothing here is fitted."""

import pytest
import torch
import torch.nn.functional as F

import models
from eval.bench import check_settings
from eval.simulator.attention import ATTENTION_PROGRAMS, attention_charges
from eval.simulator.device import DeviceClock, DeviceModel, DevicePreset, get_device
from eval.simulator.heldout import fitted_constants
from eval.simulator.replay import NO_COMM, build_meta, record_generation, release
from parallel import comm
from tests.benchkit import bench_settings, run_predicted
from tests.test_simulate import SHAPE

# Compute-bound only: HBM and launches free, 1e12 FLOP/s. A step's time is its FLOPs / 1e12.
FLOPS_ONLY = DeviceModel(DevicePreset("flops-only", 1e12, 1e30), eff_flops=1.0, eff_hbm=1.0, kernel_overhead_s=0.0)
# The committed constants (conf/bench.yaml device_model, eval.costmodel's fit) on an H100.
H100 = DeviceModel.from_config("h100-sxm", **fitted_constants())
BATCH, PROMPT, NEW = 2, 32, 16


def _record(arch: str, tp: int, batch: int = BATCH, prompt_len: int = PROMPT, **kwargs):
    degrees = {"tp": tp}
    model = build_meta(arch, models.get(arch).bench_config(SHAPE, degrees), degrees)
    try:
        return record_generation(model, batch, prompt_len=prompt_len, new_tokens=NEW, **kwargs)
    finally:
        release()


# --- TP 1: the single-GPU baseline ------------------------------------------------------------------------------


def test_the_simulated_mode_plays_one_rank_and_refuses_none():
    with comm.use_mode("simulated", link="pcie4", world_size=1) as clock:
        assert clock.world_size == 1
    before = comm.get_mode()
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=rf"world_size .* must be an integer >= 1 .*got {bad!r}"):
            comm.set_mode("simulated", world_size=bad)
    assert comm.get_mode() == before  # a refused setting leaves the mode as it was


@pytest.mark.parametrize("arch", ["llama", "ladder"])
def test_tp1_is_tp2_with_free_collectives_times_the_per_rank_compute_ratio(arch):
    one, two = _record(arch, 1), _record(arch, 2)
    for phase in ("prefill", "decode"):
        # Nothing is sent at TP 1: any link gives the compute alone, the upper bound's time.
        assert one.phases[phase].counts == {} and two.phases[phase].counts["all_reduce"]["calls"] > 0
        on_link, free = one.predict(H100, "pcie4")[phase], one.predict(H100, NO_COMM)[phase]
        assert on_link["time"] == free["time"] == free["compute"] and on_link["busy"] == on_link["exposed"] == 0
        # The same program: every kernel of TP 2's rank is run at TP 1 (a collective is no kernel of the clock's).
        kernels = [[n for n, k in zip(r.phases[phase].clock.names, r.phases[phase].clock.kernel, strict=True) if k]
                   for r in (one, two)]  # fmt: skip
        assert kernels[0] == kernels[1]
    # Compute-bound, the ratio is the FLOPs': every sharded matmul and attention head twice TP 2's rank's, the
    # LM head (replicated: rows x hidden x vocab, the last position's logits) once.
    lm_head = 2 * BATCH * SHAPE["hidden_size"] * SHAPE["vocab_size"]
    for phase in ("prefill", "decode"):
        t1 = one.predict(FLOPS_ONLY, "pcie4")[phase]["time"]
        t2 = two.predict(FLOPS_ONLY, NO_COMM)[phase]["time"]
        assert t1 == pytest.approx(2 * t2 - lm_head / 1e12, rel=1e-12)
    # With the committed constants: more compute than one TP-2 rank's, less than twice it (launches, replicated ops).
    for phase in ("prefill", "decode"):
        c1, c2 = one.predict(H100, NO_COMM)[phase]["compute"], two.predict(H100, NO_COMM)[phase]["compute"]
        assert c2 < c1 < 2 * c2


def test_the_bench_predicts_tp1_and_the_speed_up_over_one_gpu(tmp_path):
    results = run_predicted(
        tmp_path, "archs=[llama,ladder]", "tp=[1,2]", "batch_sizes=[1]", "simulated.links=[nvlink-h100]"
    )
    by = {(r["arch"], r["degrees"]["tp"], r["variant"]): r for r in results["rows"]}
    single = by[("llama", 1, "upper_bound")]
    for arch in ("llama", "ladder"):
        one = by[(arch, 1, "simulated")]
        assert one["decode_comm_calls"] == 0 and one["decode_tok_s"] == pytest.approx(by[(arch, 1, "upper_bound")]["decode_tok_s"])
        for variant in ("simulated", "upper_bound"):
            r = by[(arch, 2, variant)]
            assert r["speedup_decode_vs_one_gpu"] == pytest.approx(r["decode_tok_s"] / single["decode_tok_s"])
            assert r["speedup_prefill_vs_one_gpu"] == pytest.approx(single["prefill_ms"] / r["prefill_ms"])
    assert by[("llama", 1, "simulated")]["speedup_decode_vs_one_gpu"] == 1.0
    # Ladder hides the all-reduces: closer to the TP-2 upper bound's speed-up over one GPU than llama.
    assert by[("llama", 2, "simulated")]["speedup_decode_vs_one_gpu"] < by[("ladder", 2, "simulated")]["speedup_decode_vs_one_gpu"]
    readme = (tmp_path / "README.md").read_text()
    assert "decode speed-up vs 1 GPU" in readme and "| llama | tp=1 | 1 |" in readme
    assert "single-GPU baseline" in results["notes"][0]


def test_degree_1_is_refused_by_the_measured_bench_with_what_fits():
    with pytest.raises(ValueError, match=r"TP degree 1 in the bench must be an integer >= 2 with compute=measured .* "
                                         r"predicted with compute=<a device preset>, one of \['a100-40gb'"):  # fmt: skip
        check_settings(bench_settings("tp=[1]"))
    with pytest.raises(ValueError, match=r"degrees point \{'tp': 1\} has one rank.* compute=<a device preset>"):
        check_settings(bench_settings("tp=[]", "degrees=[{tp: 1}]"))
    with pytest.raises(ValueError, match=r"TP degree 0 must be a positive integer \(1: the single-GPU baseline\)"):
        check_settings(bench_settings("compute=h100-sxm", "tp=[0]"))
    archs_at, _ = check_settings(bench_settings("compute=h100-sxm", "tp=[1,2]", "ep=[1]"))
    assert (("tp", 1),) in archs_at and (("ep", 1),) in archs_at


# --- attention programs -----------------------------------------------------------------------------------------


def _qkv(tq=1, tk=48):
    q = torch.empty(2, 8, tq, 32, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(2, 2, tk, 32, device="meta", dtype=torch.bfloat16)
    mask = torch.empty(2, 1, tq, tk, device="meta", dtype=torch.bool)
    return q, kv, mask


def test_math_attention_is_charged_every_kernel_it_launches():
    q, kv, mask = _qkv()
    with DeviceClock(attention_program="math") as clock:
        F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=True)
    names = [n.removeprefix("attention_math:") for n in clock.names]
    assert names == ["repeat_interleave_k", "repeat_interleave_v", "qk", "softmax", "pv"]
    kv_b, rep_b, q_b = 2 * kv.numel(), 2 * kv.numel() * 4, 2 * q.numel()  # bf16; 8 query heads over 2 KV heads
    scores = 2 * 8 * 1 * 48 * 2  # [B, H, 1, Tk] in bf16
    assert clock.bytes == [kv_b + rep_b, kv_b + rep_b, q_b + rep_b + scores, 2 * scores + mask.numel(), scores + rep_b + q_b]
    assert clock.flops == [0, 0, 2 * 2 * 8 * 48 * 32, 0, 2 * 2 * 8 * 48 * 32]
    # Unfused (an eager program): the scale and the mask add are kernels of their own.
    with DeviceClock(fuse_pointwise=False, attention_program="math") as eager:
        F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=True)
    assert [n.removeprefix("attention_math:") for n in eager.names] == [
        "repeat_interleave_k", "repeat_interleave_v", "scale", "qk", "mask_add", "softmax", "pv",
    ]  # fmt: skip
    # Causal prefill: the full square is computed (flash skips half), a [Tq, Tk] boolean mask read.
    q, kv, _ = _qkv(tq=16, tk=16)
    math, flash = (attention_charges(q, kv, kv, {"is_causal": True}, program=p) for p in ("math", "flash"))
    assert sum(c[1] for c in math) == 2 * sum(c[1] for c in flash)
    assert dict((n, b) for n, _, b in math)["attention_math:softmax"] == 2 * (2 * 8 * 16 * 16 * 2) + 16 * 16


def test_gqa_expand_is_kept_and_programs_are_named_or_a_clear_error():
    q, kv, mask = _qkv()
    old = attention_charges(q, kv, kv, {"attn_mask": mask}, True)  # eval.simulator.kernels' call, positional flag
    assert old == attention_charges(q, kv, kv, {"attn_mask": mask}, program="gqa_expand")
    assert [n for n, _, _ in old] == ["repeat_kv", "scaled_dot_product_attention"]
    assert DeviceClock(gqa_expand=True).attention_program == "gqa_expand" and DeviceClock().attention_program == "flash"
    assert not DeviceClock(attention_program="math").gqa_expand  # kernels.flash_attention's training charge: flash
    with pytest.raises(ValueError, match=r"attention_program='sdpa'; choose one of \['flash', 'gqa_expand', 'math', 'inductor'\]"):
        DeviceClock(attention_program="sdpa")
    with pytest.raises(ValueError, match=r"gqa_expand=True and attention_program='math' disagree"):
        record_generation(None, 1, 1, 1, gqa_expand=True, attention_program="math")
    with pytest.raises(ValueError, match=r"attention_program='mat'; choose one of"):
        check_settings(bench_settings("compute=h100-sxm", "attention_program=mat"))
    assert set(ATTENTION_PROGRAMS) == {"flash", "gqa_expand", "math", "inductor"}


def test_inductor_decodes_by_reductions_reading_each_kv_head_per_query_head_and_prefills_as_math():
    # Decode (one query): Inductor's bmm decomposition fuses the repeat into two reductions; nothing repeated is
    # written, each of the H / H_kv query heads of a group reads its KV head's rows.
    q, kv, mask = _qkv(tq=1, tk=64)
    b, h, _, d = q.shape
    hkv, e = kv.shape[1], q.element_size()
    charges = attention_charges(q, kv, kv, {"attn_mask": mask}, program="inductor")
    assert [n for n, _, _ in charges] == ["attention_decode:qk", "attention_decode:softmax", "attention_decode:pv"]
    scores = b * h * 64 * e
    cache = kv.numel() * e * h // hkv
    assert [c[2] for c in charges] == [q.numel() * e + cache + scores, 2 * scores + mask.numel() * mask.element_size(),
                                       scores + cache + b * h * d * e]  # fmt: skip
    assert sum(c[1] for c in charges) == 4 * b * h * 64 * d
    expanded = attention_charges(q, kv, kv, {"attn_mask": mask}, program="gqa_expand")
    assert sum(c[2] for c in charges) < sum(c[2] for c in expanded)  # the copy is neither written nor read
    # A prefill (several queries) is the math program: the scores in HBM.
    q, kv, mask = _qkv(tq=16, tk=64)
    assert attention_charges(q, kv, kv, {"attn_mask": mask}, program="inductor") == attention_charges(
        q, kv, kv, {"attn_mask": mask}, program="math"
    )


def test_a_collective_launched_outside_a_cuda_graph_pays_the_host_cost_once_on_the_compute_stream():
    run = _record("llama", 2)
    base = DeviceModel.from_config("h100-sxm", eff_flops=0.4, eff_hbm=0.9, kernel_overhead_us=2.0, contention=0.2)
    launched = DeviceModel.from_config("h100-sxm", eff_flops=0.4, eff_hbm=0.9, kernel_overhead_us=2.0, contention=0.2,
                                       collective_launch_us=50.0)  # fmt: skip
    a, b = run.predict(base, "nvlink-h100"), run.predict(launched, "nvlink-h100")
    issues = run.phases["prefill"].counts["all_reduce"]["calls"]
    # The prefill is not a CUDA graph: every all-reduce adds 50 us (the standard model overlaps none of them).
    assert b["prefill"]["time"] - a["prefill"]["time"] == pytest.approx(issues * 50e-6, rel=1e-9)
    assert b["decode"]["time"] == a["decode"]["time"]  # the decode step is replayed from a graph
    assert run.predict(launched, NO_COMM)["prefill"]["time"] == run.predict(base, NO_COMM)["prefill"]["time"]
    with pytest.raises(ValueError, match=r"collective_launch_s=-1e-06 must be >= 0"):
        DeviceModel.from_config("h100-sxm", eff_flops=0.4, eff_hbm=0.9, kernel_overhead_us=2.0, contention=0.2,
                                collective_launch_us=-1.0)  # fmt: skip


def test_decode_on_a_static_cache_reads_more_under_each_program():
    steps = {p: _record("llama", 1, attention_program=p) for p in ATTENTION_PROGRAMS}
    max_len = -(-(PROMPT + NEW) // 8) * 8
    heads, d = SHAPE["num_attention_heads"], SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    clock = steps["math"].phases["decode"].clock
    qk = [b for n, b in zip(clock.names, clock.bytes, strict=True) if n == "attention_math:qk"]
    # One per layer, over the whole static buffer (max_len, not the fill): Q, the repeated K, the scores.
    assert qk == [2 * BATCH * heads * (d + max_len * d + max_len)] * SHAPE["num_hidden_layers"]
    times = {p: r.predict(H100, NO_COMM)["decode"]["time"] for p, r in steps.items()}
    assert times["flash"] < times["gqa_expand"] < times["math"]
    # Everything but attention is the same program.
    other = {p: [n for n in r.phases["decode"].clock.names if "attention" not in n and n != "repeat_kv"] for p, r in steps.items()}
    assert other["flash"] == other["gqa_expand"] == other["math"]


# --- launch-bound steps -----------------------------------------------------------------------------------------


def test_a_batch_1_prefill_pays_the_overhead_of_every_kernel():
    run = _record("llama", 1, batch=1, prompt_len=8)
    prefill = run.phases["prefill"]
    kernels = sum(prefill.clock.kernel)
    assert kernels > 10
    base = DeviceModel(get_device("h100-sxm"), kernel_overhead_s=0.0)
    slow = DeviceModel(get_device("h100-sxm"), kernel_overhead_s=1e-3)
    extra = run.predict(slow, NO_COMM)["prefill"]["time"] - run.predict(base, NO_COMM)["prefill"]["time"]
    assert extra == pytest.approx(kernels * 1e-3, rel=1e-9)
    # Launch-bound at the committed constants: the overhead is most of this prefill.
    assert kernels * H100.kernel_overhead_s > 0.5 * run.predict(H100, NO_COMM)["prefill"]["time"]


# --- SP 1: the sequence-parallel section's single-GPU baseline --------------------------------------------------


def test_the_sequence_parallel_section_predicts_one_rank_as_the_baseline(tmp_path):
    results = run_predicted(
        tmp_path, "bench_preset=sp", "sequence_parallel.lengths=[128]", "sequence_parallel.sp=[1,2]",
        "sequence_parallel.device_points=[]", "sequence_parallel.links=[nvlink-h100]", "sequence_parallel.ranks=[first]",
        "sequence_parallel.bytes.lengths=[64]", "sequence_parallel.bytes.sp=[2]", "sequence_parallel.bytes.extra_points=[]",
    )  # fmt: skip
    sp = results["sequence_parallel"]
    by = {(r["method"], r["p"]): r for r in sp["timed"]}
    compare = {r["p"]: r for r in sp["compare"]}
    for method in ("lasp2", "lasp1", "lasp2h", "ring"):
        one, two = by[(method, 1)], by[(method, 2)]
        # One rank: nothing sent, the time is the compute of the whole sequence.
        assert one["link_bytes"] == one["link_ms"] == one["exposed_ms"] == 0 and one["fwd_calls"] == one["bwd_calls"] == 0
        assert one["fwd_bwd_ms"] == pytest.approx(one["compute_ms"], rel=1e-12)
        # Half the tokens per rank at P = 2: fewer FLOPs (its time may not be less at this launch-bound tiny shape:
        # LASP-2's state exchange adds kernels).
        assert two["fwd_flops"] < one["fwd_flops"] and two["bwd_flops"] < one["bwd_flops"] and two["link_bytes"] > 0
        assert compare[2][f"{method}_speedup_over_one_gpu"] == pytest.approx(one["fwd_bwd_ms"] / two["fwd_bwd_ms"] - 1)
    assert compare[1]["lasp2_speedup_over_one_gpu"] == 0
    assert "LASP-2 over 1 GPU" in (tmp_path / "README.md").read_text()
    with pytest.raises(ValueError, match=r"sequence_parallel.sp degree 1 must be an integer >= 2 .* predicted with compute="):
        check_settings(bench_settings("bench_preset=sp", "sequence_parallel.sp=[1,2]"))


# --- wave quantisation (optional, off by default) ---------------------------------------------------------------


def test_wave_quantisation_charges_a_matmul_its_idle_sms():
    toy = DevicePreset("toy", 1e12, 1e30, sms=4)  # 4 SMs, compute-bound only
    flat = DeviceModel(toy, eff_flops=1.0, eff_hbm=1.0, kernel_overhead_s=0.0)
    waves = DeviceModel(toy, eff_flops=1.0, eff_hbm=1.0, kernel_overhead_s=0.0, wave_quantisation=True)

    def matmul(m, n, batch=None):
        a = torch.empty(*([batch] if batch else []), m, 64, device="meta", dtype=torch.bfloat16)
        b = torch.empty(*([batch] if batch else []), 64, n, device="meta", dtype=torch.bfloat16)
        with DeviceClock() as clock:
            a @ b
        return clock

    for (m, n, batch), tiles, share in [
        ((128, 128, None), 1, 1 / 4),  # one tile: 3 of the 4 SMs idle
        ((512, 128, None), 4, 1.0),  # one full wave
        ((640, 129, None), 10, 10 / 12),  # 5 x 2 tiles (129 columns: a partial tile): 3 waves of 4
        ((128, 128, 8), 8, 1.0),  # a batched matmul's tiles are per batch element: two full waves
    ]:
        clock = matmul(m, n, batch)
        assert clock.tiles == [tiles], (m, n, batch)
        assert clock.times(waves)[-1] == pytest.approx(clock.times(flat)[-1] / share, rel=1e-12)
    # Off by default (the committed fit has none); it needs the preset's SM count.
    assert not DeviceModel(get_device("h100-sxm")).wave_quantisation and get_device("h100-sxm").sms == 132
    with pytest.raises(ValueError, match=r"wave_quantisation=True needs the device's SM count; preset 'toy' has sms=0"):
        DeviceModel(DevicePreset("toy", 1e12, 1e9), wave_quantisation=True)


# --- matmul efficiency by shape (optional, off by default) ------------------------------------------------------


def test_matmul_table_charges_a_matmul_its_measured_throughput_at_its_shape():
    from eval.simulator.matmul_table import BEST, TFLOPS, shape_efficiency

    toy = DevicePreset("toy", 1e12, 1e30, sm="sm_90")  # compute-bound only, of the table's architecture
    flat = DeviceModel(toy, eff_flops=1.0, eff_hbm=1.0, kernel_overhead_s=0.0)
    table = DeviceModel(toy, eff_flops=1.0, eff_hbm=1.0, kernel_overhead_s=0.0, matmul_table=True)
    # A linear (addmm with its bias, mm without) records its (m, n, k); a grid point is charged the table's entry.
    x = torch.empty(1024, 4096, device="meta", dtype=torch.bfloat16)
    for bias in (None, torch.empty(512, device="meta", dtype=torch.bfloat16)):
        with DeviceClock() as clock:
            F.linear(x, torch.empty(512, 4096, device="meta", dtype=torch.bfloat16), bias)
        assert [s for s in clock.mnk if s] == [(1024, 512, 4096)], clock.names
        share = TFLOPS[(1024, 512)][4] / BEST  # 298.93 / 783.33 TFLOP/s
        assert clock.times(table)[-1] == pytest.approx(clock.times(flat)[-1] / share, rel=1e-12)
    # Between grid points: linear in log(throughput) over log2 of the dimension (the geometric mean half-way).
    half = round(2**10.5)
    expected = (TFLOPS[(1024, 512)][4] * TFLOPS[(2048, 512)][4]) ** 0.5 / BEST
    assert shape_efficiency(half, 512, 4096) == pytest.approx(expected, rel=1e-3)
    # Outside the grid: a dimension below 256 is not charged; K above 4096 is 4096's; an output beyond 4096 in one
    # dimension keeps its m x n with the excess moved into the other.
    assert shape_efficiency(64, 4096, 4096) == 1.0 and shape_efficiency(1024, 128, 4096) == 1.0
    assert shape_efficiency(1024, 1024, 8192) == shape_efficiency(1024, 1024, 4096)
    assert shape_efficiency(1024, 1024, 4096) == pytest.approx(TFLOPS[(1024, 1024)][4] / BEST, rel=1e-12)
    assert shape_efficiency(8192, 512, 1024) == pytest.approx(TFLOPS[(4096, 1024)][2] / BEST, rel=1e-12)
    assert shape_efficiency(256, 16384, 2048) == pytest.approx(TFLOPS[(1024, 4096)][3] / BEST, rel=1e-12)
    assert shape_efficiency(98304, 4096, 4096) == 1.0
    # A batched matmul has no shape ratio; the table is off by default.
    with DeviceClock() as clock:
        torch.empty(8, 1024, 64, device="meta") @ torch.empty(8, 64, 1024, device="meta")
    assert clock.mnk == [()] and clock.times(table) == clock.times(flat)
    assert not DeviceModel(get_device("h100-sxm")).matmul_table
    # A device of another architecture (an A100: sm_80) has no measured table: no shape ratio.
    with DeviceClock() as clock:
        F.linear(x, torch.empty(512, 4096, device="meta", dtype=torch.bfloat16))
    a100 = dict(eff_flops=1.0, eff_hbm=1.0, kernel_overhead_s=0.0)
    assert clock.times(DeviceModel(get_device("a100-sxm"), matmul_table=True, **a100)) == clock.times(
        DeviceModel(get_device("a100-sxm"), **a100))
