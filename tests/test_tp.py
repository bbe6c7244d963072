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


# --- the column-parallel linears' backward (parallel.comm.column_parallel_linears) ------------------------------


class _OpCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops run: the simulated clock's time, one unit per op."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _linears(dtype):
    torch.manual_seed(0)
    return [torch.nn.Linear(8, 6, dtype=dtype), torch.nn.Linear(8, 4, bias=False, dtype=dtype)]


def _grads(x, linears, outs):
    sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs)).backward()
    grads = [x.grad] + [p.grad for m in linears for p in m.parameters()]
    x.grad = None
    for m in linears:
        m.zero_grad(set_to_none=True)
    return grads


def test_column_parallel_linears_hide_the_input_gradients_all_reduce_behind_the_weight_gradients():
    """One node for the linears reading one input: the same outputs and gradients as the linears themselves (fp64,
    1e-12; a simulated all-reduce sums one rank), and on a simulated link its backward computes the weights'
    gradients between the issue of the input gradient's all-reduce and its wait: part of it is hidden. The
    clock's time is the number of aten ops run; the all-reduce takes 1,000 of them."""
    import torch.distributed as dist

    from parallel.link import LinkPreset

    parallel.init_mesh(tp=2, fake=True)
    try:
        linears = _linears(torch.float64)
        x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
        want = _grads(x, linears, [m(x) for m in linears])
        count = _OpCount()
        slow = LinkPreset("slow", alpha_s=500.0, beta_Bps=1e30)  # 2 (P - 1) alpha = 1,000 at P = 2
        with comm.use_mode("simulated", link=slow, world_size=2, now=lambda: float(count.ops)) as clock:
            clock.start()
            with count:
                outs = comm.column_parallel_linears(x, linears, dist.group.WORLD)
                for out, m in zip(outs, linears, strict=True):
                    torch.testing.assert_close(out, m(x), rtol=0, atol=1e-12)
                got = _grads(x, linears, outs)
            clock.elapsed()
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
        assert clock.comm_busy == 1000.0
        assert 0 < clock.comm_busy - clock.exposed < 1000.0  # the weight gradients' ops ran while it was in flight
    finally:
        dist.destroy_process_group()


def test_column_parallel_linears_under_autocast_compute_what_nn_linear_computes():
    """bf16 autocast on CPU (Lightning's bf16-mixed without FSDP): outputs at bf16, gradients at the parameters'
    fp32, as nn.Linear under autocast gives them (a fake group's all-reduce is the identity)."""
    import torch.distributed as dist

    parallel.init_mesh(tp=2, fake=True)
    try:
        linears = _linears(torch.float32)
        x = torch.randn(3, 5, 8, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain = [m(x) for m in linears]
            joint = comm.column_parallel_linears(x, linears, dist.group.WORLD)
        assert [o.dtype for o in joint] == [torch.bfloat16] * 2
        for got, want in zip(joint, plain, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        want, got = _grads(x, linears, plain), _grads(x, linears, joint)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype == torch.float32
            torch.testing.assert_close(g, w, rtol=1e-2, atol=1e-2)
    finally:
        dist.destroy_process_group()
