"""System-level overlap schedules (parallel/overlap.py) compute what the unsplit model computes: token_split (the
batch's halves) and seq_split (the sequence's chunks) give the same logits, loss and gradients in one process (fp64,
1e-10), the same prefill and cached decode on static and growing caches (with padding), under TP 2 the same as the
unsharded model (gloo, fp32, 1e-5; with selective activation checkpointing too) and under EP 2 the unsplit MoE
(fp64); their waits sit where the schedule says
(the simulated link's record); architectures that do not take them and a batch of one under token_split are refused
with the reason."""

import pytest
import torch

import models
import parallel
from parallel import comm
from tests.distributed import assert_shard_grads, run_ranks

TINY = dict(num_attention_heads=4, num_key_value_heads=2)


SPLIT_ARCHS = ["llama", "moe", "parallel"]  # the architectures that take both splits (their `overlap_schedules`)
SPLITS = ["token_split", "seq_split"]


def _llama(dtype=torch.float64, seed=0, arch="llama"):
    torch.manual_seed(seed)
    return models.get(arch).model_class(models.get(arch).tiny_at({"tp": 2}, **TINY)).to(dtype)


def _loss_and_grads(model, ids):
    model.zero_grad()
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("schedule", SPLITS)
def test_the_architectures_that_take_it_are_listed(schedule):
    takes = [a for a in sorted(models.ZOO) if schedule in getattr(models.get(a).model_class, "overlap_schedules", ())]
    assert takes == SPLIT_ARCHS


@pytest.mark.parametrize("arch", SPLIT_ARCHS)
@pytest.mark.parametrize(("schedule", "batch", "length"),
                         [("token_split", 2, 10), ("token_split", 3, 10), ("token_split", 4, 10),
                          ("seq_split", 1, 10), ("seq_split", 2, 9), ("seq_split", 3, 2)])  # fmt: skip
def test_a_split_is_the_unsplit_model_in_fp64(schedule, batch, length, arch):
    ids = torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(1))
    plain, split = _llama(arch=arch), _llama(arch=arch)
    parallel.set_overlap(split, schedule)
    assert split.model.overlap == schedule and not split.model.runs_layers_whole  # the trunk runs the halves
    ref_logits, ref_loss, ref_grads = _loss_and_grads(plain, ids)
    logits, loss, grads = _loss_and_grads(split, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-10)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-10)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    parallel.set_overlap(split, "none")  # back to the architecture's own schedule
    assert split.model.overlap == "none" and split.model.runs_layers_whole


@pytest.mark.parametrize("arch", SPLIT_ARCHS)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize(("schedule", "batch"), [("token_split", 2), ("token_split", 3), ("seq_split", 1), ("seq_split", 3)])
def test_a_split_prefill_and_cached_decode_are_the_full_forward(schedule, batch, static, arch):
    # token_split: each half writes and reads its own rows of the cache (models.common.cache.BatchSplit); the fill
    # counter of a static cache advances once per forward. seq_split: the chunks write the cache one after the
    # other, the second prefill (3 tokens after 5 cached) split too, the decode steps unsplit. The first sequence
    # is left-padded (two tokens masked out), so each chunk's mask is its own rows and keys of the layer's.
    ids = torch.randint(0, 256, (batch, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    plain, split = _llama(arch=arch), _llama(arch=arch)
    parallel.set_overlap(split, schedule)
    with torch.no_grad():
        full = plain(ids, attention_mask=mask, use_cache=False).logits
        cache = split.model.make_cache(batch_size=batch, max_cache_len=16, static=static)
        pieces, step = [], None
        for start, end in [(0, 5), (5, 8), (8, 9), (9, 10)]:
            step = split(ids[:, start:end], attention_mask=mask[:, :end], cache=cache if step is None else step.cache,
                         use_cache=True)  # fmt: skip
            pieces.append(step.logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-10)
    assert int(step.cache.get_seq_length()) == ids.shape[1]


def _tp2_splits(rank, world_size):
    mesh = parallel.init_mesh(tp=world_size)
    for schedule in SPLITS:
        for arch in SPLIT_ARCHS:
            _tp2_one(rank, world_size, mesh, arch, schedule)
        # Selective activation checkpointing recomputes each half's sub-blocks in backward (under TP they are its
        # regions): a half whose forward read state the other half had changed since would recompute something else.
        _tp2_one(rank, world_size, mesh, "llama", schedule, ac="selective")


def _all_reduces(model, ids) -> int:
    calls = comm.snapshot_counters().get("all_reduce", {}).get("calls", 0)
    _loss_and_grads(model, ids)
    return comm.snapshot_counters()["all_reduce"]["calls"] - calls


def _tp2_one(rank, world_size, mesh, arch, schedule, ac="none"):
    from train.activation_checkpointing import apply_activation_checkpointing

    ids = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(2))
    reference, sharded = _llama(torch.float32, arch=arch), _llama(torch.float32, arch=arch)
    parallel.parallelize(sharded, mesh)
    parallel.set_overlap(sharded, schedule)
    apply_activation_checkpointing(sharded, ac)
    ref_logits, ref_loss, ref_grads = _loss_and_grads(reference, ids)
    calls = comm.snapshot_counters().get("all_reduce", {}).get("calls", 0)
    logits, loss, grads = _loss_and_grads(sharded, ids)
    issued = comm.snapshot_counters()["all_reduce"]["calls"] - calls
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-5)
    assert_shard_grads(grads, ref_grads, rank, world_size, 1e-5)
    # Every all-reduce of the unsplit model, forward and backward, once per half.
    unsplit = parallel.parallelize(_llama(torch.float32, arch=arch), mesh)
    assert issued == 2 * _all_reduces(unsplit, ids), (arch, schedule)
    with torch.no_grad():  # prefill + cached decode on the static cache, split, against the unsharded full forward
        full = reference(ids, use_cache=False).logits
        step = sharded(ids[:, :7], cache=sharded.model.make_cache(4, 16, static=True), use_cache=True)
        pieces = [step.logits]
        for t in range(7, ids.shape[1]):
            step = sharded(ids[:, t : t + 1], cache=step.cache, use_cache=True)
            pieces.append(step.logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-5, msg=f"{arch}, {schedule}")


def test_splits_under_tp2_are_the_unsharded_model():
    run_ranks(_tp2_splits, 2)


@pytest.mark.parametrize("schedule", SPLITS)
def test_each_half_waits_after_the_other_halfs_sub_block(schedule):
    # The simulated link's record of a two-layer forward. Unsplit: each all-reduce waited at once. Split: each
    # half's waited after the other half's next sub-block, and half 1's last of layer 0 after half 0's attention of
    # layer 1 (issued, then waited): only the last layer's last all-reduce is waited with nothing after it.
    from eval.simulator.training import TrainLayout, record_training

    config = models.get("llama").tiny_at({"tp": 2}, **TINY, num_hidden_layers=2)
    plain = record_training("llama", config, TrainLayout(tp=2, micro_batch=2, seq_len=8), model_flops=False)
    split = record_training("llama", config, TrainLayout(tp=2, micro_batch=2, seq_len=8, overlap=schedule),
                            model_flops=False)  # fmt: skip

    def calls(run, n):  # the first n issues and waits: the forward
        return [name for name, _, _ in run.recorder.calls if name in ("issue", "wait")][:n]

    assert calls(plain, 8) == ["issue", "wait"] * 4
    layer = ["issue", "issue", "wait", "issue", "wait", "issue", "wait"]  # half 1's MLP all-reduce left in flight
    assert calls(split, 16) == layer + ["issue", "wait", "issue", "wait", "issue", "wait", "issue", "wait", "wait"]


def test_refusals_name_the_reason():
    with pytest.raises(ValueError, match=r"overlap='tokensplit' is not a schedule; choose one of \['none', 'token_split', 'seq_split', 'collective_matmul'\]"):
        parallel.check_overlap(models.get("llama").model_class, "tokensplit")
    for schedule in SPLITS:
        for name in sorted(set(models.ZOO) - set(SPLIT_ARCHS)):
            with pytest.raises(ValueError, match=rf"does not take overlap='{schedule}': it takes \['none'\]"):
                parallel.check_overlap(models.get(name).model_class, schedule)
        for name in models.variants():  # the ladder residual schedule runs the sub-blocks itself
            with pytest.raises(ValueError, match=rf"(is not built for residual='ladder'|does not take overlap='{schedule}')"):
                models.get(f"{name}+{schedule}")
    parallel.check_overlap(models.get("scmoe").model_class, "none")
    ladder = models.get("moe_ladder")
    with pytest.raises(ValueError, match=r"overlap='token_split' is not built for residual='ladder'"):
        parallel.set_overlap(ladder.model_class(ladder.tiny()), "token_split")
    model = _llama()
    parallel.set_overlap(model, "token_split")
    ids = torch.randint(0, 256, (1, 6))
    with pytest.raises(ValueError, match=r"needs a batch of at least 2 sequences to split; this one has 1"):
        model(ids, use_cache=False)


def test_the_trainer_refuses_a_schedule_before_building_anything():
    from train.module import CausalLMModule

    with pytest.raises(ValueError, match=r"ZooScMoeForCausalLM does not take overlap='token_split'"):
        CausalLMModule("scmoe", {}, 256, {"lr": 1e-3}, parallel={"overlap": "token_split"})
    with pytest.raises(ValueError, match=r"overlap='token_split' is not built for residual='ladder'"):
        CausalLMModule("moe_ladder", {}, 256, {"lr": 1e-3}, parallel={"overlap": "token_split"})


@pytest.mark.parametrize("schedule", SPLITS)
@pytest.mark.parametrize("fields", [{"capacity_factor": 1.0}, {"moe_dispatch": "padded", "dispatch_capacity_factor": 1.5}])
def test_a_split_moe_with_a_capacity_is_refused(fields, schedule):
    # A capacity is computed from the tokens of one forward: halves would drop other assignments than the batch.
    model = parallel.set_overlap(models.get("moe").model_class(models.get("moe").tiny(**fields)), schedule)
    with pytest.raises(ValueError, match=rf"overlap={schedule} splits the forward in two halves, and this MoE block's capacity"):
        model(torch.randint(0, 256, (2, 6)), use_cache=False)


def _ep2_moe(rank, world_size):
    # Two-batch overlap of the dispatch / combine all-to-alls: the unsharded model's logits, loss (with the balance
    # loss, over the ep group's tokens as unsplit) and gradients, each rank feeding its own sequences.
    mesh = parallel.init_mesh(ep=world_size)
    ids = torch.randint(0, 256, (4 * world_size, 10), generator=torch.Generator().manual_seed(5))
    mine = ids.chunk(world_size)[rank]
    for style, schedule in [("zoo", "token_split"), ("hf", "token_split"), ("zoo", "seq_split"), ("hf", "seq_split")]:
        torch.manual_seed(0)
        config = models.get("moe").tiny_at({"ep": world_size}, **TINY, router_aux_loss_style=style)
        plain = parallel.parallelize(models.get("moe").model_class(config).to(torch.float64), mesh)
        torch.manual_seed(0)
        split = parallel.parallelize(models.get("moe").model_class(config).to(torch.float64), mesh)
        parallel.set_overlap(split, schedule)
        ref_logits, ref_loss, ref_grads = _loss_and_grads(plain.train(), mine)
        logits, loss, grads = _loss_and_grads(split.train(), mine)
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-10)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-10)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_splits_of_the_moe_all_to_alls_under_ep2_are_the_unsplit_model():
    run_ranks(_ep2_moe, 2)


def _compiled_ranks(rank, world_size):
    from tests.test_compile import (
        compiled_generation_equals_eager,
        compiled_training_step_equals_eager,
        sharded_tiny,
    )

    mesh = parallel.init_mesh(tp=world_size)
    model = parallel.set_overlap(sharded_tiny("llama", mesh, "tp", world_size), "token_split")
    ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    counts = compiled_generation_equals_eager(model, ids)  # one graph for every decode step (the static cache's rows written in place)
    assert counts["all_reduce"]["calls"] == 8 * 4 * model.config.num_hidden_layers  # 8 steps, two halves x two sub-blocks
    compiled_training_step_equals_eager(model.train(), torch.cat([ids, ids.flip(0)]), "aot_eager", "token_split")
    parallel.set_overlap(model, "seq_split").zero_grad(set_to_none=True)  # the sequence's chunks: compiled == eager
    compiled_training_step_equals_eager(model, ids, "aot_eager", "seq_split")


def test_splits_compile_fullgraph_for_decode_and_training_at_tp2():
    run_ranks(_compiled_ranks, 2)
