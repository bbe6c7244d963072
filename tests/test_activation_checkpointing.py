"""Activation checkpointing and per-layer compile in place (train/activation_checkpointing.py).

- One process, every architecture (degree 1, fp32): modes none / full / selective give the same loss and
  gradients (atol 1e-6; observed 0), and they checkpoint for real: full runs more matmuls in the backward
  (the recomputation), selective as many as none (their outputs kept) but more of the other ops;
  parameter and state-dict names unchanged. A collective inside a selective region is refused, not cached.
- 2 gloo ranks, every architecture at its degree 2 (tp; ep for the MoE family; sp for linear attention),
  one set of ranks per architecture doing the three modes: the same loss and gradients (atol 1e-6), the
  same forward collectives, selective re-issues none in the backward, full re-issues exactly
  `FULL_REISSUED[name]` (measured, each explained beside it); ShardSpec names unchanged.
- Under FSDP2 at dp 2 (applied after AC and compile, per decoder layer): the same loss and gradients in
  every mode, for llama, ladder and scmoe eager, and ladder compiled (aot_eager; slow).
- Compiled training steps (compile_layers, after each AC mode) == eager without checkpointing (atol 1e-5),
  no graph break, the same names: llama at tp 2 on 2 ranks and ladder at degree 1 under aot_eager; under
  inductor (compile_layers' default backend) as a slow test; scmoe at degree 1 (aot_eager), whose MoE
  blocks stay eager.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import models
import parallel
from parallel import comm
from tests.distributed import run_ranks
from train.activation_checkpointing import (
    MODES,
    apply_activation_checkpointing,
    checkpoint_units,
    compile_layers,
)

# Collectives one "full" training step of the tiny config at degree 2 (2 gloo ranks) issues beyond mode "none".
FULL_REISSUED = {
    "llama": {"all_reduce": 8},
    "parallel": {"all_reduce": 4},
    "gqla": {"all_reduce": 8},
    "ladder": {"all_reduce": 4},
    "kraken": {},
    "moe": {"exchange_splits": 2, "all_to_all": 4, "all_reduce": 2},
    "scmoe": {"exchange_splits": 2, "all_to_all": 2, "all_reduce": 2},
    "moepp": {"exchange_splits": 4, "all_to_all": 8, "all_reduce": 4},
    "linear": {"all_gather": 4},
    "linear_hybrid": {"all_gather": 5},
    "gqla_ladder": {"all_reduce": 4},
    "moe_ladder": {"exchange_splits": 1, "all_to_all": 2, "all_reduce": 1},
    "moepp_ladder": {"exchange_splits": 2, "all_to_all": 4, "all_reduce": 2},
    "linear_ladder": {"all_gather": 4},
    "linear_hybrid_ladder": {"all_gather": 5},
}
# Why: llama, gqla re-issue both all-reduces of each layer; parallel its one per layer; ladder those of its 2
# standard layers (the laddered ones wait in run_layers, outside units); kraken none (all in run_layers); moe the
# count exchange, dispatch, combine and balance loss of its 2 MoE layers; scmoe `dispatch_shortcut`'s counts,
# dispatch and balance loss (the combine is the trunk's); linear LASP-2's state all-gather per layer;
# linear_hybrid its 3 LASP-2 layers and LASP-2H's K and V. The ladder variants (upper 2 of 4 layers laddered) as ladder:
# their standard layers' collectives only (gqla_ladder 2 layers x 2 all-reduces; moe_ladder its one standard MoE
# layer, moepp_ladder its two), since a laddered layer's last collective is issued by the schedule outside the units
# and an MoE block's `issue` is no unit (so full AC keeps a laddered MoE block's activations); linear's all-gathers
# sit inside the mixers, which are units under either schedule.

ATOL = 1e-6
COMPILE_ATOL = 1e-5
ARCHS = sorted(models.ZOO) + models.variants()  # the ladder variants through their registry entries


def degree_2(name: str) -> dict[str, int]:
    """The dimension an architecture is built to shard over, at degree 2: ep for the MoE family (whose
    layouts also have tp), else its only one (tp, or sp for linear attention)."""
    dims = models.get(name).degrees
    return {"ep" if "ep" in dims else dims[0]: 2}


def build(name: str, degrees: dict[str, int], **overrides):
    torch.manual_seed(0)
    entry = models.get(name)
    return entry.model_class(entry.tiny_at(degrees, **overrides)).train()


def step(model, ids):
    """Loss and gradients of one training step, and the collectives of its forward and of its backward."""
    comm.reset_counters()
    out = model(ids, labels=ids, use_cache=False)
    forward = comm.snapshot_counters()
    comm.reset_counters()
    out.loss.backward()
    backward = {kind: c["calls"] for kind, c in comm.snapshot_counters().items()}
    grads = {name: p.grad for name, p in model.named_parameters()}
    return out.loss.detach(), grads, forward, backward


def assert_same_step(got, want, label: str, atol: float = ATOL) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=atol, msg=label)
    assert got[1].keys() == want[1].keys(), label
    for pname, grad in want[1].items():
        if grad is None:
            assert got[1][pname] is None, (label, pname)
            continue
        torch.testing.assert_close(got[1][pname], grad, rtol=0, atol=atol, msg=lambda m, n=pname: f"{label} {n}: {m}")


class OpCounter(TorchDispatchMode):
    """Counts aten ops, matmul-like ones apart."""

    MATMULS = ("mm", "addmm", "bmm", "_grouped_mm")

    def __init__(self):
        super().__init__()
        self.matmuls = self.others = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "aten" and func.__name__.split(".")[0] in self.MATMULS:
            self.matmuls += 1
        else:
            self.others += 1
        return func(*args, **(kwargs or {}))


# --- one process ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ARCHS)
def test_modes_agree_and_checkpoint_on_one_device(name):
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    results, backward_ops = {}, {}
    for mode in MODES:
        model = build(name, {})
        names, keys = [n for n, _ in model.named_parameters()], list(model.state_dict())
        apply_activation_checkpointing(model, mode)
        assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys
        out = model(ids, labels=ids, use_cache=False)
        with OpCounter() as ops:
            out.loss.backward()
        results[mode] = (out.loss.detach(), {n: p.grad for n, p in model.named_parameters()})
        backward_ops[mode] = ops
    for mode in ("full", "selective"):
        assert_same_step(results[mode], results["none"], f"{name} {mode}")
    none, full, selective = (backward_ops[m] for m in MODES)
    assert full.matmuls > none.matmuls, name  # the forward's matmuls again
    assert selective.matmuls == none.matmuls and selective.others > none.others, name  # kept; the rest again


def test_units_cover_what_run_layers_calls():
    ladder = build("ladder", {})
    units = checkpoint_units(ladder, "full")
    # Laddered layers call their sub-blocks, never forward: both are units.
    assert {"model.layers.0.forward", "model.layers.0.attention_block", "model.layers.0.mlp_block"} <= set(units)
    scmoe = build("scmoe", {})
    moe_block = next(i for i, layer in enumerate(scmoe.model.layers) if hasattr(layer, "dispatch_shortcut"))
    assert {
        f"model.layers.{moe_block}.{unit}"
        for unit in ("attention_block", "shared_expert_block", "dispatch_shortcut", "mlp.experts.forward")
    } <= set(checkpoint_units(scmoe, "full"))
    kraken = build("kraken", {"tp": 2})  # a container layer: its streams are the holders
    assert "model.layers.1.streams.1.attention_block" in checkpoint_units(kraken, "full")
    assert checkpoint_units(ladder, "none") == []


def test_bad_mode_and_twice_are_clear_errors():
    model = build("llama", {})
    with pytest.raises(ValueError, match=r"mode='partial' is not one of \('none', 'full', 'selective'\)"):
        apply_activation_checkpointing(model, "partial")
    apply_activation_checkpointing(model, "full")
    with pytest.raises(ValueError, match=r"already applied to this model \(mode='full'\)"):
        apply_activation_checkpointing(model, "selective")


def test_recomputation_does_not_count_buffers_twice():
    # A balance-bias router counts its tokens per expert in forward: the recomputation must not add them again.
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    counts = {}
    for mode in MODES:
        model = build("moe", {}, router_balance_bias=True)
        apply_activation_checkpointing(model, mode)
        model(ids, labels=ids, use_cache=False).loss.backward()
        counts[mode] = [b.clone() for n, b in model.named_buffers() if n.endswith("tokens_per_expert")]
    assert counts["none"] and all(c.sum() > 0 for c in counts["none"])
    for mode in ("full", "selective"):
        assert all(torch.equal(a, b) for a, b in zip(counts[mode], counts["none"], strict=True)), mode


def test_selective_refuses_a_collective_in_its_region():
    # On PyTorch's fake process group: llama at tp 2, its layer forward (which all-reduces) forced into a
    # selective region by hand, as the region rule never would.
    from train.activation_checkpointing import _SELECTIVE, _Checkpointed

    try:
        mesh = parallel.init_mesh(tp=2, fake=True)
        model = parallel.parallelize(build("llama", {"tp": 2}), mesh)
        assert all(".forward" not in u for u in checkpoint_units(model, "selective"))  # the rule leaves it out
        layer = model.model.layers[0]
        layer.forward = _Checkpointed(layer, "forward", _SELECTIVE)
        ids = torch.randint(0, 256, (2, 8))
        with pytest.raises(RuntimeError, match=r"met the collective c10d\.allreduce_"):
            model(ids, labels=ids, use_cache=False)
    finally:
        torch.distributed.destroy_process_group()


# --- 2 gloo ranks, each architecture at its degree 2 ------------------------------------------------


def _modes_ranks(rank, world_size, name):
    degrees = degree_2(name)
    mesh = parallel.init_mesh(**degrees)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    if "ep" in degrees:  # every ep rank its own tokens
        ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1 + rank))
    if "sp" in degrees:  # rank r holds the r-th chunk of every sequence
        ids = ids.chunk(world_size, dim=1)[rank]
    results = {}
    for mode in MODES:
        model = parallel.parallelize(build(name, degrees), mesh)
        names, keys, specs = [n for n, _ in model.named_parameters()], list(model.state_dict()), parallel.shard_specs(model)
        apply_activation_checkpointing(model, mode)
        assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys
        assert parallel.shard_specs(model) == specs
        assert mode == "none" or checkpoint_units(model, mode), (name, mode)  # something is checkpointed
        results[mode] = step(model, ids)
    none = results["none"]
    for mode in ("full", "selective"):
        assert_same_step(results[mode], none, f"{name} {mode}")
        assert results[mode][2] == none[2], (name, mode)  # the forward's collectives
    assert none[2], name  # degree 2 communicates
    reissued = {k: n - none[3].get(k, 0) for k, n in results["full"][3].items() if n != none[3].get(k, 0)}
    assert reissued == FULL_REISSUED[name], (name, reissued)
    assert results["selective"][3] == none[3], name  # no collective recomputed


@pytest.mark.parametrize("name", ARCHS)
def test_modes_agree_at_degree_2_and_count_reissued_collectives(name):
    run_ranks(_modes_ranks, 2, name)


def _fsdp_ranks(rank, world_size, names, compiled):
    """dp 2, FSDP2 per decoder layer applied last (parallelize -> AC -> compile -> fully_shard): every mode the
    same loss and gathered gradients (selective regions hold FSDP's gathers, which it skips when recomputing)."""
    from parallel.fsdp import apply_fsdp

    mesh = parallel.init_mesh(dp=world_size)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1 + rank))
    for name in names:
        results = {}
        for mode in MODES:
            model = parallel.parallelize(build(name, {}), mesh)
            apply_activation_checkpointing(model, mode)
            if compiled:
                compile_layers(model, backend="aot_eager")
            apply_fsdp(model, mesh, model.model)
            for _ in range(1 + compiled):
                model.zero_grad(set_to_none=True)
                out = model(ids, labels=ids, use_cache=False)
                out.loss.backward()
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            results[mode] = (out.loss.detach(), grads)
        for mode in ("full", "selective"):
            assert_same_step(results[mode], results["none"], f"{name} {mode} fsdp", atol=COMPILE_ATOL if compiled else ATOL)


def test_modes_agree_under_fsdp():
    run_ranks(_fsdp_ranks, 2, ["llama", "ladder", "scmoe"], False)


@pytest.mark.slow
def test_compiled_modes_agree_under_fsdp():
    run_ranks(_fsdp_ranks, 2, ["ladder"], True)


# --- compile ----------------------------------------------------------------------------------------


def compiled_steps_equal_eager(model_for, ids, backend: str, label: str, graph_breaks: bool = False) -> None:
    """For each AC mode: a fresh model (`model_for()`), checkpointed, layers compiled, two training steps ==
    eager without checkpointing; names unchanged; no graph break unless `graph_breaks`."""
    import torch._dynamo as dynamo

    eager = step(model_for(), ids)
    for mode in MODES:
        model = model_for()
        names, keys, specs = [n for n, _ in model.named_parameters()], list(model.state_dict()), parallel.shard_specs(model)
        apply_activation_checkpointing(model, mode)
        compile_layers(model, backend=backend)
        assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys
        assert parallel.shard_specs(model) == specs
        dynamo.reset()
        dynamo.utils.counters.clear()
        for _ in range(2):  # the second step runs the compiled code only
            model.zero_grad(set_to_none=True)
            got = step(model, ids)
        assert_same_step(got, eager, f"{label} {mode} {backend}", atol=COMPILE_ATOL)
        if not graph_breaks:
            assert not dynamo.utils.counters["graph_break"], (label, mode, dict(dynamo.utils.counters["graph_break"]))
        assert dynamo.utils.counters["stats"]["unique_graphs"] > 0, (label, mode)


def _compile_tp_ranks(rank, world_size, backend):
    mesh = parallel.init_mesh(tp=world_size)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    compiled_steps_equal_eager(lambda: parallel.parallelize(build("llama", {"tp": 2}), mesh), ids, backend, "llama tp 2")


def compile_ladder(backend: str) -> None:
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    compiled_steps_equal_eager(lambda: build("ladder", {}), ids, backend, "ladder")


# Slow (the default run compiles under FSDP + TP 2 in tests/test_fsdp.py).
@pytest.mark.slow
def test_compiled_training_step_equals_eager():
    compile_ladder("aot_eager")
    run_ranks(_compile_tp_ranks, 2, "aot_eager")


@pytest.mark.slow
def test_compiled_moe_training_step_equals_eager():
    # ScMoE: its dropless MoE blocks and the units reaching them (dispatch_shortcut) stay eager (graph breaks
    # around them), its attention / shared-expert sub-blocks and its dense layers compile.
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    compiled_steps_equal_eager(lambda: build("scmoe", {}), ids, "aot_eager", "scmoe", graph_breaks=True)


@pytest.mark.slow
def test_compiled_training_step_under_inductor_equals_eager():
    compile_ladder("inductor")
    run_ranks(_compile_tp_ranks, 2, "inductor")
