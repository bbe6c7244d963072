"""MoE++ (models/moepp): the formulas one by one, and the expert-parallel layout.

- a layer == a token-by-token reference written from the paper (zero / copy / constant experts, the zero
  expert's weight renormalised away, FFN experts), with its routing fixed through the gating residual and
  with random weights (fp32 atol 1e-5; float64 atol 1e-10: routing and combine follow the model's dtype);
  a float64 token routed to (zero, copy) comes out as its float64 input exactly; the constant expert; the
  gating residual within a layer and down
  the stack; capacities (formula, which assignments are kept, the layer with tokens dropped); the
  heterogeneous balance loss; a layer where no token reaches an FFN expert (forward and backward);
- under expert parallelism, on the ranks of tests/test_ep.py (which checks ep 2, ep 4 and ep 2 x tp 2 == one
  process and the collectives for every ep architecture, the all-to-all carrying the rows of FFN experts
  only): a layer whose tokens all stay with the zero-computation experts sends nothing and equals one
  process; fewer rows than top-2 of every token cross the link;
- `simulated` mode on the fake process group: 2 all-to-alls per layer, fewer bytes than `moe`'s (k_eff);
- bad inputs, one clear error each.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import models
import parallel
from models.common.moe import load_balance_loss
from models.moepp.entry import k_eff
from models.moepp.modeling import ConstantExperts, expert_capacities, within_capacity
from parallel import comm
from tests.test_ep import build as build_at
from tests.test_ep import count_one_forward, fake_ep_mesh, ids_of

ATOL = 1e-5


def build(**overrides):
    return build_at("moepp", {}, **overrides)


def expert_ffn(experts, e: int, x: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ experts.gate_proj[e].T) * (x @ experts.up_proj[e].T)) @ experts.down_proj[e].T


def reference(layer, x: torch.Tensor, logits: torch.Tensor, capacity=None) -> torch.Tensor:
    """The MoE++ layer token by token from the paper's formulas, given its router logits [T, N]: top-k of
    softmax(logits), the zero experts' weight given to the token's other chosen experts, sum_i g_i E_i(x).
    `capacity` [N]: an expert keeps its first assignments in assignment order (token-major)."""
    cfg = layer.config
    ffn, zero_end, copy_end = cfg.num_local_experts, cfg.num_local_experts + cfg.num_zero_experts, None
    copy_end = zero_end + cfg.num_copy_experts
    constant = layer.constant_experts
    probs = logits.softmax(-1)
    seen = [0] * logits.shape[1]
    out = torch.zeros(x.shape, dtype=x.dtype)
    for t in range(x.shape[0]):
        chosen = probs[t].topk(cfg.num_experts_per_tok).indices.tolist()
        kept = []
        for i in chosen:
            seen[i] += 1
            if capacity is None or seen[i] <= capacity[i]:
                kept.append(i)
        total = sum(probs[t, i] for i in chosen if not ffn <= i < zero_end)
        for i in kept:
            if ffn <= i < zero_end:
                continue  # E(x) = 0
            if i < ffn:
                e = expert_ffn(layer.experts, i, x[t : t + 1])[0]
            elif i < copy_end:
                e = x[t]  # E(x) = x
            else:
                c = i - copy_end
                a = (constant.weight[c] @ x[t]).softmax(-1)
                e = a[0] * x[t] + a[1] * constant.constant[c]
            out[t] += probs[t, i] / total * e
    return out


def forced(layer, logits: torch.Tensor):
    """Make `layer`'s router logits equal `logits` (fed as the previous layer's): W^j = 0, W_g^j = I."""
    with torch.no_grad():
        layer.router.gate.weight.zero_()
        layer.gate_residual.weight.copy_(torch.eye(logits.shape[1]))
    return logits


# --- the formulas -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "atol"), [(torch.float32, ATOL), (torch.float64, 1e-10)], ids=["fp32", "fp64"]
)
@pytest.mark.parametrize("dispatch", ["dropless", "padded"])
def test_layer_with_fixed_routing_equals_reference(dtype, atol, dispatch):
    """Every kind of expert, chosen through logits fixed by the gating residual; in float64 to float64's
    precision (the router, the zero-computation experts and the combine run in fp64 there)."""
    layer = build(moe_dispatch=dispatch).model.layers[1].mlp.to(dtype)
    n, ffn = layer.router.num_experts, layer.config.num_local_experts
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2), dtype=dtype)
    logits = forced(layer, 2 * torch.randn(64, n, generator=torch.Generator().manual_seed(3), dtype=dtype))
    chosen = set(logits.topk(2).indices.flatten().tolist())
    assert set(range(n)) <= chosen  # FFN, zero, copy and both constant experts are exercised
    out, returned_logits, _ = layer(x, logits)
    assert out.dtype == returned_logits.dtype == dtype
    torch.testing.assert_close(returned_logits, logits, rtol=0, atol=0)
    torch.testing.assert_close(out, reference(layer, x, logits), rtol=0, atol=atol)
    assert ffn == 4 and n == 8


@pytest.mark.parametrize("dispatch", ["dropless", "padded"])
def test_float64_copy_expert_keeps_its_input_exactly(dispatch):
    """A float64 token routed to (zero, copy) gets gate 1 on the copy expert and comes out as its input,
    bit for bit: the copy expert's row is not rounded through fp32 (models/common/moe.py `routing_dtype`)."""
    layer = build(moe_dispatch=dispatch).model.layers[1].mlp.double()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    logits = torch.full((3, 8), -10.0, dtype=torch.float64)
    logits[:, 4], logits[:, 5] = 3.0, 1.0  # the zero expert (id 4) and the copy expert (id 5)
    out, _, _ = layer(x, forced(layer, logits))
    assert out.dtype == torch.float64
    assert torch.equal(out, x)
    assert not torch.equal(x.float().double(), x)  # the inputs carry bits fp32 would have rounded away


def test_zero_expert_weight_goes_to_the_other_choice():
    """A token choosing FFN expert 0 and the zero expert gets expert 0's output in full (gate 1); one choosing
    the zero expert and the copy expert gets x itself."""
    layer = build().model.layers[1].mlp
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    logits = torch.full((2, 8), -10.0)
    logits[0, 0], logits[0, 4] = 2.0, 1.5  # FFN 0 and the zero expert (id 4)
    logits[1, 4], logits[1, 5] = 3.0, 1.0  # the zero expert and the copy expert (id 5)
    out, _, _ = layer(x, forced(layer, logits))
    torch.testing.assert_close(out[0], expert_ffn(layer.experts, 0, x[:1])[0], rtol=0, atol=ATOL)
    torch.testing.assert_close(out[1], x[1], rtol=0, atol=ATOL)


def test_layer_with_learned_router_and_gating_residual_equals_reference():
    """G(x^j) = W^j x^j + W_g^j G(x^{j-1}) with random W, W_g; the output from those logits."""
    layer = build().model.layers[2].mlp
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(5))
    previous = torch.randn(16, 8, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        layer.router.gate.weight.normal_(0, 0.5)
        layer.gate_residual.weight.normal_(0, 0.5)
    out, logits, _ = layer(x, previous)
    expected = x @ layer.router.gate.weight.T + previous @ layer.gate_residual.weight.T
    torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)
    torch.testing.assert_close(out, reference(layer, x, expected), rtol=0, atol=ATOL)


def test_logits_go_down_the_stack():
    """Layer j's router gets layer j-1's logits (the first none and no W_g); without `gating_residual` none."""
    for residual in (True, False):
        model = build(gating_residual=residual)
        seen = []
        for layer in model.model.layers:
            layer.mlp.register_forward_hook(lambda _, args, out, seen=seen: seen.append((args[1], out[1])))
        model(ids_of())
        assert seen[0][0] is None and model.model.layers[0].mlp.gate_residual is None
        for (_, before), (previous, _) in zip(seen, seen[1:], strict=False):
            assert previous is before
        assert all((layer.mlp.gate_residual is not None) == residual for layer in model.model.layers[1:])


def test_constant_expert():
    experts = ConstantExperts(3, 8)
    with torch.no_grad():
        experts.weight.normal_()
        experts.constant.normal_()
    x = torch.randn(5, 8)
    which = torch.tensor([0, 2, 1, 2, 0])
    out = experts(x, which)
    for t in range(5):
        a1, a2 = torch.softmax(experts.weight[which[t]] @ x[t], -1)
        torch.testing.assert_close(out[t], a1 * x[t] + a2 * experts.constant[which[t]], rtol=0, atol=1e-6)


def test_capacities():
    """C_FFN = gamma tau T / (tau N_FFN + N_ZC), C_ZC = gamma T / (tau N_FFN + N_ZC), T = k x tokens: at the
    paper's 16 + 1/1/2, 100 tokens, top-2: 1.1 * 0.75 * 200 / 16 = 10.3 -> 11, 1.1 * 200 / 16 = 13.75 -> 14."""
    config = models.ZOO["moepp"].tiny(num_local_experts=16)
    assert expert_capacities(100, config) == (11, 14)
    c_ffn, c_zc = expert_capacities(1000, config)
    assert 1.1 * 2000 <= 16 * c_ffn + 4 * c_zc < 1.1 * 2000 + 20  # room for gamma T assignments
    assert expert_capacities(1, config) == (1, 1)  # at least one
    # An expert keeps its first assignments in assignment order.
    keep = within_capacity(torch.tensor([0, 0, 1, 0, 1, 2]), torch.tensor([2, 1, 5]))
    assert keep.tolist() == [True, True, True, False, False, True]


def test_layer_drops_over_capacity():
    model = build(drop_tokens=True, capacity_gamma=0.4)
    layer = model.model.layers[1].mlp
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(7))
    logits = forced(layer, torch.randn(32, 8, generator=torch.Generator().manual_seed(8)))
    c_ffn, c_zc = expert_capacities(32, layer.config)
    capacity = [c_ffn] * 4 + [c_zc] * 4
    out, _, _ = layer(x, logits)
    torch.testing.assert_close(out, reference(layer, x, logits, capacity), rtol=0, atol=ATOL)
    assert not torch.allclose(out, reference(layer, x, logits), atol=1e-3)  # something was dropped
    model(ids_of()).loss  # noqa: B018 (the whole model runs with capacities)


def test_heterogeneous_balance_loss():
    """L_b = N sum_i eta_i f_i P_i, eta 1 for FFN experts and tau for the others; the model's aux loss is
    coef times its mean over layers."""
    model = build(tau=0.25)
    layer = model.model.layers[1].mlp
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(9))
    logits = forced(layer, torch.randn(20, 8, generator=torch.Generator().manual_seed(10)))
    _, _, balance = layer(x, logits)
    probs = logits.softmax(-1)
    chosen = probs.topk(2).indices.flatten()
    f = torch.bincount(chosen, minlength=8) / chosen.numel()
    eta = torch.tensor([1.0] * 4 + [0.25] * 4)
    torch.testing.assert_close(balance, 8 * (eta * f * probs.mean(0)).sum(), rtol=0, atol=1e-6)
    torch.testing.assert_close(balance, load_balance_loss(probs, chosen, 8, weights=eta), rtol=0, atol=1e-6)
    out = model(ids_of(), labels=ids_of())
    assert set(out.aux_losses) == {"load_balance"}
    torch.testing.assert_close(out.loss, out.lm_loss + out.aux_losses["load_balance"])
    assert model.eval()(ids_of(), labels=ids_of()).aux_losses == {}


def test_no_token_reaches_an_ffn_expert():
    """Every token picks the copy and a constant expert: nothing is dispatched, forward and backward run."""
    layer = build().model.layers[1].mlp
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(11), requires_grad=True)
    logits = torch.tensor([-10.0] * 4 + [3.0, 5.0, 4.0, 1.0]).expand(6, 8)  # zero, copy, constant 0, 1
    out, _, balance = layer(x, forced(layer, logits))
    torch.testing.assert_close(out, reference(layer, x.detach(), logits), rtol=0, atol=ATOL)
    (out.sum() + balance).backward()
    assert torch.isfinite(x.grad).all() and layer.constant_experts.constant.grad[0].abs().sum() > 0
    assert layer.experts.gate_proj.grad is None or not layer.experts.gate_proj.grad.any()


def test_k_eff():
    """The spec: k_eff = 2 tau N_FFN / (tau N_FFN + N_ZC) = 1.5 (0.75x of top-2) at 16 + 4 experts, tau 0.75."""
    assert k_eff(models.ZOO["moepp"].tiny(num_local_experts=16)) == 1.5
    assert k_eff(models.ZOO["moepp"].tiny(num_local_experts=16, tau=0.25)) == 2 * 4 / (4 + 4)


def test_bad_inputs_are_one_clear_error_each():
    entry = models.ZOO["moepp"]
    with pytest.raises(ValueError, match=r"num_experts_per_tok=9 experts per token does not fit 8 experts"):
        entry.tiny(num_experts_per_tok=9)
    entry.tiny(num_experts_per_tok=6)  # top-k runs over the zero-computation experts too
    with pytest.raises(ValueError, match=r"tau=0 must be in \(0, 1\]"):
        entry.tiny(tau=0)
    with pytest.raises(ValueError, match=r"num_copy_experts=-1 must be an int >= 0"):
        entry.tiny(num_copy_experts=-1)
    with pytest.raises(ValueError, match=r"capacity_gamma=0 must be a number > 0"):
        entry.tiny(capacity_gamma=0)
    with pytest.raises(ValueError, match=r"intermediate_size=100 do not fit grouped_mm"):
        entry.tiny(intermediate_size=100)
    with pytest.raises(ValueError, match=r"EP degree 8 does not divide num_local_experts \(FFN experts\)=4; EP degrees that fit this model: \[1, 2, 4\]"):
        entry.check_layout(entry.tiny(), {"ep": 8})
    with pytest.raises(ValueError, match=r"has no sequence-parallel layout, so sp=2"):
        entry.check_layout(entry.tiny(), {"sp": 2})


# --- expert parallelism: this model's own checks, run by tests/test_ep.py on its ranks --------------------


def check_layer_without_ffn_tokens(mesh):
    """Under ep, a layer whose every token stays with the zero-computation experts: nothing to send."""
    reference, sharded = build(), build()
    parallel.parallelize(sharded, mesh)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(12))
    logits = torch.tensor([-10.0] * 4 + [3.0, 5.0, 4.0, 1.0]).expand(6, 8)
    expected, _, _ = reference.model.layers[1].mlp(x, forced(reference.model.layers[1].mlp, logits))
    comm.reset_counters()
    out, _, balance = sharded.model.layers[1].mlp(x, forced(sharded.model.layers[1].mlp, logits))
    (out.sum() + balance).backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=ATOL)
    assert comm.snapshot_counters()["all_to_all"]["bytes"] == 0


def ep_checks(mesh):
    """MoE++'s own checks under ep (module docstring)."""
    check_layer_without_ffn_tokens(mesh)
    # The all-to-alls carry the FFN experts' rows only (test_ep counts them): fewer than top-2 of every token.
    rows, assignments = count_one_forward(mesh, "moepp")
    assert rows < assignments


# --- comm modes on the fake process group ------------------------------------------------------------------


def test_simulated_all_to_all_bytes_below_moe():
    """2 all-to-alls per layer, as `moe`; MoE++'s carry only the FFN experts' rows, so fewer bytes than those
    of `moe` with the same 4 FFN experts, top-2, in every layer."""
    ids = ids_of(2, 8)
    torch.manual_seed(0)
    moe = models.ZOO["moe"].model_class(models.ZOO["moe"].tiny(moe_layer_freq=1)).eval()
    moepp = build().eval()
    ffn_rows = []
    for layer in moepp.model.layers:
        layer.mlp.router.register_forward_hook(lambda _, __, routing: ffn_rows.append(int((routing.expert_idx < 4).sum())))
    counts = {}
    with fake_ep_mesh(2) as mesh:
        for name, model in (("moe", moe), ("moepp", moepp)):
            parallel.parallelize(model, mesh)
            comm.reset_counters()
            with comm.use_mode("simulated", link="pcie4"), torch.no_grad():
                model(ids)
            counts[name] = comm.snapshot_counters()
    layers = moepp.config.num_hidden_layers
    assert counts["moe"]["all_to_all"]["calls"] == counts["moepp"]["all_to_all"]["calls"] == 2 * layers
    assert counts["moepp"]["exchange_splits"]["calls"] == layers
    assert counts["moe"]["all_to_all"]["bytes"] == 2 * layers * 16 * 2 * 64 * 4  # T k d fp32, each way
    assert counts["moepp"]["all_to_all"]["bytes"] == 2 * sum(ffn_rows) * 64 * 4
    assert counts["moepp"]["all_to_all"]["bytes"] < counts["moe"]["all_to_all"]["bytes"]
    assert math.isclose(sum(ffn_rows) / (16 * layers), k_eff(moepp.config), abs_tol=1.0)  # about k_eff per token
