"""The shared MoE layer (models/common/moe.py), expert parallelism (parallel/ep.py) and the `moe` architecture.

- grouped_mm experts == the per-expert loop (values and gradients; fp32 atol 1e-5, bf16 loose);
- dispatch / compute / combine == a dense reference that sends every token through its experts one by one
  (dropless, capacity, a filtered subset of assignments; fp32 atol 1e-5, gradients included), and in
  float64 (dropless and padded, atol 1e-12: routing and combine run in fp64 there, fp32 below);
- router, balance loss and the aux-loss-free bias, each against its formula;
- bad inputs, one clear error each;
- under expert parallelism, on the ranks of tests/test_ep.py (which checks ep 2, ep 4 and ep 2 x tp 2 ==
  one process, uneven routing and the collectives for every ep architecture): a capacity factor runs.
"""

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
    dispatch_padded,
    load_balance_loss,
    update_balance_biases,
)

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
    out = torch.zeros(x.shape, dtype=torch.promote_types(x.dtype, torch.float32))  # the combine's dtype
    seen = [0] * experts.num_experts
    for t, e, g in zip(token_idx.tolist(), expert_idx.tolist(), gates, strict=True):
        seen[e] += 1
        if cap is not None and seen[e] > cap:
            continue
        out[t] = out[t] + g * expert_ffn(experts, e, x[t : t + 1])[0].to(out.dtype)
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


@pytest.mark.parametrize("path", ["grouped_mm", "padded"])
def test_fp32_experts_take_bf16_activations(path):
    """FSDP2's bf16 mixed precision leaves experts outside FSDP at dp x sp = 1 in fp32 (parallel.fsdp): a bf16
    input is computed as autocast would (the weights cast for the matmul), bf16 out, fp32 gradients."""
    experts = make_experts()  # fp32
    counts = [3, 1, 4, 2]
    x = torch.randn(sum(counts), D, generator=torch.Generator().manual_seed(3))
    if path == "grouped_mm":
        out, ref = experts(x.bfloat16(), counts), experts(x, counts)
    else:
        rows = x[:8].view(E, 2, D)
        out, ref = experts.forward_padded(rows.bfloat16()), experts.forward_padded(rows)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=5e-2, atol=5e-2)
    out.float().sum().backward()
    assert experts.gate_proj.grad.dtype == torch.float32 and experts.gate_proj.grad.abs().sum() > 0


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
    # A gate's gradient is a dot product over the hidden dim of values up to ~50: in fp32 its last bits move with
    # the summation order (thread count), so it is compared to a few ulps of its size as well.
    torch.testing.assert_close(gates.grad, gates_ref.grad, rtol=1e-6, atol=ATOL)
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


@pytest.mark.parametrize("padded", [False, True], ids=["dropless", "padded"])
def test_float64_routing_and_combine_stay_float64(padded):
    """A float64 model routes and combines in float64: logits are the fp64 product, gates and probs fp64,
    and the layer equals the dense reference (forward and input gradient) to 1e-12, which fp32 gates miss."""
    experts = make_experts(dtype=torch.float64)
    seed = torch.Generator().manual_seed(3)
    x = torch.randn(11, D, generator=seed, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(0)
    router = TopKRouter(D, E, K).double()
    routing = router(x)
    assert routing.logits.dtype == routing.probs.dtype == routing.gates.dtype == torch.float64
    assert torch.equal(routing.logits, F.linear(x, router.gate.weight))
    pending = (dispatch_padded if padded else dispatch)(x, routing, experts)
    pending.compute()
    out = pending.combine()
    x_ref = x.detach().clone().requires_grad_()
    ref = dense_reference(x_ref, routing.token_idx, routing.expert_idx, router(x_ref).gates, experts)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-12)
    # fp32 gates would be far outside the tolerance.
    rounded_gates = routing.gates.float()
    rounded = dense_reference(x_ref.detach(), routing.token_idx, routing.expert_idx, rounded_gates, experts)
    assert not torch.allclose(out, rounded, rtol=0, atol=1e-12)


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
    # top_k * ceil(cf * T / E) (Switch Transformer's capacity, k per token)
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


# --- expert parallelism: this model's own checks, run by tests/test_ep.py on its ranks --------------------


def build_moe(**overrides):
    torch.manual_seed(0)
    return models.ZOO["moe"].model_class(models.ZOO["moe"].tiny(**overrides)).train()


def ep_checks(mesh):
    """With a capacity factor each rank drops over-capacity tokens on its own; nothing hangs."""
    model = parallel.parallelize(build_moe(capacity_factor=0.5), mesh)
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(mesh.get_rank()))
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
