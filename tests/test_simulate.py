"""The speed simulator (eval.simulator.device + eval.simulator.replay): the device clock charges what the roofline says,
runs are deterministic, and the schedule comes from the model's own forward() (moving a wait there moves
the prediction, with no edit anywhere else)."""

import pytest
import torch
import torch.nn.functional as F

import models
from eval.simulator.device import DeviceClock, DeviceModel, DevicePreset, get_device
from eval.simulator.replay import NO_COMM, build_meta, record_generation, release
from models.common.cache import StaticKVLayer
from models.common.decoder import add_pending
from models.ladder import modeling as ladder_modeling
from models.moepp.entry import k_eff
from parallel import comm
from parallel.link import LinkPreset, collective_time

# A toy device and link with round numbers: 1e12 FLOP/s, 1e9 B/s, 1 us per kernel.
TOY = DeviceModel(DevicePreset("toy", 1e12, 1e9), eff_flops=1.0, eff_hbm=1.0, kernel_overhead_s=1e-6)
SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip


def test_matmul_is_charged_its_roofline():
    a = torch.empty(64, 128, device="meta", dtype=torch.bfloat16)
    b = torch.empty(128, 32, device="meta", dtype=torch.bfloat16)
    with DeviceClock() as clock:
        a @ b
    (flops,), (nbytes,) = clock.flops, clock.bytes
    assert flops == 2 * 64 * 128 * 32
    assert nbytes == 2 * (64 * 128 + 128 * 32 + 64 * 32)
    # memory-bound on the toy device: 24576 B / 1e9 B/s = 24.6 us, plus 1 us per kernel
    assert clock.times(TOY)[-1] == pytest.approx(nbytes / 1e9 + 1e-6)


def test_views_and_fused_pointwise_ops_are_free_and_a_reduction_is_one_kernel():
    x = torch.empty(8, 64, device="meta")
    with DeviceClock() as clock:
        y = x.view(64, 8).t()  # views
        z = torch.nn.functional.silu(x) * x  # elementwise: fused into their neighbours
        z.mean(-1)  # a reduction: one kernel reading x-sized input
    assert y.shape == (8, 64)
    assert sum(clock.kernel) == 1
    assert clock.times(TOY)[-1] == pytest.approx((8 * 64 * 4 + 8 * 4) / 1e9 + 1e-6)
    with DeviceClock(fuse_pointwise=False) as unfused:
        torch.nn.functional.silu(x) * x
    assert sum(unfused.kernel) == 2


def test_attention_is_one_fused_kernel():
    q = torch.empty(2, 8, 16, 32, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(2, 2, 48, 32, device="meta", dtype=torch.bfloat16)
    with DeviceClock() as clock:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    assert clock.names == ["scaled_dot_product_attention"]  # not the math decomposition, nor a GQA copy
    assert clock.flops == [4 * 2 * 8 * 16 * 48 * 32]
    assert clock.bytes == [2 * (2 * q.numel() + 2 * kv.numel())]


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_static_cache_writes_only_the_new_tokens(device):
    # The simulator runs the bench's own static cache (models.common.cache), on the meta device too.
    layer = StaticKVLayer(max_cache_len=64, device=device)
    k = torch.zeros(1, 2, 4, 16, device=device)
    layer.update(k, k)
    with DeviceClock() as clock:
        keys, _ = layer.update(k[:, :, :1], k[:, :, :1])
    assert keys.shape[2] == 64
    if device == "cpu":
        assert int(layer.get_seq_length()) == 5
    # the fill level advanced on the device (one tiny kernel), then two index_copy_ of one token's K (and
    # V): source and index read, written once
    assert clock.names == ["aten::add", "aten::add_", "aten::index_copy_", "aten::index_copy_"]
    assert sum(clock.bytes) == 2 * 2 * (2 * 16 * 4 + 8)


def test_link_base_latency_is_added_once_per_collective():
    link = LinkPreset("toy", alpha_s=1e-6, beta_Bps=1e9, base_s=5e-6)
    assert collective_time("all_reduce", 8000, 4, link) == pytest.approx(5e-6 + 6e-6 + 1.5 * 8000 / 1e9)
    assert collective_time("send_recv", 1000, 4, link) == pytest.approx(5e-6 + 1e-6 + 1000 / 1e9)


def _record(arch, batch=2, tp=2, **shape):
    degrees = {"tp": tp}
    model = build_meta(arch, models.get(arch).bench_config({**SHAPE, **shape}, degrees), degrees)
    try:
        return record_generation(model, batch, prompt_len=32, new_tokens=16)
    finally:
        release()


def test_two_runs_give_identical_numbers():
    a = _record("ladder").predict(TOY, "nvlink-h100")
    b = _record("ladder").predict(TOY, "nvlink-h100")
    assert a == b


def test_llama_leaves_all_its_link_time_exposed_and_ladder_hides_most():
    device = DeviceModel(get_device("h100-sxm"))
    llama = _record("llama").predict(device, "pcie4")
    for phase in ("prefill", "decode"):
        assert llama[phase]["busy"] > 0
        assert llama[phase]["exposed"] == pytest.approx(llama[phase]["busy"], rel=1e-12)
    ladder = _record("ladder").predict(device, "pcie4")
    assert ladder["decode"]["busy"] == pytest.approx(llama["decode"]["busy"])  # the same all-reduces
    assert ladder["decode"]["exposed"] < 0.5 * llama["decode"]["exposed"]
    # upper bound: the same run with free communication is the compute alone
    free = _record("llama").predict(device, NO_COMM)
    assert free["decode"]["time"] == pytest.approx(free["decode"]["compute"]) and free["decode"]["exposed"] == 0


def test_moving_one_wait_in_forward_changes_the_prediction(monkeypatch):
    device = DeviceModel(get_device("h100-sxm"))
    before = _record("ladder").predict(device, "pcie4")

    def run_layers(self, hidden_states, position_embeddings, attention_mask, cache):
        # Ladder's forward with one change: the MLP's all-reduce is waited at once instead of one
        # sub-block later (the attention's stays overlapped).
        x, attn_pending = hidden_states, None
        for layer in self.layers:
            x = add_pending(x, attn_pending)
            attn_out = layer.attention_block(x, position_embeddings, attention_mask, cache)
            attn_pending = comm.all_reduce(attn_out, layer.tp_group)
            x = x + comm.all_reduce(layer.mlp_block(x), layer.tp_group).wait()
        return add_pending(x, attn_pending)

    monkeypatch.setattr(ladder_modeling.ZooLadderModel, "run_layers", run_layers)
    after = _record("ladder").predict(device, "pcie4")
    assert after["decode"]["busy"] == pytest.approx(before["decode"]["busy"])
    assert after["decode"]["exposed"] > before["decode"]["exposed"] * 1.5
    assert after["tok_s"] < before["tok_s"]


def test_a_device_preset_is_named_or_a_clear_error():
    assert get_device("h100-sxm").hbm_Bps == 3.35e12
    with pytest.raises(ValueError, match=r"Unknown device preset 'tpu'; choose one of \['a100-40gb', 'a100-sxm', 'a30', 'a800', 'h100-sxm', 'h200', 'rtx4090'\]"):
        get_device("tpu")
    with pytest.raises(ValueError, match=r"eff_hbm=0 must be in \(0, 1\]"):
        DeviceModel(get_device("h100-sxm"), eff_hbm=0)


def test_moepp_runs_on_meta_at_the_load_its_balance_loss_aims_for():
    # MoE++ selects its FFN / copy / constant assignments by boolean masks; on the meta device the simulator
    # takes the split the heterogeneous balance loss aims for (models/moepp: expected_assignments), so its
    # all-to-all carries k_eff rows per token, as the entry's collectives_per_forward declares.
    shape = {**SHAPE, "num_hidden_layers": 2}
    config = models.get("moepp").bench_config(shape, {"ep": 2})
    model = build_meta("moepp", config, {"ep": 2})
    try:
        recording = record_generation(model, batch=8, prompt_len=16, new_tokens=4)
    finally:
        release()
    expected = model.model.layers[0].mlp.expected_assignments(8)
    sent = recording.phases["decode"].counts["all_to_all"]
    assert sent["calls"] == 2 * 2  # dispatch and combine, per layer
    assert sent["bytes"] == 2 * 2 * expected["ffn"] * shape["hidden_size"] * 2  # bf16 rows
    assert expected["ffn"] == round(k_eff(config) * 8)
    assert recording.predict(TOY, "pcie4")["tok_s"] > 0


def test_routed_experts_are_charged_their_flops():
    # aten::_grouped_mm has no formula in torch.utils.flop_counter: the experts' matmuls were charged bytes only.
    a = torch.empty(96, 64, device="meta", dtype=torch.bfloat16)  # 96 routed rows of width K = 64
    b = torch.empty(4, 64, 32, device="meta", dtype=torch.bfloat16)  # 4 experts, K x N = 64 x 32
    offs = torch.empty(4, device="meta", dtype=torch.int32)
    with DeviceClock() as clock:
        torch.nn.functional.grouped_mm(a, b, offs=offs)
    assert clock.names == ["aten::_grouped_mm"] and clock.flops == [2 * 96 * 64 * 32]
    # dB's layout: [K, rows] x [rows, N] with offsets along the rows: the same 2 x rows x K x N.
    with DeviceClock() as clock:
        torch.nn.functional.grouped_mm(a.T, torch.empty(96, 32, device="meta", dtype=torch.bfloat16), offs=offs)
    assert clock.flops == [2 * 96 * 64 * 32]


def test_every_op_without_a_flop_formula_is_memory_bound():
    from eval.simulator.audit import UNCLASSIFIED, audit

    rows = audit()  # every architecture: prefill, decode on its static cache, a training step
    assert not [name for name, r in rows.items() if r["class"] == UNCLASSIFIED], rows
    assert "aten::_grouped_mm" not in rows and "aten::mean" in rows  # charged now; a norm's mean memory-bound
