"""FSDP2 as the data-parallel engine (parallel/fsdp.py) against the replicated trainer, for every architecture.

On 4 gloo ranks, dp 2 x the architecture's own degree 2 (tp for the dense family, ep for the MoE family, sp
for linear attention), two copies of the tiny model from the same seed train 3 AdamW steps on the same
batches with gradient clipping: one replicated over the data ranks with `parallel.grad_sync` (what
`parallel.fsdp=false` trains), one sharded by `apply_fsdp`. The losses agree (rtol 1e-5), and every
parameter and optimizer state is held in pieces with no rank holding another's: summed over its FSDP mesh a
parameter's local size is the replicated size, and a rank holds 1 / (dp x ep x sp) of the replicated
parameters and Adam state (experts: 1 / (dp x sp)), measured.
"""

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import models
import parallel
from parallel.fsdp import apply_fsdp, is_expert, scale_expert_gradients
from parallel.grad_sync import sync_gradients
from parallel.layout import shard_specs
from parallel.state import clip_grad_norm_
from tests.distributed import run_ranks
from train.data import next_token_targets
from train.metrics import IGNORE_INDEX

STEPS, BATCH, SEQ = 3, 2, 16
TP_SHAPES = dict(num_attention_heads=4, num_key_value_heads=4)


def model_degree(name: str) -> str:
    """The dimension an architecture is tested at besides dp: its expert, sequence or tensor layout."""
    dims = models.get(name).degrees
    return "ep" if "ep" in dims else "sp" if "sp" in dims else "tp"


def build(name: str, degrees: dict[str, int]):
    entry = models.get(name)
    shapes = TP_SHAPES if degrees.get("tp", 1) > 1 else {}
    torch.manual_seed(0)
    return entry.model_class(entry.tiny_at(degrees, **shapes)).train()


def loss_of(model, ids: torch.Tensor, sp_group, sp: int) -> torch.Tensor:
    """Each rank's loss as train.module's training_step computes it (sp: its chunk, over the whole batch's
    targets / sp, so that the mean over sp ranks is the sequences' loss)."""
    if sp_group is None:
        return model(input_ids=ids, labels=ids, use_cache=False).loss
    targets = next_token_targets(ids)
    chunk = parallel.sequence.split_sequence(targets, sp_group)
    count = (targets != IGNORE_INDEX).sum() / sp
    inputs = parallel.sequence.split_sequence(ids, sp_group)
    return model(input_ids=inputs, labels=chunk, shift_labels=chunk, num_items_in_batch=count, use_cache=False).loss


def local_numel(t: torch.Tensor) -> int:
    return (t._local_tensor if isinstance(t, DTensor) else t).numel()


def _compare(rank: int, world_size: int, name: str, degrees: dict[str, int]) -> None:
    mesh = parallel.init_mesh(**degrees)
    sp_group = parallel.mesh_group(mesh, "sp") if degrees["sp"] > 1 else None
    data_rank = mesh.get_local_rank("dp") * degrees["ep"] + mesh.get_local_rank("ep")
    replicated, sharded = build(name, degrees), build(name, degrees)
    for model in (replicated, sharded):
        parallel.parallelize(model, mesh)
    assert apply_fsdp(sharded, mesh, sharded.model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (replicated, sharded)]
    vocab = replicated.config.vocab_size
    world_group = dist.group.WORLD
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 * step + data_rank)
        ids = torch.randint(0, vocab, (BATCH, SEQ), generator=generator)
        losses = []
        for model, optimizer in zip((replicated, sharded), optimizers, strict=True):
            loss = loss_of(model, ids, sp_group, degrees["sp"])
            loss.backward()
            if model is replicated:
                sync_gradients(model, mesh)
            else:
                scale_expert_gradients(model, degrees["ep"])
            clip_grad_norm_(model, 0.5)
            optimizer.step()
            optimizer.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=world_group)
            losses.append(mean / world_size)
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0, msg=f"{name} step {step}")

    # What each rank holds: every parameter (and its Adam moments) in pieces over its FSDP mesh, with nothing
    # held twice, and the share that mesh's size says.
    specs = shard_specs(sharded)
    token = math.prod(degrees[d] for d in ("dp", "ep", "sp"))
    expert_share = degrees["dp"] * degrees["sp"]
    held = {"replicated": [0, 0], "sharded": [0, 0]}  # [parameters, Adam state] numel on this rank
    for (pname, p), q in zip(sharded.named_parameters(), replicated.parameters(), strict=True):
        state = optimizers[1].state[p]
        moments = [state["exp_avg"], state["exp_avg_sq"]]
        if isinstance(p, DTensor):
            total = torch.tensor(local_numel(p))
            dist.all_reduce(total, group=p.device_mesh.get_group())
            assert int(total) == q.numel(), f"{name}: {pname} is held {int(total)} / {q.numel()} over its FSDP mesh"
            assert all(isinstance(m, DTensor) and local_numel(m) == local_numel(p) for m in moments)
        share = expert_share if is_expert(specs.get(pname, ())) else token
        # FSDP cuts dim 0 in `share` chunks (torch.chunk's sizes); an uneven one is padded to the largest
        largest = math.ceil(q.shape[0] / share) * (q.numel() // q.shape[0]) if q.dim() else q.numel()
        held["replicated"][0] += largest
        held["replicated"][1] += 2 * largest
        held["sharded"][0] += local_numel(p)
        held["sharded"][1] += sum(local_numel(m) for m in moments)
    # At most the largest chunk of each: 1 / (dp x ep x sp) of the replicated parameters and Adam state
    # (1 / (dp x sp) of the experts) where the dimensions divide.
    assert all(s <= r for s, r in zip(held["sharded"], held["replicated"], strict=True)), f"{name}: {held}"


ARCHS = sorted(models.ZOO) + models.variants()  # the ladder variants through their registry entries
FAST = {"llama", "moe"}


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in ARCHS]
)
def test_fsdp_trains_as_the_replicated_trainer(name):
    degrees = {"dp": 2, "ep": 1, "sp": 1, "tp": 1, model_degree(name): 2}
    run_ranks(_compare, 4, name, degrees)


def test_fsdp_at_dp2_alone():
    run_ranks(_compare, 2, "llama", {"dp": 2, "ep": 1, "sp": 1, "tp": 1})


def _reduce_scatter_order(rank: int, world_size: int, events_out) -> None:
    mesh = parallel.init_mesh(dp=2)
    model = build("llama", {"dp": 2})
    parallel.parallelize(model, mesh)
    apply_fsdp(model, mesh, model.model)
    events = []
    reduce_scatter = dist.reduce_scatter_single

    def recorded(*args, **kwargs):
        events.append("reduce-scatter")
        return reduce_scatter(*args, **kwargs)

    dist.reduce_scatter_single = recorded
    # The gradient reaches the embedding's output once every decoder layer's backward has run.
    def on_embedding(module, args, out):
        out.register_hook(lambda grad: events.append("layers' backward done"))

    model.model.embed_tokens.register_forward_hook(on_embedding)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    dist.reduce_scatter_single = reduce_scatter
    if rank == 0:
        events_out.extend(events)


def test_reduce_scatters_run_during_the_backward():
    """FSDP's reduce-scatter of each layer is issued as that layer's backward ends, before the backward has
    reached the embedding (the replicated trainer reduces everything after the whole backward)."""
    import multiprocessing

    with multiprocessing.Manager() as manager:
        events = manager.list()
        run_ranks(_reduce_scatter_order, 2, events)
        events = list(events)
    layers = len(build("llama", {"dp": 2}).model.layers)
    done = events.index("layers' backward done")
    assert events[:done] == ["reduce-scatter"] * layers, events
    assert events[done:] == ["layers' backward done", "reduce-scatter"], events  # the root's, last


def test_what_a_rank_holds_at_8b_dp8_tp8_as_the_readme_says():
    """Llama-3.1-8B's shapes laddered, dp 8 x tp 8 on the fake process group (meta tensors): the parameters one
    rank holds after the layout and FSDP, as docs/training.md's "Training at scale" quotes them."""
    from pathlib import Path

    config = models.build_config(
        "ladder", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, ladder_layers=16,
    )
    mesh = parallel.init_mesh(dp=8, tp=8, fake=True)
    try:
        with torch.device("meta"):
            model = models.get("ladder").model_class(config)
        total = sum(p.numel() for p in model.parameters())
        parallel.parallelize(model, mesh)
        apply_fsdp(model, mesh, model.model)
        held = sum(local_numel(p) for p in model.parameters())
    finally:
        dist.destroy_process_group()
    readme = (Path(__file__).parents[1] / "docs" / "training.md").read_text()  # "Training at scale"
    assert f"{total / 1e9:.2f} B parameters" in readme and f"= {held / 1e9:.2f} B parameters" in readme
    assert f"{held * 16 / 1e9:.1f} GB of state per GPU" in readme  # fp32 weights + gradients + 2 Adam moments


def _compiled_under_fsdp(rank: int, world_size: int, name: str, backend: str, degrees: dict[str, int]) -> None:
    from train.activation_checkpointing import compile_layers

    mesh = parallel.init_mesh(**degrees)
    sp_group = parallel.mesh_group(mesh, "sp") if degrees["sp"] > 1 else None
    generator = torch.Generator().manual_seed(mesh.get_local_rank("dp"))
    ids = torch.randint(0, build(name, degrees).config.vocab_size, (BATCH, SEQ), generator=generator)
    results = []
    for compiled in (False, True):
        model = build(name, degrees)
        parallel.parallelize(model, mesh)
        if compiled:
            compile_layers(model, backend=backend)
        apply_fsdp(model, mesh, model.model)
        loss = loss_of(model, ids, sp_group, degrees["sp"])
        loss.backward()
        grads = {n: p.grad._local_tensor.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    from torch._dynamo.utils import counters

    assert counters["stats"]["unique_graphs"] >= 1  # the layers did run compiled
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=0, atol=1e-5)
    assert compiled_grads.keys() == eager_grads.keys()
    for n, g in eager_grads.items():
        torch.testing.assert_close(compiled_grads[n], g, rtol=0, atol=1e-5, msg=n)


def test_compiled_training_step_equals_eager_under_fsdp_and_tp2():
    """Each decoder layer compiled in place (parallelize -> compile -> fully_shard), dp 2 x tp 2: the loss and
    every gradient shard of one step equal eager's (atol 1e-5; aot_eager, the traced graph without inductor's
    codegen, which tests/test_activation_checkpointing.py runs under -m slow)."""
    run_ranks(_compiled_under_fsdp, 4, "llama", "aot_eager", {"dp": 2, "ep": 1, "sp": 1, "tp": 2})


def test_compiled_training_step_equals_eager_under_lasp2_sp2():
    """Linear attention at sp 2 compiled: LASP-2's autograd Function runs eagerly between the compiled parts (its
    backward differentiates its local graph twice, which one compiled region cannot); loss and gradients as eager's."""
    run_ranks(_compiled_under_fsdp, 2, "linear", "aot_eager", {"dp": 1, "ep": 1, "sp": 2, "tp": 1})
