"""The trunk's hooks (models/common/causal_lm.py): rotary, cache, sequence offset, auxiliary losses.

Each hook is exercised through a toy subclass of a zoo architecture, the way a new architecture uses it.
Tolerances: fp32, atol 1e-5 where equivalent op orders differ (cached vs full attention); exact equality
where the same ops run on the same data.
"""

import ast
from pathlib import Path

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

import models
from models.common import RotaryEmbedding, make_causal_mask
from models.llama.modeling import ZooLlamaForCausalLM, ZooLlamaModel

ARCHS = sorted(models.ZOO)
ATOL = 1e-5
REPO = Path(__file__).resolve().parents[1]


def tiny(cls=ZooLlamaForCausalLM, name: str = "llama", **overrides):
    torch.manual_seed(0)
    return cls(models.ZOO[name].tiny(**overrides)).eval()


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


# --- rotary: optional, of the model's chosen dimension


class NoRopeModel(ZooLlamaModel):
    def make_rotary(self, config):
        return None


class NoRopeForCausalLM(ZooLlamaForCausalLM):
    base_model_class = NoRopeModel


def test_model_without_rotary_runs_and_is_causal():
    model = tiny(NoRopeForCausalLM)
    assert model.model.rotary_emb is None
    seen = []
    model.model.layers[0].register_forward_pre_hook(lambda _, args: seen.append(args[1]))
    ids = tokens(1, 12)
    changed = ids.clone()
    changed[0, 7] = (ids[0, 7] + 1) % 256
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
        # Cached decode == full forward without positions too.
        out = model(ids[:, :5], use_cache=True)
        pieces = [out.logits, model(ids[:, 5:], cache=out.cache).logits]
    assert seen[0] is None  # the layers get position_embeddings=None
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=0)
    assert not torch.allclose(a[:, 7:], b[:, 7:], atol=1e-4)
    torch.testing.assert_close(torch.cat(pieces, 1), a, rtol=0, atol=ATOL)
    # Without positions, attention is order-blind: a loss of information the rotary model does not have.
    assert not torch.allclose(a, tiny()(ids).logits, atol=1e-4)


class HalfRopeModel(ZooLlamaModel):
    """Ropes half of each head's dims (as GQLA ropes only a decoupled key's d_r dims); its layers would
    apply it to those dims, so this toy records what they would get and skips them."""

    def make_rotary(self, config):
        return RotaryEmbedding(config.rope_parameters, config.head_dim // 2)

    def run_layers(self, hidden_states, position_embeddings, attention_mask, cache):
        self.seen = position_embeddings
        return hidden_states


def test_rotary_dimension_is_the_models_choice():
    model = tiny(HalfRopeModel)
    head_dim = model.config.head_dim
    with torch.no_grad():
        model(tokens(1, 5))
    cos, sin = model.seen
    assert cos.shape == sin.shape == (1, 5, head_dim // 2)
    # The buffer is rebuilt at its own dimension after meta-device loading (`_init_weights`).
    inv_freq = model.rotary_emb.inv_freq.clone()
    model.rotary_emb.inv_freq.zero_()
    model._init_weights(model.rotary_emb)
    assert torch.equal(model.rotary_emb.inv_freq, inv_freq) and inv_freq.numel() == head_dim // 4


# --- sequence offset: positions and the causal mask of a chunk that does not start the sequence


class PrefixKV(DynamicCache):
    """Stands in for a sequence-parallel attention's gathered K/V: the chunk attends to the keys and values
    of the tokens before it (taken from `prefix`, a cache of them), put before its own; nothing counts
    as cached (the trunk sees past_len = 0), so the chunk's place comes from `seq_offset` alone."""

    def __init__(self, prefix: DynamicCache):
        super().__init__()
        self.prefix = prefix

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        before = self.prefix.layers[layer_idx]
        return torch.cat([before.keys, key_states], -2), torch.cat([before.values, value_states], -2)


@pytest.mark.parametrize("name", ARCHS)
def test_chunk_with_seq_offset_equals_full_forward(name):
    model = tiny(models.ZOO[name].model_class, name)
    ids, half = tokens(2, 16), 9
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        prefix = model(ids[:, :half], use_cache=True).cache
        if not all(isinstance(layer, DynamicLayer) for layer in prefix.layers):
            pytest.skip(
                f"{name} caches recurrent states, which PrefixKV cannot stand in for; its own tests bring the "
                "preceding tokens in as a state (tests/test_linear.py)."
            )
        chunk = model(ids[:, half:], cache=PrefixKV(prefix), seq_offset=half).logits
        # Padding: the mask then covers the preceding tokens' keys too.
        mask = torch.ones(2, 16, dtype=torch.long)
        padded = model(ids[:, half:], cache=PrefixKV(prefix), seq_offset=half, attention_mask=mask).logits
    torch.testing.assert_close(chunk, full[:, half:], rtol=0, atol=ATOL)
    torch.testing.assert_close(padded, full[:, half:], rtol=0, atol=ATOL)


def test_seq_offset_shifts_positions_and_mask():
    model = tiny(ZooLlamaModel)
    seen = []
    model.layers[0].register_forward_pre_hook(lambda _, args: seen.append(args[1:3]))
    x = tokens(1, 4)
    with torch.no_grad():
        prefix = model(tokens(1, 6, seed=2), use_cache=True).cache
        seen.clear()
        model(x, seq_offset=6, cache=PrefixKV(prefix))
    (cos, sin), mask = seen[0]
    expected = model.rotary_emb(model.embed_tokens(x), torch.arange(6, 10)[None])
    assert torch.equal(cos, expected[0]) and torch.equal(sin, expected[1])
    # The offset mask is the last rows of the whole sequence's causal mask, the same as a cached prefix's.
    full = torch.ones(10, 10).tril().bool()
    assert torch.equal(mask[0, 0], full[6:])
    assert torch.equal(
        make_causal_mask(None, 4, 0, x.device, q_offset=6), make_causal_mask(None, 4, 6, x.device)
    )
    assert torch.equal(make_causal_mask(None, 4, 2, x.device, q_offset=4)[0, 0], full[6:])
    # A padding mask covers cached + preceding + new tokens.
    with pytest.raises(
        ValueError,
        match=r"needs \(1, 12\): \[batch, cached \+ preceding \(seq_offset\) \+ new tokens\] = \[1, 2 \+ 6 \+ 4\]",
    ):
        make_causal_mask(torch.ones(1, 6), 4, 2, x.device, q_offset=6)


class ShiftedModel(ZooLlamaModel):
    """A layout's offset: every forward is the chunk after 3 tokens (the `sequence_offset` hook)."""

    def sequence_offset(self, q_len):
        return 3


@pytest.mark.parametrize("offset", [-1, 1.5, True])
def test_bad_seq_offset_is_one_clear_error(offset):
    with pytest.raises(ValueError, match=rf"seq_offset={offset!r} must be a non-negative int"):
        tiny()(tokens(1, 4), seq_offset=offset)


def test_sequence_offset_hook_is_the_default_offset():
    model = tiny(ShiftedModel)
    seen = []
    model.layers[0].register_forward_pre_hook(lambda _, args: seen.append(args[1][0]))
    x, before = tokens(1, 4), tokens(1, 5, seed=2)
    with torch.no_grad():
        prefix_3 = model(before[:, :3], use_cache=True, seq_offset=0).cache
        prefix_5 = model(before, use_cache=True, seq_offset=0).cache
        seen.clear()
        model(x, cache=PrefixKV(prefix_3))
        model(x, cache=PrefixKV(prefix_5), seq_offset=5)  # the argument wins
    emb = model.embed_tokens(x)
    assert torch.equal(seen[0], model.rotary_emb(emb, torch.arange(3, 7)[None])[0])
    assert torch.equal(seen[1], model.rotary_emb(emb, torch.arange(5, 9)[None])[0])


# --- auxiliary losses


class AuxModel(ZooLlamaModel):
    def run_layers(self, hidden_states, position_embeddings, attention_mask, cache):
        hidden_states = super().run_layers(hidden_states, position_embeddings, attention_mask, cache)
        return hidden_states, {
            "toy": 0.5 * hidden_states.pow(2).mean(),
            "other": hidden_states.new_tensor(0.25),
        }


class AuxForCausalLM(ZooLlamaForCausalLM):
    base_model_class = AuxModel


def test_aux_losses_are_added_to_the_loss_and_reported():
    model = tiny(AuxForCausalLM)
    plain = tiny()  # same seed: same weights
    ids = tokens(2, 8)
    out = model(ids, labels=ids)
    ref = plain(ids, labels=ids)
    assert set(out.aux_losses) == {"toy", "other"}
    torch.testing.assert_close(out.lm_loss, ref.loss, rtol=0, atol=0)
    torch.testing.assert_close(out.loss, out.lm_loss + out.aux_losses["toy"] + 0.25, rtol=0, atol=0)
    # The aux loss trains the model too: the gradients differ from the plain model's by its gradient.
    out.loss.backward()
    ref.loss.backward()
    grad, plain_grad = (
        model.model.layers[0].mlp.down_proj.weight.grad,
        plain.model.layers[0].mlp.down_proj.weight.grad,
    )
    assert not torch.allclose(grad, plain_grad, atol=1e-6)
    # Without labels: no loss, the aux losses are still reported; the plain model reports none.
    with torch.no_grad():
        out = model(ids)
    assert out.loss is None and out.lm_loss is None and set(out.aux_losses) == {"toy", "other"}
    assert ref.aux_losses == {} and torch.equal(ref.loss, ref.lm_loss)


# --- the cache hook: forward and generate() make their caches through it


class RecordingCache(DynamicCache):
    """A cache of the model's own kind (here: a DynamicCache that counts its updates)."""

    def __init__(self, config):
        super().__init__(config=config)
        self.updates = 0

    def update(self, *args, **kwargs):
        self.updates += 1
        return super().update(*args, **kwargs)


class OwnCacheModel(ZooLlamaModel):
    def make_cache(self, batch_size=None, max_cache_len=None):
        self.requests = [*getattr(self, "requests", []), (batch_size, max_cache_len)]
        return RecordingCache(self.config)

    def run_layers(self, hidden_states, position_embeddings, attention_mask, cache):
        self.seen = [*getattr(self, "seen", []), cache]
        return super().run_layers(hidden_states, position_embeddings, attention_mask, cache)


class OwnCacheForCausalLM(ZooLlamaForCausalLM):
    base_model_class = OwnCacheModel


def test_forward_makes_its_cache_with_the_hook():
    model = tiny(OwnCacheForCausalLM)
    with torch.no_grad():
        out = model(tokens(3, 5), use_cache=True)
        assert model(tokens(3, 5), use_cache=False).cache is None
    assert type(out.cache) is RecordingCache and out.cache.updates == model.config.num_hidden_layers
    assert model.model.requests == [(3, None)]


def test_generate_uses_the_cache_hook():
    model = tiny(OwnCacheForCausalLM)
    prompt = tokens(2, 5)
    out = model.generate(
        prompt, max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True
    )
    # One cache, from the hook, for the whole generation: prefill and three decode steps.
    assert model.model.requests == [(2, 5 + 4 - 1)]
    assert len(model.model.seen) == 4 and all(c is out.cache for c in model.model.seen)
    assert type(out.cache) is RecordingCache and out.cache.updates == 4 * model.config.num_hidden_layers
    # Same tokens as the plain model's generate (transformers' own default cache).
    expected = tiny().generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(out.sequences, expected)
    # A cache passed by the caller is used as is; the hook is not asked.
    model.model.requests = []
    mine = DynamicCache(config=model.config)
    model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0, cache=mine)
    assert model.model.requests == [] and mine.get_seq_length() == 5 + 1


def test_kraken_cache_hook_makes_a_cache_layer_per_stream():
    model = tiny(models.ZOO["kraken"].model_class, "kraken")
    layers, k = model.config.num_hidden_layers, model.config.kraken_degree
    assert len(model.model.make_cache().layers) == layers * k
    out = model.generate(
        tokens(1, 4), max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True
    )
    assert len(out.cache.layers) == layers * k and out.cache.get_seq_length() == 4 + 2


# --- the shared decoder block


def test_siblings_do_not_import_llama_modeling():
    """Architectures build from models/common; only a config may still extend Llama's."""
    for path in sorted((REPO / "models").glob("*/modeling.py")):
        if path.parent.name == "llama":
            continue
        tree = ast.parse(path.read_text())
        imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not [m for m in imported if m.startswith("models.llama")], path
