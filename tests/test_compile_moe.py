"""The MoE family under torch.compile: with the padded dispatch (models/common/moe.py
`dispatch_padded`) every all-to-all size is known on the host, and in real mode inside a compiled region
`parallel.comm`'s equal-split all-to-all is a functional collective (`funcol.all_to_all_single`) waited with
`wait_tensor` where forward() waits it, so a whole MoE forward and backward compile with `fullgraph=True`.
Every check: aot_eager, compiled == eager (fp32 atol 1e-6; observed 0), no graph break (`fullgraph=True`, and
`torch._dynamo.utils.counters["graph_break"]` empty), one graph holding the collectives eager counts (read off
the graph by eval.bench.steps.CountingBackend, `comm.graph_collectives`: its functional collectives, the
backward's too in its autograd functions' subgraphs; traced collectives are not counted at run time); no
timing asserted.

- one process: the padded `moe`'s eval forward without cache compiles (no device-to-host read left);
- on 2 gloo ranks, run by tests/test_moe_padded.py's EP 2 test on its ranks (`all_to_all_function`,
  `eval_forward`): a function that issues an all-to-all, computes, then waits, forward and backward (the
  reverse all-to-all); `moe` padded at EP 2, a forward of the whole model
  without cache in eval mode, no count exchange;
- slow, at EP 2: the same forward for `scmoe` (its overlapped schedule: dispatch issued after Attn_l, waited
  after MLP_l) and `moepp` (zero-computation experts masked, not selected), and one training step (forward,
  loss with the balance loss, backward) of all three: loss and every gradient;
- slow, at EP 2: the bench's decode program (eval.bench.steps: prefill, then 6 greedy decode steps on a static
  cache) of all three, padded, both steps compiled (`compile_steps`, aot_eager): the same greedy tokens, logits
  within fp32 atol 1e-5, one graph for the 6 decode steps holding one eager step's collectives.
"""

import pytest
import torch
import torch.distributed as dist

import parallel
from eval.bench.steps import CountingBackend, compile_steps, decode_step, prefill
from parallel import comm
from tests.distributed import run_ranks
from tests.test_compile import compiled_training_step_equals_eager, generation
from tests.test_ep import EP_ARCHS, build, ids_of

ATOL = 1e-6


def all_to_all_function(rank: int) -> None:
    """On the ranks of the default group: an all-to-all issued, compute, then waited, compiled == eager."""
    group = dist.group.WORLD
    torch.manual_seed(rank)  # each rank its own rows
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(6, 8)

    def f(x, w):
        handle = comm.all_to_all(x @ w, group)  # equal splits: 3 rows to each rank
        y = torch.relu(x)  # compute between the issue and the wait
        return handle.wait() * 2 + y

    comm.reset_counters()
    eager = f(x, w)
    (eager * eager).sum().backward()
    eager_grad, w.grad = w.grad, None
    # Forward and backward, each the rank's 6 x 8 fp32 rows.
    assert comm.snapshot_counters() == {"all_to_all": {"calls": 2, "bytes": 2 * 6 * 8 * 4}}
    _fresh()
    graphs = CountingBackend("aot_eager")
    out = torch.compile(f, fullgraph=True, backend=graphs)(x, w)
    (out * out).sum().backward()
    _no_graph_break()
    torch.testing.assert_close(out, eager, rtol=0, atol=ATOL)
    torch.testing.assert_close(w.grad, eager_grad, rtol=0, atol=ATOL)
    # One graph, holding the forward's all-to-all and (in the autograd function's backward) the reverse one.
    assert graphs.graphs == [{"all_to_all": {"calls": 2, "bytes": 2 * 6 * 8 * 4}}]


def _fresh() -> None:
    """A clean dynamo: no cached graph, no counted graph break."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    dynamo.reset()
    counters.clear()


def _no_graph_break() -> None:
    from torch._dynamo.utils import counters

    assert not counters["graph_break"], dict(counters["graph_break"])


def eval_forward(rank: int, mesh, name: str) -> None:
    """`name`, padded, sharded over `mesh` (ep), an eval forward without cache compiled == eager."""
    model = build(name, {"ep": mesh.size()}, moe_dispatch="padded").eval()
    parallel.parallelize(model, mesh)
    ids = ids_of(2, 8, seed=rank)  # each rank its own tokens

    def forward(ids, model=model):
        return model(ids, use_cache=False).logits

    with torch.no_grad():
        comm.reset_counters()
        eager = forward(ids)
        counts = comm.snapshot_counters()
        assert set(counts) == {"all_to_all"}, counts  # no count exchange: sizes known on the host
        _fresh()
        graphs = CountingBackend("aot_eager")
        compiled = torch.compile(forward, fullgraph=True, backend=graphs)(ids)  # fullgraph: no break allowed
    _no_graph_break()
    assert graphs.graphs == [counts], name
    torch.testing.assert_close(compiled, eager, rtol=0, atol=ATOL, msg=lambda m: f"{name}: {m}")


def _training_step(rank: int, mesh, name: str) -> None:
    model = build(name, {"ep": mesh.size()}, moe_dispatch="padded", router_aux_loss_coef=0.5)
    parallel.parallelize(model, mesh)
    ids = ids_of(2, 8, seed=rank)
    counts = compiled_training_step_equals_eager(model, ids, "aot_eager", name)
    _no_graph_break()
    # The dispatch / combine all-to-alls and the balance loss's all-reduce, forward and backward.
    assert set(counts) == {"all_to_all", "all_reduce"}, name


DECODE_STEPS = 6
DECODE_ATOL = 1e-5  # as tests/test_compile.py's decode


def _decode_ranks(rank, world_size, names: list[str]):
    mesh = parallel.init_mesh(ep=world_size)
    for name in names:
        model = parallel.parallelize(build(name, {"ep": world_size}, moe_dispatch="padded").eval(), mesh)
        ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1 + rank))
        tokens, logits, counts = generation(model, ids, prefill, decode_step, DECODE_STEPS)
        assert set(counts) == {"all_to_all"}, name  # no count exchange
        _fresh()
        prefill_fn, step_fn, graphs = compile_steps(backend="aot_eager")
        c_tokens, c_logits, _ = generation(model, ids, prefill_fn, step_fn, DECODE_STEPS)
        _no_graph_break()
        assert torch.equal(c_tokens, tokens), name
        torch.testing.assert_close(
            c_logits, logits, rtol=0, atol=DECODE_ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )
        per_step = {kind: {n: v // DECODE_STEPS for n, v in c.items()} for kind, c in counts.items()}
        assert graphs["decode"].graphs == [per_step], name  # one graph for every step
        assert len(graphs["prefill"].graphs) == 1, name


def _ranks(rank, world_size, function: bool, forwards: list[str], steps: list[str]):
    mesh = parallel.init_mesh(ep=world_size)
    if function:
        all_to_all_function(rank)
    for name in forwards:
        eval_forward(rank, mesh, name)
    for name in steps:
        _training_step(rank, mesh, name)


def test_padded_moe_compiles_fullgraph_on_one_process():
    """No ep group: no collective, but the padded dispatch itself reads nothing off the device (the dropless
    one's `.tolist()` would break the graph). At EP 2 the same checks run on the ranks of
    tests/test_moe_padded.py (`all_to_all_function`, `eval_forward` for moe), which spawns them anyway."""
    model = build("moe", {}, moe_dispatch="padded").eval()
    ids = ids_of(2, 8)

    def forward(ids):
        return model(ids, use_cache=False).logits

    with torch.no_grad():
        eager = forward(ids)
        _fresh()
        compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")(ids)
    _no_graph_break()
    torch.testing.assert_close(compiled, eager, rtol=0, atol=ATOL)


@pytest.mark.slow
def test_ep2_padded_forward_and_training_step_compile_fullgraph_every_ep_arch():
    run_ranks(_ranks, 2, False, [n for n in EP_ARCHS if n != "moe"], EP_ARCHS)


@pytest.mark.slow
def test_ep2_padded_decode_program_compiles_one_graph_every_ep_arch():
    run_ranks(_decode_ranks, 2, EP_ARCHS)
