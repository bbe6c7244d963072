"""Expert parallelism, for every architecture with an ep layout (the `models.ZOO` entries whose shard plan
has "ep"), as tests/test_tp.py does for tp:

- on gloo: EP 2, EP 4 (where the tiny config's experts split 4 ways) and EP 2 x TP 2 == one process on the
  concatenated batch (logits, the loss with the balance loss, every gradient after parallel.grad_sync; fp32
  atol 1e-5; and float64 atol 1e-10, a float64 model routing and combining in float64, with a float64 loss
  of its own since transformers' LM loss is computed in fp32); exactly the stacked experts are sharded over
  ep; one eval forward's real collectives counted
  against the entry's declaration and against the rows its routers send to the experts;
- the shared dispatch on uneven routing at EP 2 and 4 (a rank that sends its peers nothing, an expert that
  gets nothing, ranks with different token counts) == the dense reference, forward and backward;
- `none` and `simulated` modes on the fake process group, counted likewise, training mode included.

A model's own checks under expert parallelism stay beside its other tests: `ep_checks(mesh)` in
tests/test_<name>.py, if it defines one, runs on the same ranks after the shared ones (on the ep-only
meshes), since starting the processes costs more than every check together on 2 cores.
"""

import importlib
import math
from contextlib import contextmanager

import pytest
import torch

import models
import parallel
from models.common.moe import GroupedExperts, Routing, TopKRouter
from parallel import comm
from parallel.grad_sync import sync_gradients
from parallel.layout import shard_specs
from tests.distributed import run_ranks
from tests.test_moe import D, dense_reference, make_experts, run_moe

ATOL = 1e-5
# float64 models route and combine in float64 (models/common/moe.py `routing_dtype`): only the summation
# order differs.
ATOL_FP64 = 1e-10
EP_ARCHS = [name for name in sorted(models.ZOO) + models.variants() if "ep" in models.get(name).degrees]
# A large balance-loss weight, so that a wrong scale of its gradient under ep is far above atol.
AUX = dict(router_aux_loss_coef=0.5)
# Every query and KV head split over tp.
TP_SHAPES = dict(num_attention_heads=4, num_key_value_heads=4)
EP_POINTS = ({"ep": 2}, {"ep": 4}, {"ep": 2, "tp": 2})


def shapes_at(degrees: dict[str, int]) -> dict:
    return TP_SHAPES if degrees.get("tp", 1) > 1 else {}


def fits(name: str, degrees: dict[str, int]) -> bool:
    entry = models.get(name)
    try:
        entry.check_layout(entry.tiny_at(degrees, **shapes_at(degrees)), degrees)
    except ValueError:
        return False
    return True


def archs_at(degrees: dict[str, int]) -> list[str]:
    return [name for name in EP_ARCHS if fits(name, degrees)]


def build(name: str, degrees: dict[str, int], **overrides):
    """The tiny `name` in training mode, as it runs at `degrees`, the same weights on every rank."""
    torch.manual_seed(0)
    entry = models.get(name)
    return entry.model_class(entry.tiny_at(degrees, **shapes_at(degrees), **overrides)).train()


def mesh_degrees(mesh) -> dict[str, int]:
    return {dim: mesh.size(i) for i, dim in enumerate(mesh.mesh_dim_names)}


def ids_of(batch: int = 2, seq: int = 10, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def local_part(reference: torch.Tensor, specs) -> torch.Tensor:
    """The part of a full tensor that this rank holds, from its ShardSpecs (one per sharded mesh dimension)."""
    for spec in specs:
        reference = reference.chunk(spec.size, dim=spec.tensor_dim)[spec.rank]
    return reference


def expert_parameters(model) -> set[str]:
    """The names of the stacked experts' weights (what the ep layout splits)."""
    return {
        f"{module_name}.{name}"
        for module_name, module in model.named_modules()
        if isinstance(module, GroupedExperts)
        for name, _ in module.named_parameters(recurse=False)
    }


# --- the model on P ranks == one process -----------------------------------------------------------


def check_equivalence(
    mesh,
    name: str,
    reference_overrides: dict | None = None,
    batch_per_rank: int = 2,
    seq: int = 10,
    dtype: torch.dtype = torch.float32,
    **overrides,
) -> None:
    """`name` sharded over `mesh`, fed this ep rank's rows of a global batch, == the one-process model on all
    of it (its tp ranks share the rows), in `dtype` (fp32: atol 1e-5; float64: 1e-10). `reference_overrides`:
    config fields of the one-process model only (e.g. a serial schedule the sharded model must equal)."""
    degrees = mesh_degrees(mesh)
    ep, ep_rank = mesh["ep"].size(), mesh.get_local_rank("ep")
    ids = ids_of(ep * batch_per_rank, seq, seed=7)
    rows = slice(ep_rank * batch_per_rank, (ep_rank + 1) * batch_per_rank)
    atol = ATOL_FP64 if dtype == torch.float64 else ATOL
    reference = build(name, degrees, **{**overrides, **(reference_overrides or {})}).to(dtype)
    sharded = build(name, degrees, **overrides).to(dtype)
    parallel.parallelize(sharded, mesh)

    if dtype == torch.float64:
        # transformers' causal-LM loss casts the logits to fp32 (transformers/loss/loss_utils.py), so a
        # float64 comparison uses a float64 loss: the mean of the logits weighted by fixed random weights,
        # plus the aux losses. Each ep rank's share is its rows' sum times ep / all logits; their mean is
        # the whole batch's.
        shape, seed = (*ids.shape, sharded.config.vocab_size), torch.Generator().manual_seed(8)
        weights = torch.randn(shape, generator=seed, dtype=dtype)
        ref_out = reference(ids)
        ref_loss = (ref_out.logits * weights).sum() / weights.numel() + sum(ref_out.aux_losses.values())
        out = sharded(ids[rows])
        loss = ep * (out.logits * weights[rows]).sum() / weights.numel() + sum(out.aux_losses.values())
    else:
        ref_out = reference(ids, labels=ids)
        out = sharded(ids[rows], labels=ids[rows])
        ref_loss, loss = ref_out.loss, out.loss
    ref_loss.backward()
    loss.backward()
    sync_gradients(sharded, mesh)

    where = f"{name} at {degrees}"
    assert out.logits.dtype == ref_out.logits.dtype == dtype, where
    torch.testing.assert_close(
        out.logits, ref_out.logits[rows], rtol=0, atol=atol, msg=lambda m: f"{where}: {m}"
    )
    # Every ep rank gets the balance loss of the whole batch; the LM losses average to the whole batch's.
    balance, ref_balance = out.aux_losses["load_balance"], ref_out.aux_losses["load_balance"]
    torch.testing.assert_close(balance, ref_balance, rtol=0, atol=atol, msg=lambda m: f"{where}: {m}")
    mean_loss = comm.all_reduce(loss.detach(), mesh.get_group("ep")).wait() / ep
    torch.testing.assert_close(mean_loss, ref_loss, rtol=0, atol=atol, msg=lambda m: f"{where}: {m}")

    # Exactly the stacked experts are split over ep, and over nothing else (the zero-computation experts of
    # MoE++, routers, shared experts stay replicated over ep).
    specs = shard_specs(sharded)
    experts = expert_parameters(sharded)
    assert experts and {n for n, s in specs.items() if any(x.mesh_dim == "ep" for x in s)} == experts, where
    assert all([x.mesh_dim for x in specs[n]] == ["ep"] for n in experts), where
    ref_params = dict(reference.named_parameters())
    for pname, p in sharded.named_parameters():
        expected = local_part(ref_params[pname].grad, specs.get(pname, ()))
        torch.testing.assert_close(
            p.grad, expected, rtol=0, atol=atol, msg=lambda m, n=pname: f"{where}, {n}: {m}"
        )


# --- collectives -------------------------------------------------------------------------------------


def moe_blocks(model) -> list:
    """The modules that route tokens to stacked experts (a router and `experts`)."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "router", None), TopKRouter) and isinstance(getattr(m, "experts", None), GroupedExperts)
    ]


def count_routed_rows(model) -> list[int]:
    """Hooks that add to the returned [rows, assignments] each forward: the assignments every router makes,
    and those of them that go to stacked experts (the rows its all-to-alls carry each way, dropless)."""
    totals = [0, 0]
    for block in moe_blocks(model):

        def hook(_, __, routing, experts=block.experts.num_experts):
            totals[0] += int((routing.expert_idx < experts).sum())
            totals[1] += routing.expert_idx.numel()

        block.router.register_forward_hook(hook)
    return totals


def every_assignment_dispatched(model) -> bool:
    """Whether each router chooses among its stacked experts only (no zero-computation experts): then the
    all-to-alls carry k rows per token, and the entry's declaration is exact."""
    return all(b.router.num_experts == b.experts.num_experts for b in moe_blocks(model))


def check_counts(counts: dict, declared: dict, model, rows: int, tokens: int, ranks: int = 1) -> None:
    """One forward's counters (summed over `ranks` ep ranks where they differ) against the entry's
    declaration and the `rows` the routers sent to stacked experts; `tokens` per rank; fp32."""
    blocks = moe_blocks(model)
    d = model.config.hidden_size
    assert set(counts) == set(declared) == {"all_to_all", "exchange_splits"}
    for kind, expected in declared.items():
        assert counts[kind]["calls"] == expected.calls, kind
    assert counts["all_to_all"]["calls"] == 2 * len(blocks)  # dispatch and combine per MoE layer
    # The per-expert counts (int64, E of them) once per MoE layer, whatever the batch.
    assert counts["exchange_splits"]["bytes"] == 8 * sum(b.experts.num_experts for b in blocks)
    # The dispatch sends the rank's rows, the combine sends back what it received: each way, every row once
    # over the ranks (on the fake process group, rank 0's own).
    assert counts["all_to_all"]["bytes"] == 2 * rows * d * 4
    if every_assignment_dispatched(model):
        assert counts["all_to_all"]["bytes"] == ranks * declared["all_to_all"].values_per_token * tokens * 4


def count_one_forward(mesh, name: str) -> tuple[int, int]:
    """Real collectives of one eval forward on an ep mesh, checked (`check_counts`); returns the rows the
    routers sent to stacked experts and their assignments, summed over the ep ranks."""
    ep, group = mesh["ep"].size(), mesh.get_group("ep")
    model = parallel.parallelize(build(name, {"ep": ep}).eval(), mesh)
    routed = count_routed_rows(model)
    declared = models.get(name).collectives_per_forward(model.config, {"ep": ep})
    comm.reset_counters()
    with torch.no_grad():
        model(ids_of(2, 8, seed=1))
    counts = comm.snapshot_counters()
    rows, assigned = (int(comm.all_reduce(torch.tensor(n), group).wait()) for n in routed)
    # Each rank counts what it sent: the all-to-all bytes differ by rank, their sum does not.
    counts["all_to_all"]["bytes"] = int(comm.all_reduce(torch.tensor(counts["all_to_all"]["bytes"]), group).wait())
    check_counts(counts, declared, model, rows, tokens=2 * 8, ranks=ep)
    return rows, assigned


# --- the shared dispatch on uneven routing -----------------------------------------------------------


def check_uneven_routing(rank: int, group, world_size: int, dtype: torch.dtype = torch.float32) -> None:
    """Rank 0 sends its peers nothing; the last expert gets no token anywhere; ranks route different numbers
    of tokens; forward and backward equal the dense reference (each rank checks its own tokens), in
    `dtype`."""
    atol = ATOL_FP64 if dtype == torch.float64 else ATOL
    num_experts = 2 * world_size
    full = make_experts(num_experts, dtype=dtype)
    local = make_experts(num_experts, dtype=dtype)
    per = num_experts // world_size
    with torch.no_grad():  # this rank's experts, as parallel.ep's role keeps them
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(local, name, torch.nn.Parameter(getattr(local, name)[rank * per : (rank + 1) * per].clone()))
    local.num_local_experts = per
    tokens = 5 + rank
    seed = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(tokens, D, generator=seed, dtype=dtype, requires_grad=True)
    token_idx = torch.arange(tokens).repeat_interleave(2)
    if rank == 0:
        expert_idx = torch.tensor([0, 1] * tokens)  # both of rank 0's own experts
    else:
        expert_idx = torch.randint(0, num_experts - 1, (2 * tokens,), generator=torch.Generator().manual_seed(rank))
    gates = torch.rand(2 * tokens, generator=torch.Generator().manual_seed(20 + rank), dtype=dtype)
    out = run_moe(x, Routing(token_idx, expert_idx, gates, None, None), local, group)
    x_ref = x.detach().clone().requires_grad_()
    ref = dense_reference(x_ref, token_idx, expert_idx, gates, full)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, rtol=0, atol=atol)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=atol)


# --- on gloo ranks -----------------------------------------------------------------------------------


def model_ep_checks(name: str):
    """`ep_checks(mesh)` of tests/test_<name>.py (a model's own checks under expert parallelism), or None."""
    try:
        module = importlib.import_module(f"tests.test_{name}")
    except ModuleNotFoundError as error:
        if error.name != f"tests.test_{name}":
            raise
        return None
    return getattr(module, "ep_checks", None)


def _ep_ranks(rank, world_size, points):
    for degrees, names in points:
        mesh = parallel.init_mesh(**degrees)
        for name in names:
            check_equivalence(mesh, name, **AUX)
            check_equivalence(mesh, name, dtype=torch.float64, **AUX)
        if set(degrees) != {"ep"}:
            continue
        check_uneven_routing(rank, mesh.get_group("ep"), world_size)
        check_uneven_routing(rank, mesh.get_group("ep"), world_size, torch.float64)
        for name in names:
            count_one_forward(mesh, name)
            own = model_ep_checks(name)
            if own is not None:
                own(mesh)


def points_for(world_size: int) -> list[tuple[dict, list[str]]]:
    """The degree points of `EP_POINTS` on `world_size` ranks, each with the architectures that fit it."""
    points = [(d, archs_at(d)) for d in EP_POINTS if math.prod(d.values()) == world_size]
    assert all(names for _, names in points), points
    return points


def test_ep2_equals_one_process():
    # One set of spawned ranks checks every architecture: process start-up dominates on 2 cores.
    run_ranks(_ep_ranks, 2, points_for(2))


def test_ep4_and_ep2_x_tp2_equal_one_process():
    # The same four ranks as an ep 4 mesh, then as an ep 2 x tp 2 one (experts over ep; attention, dense
    # MLPs and shared experts over tp).
    run_ranks(_ep_ranks, 4, points_for(4))


# --- comm modes on the fake process group --------------------------------------------------------------


@contextmanager
def fake_ep_mesh(ep: int):
    """An ep mesh of `ep` ranks in this process, on PyTorch's fake process group (this process is rank 0;
    collectives return at once), torn down afterwards."""
    try:
        yield parallel.init_mesh(ep=ep, fake=True)
    finally:
        torch.distributed.destroy_process_group()


FAKE_POINTS = [(name, ep) for ep in (2, 4) for name in archs_at({"ep": ep})]


@pytest.mark.parametrize(("name", "ep"), FAKE_POINTS, ids=[f"{n}-ep{p}" for n, p in FAKE_POINTS])
def test_none_and_simulated_modes_run_and_count(name, ep):
    """Rank 0 of P keeps its E/P experts; `none` issues (and counts) no collective; `simulated` times every
    one on the link and counts them as the entry declares; training mode runs too."""
    with fake_ep_mesh(ep) as mesh:
        _none_and_simulated(name, mesh)


def _none_and_simulated(name, mesh):
    ep = mesh.size()
    model = parallel.parallelize(build(name, {"ep": ep}).eval(), mesh)
    blocks = moe_blocks(model)
    assert all(b.experts.gate_proj.shape[0] == b.experts.num_experts // ep for b in blocks)
    routed = count_routed_rows(model)
    declared = models.get(name).collectives_per_forward(model.config, {"ep": ep})
    ids = ids_of(2, 8, seed=1)
    comm.reset_counters()
    with comm.use_mode("none"), torch.no_grad():
        assert model(ids).logits.shape == (2, 8, 256)
    assert comm.snapshot_counters() == {}
    routed[:] = [0, 0]
    comm.reset_counters()
    with comm.use_mode("simulated", link="nvlink-h100") as clock, torch.no_grad():
        clock.start()
        assert model(ids).logits.shape == (2, 8, 256)
        assert clock.comm_busy > 0
    check_counts(comm.snapshot_counters(), declared, model, routed[0], tokens=2 * 8)
    # Training mode (the balance loss's all-reduce is simulated as well).
    model.train()
    with comm.use_mode("simulated", link="pcie4"):
        model(ids, labels=ids).loss.backward()
    assert all(math.isfinite(b.router.gate.weight.grad.sum().item()) for b in blocks)
