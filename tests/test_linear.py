"""Linear-Llama (models/linear): the kernels against their references, the model's causality and O(1)
decoding, the decays, the sequence-parallel hook's contract, and bad inputs.

Tolerances: kernels in fp64 to 1e-10 (the same sums in different orders); model-level parity in fp64 to
1e-10 (fixed decays exact in float64 models, fp32-rounded below); causality is bit-identical (outputs
before a changed token are the same bits).
"""

import pytest
import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache

import models
from models.linear import modeling as linear_modeling
from models.linear.modeling import (
    LinearAttention,
    LinearCache,
    SoftmaxAttention,
    alibi_slopes,
    fixed_log_decay,
    learned_decay_init,
)
from models.linear.ops import (
    fla_available,
    linear_attention,
    linear_attention_chunked,
    linear_attention_fla,
    linear_attention_quadratic,
    linear_attention_recurrent,
)

TOL = dict(rtol=0, atol=1e-10)
DECAYS = ("none", "lightning", "retnet", "learned")


def qkv(b=2, h=3, t=37, d_k=8, d_v=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q, k = (F.silu(torch.randn(b, h, t, d_k, generator=g, dtype=dtype)) for _ in range(2))
    v = torch.randn(b, h, t, d_v, generator=g, dtype=dtype)
    return q, k, v


def log_decay_of(decay: str, h: int = 3) -> torch.Tensor | None:
    if decay == "none":
        return None
    if decay == "learned":  # any values in (-inf, 0): strong decays too
        return F.logsigmoid(torch.randn(h, generator=torch.Generator().manual_seed(5), dtype=torch.float64))
    return fixed_log_decay(decay, h, layer_idx=1, num_layers=4)


def tiny(name: str = "linear", **overrides):
    torch.manual_seed(0)
    entry = models.ZOO[name]
    return entry.model_class(entry.tiny(**overrides)).eval()


def ids_of(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


# --- kernels against the references


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("t", [1, 16, 37])  # one token, a chunk multiple, a ragged last chunk
def test_chunked_equals_recurrent_equals_quadratic(decay, t):
    q, k, v = qkv(t=t)
    log_decay = log_decay_of(decay)
    reference = linear_attention_quadratic(q, k, v, log_decay)
    o_rec, s_rec = linear_attention_recurrent(q, k, v, log_decay)
    o_chunk, s_chunk = linear_attention_chunked(q, k, v, log_decay, chunk_size=8)
    torch.testing.assert_close(o_rec, reference, **TOL)
    torch.testing.assert_close(o_chunk, reference, **TOL)
    torch.testing.assert_close(s_chunk, s_rec, **TOL)
    # The final state is the definition's: sum_j lambda^(T-1-j) k_j^T v_j.
    steps = torch.arange(t - 1, -1, -1, dtype=torch.float64)
    weights = (
        torch.ones(3, t, dtype=torch.float64) if log_decay is None else torch.exp(log_decay[:, None] * steps)
    )
    torch.testing.assert_close(s_rec, torch.einsum("ht,bhtk,bhtv->bhkv", weights, k, v), **TOL)


@pytest.mark.parametrize("decay", DECAYS)
def test_initial_state_continues_the_sequence(decay):
    """Running the second part from the first part's state == running the whole, for both kernels."""
    q, k, v = qkv(t=45)
    log_decay = log_decay_of(decay)
    full = linear_attention_quadratic(q, k, v, log_decay)
    cut = 19
    for kernel in (linear_attention_recurrent, linear_attention_chunked):
        head, state = kernel(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], log_decay)
        tail, _ = kernel(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], log_decay, initial_state=state)
        torch.testing.assert_close(torch.cat([head, tail], dim=2), full, **TOL)
    # A random initial state: chunked (any chunk size) == recurrent.
    state = torch.randn(2, 3, 8, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    o_rec, s_rec = linear_attention_recurrent(q, k, v, log_decay, initial_state=state)
    for chunk_size in (1, 7, 64):
        o, s = linear_attention_chunked(q, k, v, log_decay, chunk_size=chunk_size, initial_state=state)
        torch.testing.assert_close(o, o_rec, **TOL)
        torch.testing.assert_close(s, s_rec, **TOL)


def test_chunked_gradients_equal_the_references():
    """The training path's backward (autograd through the chunks) == the definition's, decay included."""
    q, k, v = qkv(t=29)
    logits = torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    grads = []
    for run in (
        lambda *a: linear_attention_quadratic(*a),
        lambda *a: linear_attention_chunked(*a, chunk_size=8)[0],
    ):
        inputs = [x.clone().requires_grad_() for x in (q, k, v, logits)]
        out = run(*inputs[:3], F.logsigmoid(inputs[3]))
        out.pow(2).sum().backward()
        grads.append([x.grad for x in inputs])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_half_precision_inputs_keep_an_fp32_state():
    q, k, v = (x.to(torch.bfloat16) for x in qkv(t=20, dtype=torch.float32))
    o, state = linear_attention(q, k, v, log_decay_of("retnet").float())
    assert o.dtype == torch.bfloat16 and state.dtype == torch.float32


@pytest.mark.skipif(
    not (torch.cuda.is_available() and fla_available()),
    reason="needs a CUDA GPU and fla-core (pip install 'overlap-zoo[gpu]'); the CPU path is the chunked kernel",
)
@pytest.mark.parametrize("decay", DECAYS)
def test_fla_kernel_equals_the_chunked_path(decay):
    q, k, v = (x.float().cuda() for x in qkv(b=2, h=4, t=300, d_k=64, d_v=64))
    log_decay = log_decay_of(decay, h=4)
    log_decay = None if log_decay is None else log_decay.float().cuda()
    if decay == "learned":
        log_decay.requires_grad_()
    state = torch.randn(2, 4, 64, 64, device="cuda")
    o_fla, s_fla = linear_attention_fla(q, k, v, log_decay, initial_state=state)
    o_ref, s_ref = linear_attention_chunked(q.double(), k.double(), v.double(), log_decay, 64, state.double())
    torch.testing.assert_close(o_fla.double(), o_ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(s_fla.double(), s_ref, rtol=1e-3, atol=1e-3)
    if decay == "learned":  # the learned decay gets a gradient through fla's gate
        o_fla.sum().backward()
        assert log_decay.grad is not None and torch.isfinite(log_decay.grad).all()


# --- the decays


def test_decay_values_follow_the_papers():
    # RetNet: gamma_h = 1 - 2^(-5-h).
    torch.testing.assert_close(
        fixed_log_decay("retnet", 4, 0, 4).exp(), 1 - 2.0 ** -torch.arange(5, 9, dtype=torch.float64), **TOL
    )
    # ALiBi slopes: 2^(-8(h+1)/H) for H = 8; for H = 6 those of 4, then every other of 8's.
    assert alibi_slopes(8) == [2 ** -(h + 1) for h in range(8)]
    assert alibi_slopes(6) == [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]
    # Lightning: slopes scaled from (1 + 1e-5) in the first layer to 1e-5 in the last.
    first, last = fixed_log_decay("lightning", 8, 0, 5), fixed_log_decay("lightning", 8, 4, 5)
    torch.testing.assert_close(first, -torch.tensor(alibi_slopes(8), dtype=torch.float64) * (1 + 1e-5))
    torch.testing.assert_close(last, -torch.tensor(alibi_slopes(8), dtype=torch.float64) * 1e-5)
    # Learned: starts at RetNet's values.
    torch.testing.assert_close(F.logsigmoid(learned_decay_init(4)), fixed_log_decay("retnet", 4, 0, 4))


@pytest.mark.parametrize("decay", ["lightning", "retnet"])
def test_fixed_decay_is_exact_in_float64_and_fp32_rounded_below(decay, tmp_path):
    """A fixed decay is its fp64 value in a float64 model and rounded once to fp32 (not to the model's
    dtype) in bf16 / fp16 / fp32 ones, after model.to(dtype) and after a reload on the meta device too; a
    float64 layer's mixing then equals the definition with the exact decay to 1e-10, which the fp32-rounded
    decay misses."""
    model = tiny(decay=decay)
    attn = model.model.layers[1].self_attn
    exact = fixed_log_decay(decay, attn.num_heads, 1, attn.num_layers)
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        model.to(dtype)
        expected = exact if dtype == torch.float64 else exact.float()
        assert torch.equal(attn.log_decay(dtype), expected), dtype
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert torch.equal(loaded.model.layers[1].self_attn.log_decay(torch.bfloat16), exact.float())
    model.double()
    q, k, v = qkv(h=attn.num_heads, t=37, d_k=attn.head_dim, d_v=attn.head_dim)
    o = attn.mix(q, k, v)
    torch.testing.assert_close(o, linear_attention_quadratic(q, k, v, exact), **TOL)
    rounded = linear_attention_quadratic(q, k, v, exact.float().double())
    assert not torch.allclose(o, rounded, rtol=0, atol=1e-10)  # the fp32-rounded decay is outside it


def test_learned_decay_trains_and_reloads(tmp_path):
    model = tiny(decay="learned").train()
    logits = [layer.self_attn.decay_logits for layer in model.model.layers]
    before = [p.detach().clone() for p in logits]
    ids = ids_of(2, 24)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(ids, labels=ids).loss.backward()
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, logits, strict=True))
    model.eval().save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


# --- the model


def test_layer_pattern_builds_the_layers():
    model = tiny("linear", layer_pattern="LLNLL", num_hidden_layers=5)
    kinds = "".join(
        "L" if isinstance(layer.self_attn, LinearAttention) else "N" for layer in model.model.layers
    )
    assert kinds == "LLNLL"
    assert isinstance(model.model.layers[2].self_attn, SoftmaxAttention)
    assert model.model.rotary_emb is not None  # the softmax layers need RoPE
    assert tiny("linear").model.rotary_emb is None  # a pure linear model has no positions
    # Llama's names, plus the gate and the norm.
    names = {
        name.split("self_attn.")[1]
        for name, _ in model.model.layers[0].named_parameters()
        if "self_attn" in name
    }
    assert names == {f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "o_norm")}


CASES = [("linear", decay) for decay in DECAYS] + [("linear_hybrid", "lightning"), ("linear_hybrid", "none")]


@pytest.mark.parametrize(
    ("name", "decay"), [("linear", "none"), ("linear", "learned"), ("linear_hybrid", "lightning")]
)
def test_perturbing_a_token_leaves_earlier_outputs_bit_identical(name, decay):
    """The test that catches a leak of future tokens inside a chunk (the public LASP-2 code's masked
    variant): token j changes, every output before j keeps its bits, in every chunk position."""
    model = tiny(name, decay=decay, chunk_size=8)
    ids = ids_of(1, 30)
    with torch.no_grad():
        base = model(ids).logits
        for j in (3, 8, 13, 29):  # inside the first chunk, a chunk start, mid-chunk, the last token
            changed = ids.clone()
            changed[0, j] = (ids[0, j] + 1) % 256
            out = model(changed).logits
            assert torch.equal(out[:, :j], base[:, :j]), j
            assert not torch.allclose(out[:, j], base[:, j])


@pytest.mark.parametrize(("name", "decay"), CASES)
def test_cached_decode_equals_full_forward(name, decay):
    """Prefill, a multi-token chunk on the cache, then one token at a time == one full forward (fp64)."""
    model = tiny(name, decay=decay, chunk_size=8).double()
    ids = ids_of(2, 27)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :11], use_cache=True)
        cache, pieces = out.cache, [out.logits]
        assert isinstance(cache, LinearCache)
        pieces.append(model(ids[:, 11:20], cache=cache).logits)
        for t in range(20, 27):
            pieces.append(model(ids[:, t : t + 1], cache=cache).logits)
        assert cache.get_seq_length() == 27
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, **TOL)


def cache_bytes(cache) -> int:
    tensors = [getattr(layer, name, None) for layer in cache.layers for name in ("state", "keys", "values")]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def test_decode_memory_does_not_grow_with_tokens():
    model = tiny("linear")
    config = model.config
    with torch.no_grad():
        short = model(ids_of(2, 4), use_cache=True).cache
        long = model(ids_of(2, 100), use_cache=True).cache
        for t in range(5):
            model(ids_of(2, 1, seed=t), cache=long)
    assert long.get_seq_length() == 105
    # One fp32 d_k x d_v state per (row, head, layer), however many tokens went in.
    state = 2 * config.num_attention_heads * config.head_dim**2 * 4
    assert cache_bytes(short) == cache_bytes(long) == config.num_hidden_layers * state
    # The hybrid's KV caches grow, in its softmax layers only.
    hybrid = tiny("linear_hybrid")
    with torch.no_grad():
        a, b = (hybrid(ids_of(2, n), use_cache=True).cache for n in (4, 100))
    kv = [i for i, layer in enumerate(a.layers) if not hasattr(layer, "state")]
    assert kv == [3]
    assert b.layers[3].keys.shape[2] == 100 and a.layers[0].state.shape == b.layers[0].state.shape


@pytest.mark.parametrize("name", ["linear", "linear_hybrid"])
def test_generate_greedy_sampled_and_beams(name):
    model = tiny(name)
    prompt = ids_of(2, 5)
    greedy = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    seq = prompt
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(greedy, seq)
    # Beam search reorders the cache rows (LinearStateLayer.reorder_cache); sampling repeats them.
    beams = model.generate(
        prompt, max_new_tokens=4, num_beams=3, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    sampled = model.generate(
        prompt, max_new_tokens=4, do_sample=True, num_return_sequences=2, pad_token_id=0, eos_token_id=None
    )
    assert beams.shape == (2, 9) and sampled.shape == (4, 9)


class PrefixStates(LinearCache):
    """The linear model's counterpart of tests/test_trunk.py's PrefixKV: the chunk starts from the states
    (and, in softmax layers, the keys and values) of the tokens before it, which do not count as cached,
    so the chunk's place comes from `seq_offset` alone."""

    def __init__(self, prefix: LinearCache, config):
        super().__init__(config)
        self.prefix = prefix

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_state(self, layer_idx):
        return self.prefix.get_state(layer_idx)

    def update_state(self, state, num_tokens, layer_idx):
        pass

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        before = self.prefix.layers[layer_idx]
        return torch.cat([before.keys, key_states], -2), torch.cat([before.values, value_states], -2)


@pytest.mark.parametrize("name", ["linear", "linear_hybrid"])
def test_chunk_with_seq_offset_and_prefix_states_equals_full_forward(name):
    model = tiny(name, chunk_size=4).double()
    ids, half = ids_of(2, 16), 9
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        prefix = model(ids[:, :half], use_cache=True).cache
        chunk = model(ids[:, half:], cache=PrefixStates(prefix, model.config), seq_offset=half).logits
    torch.testing.assert_close(chunk, full[:, half:], **TOL)


@pytest.mark.parametrize("name", ["linear", "linear_hybrid"])
def test_left_padding_drops_the_padded_keys(name):
    """Padded tokens add nothing to the state: a left-padded row decodes as the unpadded row, cache included."""
    model = tiny(name, decay="retnet").double()
    ids, pad = ids_of(1, 10), 4
    padded = torch.cat([torch.full((1, pad), 7), ids], dim=1)
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(ids)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    nxt = ids_of(1, 1, seed=9)
    with torch.no_grad():
        ref = model(ids, use_cache=True)
        ref_next = model(nxt, cache=ref.cache).logits
        out = model(padded, attention_mask=mask, position_ids=positions, use_cache=True)
        out_next = model(
            nxt,
            cache=out.cache,
            attention_mask=torch.cat([mask, torch.ones(1, 1, dtype=torch.long)], 1),
            position_ids=torch.tensor([[10]]),
        ).logits
    torch.testing.assert_close(out.logits[:, pad:], ref.logits, **TOL)
    torch.testing.assert_close(out_next, ref_next, **TOL)


# --- the sequence-parallel hook (parallel/sequence.py provides the real functions)


def test_sequence_parallel_hook_calls_the_configured_functions(monkeypatch):
    """With `sp_group` set, each attention module hands its q, k, v to parallel.sequence with its
    `sp_method`. A stand-in group of one rank, whose functions are the unsharded computations, must give
    the unsharded forward: the arguments are in the documented layout and already feature-mapped, scaled
    and (softmax layers) roped, and `intra` is the layer's own kernel."""
    calls = []

    def linear_attention(q, k, v, group, log_decay=None, *, method, intra):
        calls.append(("linear", method, q.shape, None if log_decay is None else log_decay.shape, group))
        return intra(q, k, v, log_decay)

    def softmax_attention(q, k, v, group, attention_mask=None, scale=None, *, method):
        calls.append(("softmax", method, q.shape, k.shape, group))
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, is_causal=True, enable_gqa=True
        )

    # The modeling module's names for parallel.sequence's functions, replaced by the stand-ins.
    monkeypatch.setattr(linear_modeling, "sp_linear_attention", linear_attention)
    monkeypatch.setattr(linear_modeling, "sp_softmax_attention", softmax_attention)
    monkeypatch.setattr(linear_modeling, "chunk_offset", lambda group, q_len: calls.append(("offset", group, q_len)) or 0)
    model = tiny("linear_hybrid", sp_method="lasp1").double()
    ids = ids_of(2, 12)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        model.model.sp_group = "group"
        for layer in model.model.layers:
            layer.self_attn.sp_group = "group"
        got = model(ids, use_cache=False).logits
        with pytest.raises(ValueError, match="decoding runs on one device"):
            model(ids, use_cache=True)
    torch.testing.assert_close(got, expected, **TOL)
    h, kv, hd = 4, 2, 16
    assert calls[0] == ("offset", "group", 12)
    assert [c[:2] for c in calls[1:5]] == [("linear", "lasp1")] * 3 + [("softmax", "lasp1")]
    assert calls[1] == ("linear", "lasp1", (2, h, 12, hd), (h,), "group")
    assert calls[4] == ("softmax", "lasp1", (2, h, 12, hd), (2, kv, 12, hd), "group")


# --- bad inputs: one clear error each


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"layer_pattern": "LLXN"},
            r"layer_pattern='LLXN' must be .* letters L .* and N .*\['X'\] are neither",
        ),
        ({"layer_pattern": "llln"}, r"layer_pattern='llln' must be .*\['l', 'n'\] are neither"),
        ({"layer_pattern": ""}, r"layer_pattern='' must be a non-empty string"),
        (
            {"layer_pattern": "LLN"},  # over 4 layers it would silently be L L N L
            r"layer_pattern='LLN' \(3 letters\) does not repeat a whole number of times over num_hidden_layers=4: "
            r"it would give 'LLNL'; .* a pattern of \[1, 2, 4\] letters",
        ),
        (
            {"layer_pattern": "LLLLN"},
            r"layer_pattern='LLLLN' has 5 letters but the model has num_hidden_layers=4",
        ),
        (
            {"decay": "alibi"},
            r"decay='alibi' is not a linear-attention decay; use one of \('none', 'lightning'",
        ),
        (
            {"sp_method": "ulysses"},
            r"sp_method='ulysses' is not .*; use one of \('lasp2', 'lasp1'\) \(LASP-2",
        ),
        ({"chunk_size": 0}, r"chunk_size=0 must be a positive integer"),
    ],
)
def test_bad_config_is_one_clear_error(fields, message):
    with pytest.raises(ValueError, match=message):
        models.ZOO["linear"].tiny(**fields)


def test_bad_field_assigned_after_construction_is_caught_when_building():
    config = models.ZOO["linear"].tiny()
    config.layer_pattern = "LQ"
    with pytest.raises(ValueError, match=r"layer_pattern='LQ'"):
        models.ZOO["linear"].model_class(config)


def test_a_kv_cache_is_one_clear_error():
    model = tiny("linear")
    with pytest.raises(TypeError, match=r"needs its own cache \(LinearCache.*not a DynamicCache"):
        model(ids_of(1, 4), cache=DynamicCache())
