"""Tensor parallelism under torch.compile: every collective of parallel.comm (all-reduce, all-gather,
reduce-scatter, the ring shift, the all-to-all) is functional inside a compiled region, forward and backward
(4 gloo ranks, compiled fullgraph == eager with gradients); in real mode inside a compiled region `parallel.comm`'s
all-reduce is a functional collective waited with `wait_tensor` where forward() waits it, so a whole TP
forward and backward compiles with `fullgraph=True` (no graph break) and computes what eager computes; with
a static cache (models.common.cache) so does the whole decode step, one graph for every step.

On 2 gloo ranks: a function that issues an all-reduce, computes, then waits, compiled (aot_eager) == eager,
its gradient too, counted once per call; one training step (forward, loss, backward) of every architecture
with a tp layout and no ep layout at TP 2, compiled with `fullgraph=True` under aot_eager == eager (loss and every gradient,
fp32 atol 1e-6; observed 0), the compiled graph holding eager's collectives (read off the graph:
traced collectives are not counted at run time); under inductor for llama and ladder (slow: a
minute of C++ compilation each). The decode program of the bench (eval.bench.steps: prefill, then 8 greedy
decode steps on a static cache) at TP 2 for the same architectures, both steps compiled with
`fullgraph=True` under aot_eager (inductor for llama and ladder, slow): the same greedy tokens, logits
within fp32 atol 1e-5, one graph per step function over all 8 steps holding one eager step's collectives,
no graph break counted; and HF's recipe at TP 2: `generate(cache_implementation="static")` == the default cache's
greedy output, at EP 2 for the MoE family too (its padded dispatch), and under a compiled forward for every
tp / ep architecture (slow). No timing is asserted.
"""

import pytest
import torch
import torch.distributed as dist

import models
import parallel
from eval.bench.steps import CountingBackend, compile_steps, decode_step, prefill
from parallel import comm
from tests.distributed import run_ranks

ATOL = 1e-6
# The MoE family's tp layouts (attention) are left out: its dropless dispatch sizes the all-to-all from counts
# read off the device, which no graph can hold (a dispatch with host-known sizes).
NAMES = sorted(models.ZOO) + models.variants()  # the ladder variants through their registry entries
TP_ARCHS = [name for name in NAMES if "tp" in models.get(name).degrees and "ep" not in models.get(name).degrees]


def _all_reduce_ranks(rank, world_size):
    import torch._dynamo as dynamo

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    group = dist.group.WORLD
    torch.manual_seed(rank)  # each rank its own partial sums
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def f(x, w):
        handle = comm.all_reduce(x @ w, group)
        y = torch.relu(x)  # compute between the issue and the wait
        return handle.wait() * 2 + y

    comm.reset_counters()
    eager = f(x, w)
    eager.sum().backward()
    eager_grad, w.grad = w.grad, None
    assert comm.snapshot_counters() == {"all_reduce": {"calls": 1, "bytes": 4 * 8 * 4}}
    assert dynamo.explain(f)(x, w).graph_break_count == 0
    dynamo.reset()
    graphs = CountingBackend("aot_eager")
    compiled = torch.compile(f, fullgraph=True, backend=graphs)
    comm.reset_counters()
    for _ in range(2):
        out = compiled(x, w)
    torch.testing.assert_close(out, eager, rtol=0, atol=ATOL)
    out.sum().backward()
    torch.testing.assert_close(w.grad, eager_grad, rtol=0, atol=ATOL)
    # One graph for both calls, holding the one all-reduce; traced collectives are not counted at run time
    # (a count would be a guard on the counters' values: a recompile at every call).
    assert graphs.graphs == [{"all_reduce": {"calls": 1, "bytes": 4 * 8 * 4}}]
    assert comm.snapshot_counters() == {}


def test_all_reduce_is_functional_and_waited_in_place_under_compile():
    run_ranks(_all_reduce_ranks, 2)


def _collectives_ranks(rank, world_size):
    import torch._dynamo as dynamo

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    group = dist.group.WORLD
    cases = {
        "all_gather dim 0": lambda x: comm.all_gather(x, group).wait(),
        "all_gather dim 2": lambda x: comm.all_gather(x, group, dim=2).wait(),
        "reduce_scatter dim 0": lambda x: comm.reduce_scatter(x, group).wait(),
        "reduce_scatter dim 1": lambda x: comm.reduce_scatter(x, group, dim=1).wait(),
        "send_recv +1": lambda x: comm.send_recv(x, group).wait(),
        "send_recv -1": lambda x: comm.send_recv(x, group, shift=-1).wait(),
    }
    for name, collective in cases.items():
        torch.manual_seed(rank)
        x = torch.randn(4, 8, 2, requires_grad=True)
        weights = torch.randn_like(collective(x.detach()))  # each rank uses the result its own way

        def f(x, collective=collective, weights=weights):
            return (collective(torch.tanh(x)) * weights).sum()

        eager = f(x)
        eager.backward()
        eager_grad, x.grad = x.grad, None
        dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
        compiled.backward()
        torch.testing.assert_close(compiled, eager, rtol=0, atol=ATOL, msg=name)
        torch.testing.assert_close(x.grad, eager_grad, rtol=0, atol=ATOL, msg=name)


def test_every_collective_is_functional_under_compile_forward_and_backward():
    # all-gather (any dim), reduce-scatter (any dim), the ring shift both ways (4 ranks: +1 and -1 differ):
    # compiled fullgraph == eager, with gradients.
    run_ranks(_collectives_ranks, 4)


def sharded_tiny(arch: str, mesh, dim: str, world_size: int):
    """`arch`'s tiny config at {dim: world_size}, seeded, sharded over `mesh`, in eval mode."""
    entry = models.get(arch)
    torch.manual_seed(0)
    model = entry.model_class(entry.tiny_at({dim: world_size})).eval()
    parallel.parallelize(model, mesh)
    return model


def compiled_training_step_equals_eager(model, ids, backend: str, label: str, traced_as: dict | None = None) -> dict:
    """One training step (loss, backward) eager, then compiled with fullgraph=True (no break allowed): the same
    loss and every gradient (atol ATOL), the graph holding eager's collectives, the backward's too (in its
    autograd functions' subgraphs); `traced_as` renames an eager kind to the op it traces as (`send_recv` runs as
    a functional all-to-all under compile: parallel.comm_all_to_all.send_recv). Returns eager's collectives.
    tests/test_compile_moe.py runs it too."""
    import torch._dynamo as dynamo

    def step(ids):
        return model(ids, labels=ids, use_cache=False).loss

    comm.reset_counters()
    loss = step(ids)
    loss.backward()
    counts = comm.snapshot_counters()
    grads = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    dynamo.reset()
    dynamo.utils.counters.clear()
    graphs = CountingBackend(backend)
    compiled_loss = torch.compile(step, fullgraph=True, backend=graphs)(ids)
    compiled_loss.backward()
    traced = {(traced_as or {}).get(kind, kind): count for kind, count in counts.items()}
    assert graphs.graphs == [traced], f"{label}: {graphs.graphs} vs {traced}"
    torch.testing.assert_close(compiled_loss, loss, rtol=0, atol=ATOL, msg=label)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=ATOL, msg=f"{label}: {name}")
    return counts


def _training_step_ranks(rank, world_size, archs, backend):
    mesh = parallel.init_mesh(tp=world_size)
    for arch in archs:
        model = sharded_tiny(arch, mesh, "tp", world_size).train()
        ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
        compiled_training_step_equals_eager(model, ids, backend, arch)


@pytest.mark.slow  # 24 s; compiled layers under FSDP + TP 2 == eager: tests/test_fsdp.py
def test_tp2_training_step_compiles_fullgraph_and_equals_eager():
    run_ranks(_training_step_ranks, 2, TP_ARCHS, "aot_eager")


@pytest.mark.slow
def test_tp2_training_step_under_inductor_equals_eager():
    run_ranks(_training_step_ranks, 2, ["llama", "ladder"], "inductor")


DECODE_ATOL = 1e-5  # fp32 logits: a compiled graph may fuse and reorder the same arithmetic
STEPS = 8


def generation(model, ids, prefill_fn, step_fn, steps: int = STEPS):
    """Greedy tokens [B, 1 + steps], logits [1 + steps, B, V] and the decode steps' collectives (the bench's
    program on a static cache; tests/test_compile_moe.py runs it too)."""
    cache = model.model.make_cache(batch_size=ids.shape[0], max_cache_len=16, static=True)
    token, logits = prefill_fn(model, ids, cache)
    tokens, all_logits = [token], [logits]
    comm.reset_counters()
    for _ in range(steps):
        token, logits = step_fn(model, token, cache)
        tokens.append(token)
        all_logits.append(logits)
    return torch.cat(tokens, 1), torch.stack(all_logits), comm.snapshot_counters()


def compiled_generation_equals_eager(model, ids, backend: str = "aot_eager") -> dict:
    """Greedy generation on a static cache eager, then with the prefill and the decode step compiled
    (fullgraph): the same tokens, logits within 1e-5, one graph for every decode step and no graph break.
    Returns eager's decode collectives (tests/test_overlap.py, tests/test_collective_matmul.py)."""
    import torch._dynamo as dynamo

    tokens, logits, counts = generation(model, ids, prefill, decode_step)
    dynamo.reset()
    dynamo.utils.counters.clear()
    prefill_fn, step_fn, graphs = compile_steps(backend=backend)
    c_tokens, c_logits, _ = generation(model, ids, prefill_fn, step_fn)
    assert torch.equal(c_tokens, tokens)
    torch.testing.assert_close(c_logits, logits, rtol=0, atol=1e-5)
    assert len(graphs["decode"].graphs) == 1 and not dynamo.utils.counters["graph_break"]
    return counts


def _decode_ranks(rank, world_size, archs, backend):
    import torch._dynamo as dynamo

    mesh = parallel.init_mesh(tp=world_size)
    for arch in archs:
        model = sharded_tiny(arch, mesh, "tp", world_size)
        ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
        tokens, logits, counts = generation(model, ids, prefill, decode_step)
        assert counts["all_reduce"]["calls"] > 0, arch
        dynamo.reset()
        dynamo.utils.counters.clear()
        prefill_fn, step_fn, graphs = compile_steps(backend=backend)
        c_tokens, c_logits, _ = generation(model, ids, prefill_fn, step_fn)
        assert torch.equal(c_tokens, tokens), arch
        torch.testing.assert_close(c_logits, logits, rtol=0, atol=DECODE_ATOL, msg=arch)
        # One graph for the 8 steps, holding one step's collectives as eager issues them.
        per_step = {kind: {n: v // STEPS for n, v in c.items()} for kind, c in counts.items()}
        assert graphs["decode"].graphs == [per_step], arch
        assert len(graphs["prefill"].graphs) == 1, arch
        assert not dynamo.utils.counters["graph_break"], (arch, dict(dynamo.utils.counters["graph_break"]))
        if backend == "aot_eager":  # HF's recipe on the same sharded model (eager)
            want = model.generate(ids, max_new_tokens=6, do_sample=False)
            out = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static")
            assert torch.equal(out, want), arch


def test_tp2_decode_step_compiles_to_one_graph_and_equals_eager():
    run_ranks(_decode_ranks, 2, TP_ARCHS, "aot_eager")


@pytest.mark.slow
def test_tp2_decode_step_under_inductor_equals_eager():
    run_ranks(_decode_ranks, 2, ["llama", "ladder"], "inductor")


EP_ARCHS = [name for name in NAMES if "ep" in models.get(name).degrees]


def _generate_ranks(rank, world_size, archs, dim, compiled):
    """HF's recipe on the sharded model: generate(cache_implementation="static") == the default cache's greedy
    output; `compiled`: after model.forward = torch.compile(model.forward, fullgraph=True) (aot_eager)."""
    import torch._dynamo as dynamo

    mesh = parallel.init_mesh(**{dim: world_size})
    for arch in archs:
        model = sharded_tiny(arch, mesh, dim, world_size)
        if hasattr(model, "set_moe_dispatch"):
            model.set_moe_dispatch("padded")  # no host sync: what a compiled step can hold
        ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
        want = model.generate(ids, max_new_tokens=6, do_sample=False)
        if compiled:
            dynamo.reset()
            model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
        out = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static")
        assert torch.equal(out, want), arch


def test_ep2_generate_with_static_cache_equals_default():
    run_ranks(_generate_ranks, 2, EP_ARCHS, "ep", False)


@pytest.mark.slow
@pytest.mark.parametrize(("dim", "archs"), [("tp", TP_ARCHS), ("ep", EP_ARCHS)])
def test_generate_static_under_compiled_forward_at_degree_2(dim, archs):
    run_ranks(_generate_ranks, 2, archs, dim, True)
