"""Static caches (models.common.cache) for every architecture in `models.ZOO`, on one process.

- A prefill then single-token steps on `make_cache(..., static=True)` equal the full forward (fp32, atol
  1e-5: cached and full attention add in different orders); the fill level is a device tensor.
- HF's fast-generation recipe: `generate(ids, cache_implementation="static")` builds the architecture's own
  static cache and equals the default cache's greedy output, with left padding too; so does the same call
  after `model.forward = torch.compile(model.forward, fullgraph=True)` (aot_eager; every architecture under
  `-m slow`, two in the default run).
- A reset cache serves the next generation from the same buffers (the bench reuses one, as gpt-fast does).

The TP 2 / EP 2 versions (gloo) are in tests/test_compile.py.
"""

import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from models.common.cache import is_static, make_static_causal_mask
from tests.test_models import ARCHS, tiny_model, tokens

ATOL = 1e-5
# The default run compiles one KV-cache and one recurrent-state architecture; -m slow compiles them all.
COMPILED_DEFAULT = ("llama", "linear_hybrid")


def compile_ready(model):
    """The model as a compiled step runs it: the MoE family with its host-sync-free dispatch."""
    if hasattr(model, "set_moe_dispatch"):
        model.set_moe_dispatch("padded")
    return model


@pytest.mark.parametrize("name", ARCHS)
def test_static_decode_equals_full_forward(name):
    model = tiny_model(name).float()
    ids = tokens(2, 7, model.config.vocab_size)
    with torch.no_grad():
        full = model(ids).logits
        cache = model.model.make_cache(batch_size=2, max_cache_len=16, static=True)
        assert is_static(cache)
        steps = [model(ids[:, :4], cache=cache, use_cache=True).logits]
        for i in range(4, 7):
            steps.append(model(ids[:, i : i + 1], cache=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=ATOL)
    counter = cache.layers[0].cumulative_length
    assert isinstance(counter, torch.Tensor) and int(counter) == 7


@pytest.mark.parametrize("name", ARCHS)
def test_generate_with_static_cache_equals_default(name):
    model = tiny_model(name).float()
    ids = tokens(2, 5, model.config.vocab_size)
    padded = torch.ones_like(ids)
    padded[0, :2] = 0  # left padding, as generate expects
    for mask in (None, padded):
        want = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation="static",
            return_dict_in_generate=True,
        )  # fmt: skip
        assert torch.equal(out.sequences, want), name
        assert is_static(out.cache) and type(out.cache) is type(model.model.make_cache(max_cache_len=8, static=True))


def _generate_compiled(name):
    model = compile_ready(tiny_model(name).float())
    ids = tokens(2, 5, model.config.vocab_size)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    model.forward = torch.compile(model.forward, fullgraph=True, backend=counter)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, cache_implementation="static")
    assert torch.equal(out, want), name
    # One graph for the prefill, one for every decode step (generate's growing 2-D mask is a dynamic dim).
    assert counter.frame_count == 2, name


@pytest.mark.parametrize("name", COMPILED_DEFAULT)
def test_generate_static_under_compiled_forward(name):
    _generate_compiled(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(ARCHS) - set(COMPILED_DEFAULT)))
def test_generate_static_under_compiled_forward_every_arch(name):
    _generate_compiled(name)


def test_reset_cache_serves_the_next_generation_in_place():
    model = tiny_model("kraken").float()
    ids = tokens(1, 6, model.config.vocab_size)
    cache = model.model.make_cache(batch_size=1, max_cache_len=8, static=True)
    with torch.no_grad():
        first = model(ids, cache=cache, use_cache=True).logits
        pointers = [layer.keys.data_ptr() for layer in cache.layers]
        cache.reset()
        again = model(ids, cache=cache, use_cache=True).logits
    assert torch.equal(first, again)
    assert [layer.keys.data_ptr() for layer in cache.layers] == pointers


def test_static_mask_sees_each_slot_up_to_its_position_and_not_padding():
    start = torch.tensor(2)
    padding = torch.tensor([[0, 1, 1, 1]])
    mask = make_static_causal_mask(padding, start, 2, 6, torch.device("cpu"), 1)
    assert mask.tolist() == [[[[False, True, True, False, False, False], [False, True, True, True, False, False]]]]
    with pytest.raises(ValueError, match=r"static cache of 6 tokens needs \[batch, cached \+ new tokens\] = \[1, at most 6\]"):
        make_static_causal_mask(torch.ones(1, 7), start, 2, 6, torch.device("cpu"), 1)


def test_static_cache_needs_its_length():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"A static cache needs max_cache_len.*got None"):
        model.model.make_cache(batch_size=1, static=True)
