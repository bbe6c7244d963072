"""Tensor parallelism on gloo: TP 2 and 4 compute the same function as TP 1 (fp32, atol 1e-5) for every
architecture with a TP layout, for logits, gradients and cached decode; comm counters match the
architecture's schedule; `mode=none` issues no collective; bad TP degrees give one clear error."""

import pytest
import torch

import models
import parallel
from parallel import comm
from parallel.state import (
    full_optimizer_state,
    full_state_dict,
    load_full_optimizer_state,
    load_full_state_dict,
)
from tests.distributed import run_ranks

ATOL = 1e-5
TP_ARCHS = [name for name in sorted(models.ZOO) + models.variants() if "tp" in models.get(name).degrees]
# Shapes every TP degree up to 4 divides.
TP4 = dict(num_attention_heads=4, num_key_value_heads=4)


def build(name: str, tp: int, **overrides):
    """The tiny `name` as it runs at TP degree `tp` (its entry's fit_degrees, e.g. one Kraken stream per rank)."""
    torch.manual_seed(0)
    return models.get(name).model_class(models.get(name).tiny_at({"tp": tp}, **TP4, **overrides)).eval()


def local_slice(reference: torch.Tensor, local: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """The part of a full tensor that a rank holds (the dimension whose size differs is sharded)."""
    if reference.shape == local.shape:
        return reference
    (dim,) = [d for d, (a, b) in enumerate(zip(reference.shape, local.shape, strict=True)) if a != b]
    return reference.chunk(tp, dim=dim)[rank]


def _check_equivalence(rank, world_size, names):
    mesh = parallel.init_mesh(tp=world_size)
    for name in names:
        _check_one(rank, world_size, mesh, name)


def _check_one(rank, world_size, mesh, name):
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    reference, sharded = build(name, world_size), build(name, world_size)
    parallel.parallelize(sharded, mesh)

    ref_out = reference(ids, labels=ids)
    ref_out.loss.backward()
    out = sharded(ids, labels=ids)
    out.loss.backward()
    torch.testing.assert_close(out.logits, ref_out.logits, rtol=0, atol=ATOL)

    ref_params = dict(reference.named_parameters())
    for pname, p in sharded.named_parameters():
        expected = local_slice(ref_params[pname].grad, p.grad, rank, world_size)
        torch.testing.assert_close(p.grad, expected, rtol=0, atol=ATOL, msg=lambda m, n=pname: f"{n}: {m}")

    # Prefill + cached decode under TP == the unsharded full forward.
    with torch.no_grad():
        full = reference(ids, use_cache=False).logits
        step = sharded(ids[:, :7], use_cache=True)
        pieces, cache = [step.logits], step.cache
        for t in range(7, ids.shape[1]):
            step = sharded(ids[:, t : t + 1], cache=cache, use_cache=True)
            pieces.append(step.logits)
        ref_cache = reference(ids, use_cache=True).cache
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=ATOL)

    # The cache is sharded with the model: a rank holds 1/P of the unsharded model's keys and values (its
    # KV heads, or its own stream's layers) and of its recurrent states (linear attention: its heads). Every
    # tensor a cache layer holds is counted, whatever its name.
    def cached(c):
        tensors = [t for layer in c.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
        assert tensors, f"{name}: the cache holds no tensor after a prefill"
        return sum(t.numel() for t in tensors)

    assert cached(cache) * world_size == cached(ref_cache)

    # Checkpoints under TP: the gathered full state is the unsharded model's, and loads back exactly.
    group = mesh.get_group("tp")
    full = full_state_dict(sharded, group)
    ref_state = reference.state_dict()
    assert full.keys() == ref_state.keys() and all(torch.equal(full[k], ref_state[k]) for k in full)
    fresh = parallel.parallelize(build(name, world_size, initializer_range=0.5), mesh)
    load_full_state_dict(fresh, full, rank, world_size)
    for (n, a), b in zip(fresh.state_dict().items(), sharded.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    # ... and so does the optimizer state (AdamW moments are sharded like their parameters).
    opt = torch.optim.AdamW(sharded.parameters())
    opt.step()
    full_opt = full_optimizer_state(sharded, opt, group)
    # (indexed like the unsharded model's optimizer: for stream architectures that is not the local order)
    for i, n in enumerate(ref_params):
        assert full_opt["state"][i]["exp_avg"].shape == ref_params[n].shape
    names = [n for n, _ in sharded.named_parameters()]
    opt2 = torch.optim.AdamW(fresh.parameters())
    load_full_optimizer_state(fresh, opt2, full_opt, rank, world_size)
    for i in range(len(names)):
        assert torch.equal(opt2.state_dict()["state"][i]["exp_avg_sq"], opt.state_dict()["state"][i]["exp_avg_sq"])


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_equals_single_device(tp):
    # One set of spawned ranks checks every architecture: process start-up dominates on 2 cores.
    run_ranks(_check_equivalence, tp, TP_ARCHS)


def _count_collectives(rank, world_size, names):
    mesh = parallel.init_mesh(tp=world_size)
    for name in names:
        _count_one(mesh, name)


def _count_one(mesh, name):
    """The counters of one forward match what the architecture's entry declares (collectives_per_forward)."""
    model = parallel.parallelize(build(name, mesh.size()), mesh)
    declared = models.get(name).collectives_per_forward(model.config, {"tp": mesh.size()})
    ids = torch.randint(0, 256, (2, 8))
    comm.reset_counters()
    with torch.no_grad():
        model(ids)
    counts = comm.snapshot_counters()
    assert set(counts) == set(declared), name
    for kind, expected in declared.items():
        assert counts[kind]["calls"] == expected.calls, (name, kind)
        assert counts[kind]["bytes"] == expected.values_per_token * 2 * 8 * 4, (name, kind)  # B x T tokens, fp32
    comm.reset_counters()
    with comm.use_mode("none"), torch.no_grad():
        model(ids)
    assert comm.snapshot_counters() == {}


def test_comm_counters():
    run_ranks(_count_collectives, 2, TP_ARCHS)


def test_tp_degree_that_does_not_divide_heads_is_one_clear_error():
    try:
        mesh = parallel.init_mesh(tp=4, fake=True)
        model = models.ZOO["llama"].model_class(models.ZOO["llama"].tiny(num_key_value_heads=2))
        with pytest.raises(ValueError, match=r"TP degree 4 does not divide num_key_value_heads=2; TP degrees that fit this model: \[1, 2\]"):
            parallel.parallelize(model, mesh)
    finally:
        torch.distributed.destroy_process_group()


def test_mesh_without_tp_dimension_is_one_clear_error():
    from parallel.mesh import mesh_group

    class FakeMesh:
        mesh_dim_names = ("dp",)

    with pytest.raises(ValueError, match=r"has dimensions \('dp',\) but .* needs a 'tp' dimension"):
        mesh_group(FakeMesh(), "tp", needed_by="tensor parallelism")
