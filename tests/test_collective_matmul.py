"""The collective_matmul overlap schedule (parallel/collective_matmul.py) computes what the plain model computes: in
one process (fp64, 1e-10) logits, loss, gradients and a prefill + cached decode; under TP 2 and TP 4 (gloo, fp32,
1e-5) the unsharded model's logits, loss, every parameter's gradient (the replicated norms' and embedding's
included) and cached decode, with selective activation checkpointing too, and no all-reduce in the forward (its
collectives are ring shifts); the simulated link's record shows each shift waited after a matmul issued behind it;
a length that is not a multiple of the TP degree is refused with the length that would fit."""

import pytest
import torch

import models
import parallel
from parallel import comm
from tests.distributed import assert_shard_grads, run_ranks

ARCHS = ["llama", "parallel"]  # the architectures whose `overlap_schedules` list collective_matmul
TINY = dict(num_attention_heads=4, num_key_value_heads=4)


def _model(arch, dtype=torch.float64, degree=2):
    torch.manual_seed(0)
    return models.get(arch).model_class(models.get(arch).tiny_at({"tp": degree}, **TINY)).to(dtype)


def _loss_and_grads(model, ids):
    model.zero_grad()
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_architectures_that_take_it_are_listed():
    takes = [a for a in sorted(models.ZOO) if "collective_matmul" in getattr(models.get(a).model_class, "overlap_schedules", ())]
    assert takes == ARCHS


@pytest.mark.parametrize("arch", ARCHS)
def test_one_process_is_the_plain_model_in_fp64(arch):
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    plain, sharded = _model(arch), parallel.set_overlap(_model(arch), "collective_matmul")
    assert sharded.model.runs_layers_whole  # each layer is called whole: FSDP units and AC regions are the layers
    for got, want in zip(_loss_and_grads(sharded, ids)[:2], _loss_and_grads(plain, ids)[:2], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    grads, ref = _loss_and_grads(sharded, ids)[2], _loss_and_grads(plain, ids)[2]
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref[name], rtol=0, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    with torch.no_grad():  # a sequence-sharded prefill, then decode steps (one token: unsharded) on its cache
        full = plain(ids, use_cache=False).logits
        step = sharded(ids[:, :6], use_cache=True)
        pieces = [step.logits]
        for t in range(6, 10):
            step = sharded(ids[:, t : t + 1], cache=step.cache, use_cache=True)
            pieces.append(step.logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-10)


def _tp(rank, world_size):
    from train.activation_checkpointing import apply_activation_checkpointing

    mesh = parallel.init_mesh(tp=world_size)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    for arch, ac in [("llama", "none"), ("parallel", "none"), ("llama", "selective")]:
        reference, sharded = _model(arch, torch.float32, world_size), _model(arch, torch.float32, world_size)
        parallel.parallelize(sharded, mesh)
        parallel.set_overlap(sharded, "collective_matmul")
        apply_activation_checkpointing(sharded, ac)
        ref_logits, ref_loss, ref_grads = _loss_and_grads(reference, ids)
        comm.reset_counters()
        with torch.no_grad():
            sharded(ids, use_cache=False)
        assert "all_reduce" not in comm.snapshot_counters(), arch  # the forward's collectives are ring shifts
        assert comm.snapshot_counters()["send_recv"]["calls"] > 0
        logits, loss, grads = _loss_and_grads(sharded, ids)
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-5)
        assert_shard_grads(grads, ref_grads, rank, world_size, 1e-5, f"{arch} {ac} ")
        with torch.no_grad():  # sharded prefill, then cached decode on the static cache, against the full forward
            full = reference(ids, use_cache=False).logits
            step = sharded(ids[:, :8], cache=sharded.model.make_cache(2, 16, static=True), use_cache=True)
            pieces = [step.logits]
            for t in range(8, ids.shape[1]):
                step = sharded(ids[:, t : t + 1], cache=step.cache, use_cache=True)
                pieces.append(step.logits)
        torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-5, msg=f"{arch} decode")


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_is_the_unsharded_model(world_size):
    run_ranks(_tp, world_size)


def test_the_ring_shifts_are_hidden_on_the_simulated_link():
    # One training micro-batch at TP 4 on the simulated link: its collectives are ring shifts, and part of their
    # link time runs behind the chunks' matmuls.
    from eval.simulator.device import DeviceModel, get_device
    from eval.simulator.training import TrainLayout, record_training

    config = models.get("llama").tiny_at({"tp": 4}, **TINY, num_hidden_layers=1)
    run = record_training("llama", config, TrainLayout(tp=4, micro_batch=1, seq_len=64, overlap="collective_matmul"),
                          model_flops=False)  # fmt: skip
    # Forward: 3 shifts for each sub-block's gather and scatter and the exit's gather (the entry's scatter keeps a
    # chunk); backward as many (the entry's gradient gathered, the exit's kept). The one all-reduce per norm
    # sums its weight's gradient over the ranks' chunks.
    assert run.counts["send_recv"]["calls"] == 2 * 3 * (4 + 1)
    assert run.counts["all_reduce"]["calls"] == 2
    assert run.predict(DeviceModel(get_device("h100-sxm")), link="nvlink-h100")["overlapped_s"] > 0


def _refuses_a_length_that_does_not_divide(rank, world_size):
    mesh = parallel.init_mesh(tp=world_size)
    model = parallel.set_overlap(parallel.parallelize(_model("llama", torch.float32), mesh), "collective_matmul")
    with pytest.raises(ValueError, match=r"this forward has 7 tokens, not a multiple of 2: pad the input to 8 tokens"):
        model(torch.zeros(1, 7, dtype=torch.long))


def test_a_length_that_does_not_divide_is_refused():
    run_ranks(_refuses_a_length_that_does_not_divide, 2)


def _compiled(rank, world_size):
    from tests.test_compile import (
        compiled_generation_equals_eager,
        compiled_training_step_equals_eager,
        sharded_tiny,
    )

    mesh = parallel.init_mesh(tp=world_size)
    model = parallel.set_overlap(sharded_tiny("llama", mesh, "tp", world_size), "collective_matmul")
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))  # 6: a multiple of the TP degree
    compiled_generation_equals_eager(model, ids)  # the prefill sequence-sharded, each decode step plain TP
    # The training step: the ring's shifts (send_recv, traced as all-to-alls) and the norms' gradient all-reduces.
    counts = compiled_training_step_equals_eager(model.train(), ids, "aot_eager", "collective_matmul",
                                                 traced_as={"send_recv": "all_to_all"})  # fmt: skip
    assert counts["send_recv"]["calls"] > 0 and "all_to_all" not in counts


def test_compiles_fullgraph_for_decode_and_training_at_tp2():
    run_ranks(_compiled, 2)
