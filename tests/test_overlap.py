"""System-level overlap schedules (parallel/overlap.py) compute what the unsplit model computes: token_split gives
the same logits, loss and gradients in one process (fp64, 1e-10) and under TP 2 the same as the unsharded model
(gloo, fp32, 1e-5); its waits sit where the schedule says (the simulated link's record); architectures that do not
take it, a cached forward and a batch of one are refused with the reason."""

import pytest
import torch

import models
import parallel
from parallel import comm
from tests.distributed import run_ranks

TINY = dict(num_attention_heads=4, num_key_value_heads=2)


def _llama(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return models.get("llama").model_class(models.get("llama").tiny_at({"tp": 2}, **TINY)).to(dtype)


def _loss_and_grads(model, ids):
    model.zero_grad()
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("batch", [2, 3, 4])
def test_token_split_is_the_unsplit_model_in_fp64(batch):
    ids = torch.randint(0, 256, (batch, 10), generator=torch.Generator().manual_seed(1))
    plain, split = _llama(), _llama()
    parallel.set_overlap(split, "token_split")
    assert all(layer.overlap == "token_split" for layer in split.model.layers)
    ref_logits, ref_loss, ref_grads = _loss_and_grads(plain, ids)
    logits, loss, grads = _loss_and_grads(split, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-10)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-10)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    parallel.set_overlap(split, "none")  # back to the architecture's own schedule
    assert all(layer.overlap == "none" for layer in split.model.layers)


def _tp2_token_split(rank, world_size):
    mesh = parallel.init_mesh(tp=world_size)
    ids = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(2))
    reference, sharded = _llama(torch.float32), _llama(torch.float32)
    parallel.parallelize(sharded, mesh)
    parallel.set_overlap(sharded, "token_split")
    ref_logits, ref_loss, ref_grads = _loss_and_grads(reference, ids)
    calls = comm.snapshot_counters().get("all_reduce", {}).get("calls", 0)
    logits, loss, grads = _loss_and_grads(sharded, ids)
    issued = comm.snapshot_counters()["all_reduce"]["calls"] - calls
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-5)
    for name, grad in grads.items():
        ref = ref_grads[name]
        if ref.shape != grad.shape:  # a TP shard: the rank's slice of the full gradient
            (dim,) = [d for d, (a, b) in enumerate(zip(ref.shape, grad.shape, strict=True)) if a != b]
            ref = ref.chunk(world_size, dim=dim)[rank]
        torch.testing.assert_close(grad, ref, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    # Forward: four all-reduces per layer (two sub-blocks x two halves); backward: the column-parallel inputs'
    # gradients, two per half per layer.
    assert issued == 8 * sharded.config.num_hidden_layers


def test_token_split_under_tp2_is_the_unsharded_model():
    run_ranks(_tp2_token_split, 2)


def test_each_half_waits_after_the_other_halfs_sub_block():
    # The simulated link's record of one layer's forward: issue, issue, wait, issue, wait, issue, wait, wait.
    from eval.simulator.training import TrainLayout, record_training

    config = models.get("llama").tiny_at({"tp": 2}, **TINY, num_hidden_layers=1)
    plain = record_training("llama", config, TrainLayout(tp=2, micro_batch=2, seq_len=8), model_flops=False)
    split = record_training("llama", config, TrainLayout(tp=2, micro_batch=2, seq_len=8, overlap="token_split"),
                            model_flops=False)  # fmt: skip

    def calls(run, n):  # the first n issues and waits: the one layer's forward
        return [name for name, _, _ in run.recorder.calls if name in ("issue", "wait")][:n]

    assert calls(plain, 4) == ["issue", "wait", "issue", "wait"]
    assert calls(split, 8) == ["issue", "issue", "wait", "issue", "wait", "issue", "wait", "wait"]


def test_refusals_name_the_reason():
    with pytest.raises(ValueError, match=r"overlap='tokensplit' is not a schedule; choose one of \['none', 'token_split'\]"):
        parallel.check_overlap(models.get("llama").model_class, "tokensplit")
    for name in ("moe", "ladder", "kraken"):
        with pytest.raises(ValueError, match=r"does not take overlap='token_split': it takes \['none'\]"):
            parallel.check_overlap(models.get(name).model_class, "token_split")
    parallel.check_overlap(models.get("moe").model_class, "none")
    model = _llama()
    parallel.set_overlap(model, "token_split")
    ids = torch.randint(0, 256, (1, 6))
    with pytest.raises(ValueError, match=r"needs a batch of at least 2 sequences to split; this one has 1"):
        model(ids, use_cache=False)
    with pytest.raises(ValueError, match=r"a cached forward \(generation\) runs with overlap=none"):
        model(torch.randint(0, 256, (2, 6)), use_cache=True)


def test_the_trainer_refuses_a_schedule_before_building_anything():
    from train.module import CausalLMModule

    with pytest.raises(ValueError, match=r"ZooMoeForCausalLM does not take overlap='token_split'"):
        CausalLMModule("moe", {}, 256, {"lr": 1e-3}, parallel={"overlap": "token_split"})
