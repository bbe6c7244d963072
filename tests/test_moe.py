"""The shared MoE layer (models/common/moe.py), expert parallelism (parallel/ep.py) and the `moe` architecture.

- grouped_mm experts == the per-expert loop (values and gradients; fp32 atol 1e-5, bf16 loose);
- dispatch / compute / combine == a dense reference that sends every token through its experts one by one
  (dropless, capacity, a filtered subset of assignments; fp32 atol 1e-5, gradients included);
- router, balance loss and the aux-loss-free bias, each against its formula;
- on gloo: ep 2, ep 4 and ep 2 x tp 2 == one process on the concatenated batch (logits, loss with the
  balance loss, every gradient after parallel.grad_sync; fp32 atol 1e-5), a rank that sends a peer nothing
  and an expert that gets nothing, and the collectives counted against the entry's declaration;
- `none` and `simulated` modes on the fake process group; bad inputs, one clear error each.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import models
import parallel
from models.common.moe import (
    GroupedExperts,
    Routing,
    SparseMoE,
    TopKRouter,
    capacity,
    dispatch,
    load_balance_loss,
    update_balance_biases,
)
from parallel import comm
from parallel.layout import shard_specs
from tests.distributed import run_ranks

ATOL = 1e-5
D, F_WIDTH, E, K = 16, 24, 4, 2


def make_experts(
    num_experts=E, d=D, f=F_WIDTH, dtype=torch.float32, seed=0, impl="grouped_mm"
) -> GroupedExperts:
    torch.manual_seed(seed)
    experts = GroupedExperts(num_experts, d, f, impl=impl)
    with torch.no_grad():
        for w in (experts.gate_proj, experts.up_proj, experts.down_proj):
            w.normal_(0, 0.3)
    return experts.to(dtype)


def expert_ffn(experts, e: int, x: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ experts.gate_proj[e].T) * (x @ experts.up_proj[e].T)) @ experts.down_proj[e].T


def dense_reference(x, token_idx, expert_idx, gates, experts, cap=None) -> torch.Tensor:
    """Every kept assignment through its expert, one at a time; over capacity: an expert's first `cap`
    assignments in assignment order are kept."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    seen = [0] * experts.num_experts
    for t, e, g in zip(token_idx.tolist(), expert_idx.tolist(), gates, strict=True):
        seen[e] += 1
        if cap is not None and seen[e] > cap:
            continue
        out[t] = out[t] + g * expert_ffn(experts, e, x[t : t + 1])[0].float()
    return out.to(x.dtype)


def run_moe(x, assignments, experts, ep_group=None, cap=None):
    pending = dispatch(x, assignments, experts, ep_group, cap)
    pending.compute()
    return pending.combine()


# --- experts ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_equals_per_expert_loop(dtype):
    grouped = make_experts(dtype=dtype)
    loop = make_experts(dtype=dtype, impl="loop")
    counts = [3, 0, 7, 2]  # an expert without rows too
    x = torch.randn(sum(counts), D, dtype=dtype, generator=torch.Generator().manual_seed(1))
    upstream = torch.randn(sum(counts), D, dtype=dtype, generator=torch.Generator().manual_seed(2))
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [grouped(xs[0], counts), loop(xs[1], torch.tensor(counts))]
    for out in outs:
        (out * upstream).sum().backward()
    tol = dict(rtol=0, atol=ATOL) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outs[0], outs[1], **tol)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, **tol)
    for name in ("gate_proj", "up_proj", "down_proj"):
        a, b = getattr(grouped, name).grad, getattr(loop, name).grad
        torch.testing.assert_close(a, b, **tol, msg=lambda m, n=name: f"{n}: {m}")
    # No rows at all: an empty result; an expanded output gradient (of a sum) is taken too.
    empty = grouped(torch.zeros(0, D, dtype=dtype), [0] * E)
    assert empty.shape == (0, D)
    grouped(x, counts).sum().backward()


def test_loop_fallback_for_float64():
    experts = make_experts().double()
    x = torch.randn(5, D, dtype=torch.float64)
    expected = torch.cat([expert_ffn(experts, 0, x[:2]), expert_ffn(experts, 2, x[2:])])
    torch.testing.assert_close(experts(x, [2, 0, 3, 0]), expected, rtol=0, atol=1e-12)


@pytest.mark.slow
def test_compiled_fp32_experts_fall_back_to_the_loop():
    experts = make_experts()
    x = torch.randn(10, D, generator=torch.Generator().manual_seed(1))
    counts = [3, 0, 5, 2]
    torch.testing.assert_close(torch.compile(experts)(x, counts), experts(x, counts), rtol=0, atol=ATOL)


# --- dispatch / combine -------------------------------------------------------------------------------


def routing_for(x, seed=0, num_experts=E, top_k=K) -> Routing:
    torch.manual_seed(seed)
    router = TopKRouter(x.shape[1], num_experts, top_k)
    return router(x)


@pytest.mark.parametrize("cap", [None, 3], ids=["dropless", "capacity"])
def test_dispatch_combine_equals_dense_reference(cap):
    experts = make_experts()
    x = torch.randn(11, D, generator=torch.Generator().manual_seed(3), requires_grad=True)
    routing = routing_for(x.detach())
    gates = routing.gates.detach().clone().requires_grad_()
    assignments = Routing(routing.token_idx, routing.expert_idx, gates, routing.probs, routing.logits)
    out = run_moe(x, assignments, experts, cap=cap)
    x_ref, gates_ref = x.detach().clone().requires_grad_(), gates.detach().clone().requires_grad_()
    ref_experts = make_experts()
    ref = dense_reference(x_ref, routing.token_idx, routing.expert_idx, gates_ref, ref_experts, cap)
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    if cap is not None:  # the cap really dropped something
        assert torch.bincount(routing.expert_idx, minlength=E).max() > cap
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    (out * upstream).sum().backward()
    (ref * upstream).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=ATOL)
    torch.testing.assert_close(gates.grad, gates_ref.grad, rtol=0, atol=ATOL)
    for name in ("gate_proj", "up_proj", "down_proj"):
        torch.testing.assert_close(
            getattr(experts, name).grad, getattr(ref_experts, name).grad, rtol=0, atol=ATOL
        )


def test_filtered_assignments_and_an_expert_without_tokens():
    """A subset of the assignments (MoE++ drops its zero-computation experts' before dispatch); expert 3
    gets no token; a token may keep one assignment or none."""
    experts = make_experts()
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(5))
    routing = routing_for(x, num_experts=E, top_k=K)
    keep = routing.expert_idx != 3
    keep[0] = False
    kept = routing.select(keep)
    assert kept.probs is routing.probs and kept.token_idx.numel() == int(keep.sum())
    out = run_moe(x, kept, experts)
    ref = dense_reference(x, kept.token_idx, kept.expert_idx, kept.gates, experts)
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    # Nothing dispatched at all: zeros, the residual alone.
    none = routing.select(torch.zeros_like(keep))
    assert torch.equal(run_moe(x, none, experts), torch.zeros_like(x))


def test_bf16_tokens_return_in_their_dtype():
    experts = make_experts(dtype=torch.bfloat16)
    x = torch.randn(7, D).bfloat16()
    routing = routing_for(x.float())
    out = run_moe(x, routing, experts)
    assert out.dtype == torch.bfloat16
    ref = dense_reference(x.float(), routing.token_idx, routing.expert_idx, routing.gates, make_experts())
    torch.testing.assert_close(out.float(), ref, rtol=5e-2, atol=5e-2)


def test_steps_run_in_order_once():
    experts = make_experts()
    x = torch.randn(4, D)
    pending = dispatch(x, routing_for(x), experts)
    with pytest.raises(RuntimeError, match=r"combine\(\) runs once, after compute\(\)"):
        pending.combine()
    pending.compute()
    with pytest.raises(RuntimeError, match=r"compute\(\) runs once, after dispatch"):
        pending.compute()


def test_capacity_formula():
    # top_k * ceil(cf * T / E) (specs/moe.md)
    assert capacity(100, 8, 2, 1.0) == 2 * 13
    assert capacity(1, 8, 2, 1.25) == 2
    with pytest.raises(ValueError, match="capacity_factor=0 must be > 0"):
        capacity(10, 4, 2, 0)


# --- router and balance ---------------------------------------------------------------------------------


def test_router_softmax_top_k_renormalised_in_fp32():
    torch.manual_seed(0)
    router = TopKRouter(D, E, K)
    x = torch.randn(9, D).bfloat16()
    routing = router(x)
    logits = x.float() @ router.gate.weight.float().T
    probs = logits.softmax(-1)
    top = probs.topk(K, dim=-1)
    assert routing.probs.dtype == routing.gates.dtype == routing.logits.dtype == torch.float32
    torch.testing.assert_close(routing.logits, logits)
    torch.testing.assert_close(routing.probs, probs)
    assert torch.equal(routing.expert_idx, top.indices.flatten())
    assert torch.equal(routing.token_idx, torch.arange(9).repeat_interleave(K))
    torch.testing.assert_close(routing.gates, (top.values / top.values.sum(-1, keepdim=True)).flatten())
    torch.testing.assert_close(routing.gates.view(9, K).sum(-1), torch.ones(9))
    # extra_logits (MoE++'s gating residual) are added before scoring.
    extra = torch.randn(9, E)
    torch.testing.assert_close(router(x, extra_logits=extra).logits, logits + extra)
    # Sigmoid scores: probs normalised per token for the balance loss.
    sig = TopKRouter(D, E, K, score_func="sigmoid")
    r = sig(x)
    torch.testing.assert_close(r.probs.sum(-1), torch.ones(9))
    torch.testing.assert_close(r.gates.view(9, K).sum(-1), torch.ones(9))


def test_load_balance_loss_formula():
    probs = torch.softmax(torch.randn(6, E, generator=torch.Generator().manual_seed(0)), -1)
    expert_idx = torch.tensor([0, 1, 0, 2, 0, 1, 3, 0, 0, 2, 1, 0])  # 6 tokens x top-2
    f = torch.bincount(expert_idx, minlength=E).float() / expert_idx.numel()
    p = probs.mean(0)
    torch.testing.assert_close(load_balance_loss(probs, expert_idx, E), E * (f * p).sum())
    eta = torch.tensor([1.0, 1.0, 0.75, 0.75])
    torch.testing.assert_close(load_balance_loss(probs, expert_idx, E, weights=eta), E * (eta * f * p).sum())
    # Perfect balance gives 1.
    uniform = torch.full((4, E), 1 / E)
    assert load_balance_loss(uniform, torch.arange(8) % E, E).item() == pytest.approx(1.0)


def test_aux_loss_free_bias_moves_against_the_load():
    torch.manual_seed(0)
    router = TopKRouter(D, E, 1, balance_bias=True).train()
    with torch.no_grad():
        router.gate.weight.zero_()
        router.gate.weight[0, 0] = 5.0  # every token with x[0] > 0 prefers expert 0
    x = torch.randn(64, D).abs()
    routing = router(x)
    load = torch.bincount(routing.expert_idx, minlength=E).float()
    assert torch.equal(router.tokens_per_expert, load) and load[0] == 64
    router.update_bias(coeff=0.1)
    bias = router.expert_bias
    assert bias[0] < 0 and (bias[1:] > 0).all()
    assert bias.mean().abs() < 1e-7
    assert router.tokens_per_expert.sum() == 0  # counts are per optimizer step
    # The bias decides the choice; the gates come from the scores alone.
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([-10.0, 10.0, 0.0, 0.0]))
    routing = router(x)
    assert (routing.expert_idx == 1).all()
    torch.testing.assert_close(routing.gates, torch.ones(64))  # top-1 renormalised
    two = TopKRouter(D, E, 2, renormalize=False, balance_bias=True)
    with torch.no_grad():
        two.expert_bias.copy_(torch.tensor([0.0, 0.0, 10.0, 10.0]))
    r = two(x)
    torch.testing.assert_close(r.gates, r.probs.gather(1, r.expert_idx.view(-1, 2)).flatten())
    assert set(r.expert_idx.tolist()) == {2, 3}


def test_update_balance_biases_on_a_model():
    model = models.ZOO["moe"].model_class(models.ZOO["moe"].tiny(router_balance_bias=True)).train()
    ids = torch.randint(0, 256, (2, 10))
    model(ids, labels=ids).loss.backward()
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert len(routers) == model.config.num_moe_layers
    assert all(r.tokens_per_expert.sum() == 20 * 2 for r in routers)
    update_balance_biases(model, coeff=1e-3)
    assert all(r.tokens_per_expert.sum() == 0 and r.expert_bias.abs().sum() > 0 for r in routers)
    assert "expert_bias" in "".join(model.state_dict())  # saved with the weights


def test_balance_loss_only_in_training_mode():
    model = models.ZOO["moe"].model_class(models.ZOO["moe"].tiny())
    ids = torch.randint(0, 256, (2, 10))
    out = model.train()(ids, labels=ids)
    assert set(out.aux_losses) == {"load_balance"}
    torch.testing.assert_close(out.loss, out.lm_loss + out.aux_losses["load_balance"])
    # The mean over MoE layers of coef * E sum f P: about coef when roughly balanced.
    assert 0.5 * 0.01 < out.aux_losses["load_balance"].item() < 4 * 0.01
    assert model.eval()(ids, labels=ids).aux_losses == {}


# --- bad inputs ----------------------------------------------------------------------------------------


def test_bad_inputs_are_one_clear_error_each():
    entry = models.ZOO["moe"]
    with pytest.raises(
        ValueError,
        match=r"num_experts_per_tok=5 experts per token does not fit 4 experts; choose top-k in 1\.\.4",
    ):
        entry.tiny(num_experts_per_tok=5)
    with pytest.raises(
        ValueError, match=r"top_k|num_experts_per_tok=3 experts per token does not fit 2 experts"
    ):
        SparseMoE(D, F_WIDTH, 2, 3)
    with pytest.raises(
        ValueError,
        match=r"intermediate_size=100 do not fit grouped_mm.*multiples of 8: use intermediate_size 96 or 104.*experts_impl='loop'",
    ):
        entry.tiny(intermediate_size=100)
    entry.tiny(intermediate_size=100, experts_impl="loop")  # the loop takes any width
    with pytest.raises(ValueError, match=r"moe_layer_freq=5 must be an integer in 1\.\.num_hidden_layers=4"):
        entry.tiny(moe_layer_freq=5)
    with pytest.raises(ValueError, match=r"capacity_factor=0 must be a number > 0, or None"):
        entry.tiny(capacity_factor=0)
    with pytest.raises(
        ValueError,
        match=r"EP degree 3 does not divide num_local_experts=4; EP degrees that fit this model: \[1, 2, 4\]",
    ):
        entry.check_layout(entry.tiny(), {"ep": 3})
    with pytest.raises(ValueError, match=r"has no sequence-parallel layout, so sp=2"):
        entry.check_layout(entry.tiny(), {"sp": 2})
    # A field assigned after construction is checked when the model is built.
    config = entry.tiny()
    config.num_experts_per_tok = 9
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        entry.model_class(config)


# --- expert parallelism on gloo --------------------------------------------------------------------------


def build_moe(**overrides):
    torch.manual_seed(0)
    return models.ZOO["moe"].model_class(models.ZOO["moe"].tiny(**overrides)).train()


def local_part(reference: torch.Tensor, specs) -> torch.Tensor:
    for spec in specs:
        reference = reference.chunk(spec.size, dim=spec.tensor_dim)[spec.rank]
    return reference


def _check_model_equivalence(mesh, batch_per_rank: int = 2, seq: int = 10, **overrides):
    """The sharded model on this rank's rows of a global batch == the one-process model on all of it."""
    from parallel.grad_sync import sync_gradients

    ep, ep_rank = mesh["ep"].size(), mesh.get_local_rank("ep")
    ids = torch.randint(0, 256, (ep * batch_per_rank, seq), generator=torch.Generator().manual_seed(7))
    mine = ids[ep_rank * batch_per_rank : (ep_rank + 1) * batch_per_rank]
    reference, sharded = build_moe(**overrides), build_moe(**overrides)
    parallel.parallelize(sharded, mesh)

    ref_out = reference(ids, labels=ids)
    ref_out.loss.backward()
    out = sharded(mine, labels=mine)
    out.loss.backward()
    sync_gradients(sharded, mesh)

    rows = slice(ep_rank * batch_per_rank, (ep_rank + 1) * batch_per_rank)
    torch.testing.assert_close(out.logits, ref_out.logits[rows], rtol=0, atol=ATOL)
    # Every ep rank gets the balance loss of the whole batch; the LM losses average to the whole batch's.
    torch.testing.assert_close(
        out.aux_losses["load_balance"], ref_out.aux_losses["load_balance"], rtol=0, atol=ATOL
    )
    mean_loss = comm.all_reduce(out.loss.detach(), mesh.get_group("ep")).wait() / ep
    torch.testing.assert_close(mean_loss, ref_out.loss, rtol=0, atol=ATOL)

    specs = shard_specs(sharded)
    ref_params = dict(reference.named_parameters())
    assert {s.mesh_dim for n in specs for s in specs[n] if ".experts." in n} == {"ep"}
    for name, p in sharded.named_parameters():
        expected = local_part(ref_params[name].grad, specs.get(name, ()))
        torch.testing.assert_close(p.grad, expected, rtol=0, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


def _check_uneven_routing(rank: int, group, world_size: int):
    """Rank 0 sends its peers nothing; the last expert gets no token anywhere; forward and backward
    equal the dense reference (each rank checks its own tokens)."""
    num_experts = 2 * world_size
    full = make_experts(num_experts)
    local = make_experts(num_experts)
    per = num_experts // world_size
    with torch.no_grad():  # this rank's experts, as parallel.ep's role keeps them
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(
                local, name, torch.nn.Parameter(getattr(local, name)[rank * per : (rank + 1) * per].clone())
            )
    local.num_local_experts = per
    tokens = 5 + rank  # ranks may route different numbers of tokens
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(10 + rank), requires_grad=True)
    token_idx = torch.arange(tokens).repeat_interleave(2)
    if rank == 0:
        expert_idx = torch.tensor([0, 1] * tokens)  # both of rank 0's own experts
    else:
        expert_idx = torch.randint(
            0, num_experts - 1, (2 * tokens,), generator=torch.Generator().manual_seed(rank)
        )
    gates = torch.rand(2 * tokens, generator=torch.Generator().manual_seed(20 + rank))
    assignments = Routing(token_idx, expert_idx, gates, None, None)
    out = run_moe(x, assignments, local, group)
    x_ref = x.detach().clone().requires_grad_()
    ref = dense_reference(x_ref, token_idx, expert_idx, gates, full)
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=ATOL)


def _count_one_forward(mesh):
    """Real collectives of one eval forward == what models/moe/entry.py declares."""
    ep = mesh["ep"].size()
    model = parallel.parallelize(build_moe().eval(), mesh)
    declared = models.ZOO["moe"].collectives_per_forward(model.config, {"ep": ep})
    ids = torch.randint(0, 256, (2, 8))
    comm.reset_counters()
    with torch.no_grad():
        model(ids)
    counts = comm.snapshot_counters()
    assert set(counts) == set(declared) == {"all_to_all", "exchange_splits"}
    for kind, expected in declared.items():
        assert counts[kind]["calls"] == expected.calls, kind
    # The dispatch sends T k rows; the combine sends back what the rank received, T k only on average.
    sent = comm.all_reduce(torch.tensor(counts["all_to_all"]["bytes"]), mesh.get_group("ep")).wait()
    assert sent == ep * declared["all_to_all"].values_per_token * 2 * 8 * 4  # fp32
    assert (
        counts["exchange_splits"]["bytes"] == 8 * model.config.num_local_experts * model.config.num_moe_layers
    )


def _capacity_mode_runs(mesh):
    """With a capacity factor each rank drops over-capacity tokens on its own; nothing hangs."""
    model = parallel.parallelize(build_moe(capacity_factor=0.5), mesh)
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(mesh.get_rank()))
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)


def _ep_ranks(rank, world_size):
    mesh = parallel.init_mesh(ep=world_size)
    # A large balance-loss weight, so that a wrong scale of its gradient under ep is far above atol.
    _check_model_equivalence(mesh, router_aux_loss_coef=0.5)
    _check_uneven_routing(rank, mesh.get_group("ep"), world_size)
    _count_one_forward(mesh)
    _capacity_mode_runs(mesh)


def test_ep2_equals_one_process():
    run_ranks(_ep_ranks, 2)


def _ep4_and_ep2_tp2_ranks(rank, world_size):
    _ep_ranks(rank, world_size)
    # The same four ranks as an ep 2 x tp 2 mesh: experts over ep, attention and dense MLPs over tp.
    _check_model_equivalence(parallel.init_mesh(ep=2, tp=2), num_attention_heads=4, num_key_value_heads=4)


def test_ep4_and_ep2_x_tp2_equal_one_process():
    run_ranks(_ep4_and_ep2_tp2_ranks, 4)


# --- comm modes on the fake process group ------------------------------------------------------------------


@pytest.fixture
def fake_ep4():
    try:
        yield parallel.init_mesh(ep=4, fake=True)
    finally:
        torch.distributed.destroy_process_group()


def test_none_and_simulated_modes_run_and_count(fake_ep4):
    model = parallel.parallelize(build_moe().eval(), fake_ep4)
    assert model.model.layers[1].mlp.experts.gate_proj.shape[0] == 1  # rank 0 of 4 keeps expert 0
    declared = models.ZOO["moe"].collectives_per_forward(model.config, {"ep": 4})
    ids = torch.randint(0, 256, (2, 8))
    comm.reset_counters()
    with comm.use_mode("none"), torch.no_grad():
        assert model(ids).logits.shape == (2, 8, 256)
    assert comm.snapshot_counters() == {}  # `none` skips (and so does not count) every collective
    comm.reset_counters()
    with comm.use_mode("simulated", link="nvlink-h100") as clock, torch.no_grad():
        clock.start()
        assert model(ids).logits.shape == (2, 8, 256)
        assert clock.comm_busy > 0
    counts = comm.snapshot_counters()
    assert counts["all_to_all"]["calls"] == declared["all_to_all"].calls == 2 * model.config.num_moe_layers
    assert (
        counts["exchange_splits"]["calls"] == declared["exchange_splits"].calls == model.config.num_moe_layers
    )
    assert counts["all_to_all"]["bytes"] == declared["all_to_all"].values_per_token * 16 * 4
    # Training mode runs too (the balance loss's all-reduce is simulated as well).
    model.train()
    with comm.use_mode("simulated", link="nvlink-h100"):
        model(ids, labels=ids).loss.backward()
    assert math.isfinite(model.model.layers[1].mlp.router.gate.weight.grad.sum().item())
