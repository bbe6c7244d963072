"""The padded MoE dispatch (models/common/moe.py `dispatch_padded`; `moe_dispatch="padded"` in the configs of
`moe`, `scmoe` and `moepp`): fixed capacity C per (rank, expert), every size known on the host.

- the dispatch alone: C = T (the default) == the dense reference and == the dropless dispatch, forward and
  backward (fp32 atol 1e-5), nothing dropped; with a smaller C each expert keeps its first C assignments
  (== the dropless dispatch with the same capacity and the dense reference) and the drop count is the
  number known from the routing; assignments marked invalid are never sent;
- whole models, one process: padded == dropless for moe, scmoe and moepp in training mode (logits, the loss
  with the balance loss, every gradient; float64, atol 1e-10: a float64 model routes and combines in fp64);
  the drop count 0, and with a small `dispatch_capacity_factor` exactly the overflow the routers' choices
  give (sum over layers and experts of max(0, assignments - C));
- the runtime switch (`model.set_moe_dispatch`) and the config fields; bad values, one clear error each;
- the meta device on the fake process group (the speed simulator's setting), in `simulated` and `none`
  modes, C = T and a capacity factor: the padded dispatch runs without reading a value and its collectives
  are 2 equal-split all-to-alls of E C d values per MoE layer, no count exchange, as the entry declares;
- at EP 2 on gloo: padded, sharded == dropless on one process (tests/test_ep.py `check_equivalence`, fp32
  atol 1e-5, gradients included) for every ep architecture, nothing dropped, the collectives as above;
  the dispatch with a small capacity at EP 2 == the dense reference of each rank's tokens, with its exact
  drop count; and on the same ranks tests/test_compile_moe.py's EP 2 checks (the functional all-to-all, the
  padded moe's forward compiled with fullgraph=True == eager).
"""

import pytest
import torch

import models
import parallel
from models.common.moe import (
    MOE_DISPATCHES,
    Routing,
    dispatch,
    dispatch_padded,
    dispatching_blocks,
    dropped_assignments,
    padded_capacity,
    set_moe_dispatch,
)
from parallel import comm
from tests.distributed import run_ranks
from tests.test_compile_moe import all_to_all_function, eval_forward
from tests.test_ep import AUX, EP_ARCHS, build, check_equivalence, fake_ep_mesh, ids_of, moe_blocks
from tests.test_moe import D, E, dense_reference, make_experts

ATOL = 1e-5
ATOL_FP64 = 1e-10  # float64 models route and combine in float64 (models/common/moe.py `routing_dtype`)


def run(pending):
    pending.compute()
    return pending.combine()


def known_routing(tokens: int = 6) -> Routing:
    """Top-2 of 4 experts, token-major: every token picks expert 0 (second for odd tokens) and one of
    experts 1..3 in turn, so expert 0 gets `tokens` assignments and each other expert tokens / 3."""
    pairs = [(0, 1 + t % 3) if t % 2 == 0 else (1 + t % 3, 0) for t in range(tokens)]
    expert_idx = torch.tensor(pairs).flatten()
    gates = torch.rand(2 * tokens, generator=torch.Generator().manual_seed(5))
    return Routing(torch.arange(tokens).repeat_interleave(2), expert_idx, gates, None, None)


# --- the dispatch alone ----------------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [None, 2], ids=["C=T", "C=2"])
def test_padded_dispatch_equals_dropless_and_dense_reference(cap):
    routing = known_routing()
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(3), requires_grad=True)
    gates = routing.gates.clone().requires_grad_()
    assignments = Routing(routing.token_idx, routing.expert_idx, gates, None, None)
    experts = make_experts()
    pending = dispatch_padded(x, assignments, experts, capacity=cap)
    assert pending.capacity == (6 if cap is None else cap)
    out = run(pending)
    # Expert 0 gets all 6 tokens, experts 1..3 two each: C = 2 drops expert 0's last 4.
    assert int(pending.dropped) == (0 if cap is None else 4)

    x_drop, gates_drop, experts_drop = (
        x.detach().clone().requires_grad_(),
        gates.detach().clone().requires_grad_(),
        make_experts(),
    )
    dropless = run(
        dispatch(
            x_drop,
            Routing(routing.token_idx, routing.expert_idx, gates_drop, None, None),
            experts_drop,
            capacity=cap,
        )
    )
    x_ref, gates_ref, experts_ref = (
        x.detach().clone().requires_grad_(),
        gates.detach().clone().requires_grad_(),
        make_experts(),
    )
    ref = dense_reference(x_ref, routing.token_idx, routing.expert_idx, gates_ref, experts_ref, cap)
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    torch.testing.assert_close(out, dropless, rtol=0, atol=ATOL)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    for y in (out, dropless, ref):
        (y * upstream).sum().backward()
    for other_x, other_gates, other_experts in (
        (x_drop, gates_drop, experts_drop),
        (x_ref, gates_ref, experts_ref),
    ):
        torch.testing.assert_close(x.grad, other_x.grad, rtol=0, atol=ATOL)
        torch.testing.assert_close(gates.grad, other_gates.grad, rtol=0, atol=ATOL)
        for name in ("gate_proj", "up_proj", "down_proj"):
            torch.testing.assert_close(
                getattr(experts, name).grad, getattr(other_experts, name).grad, rtol=0, atol=ATOL
            )


def test_invalid_assignments_are_never_sent():
    """`valid` (MoE++'s FFN experts): the others are ignored, their expert ids too (here out of range)."""
    routing = known_routing()
    valid = routing.expert_idx != 2
    expert_idx = torch.where(valid, routing.expert_idx, 99)  # e.g. a zero-computation expert's id
    experts = make_experts()
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(3))
    pending = dispatch_padded(
        x, Routing(routing.token_idx, expert_idx, routing.gates, None, None), experts, valid=valid
    )
    out = run(pending)
    kept = routing.select(valid)
    ref = dense_reference(x, kept.token_idx, kept.expert_idx, kept.gates, experts)
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    assert int(pending.dropped) == 0


def test_padded_capacity_formula_and_bad_inputs():
    assert padded_capacity(10, 4, 2) == 10  # C = T: never drops
    assert padded_capacity(10, 4, 2, 0.5) == 3  # ceil(0.5 * 10 * 2 / 4)
    assert padded_capacity(10, 4, 2, 4.0) == 10  # never more than T
    assert padded_capacity(1, 64, 2, 0.1) == 1  # at least 1
    experts = make_experts()
    x = torch.randn(3, D)
    odd = Routing(torch.tensor([0, 0, 1, 2]), torch.tensor([0, 1, 2, 3]), torch.ones(4), None, None)
    with pytest.raises(ValueError, match=r"4 assignments do not split evenly over 3 tokens"):
        dispatch_padded(x, odd, experts)
    routing = Routing(
        torch.arange(3).repeat_interleave(2), torch.tensor([0, 1] * 3), torch.ones(6), None, None
    )
    with pytest.raises(ValueError, match=r"capacity must be an int >= 1 \(rows per expert\), got 0"):
        dispatch_padded(x, routing, experts, capacity=0)
    pending = dispatch_padded(x, routing, experts)
    with pytest.raises(RuntimeError, match=r"PaddedDispatch.combine\(\) runs once, after compute\(\)"):
        pending.combine()


# --- whole models, one process ----------------------------------------------------------------------------


def _step(model, ids):
    """One float64 forward and backward. transformers' causal-LM loss casts the logits to fp32
    (transformers/loss/loss_utils.py), so the loss is a float64 one: the mean of the logits weighted by fixed
    random weights, plus the aux losses."""
    out = model(ids)
    seed = torch.Generator().manual_seed(8)
    weights = torch.randn(out.logits.shape, generator=seed, dtype=out.logits.dtype)
    # Set as an item: a ModelOutput then holds it as both key and attribute.
    out["loss"] = (out.logits * weights).mean() + sum(out.aux_losses.values())
    out.loss.backward()
    return out, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("name", EP_ARCHS)
def test_padded_model_equals_dropless(name):
    ids = ids_of()
    out, grads = _step(build(name, {}, **AUX).double(), ids)
    model = build(name, {}, moe_dispatch="padded", **AUX).double()
    assert model.config.moe_dispatch == "padded" and {b.moe_dispatch for b in dispatching_blocks(model)} == {
        "padded"
    }
    padded, padded_grads = _step(model, ids)
    for key in ("logits", "loss"):
        torch.testing.assert_close(
            padded[key], out[key], rtol=0, atol=ATOL_FP64, msg=lambda m, k=key: f"{name} {k}: {m}"
        )
    torch.testing.assert_close(
        padded.aux_losses["load_balance"], out.aux_losses["load_balance"], rtol=0, atol=ATOL_FP64
    )
    for pname, grad in grads.items():
        torch.testing.assert_close(
            padded_grads[pname], grad, rtol=0, atol=ATOL_FP64, msg=lambda m, n=pname: f"{name} {n}: {m}"
        )
    assert dropped_assignments(model) == 0


def expected_drops(model, factor: float) -> list[int]:
    """Hooks that add, each forward, sum over experts of max(0, assignments - C) for every block's routing:
    what the padded dispatch at `factor` must drop (MoE++: its FFN experts only)."""
    total = [0]
    for block in moe_blocks(model):

        def hook(_, inputs, routing, experts=block.experts.num_experts):
            tokens, k = inputs[0].shape[0], routing.expert_idx.numel() // inputs[0].shape[0]
            c = padded_capacity(tokens, experts, k, factor)
            counts = torch.bincount(routing.expert_idx, minlength=experts)[:experts]
            total[0] += int((counts - c).clamp(min=0).sum())

        block.router.register_forward_hook(hook)
    return total


@pytest.mark.parametrize("name", EP_ARCHS)
def test_small_capacity_factor_reports_the_exact_drops(name):
    model = build(name, {}, moe_dispatch="padded", dispatch_capacity_factor=0.3).eval()
    expected = expected_drops(model, 0.3)
    ids = ids_of(2, 16, seed=3)
    with torch.no_grad():
        model(ids)
    once = expected[0]
    assert 0 < once < ids.numel() * model.config.num_experts_per_tok * len(moe_blocks(model)), (
        "the case must overflow"
    )
    assert dropped_assignments(model) == once
    with torch.no_grad():
        model(ids)
    assert expected[0] == 2 * once
    assert dropped_assignments(model, reset=True) == 2 * once  # accumulated until reset
    assert dropped_assignments(model) == 0


def test_runtime_switch_and_config_fields():
    model = build("moe", {}).eval()
    blocks = dispatching_blocks(model)
    assert model.config.moe_dispatch == "dropless" and model.config.dispatch_capacity_factor is None
    assert len(blocks) == model.config.num_moe_layers
    ids = ids_of()
    with torch.no_grad():
        dropless = model(ids).logits
        assert model.set_moe_dispatch("padded", 0.5) is model
        assert {(b.moe_dispatch, b.dispatch_capacity_factor) for b in blocks} == {("padded", 0.5)}
        assert (model.config.moe_dispatch, model.config.dispatch_capacity_factor) == ("padded", 0.5)
        model(ids)
        assert model.dropped_assignments() > 0
        set_moe_dispatch(model, "padded")  # C = T: exact
        torch.testing.assert_close(model(ids).logits, dropless, rtol=0, atol=ATOL)
        set_moe_dispatch(model, "dropless")
        assert torch.equal(model(ids).logits, dropless)
    # Non-persistent: the counters are not saved with the weights.
    assert not any("dropped_assignments" in key for key in model.state_dict())


@pytest.mark.parametrize("name", EP_ARCHS)
def test_bad_dispatch_values_are_one_clear_error_each(name):
    entry = models.get(name)
    with pytest.raises(
        ValueError,
        match=r"moe_dispatch='fast' is not an MoE dispatch; choose one of \('dropless', 'padded'\)",
    ):
        entry.tiny(moe_dispatch="fast")
    for bad in (0, -1.5, float("inf"), "1", True):
        with pytest.raises(
            ValueError, match=rf"dispatch_capacity_factor={bad!r} must be a finite number > 0.*or None"
        ):
            entry.tiny(moe_dispatch="padded", dispatch_capacity_factor=bad)
    model = build(name, {})
    with pytest.raises(ValueError, match=r"moe_dispatch='Padded' is not an MoE dispatch"):
        model.set_moe_dispatch("Padded")
    with pytest.raises(ValueError, match=r"dispatch_capacity_factor=0 must be"):
        model.set_moe_dispatch("padded", 0)
    assert model.config.moe_dispatch == "dropless"  # a refused switch changes nothing
    assert MOE_DISPATCHES == ("dropless", "padded")
    with pytest.raises(ValueError, match=r"has no MoE block whose dispatch could be set"):
        set_moe_dispatch(models.ZOO["llama"].model_class(models.ZOO["llama"].tiny()), "padded")


# --- the meta device on the fake process group (the speed simulator's setting) ----------------------------


META_POINTS = [(name, factor) for name in EP_ARCHS for factor in (None, 0.5)]


@pytest.mark.parametrize(("name", "factor"), META_POINTS, ids=[f"{n}-cf{f}" for n, f in META_POINTS])
def test_padded_runs_on_the_meta_device_simulated_and_none(name, factor):
    ep, batch, seq = 2, 2, 8
    with fake_ep_mesh(ep) as mesh:
        entry = models.get(name)
        config = entry.tiny_at({"ep": ep}, moe_dispatch="padded", dispatch_capacity_factor=factor)
        with torch.device("meta"):
            model = entry.model_class(config)
        parallel.parallelize(model, mesh).eval()
        ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        with comm.use_mode("none"), torch.no_grad():
            assert model(ids).logits.shape == (batch, seq, 256)
        comm.reset_counters()
        with comm.use_mode("simulated", link="nvlink-h100") as clock, torch.no_grad():
            clock.start()
            assert model(ids).logits.is_meta
            assert clock.comm_busy > 0
        check_padded_counts(comm.snapshot_counters(), model, tokens=batch * seq)


def check_padded_counts(counts: dict, model, tokens: int) -> None:
    """One eval forward's counters of a padded model (this rank's `tokens`, fp32): per MoE block a dispatch
    and a combine of E * C rows each, C from the rank's token count, no count exchange; as the entry declares."""
    blocks, config = moe_blocks(model), model.config
    experts, k = blocks[0].experts.num_experts, config.num_experts_per_tok
    rows = experts * padded_capacity(tokens, experts, k, config.dispatch_capacity_factor)
    assert counts == {
        "all_to_all": {"calls": 2 * len(blocks), "bytes": 2 * len(blocks) * rows * config.hidden_size * 4}
    }
    declared = models.ZOO[config_name(config)].collectives_per_forward(config, {"ep": 2})
    assert set(declared) == {"all_to_all"} and declared["all_to_all"].calls == 2 * len(blocks)
    assert counts["all_to_all"]["bytes"] == declared["all_to_all"].values_per_token * tokens * 4


def config_name(config) -> str:
    return next(name for name, entry in models.ZOO.items() if entry.config_class is type(config))


# --- EP 2 on gloo --------------------------------------------------------------------------------------


def check_padded_dispatch_with_drops(rank: int, group, world_size: int) -> None:
    """Each rank routes its 6 tokens by `known_routing` (expert 0 chosen by every token) with C = 2: every
    rank drops 4 of its assignments to expert 0; outputs and gradients == the dense reference of its own
    tokens."""
    full, local = make_experts(), make_experts()
    per = E // world_size
    with torch.no_grad():
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(
                local, name, torch.nn.Parameter(getattr(local, name)[rank * per : (rank + 1) * per].clone())
            )
    local.num_local_experts = per
    routing = known_routing()
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(10 + rank), requires_grad=True)
    pending = dispatch_padded(x, routing, local, group, capacity=2)
    out = run(pending)
    assert int(pending.dropped) == 4
    x_ref = x.detach().clone().requires_grad_()
    ref = dense_reference(x_ref, routing.token_idx, routing.expert_idx, routing.gates, full, cap=2)
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=ATOL)


def _ep2_ranks(rank, world_size):
    mesh = parallel.init_mesh(ep=world_size)
    for name in EP_ARCHS:
        # Sharded and padded == one process, dropless.
        check_equivalence(
            mesh, name, reference_overrides={"moe_dispatch": "dropless"}, moe_dispatch="padded", **AUX
        )
        # An eval forward: nothing dropped; per MoE block two equal all-to-alls of E * T rows, no count exchange.
        model = parallel.parallelize(build(name, {"ep": world_size}, moe_dispatch="padded").eval(), mesh)
        comm.reset_counters()
        with torch.no_grad():
            model(ids_of(2, 8, seed=rank))
        check_padded_counts(comm.snapshot_counters(), model, tokens=2 * 8)
        assert dropped_assignments(model) == 0, name
    check_padded_dispatch_with_drops(rank, mesh.get_group("ep"), world_size)
    # Under torch.compile (fullgraph, aot_eager): the functional all-to-all, then the padded moe's forward.
    all_to_all_function(rank)
    eval_forward(rank, mesh, "moe")


def test_ep2_padded_equals_one_process_dropless_and_compiles():
    # One set of spawned ranks for every check, tests/test_compile_moe.py's at EP 2 included: process
    # start-up dominates on 2 cores.
    run_ranks(_ep2_ranks, 2)
