"""Linear-Llama under tensor parallelism (models/linear/sharding.py), beyond tests/test_tp.py's shared harness
(which runs the tiny `linear` and `linear_hybrid` at TP 2 and 4): a learned decay (sharded by heads), the
ladder residual schedule and a static cache at TP 2 == one device (fp32, atol 1e-5); a model built on the
meta device and sharded there gets its own heads' decay back from `_init_weights`; degrees that do not fit
are one clear error."""

import pytest
import torch

import models
import parallel
from tests.distributed import run_ranks

ATOL = 1e-5
TP4 = dict(num_attention_heads=4, num_key_value_heads=4)
CASES = [
    ("linear", dict(decay="learned", residual="ladder")),
    ("linear_hybrid", dict(decay="retnet", residual="ladder")),
    ("linear_hybrid", dict(decay="learned")),
]


def build(name: str, **overrides):
    torch.manual_seed(0)
    return models.ZOO[name].model_class(models.ZOO[name].tiny(**{**TP4, "chunk_size": 4, **overrides}))


def local_slice(reference: torch.Tensor, local: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    if reference.shape == local.shape:
        return reference
    (dim,) = [d for d, (a, b) in enumerate(zip(reference.shape, local.shape, strict=True)) if a != b]
    return reference.chunk(tp, dim=dim)[rank]


def _check(rank, world_size):
    mesh = parallel.init_mesh(tp=world_size)
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(1))
    for name, overrides in CASES:
        reference, sharded = build(name, **overrides), build(name, **overrides)
        parallel.parallelize(sharded, mesh)
        ref_out = reference(ids, labels=ids, use_cache=False)
        ref_out.loss.backward()
        out = sharded(ids, labels=ids, use_cache=False)
        out.loss.backward()
        torch.testing.assert_close(out.logits, ref_out.logits, rtol=0, atol=ATOL)
        ref_params = dict(reference.named_parameters())
        for pname, p in sharded.named_parameters():
            expected = local_slice(ref_params[pname].grad, p.grad, rank, world_size)
            torch.testing.assert_close(
                p.grad, expected, rtol=0, atol=ATOL, msg=lambda m, n=f"{name} {pname}": f"{n}: {m}"
            )
        attn = sharded.model.layers[0].self_attn
        heads = slice(rank * 2, rank * 2 + 2)
        assert attn.num_heads == 2 and attn.heads() == heads
        torch.testing.assert_close(
            attn.log_decay(), reference.model.layers[0].self_attn.log_decay()[heads], rtol=0, atol=0
        )

        # Prefill then one token at a time on a static cache (states and K/V of this rank's heads).
        with torch.no_grad():
            full = reference.eval()(ids, use_cache=False).logits
            sharded.eval()
            cache = sharded.model.make_cache(batch_size=2, max_cache_len=16, static=True)
            pieces = [sharded(ids[:, :6], cache=cache, use_cache=True).logits]
            for t in range(6, ids.shape[1]):
                pieces.append(sharded(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
        torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=ATOL)
        assert cache.layers[0].state.shape == (2, 2, 16, 16)


def test_learned_decay_ladder_and_static_cache_at_tp2_equal_one_device():
    run_ranks(_check, 2)


@pytest.mark.parametrize("decay", ["lightning", "learned"])
def test_meta_device_build_gets_its_own_heads_decay_back(decay):
    """eval.bench builds on the meta device, shards there, then materialises with `_init_weights`: rank 1's
    decay must be heads 2..3's, not heads 0..1's."""
    reference = build("linear_hybrid", decay=decay)
    try:
        mesh = parallel.init_mesh(tp=2, fake=True, rank=1)
        with torch.device("meta"):
            model = build("linear_hybrid", decay=decay)
        parallel.parallelize(model, mesh)
    finally:
        torch.distributed.destroy_process_group()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.apply(model._init_weights)
    for layer, ref in zip(model.model.layers, reference.model.layers, strict=True):
        if hasattr(ref.self_attn, "g_proj"):
            assert torch.equal(layer.self_attn.log_decay(), ref.self_attn.log_decay()[2:])


@pytest.mark.parametrize(
    ("name", "overrides", "degrees", "message"),
    [
        (
            "linear",
            {},
            {"tp": 3},
            r"TP degree 3 does not divide num_attention_heads=4; TP degrees that fit this model: \[1, 2, 4\]",
        ),
        (
            "linear_hybrid",
            {},
            {"tp": 4},
            r"TP degree 4 does not divide num_key_value_heads=2; .* fit this model: \[1, 2\]",
        ),
        (
            "linear",
            {"intermediate_size": 10},
            {"tp": 4},
            r"TP degree 4 does not divide intermediate_size=10; .*: \[1, 2\]",
        ),
        ("linear", {}, {"tp": 2, "sp": 2}, r"shards over sp or over tp, not both at once \(tp=2 with sp=2\)"),
        ("linear", {}, {"tp": 2, "ep": 2}, r"no expert-parallel layout, so ep=2 does not fit"),
    ],
)
def test_degrees_that_do_not_fit_are_one_clear_error(name, overrides, degrees, message):
    config = models.ZOO[name].tiny(**overrides)
    with pytest.raises(ValueError, match=message):
        models.ZOO[name].check_layout(config, degrees)


def test_a_pure_linear_model_splits_its_heads_whatever_its_kv_heads():
    # Its layers have no KV grouping: num_key_value_heads is a softmax layer's field.
    models.ZOO["linear"].check_layout(models.ZOO["linear"].tiny(), {"tp": 4, "dp": 2})
