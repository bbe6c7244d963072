"""Kraken: the model equals an independent k-stream reference written from the spec; the all-reduce is
issued before attention and waited at the MLP input; TP k on gloo equals the one-process k-stream model
(logits, gradients, cached decode, checkpoints, optimizer state); the comm counters show the schedule;
bad TP degrees and bad configs are one clear error; the parameter matching with llama.

Tolerances: fp32, atol 1e-5 (sums over streams and ranks in different orders differ by a few ulps).
"""

import math
from pathlib import Path

import pytest
import torch
import yaml
from transformers import StaticCache

import models
import parallel
from models.kraken import ZooKrakenConfig, ZooKrakenForCausalLM, match_llama_parameters
from models.llama import ZooLlamaConfig
from parallel import comm
from parallel.state import (
    full_optimizer_state,
    full_state_dict,
    grad_norm,
    load_full_optimizer_state,
    load_full_state_dict,
)
from tests.distributed import run_ranks

ATOL = 1e-5
CONF = Path(__file__).resolve().parents[1] / "conf" / "model"


def build(**overrides) -> ZooKrakenForCausalLM:
    torch.manual_seed(0)
    model = ZooKrakenForCausalLM(models.ZOO["kraken"].tiny(**overrides)).eval()
    # The conjunction bias starts at zero; make it count, so that "added once" is checked.
    with torch.no_grad():
        model.model.conjunction_bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    return model


def spec_reference(model: ZooKrakenForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The spec's forward, stream by stream: s_i = Block_i^0(x0); for l >= 1, S = sum_j s_j,
    a_i = s_i + Attn_i(LN1_i(s_i)), s_i = a_i + MLP_i(LN2_i(a_i - s_i + S)); y = LN_f(W_conj concat + b)."""
    inner, k = model.model, model.config.kraken_degree
    x0 = inner.embed_tokens(ids)
    rope = inner.rotary_emb(x0, torch.arange(ids.shape[1])[None])

    def attn(block, x):
        return block.self_attn(block.input_layernorm(x), rope, None, None)

    def mlp(block, x):
        return block.mlp(block.post_attention_layernorm(x))

    s = []
    for i in range(k):
        block = inner.layers[0].streams[str(i)]
        h = x0 + attn(block, x0)
        s.append(h + mlp(block, h))
    for layer in inner.layers[1:]:
        total = sum(s)
        new = []
        for i in range(k):
            block = layer.streams[str(i)]
            a = s[i] + attn(block, s[i])
            new.append(a + mlp(block, a - s[i] + total))
        s = new
    y = torch.cat(s, dim=-1) @ inner.conjunction.weight.T + inner.conjunction_bias
    return model.lm_head(inner.norm(y))


@pytest.mark.parametrize("overrides", [{}, {"kraken_degree": 1}, {"kraken_degree": 3}, {"num_hidden_layers": 1}])
def test_equals_spec_reference(overrides):
    model = build(**overrides)
    ids = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, spec_reference(model, ids), rtol=0, atol=ATOL)


def test_all_reduce_issued_before_attention_and_waited_at_mlp(monkeypatch):
    """The schedule itself: per layer l >= 1, issue S, run every local stream's attention, wait, MLPs;
    then the conjunction's all-reduce. Layer 0 communicates nothing."""
    model = build()
    events = []

    class LoggedHandle:
        def __init__(self, handle):
            self.handle = handle

        def wait(self):
            events.append("wait")
            return self.handle.wait()

    real_all_reduce = comm.all_reduce

    def all_reduce(x, group):
        events.append("issue")
        return LoggedHandle(real_all_reduce(x, group))

    monkeypatch.setattr(comm, "all_reduce", all_reduce)
    for layer in model.model.layers:
        for block in layer.streams.values():
            block.self_attn.register_forward_hook(lambda *_: events.append("attn"))
            block.mlp.register_forward_hook(lambda *_: events.append("mlp"))
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 5)))
    layer0 = ["attn", "mlp"] * 2
    later = ["issue", "attn", "attn", "wait", "mlp", "mlp"]
    assert events == layer0 + later * (model.config.num_hidden_layers - 1) + ["issue", "wait"]


def test_streams_cache_layers_and_init():
    model = build()
    config = model.config
    k, layers = config.kraken_degree, config.num_hidden_layers
    assert list(model.model.layers[1].streams) == ["0", "1"]
    assert model.model.layers[2].streams["1"].self_attn.layer_idx == 2 * k + 1  # cache layer l * k + i
    with torch.no_grad():
        cache = model(torch.randint(0, 256, (1, 4)), use_cache=True).cache
    assert len(cache.layers) == layers * k
    assert cache.layers[0].keys.shape[1] == config.num_key_value_heads  # per stream
    # Reference init: residual output projections std 0.02 / sqrt(2 L k), everything else 0.02.
    fresh = ZooKrakenForCausalLM(models.ZOO["kraken"].tiny())
    out = torch.cat([p.flatten() for n, p in fresh.named_parameters() if n.endswith(("o_proj.weight", "down_proj.weight"))])
    assert out.std().item() == pytest.approx(0.02 / math.sqrt(2 * layers * k), rel=0.05)
    assert fresh.model.conjunction.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(fresh.model.conjunction_bias, torch.zeros(config.hidden_size))


def test_transformers_static_cache_is_one_clear_error():
    # transformers' StaticCache(config=...) has one layer per model layer; Kraken's own has one per stream.
    model = build()
    cache = StaticCache(config=model.config, max_cache_len=16)
    with pytest.raises(ValueError, match=r"Kraken needs 8 KV-cache layers .* got a StaticCache with 4; use .*static=True"):
        model(torch.randint(0, 256, (1, 4)), cache=cache, use_cache=True)
    assert len(model.model.make_cache(max_cache_len=16, static=True).layers) == 8


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("kraken_degree", 0, r"kraken_degree=0 must be a positive integer"),
        ("intermediate_size", 0, r"intermediate_size=0 \(the MLP width of one stream\) must be positive"),
        ("head_dim", 0, r"head_dim=0 \(per stream\) must be positive"),
        ("num_key_value_heads", 3, r"num_attention_heads=4 is not divisible by num_key_value_heads=3"),
    ],
)
def test_bad_config_is_one_clear_error(field, value, message):
    with pytest.raises(ValueError, match=message):
        models.ZOO["kraken"].tiny(**{field: value})


# --- parameter matching -----------------------------------------------------------------------


def llama_from_conf(vocab_size: int = 8192) -> ZooLlamaConfig:
    """conf/model/llama.yaml with the bundled tokenizer's vocabulary."""
    return ZooLlamaConfig(vocab_size=vocab_size, **yaml.safe_load((CONF / "llama.yaml").read_text())["config"])


def test_match_llama_parameters_on_the_conf_llama():
    llama = llama_from_conf()
    width = match_llama_parameters(llama, 2)
    assert width == 116
    matched = ZooKrakenConfig.from_llama(llama, 2)
    assert (matched.hidden_size, matched.num_attention_heads, matched.num_key_value_heads) == (116, 2, 1)
    assert (matched.head_dim, matched.intermediate_size, matched.kraken_degree) == (58, 160, 2)
    target = llama.num_parameters_formula()
    assert target == 1_787_008 and matched.num_parameters_formula() == 1_747_656
    # No other width on the grid (multiples of 2 x heads per stream) comes closer.
    for other in (width - 4, width + 4):
        count = ZooKrakenConfig.from_llama(llama, 2, hidden_size=other).num_parameters_formula()
        assert abs(count - target) > abs(matched.num_parameters_formula() - target)
    # ... and the model really has that many parameters.
    assert sum(p.numel() for p in ZooKrakenForCausalLM(matched).parameters()) == 1_747_656


def test_conf_kraken_is_the_matched_config():
    kraken = yaml.safe_load((CONF / "kraken.yaml").read_text())
    assert kraken["name"] == "kraken"
    matched = ZooKrakenConfig.from_llama(llama_from_conf(), kraken["config"]["kraken_degree"])
    for field, value in kraken["config"].items():
        if field == "rope_theta":  # transformers keeps it in rope_parameters
            assert matched.rope_parameters["rope_theta"] == value
        else:
            assert getattr(matched, field) == value, field


@pytest.mark.parametrize(
    ("shape", "k", "paper"),
    [("125M", 2, 678), ("125M", 4, 504), ("125M", 6, 418), ("350M", 2, 888), ("350M", 4, 644)],
)
def test_matching_reproduces_the_paper_within_one_width_step(shape, k, paper):
    """GPT-2-shaped Llamas (SwiGLU at 8/3 has GPT-2's MLP parameters): the paper's matched widths, up to
    GPT-2's learned positions and biases, which move them by less than one step of the grid."""
    d, layers, heads = {"125M": (768, 12, 12), "350M": (1024, 24, 16)}[shape]
    llama = ZooLlamaConfig(
        vocab_size=50304, hidden_size=d, intermediate_size=round(8 * d / 3), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, tie_word_embeddings=True,
    )
    step = 2 * (heads // k)
    assert abs(match_llama_parameters(llama, k) - paper) <= step


# --- tensor parallelism ------------------------------------------------------------------------


def test_tp_degree_other_than_k_is_one_clear_error():
    try:
        mesh = parallel.init_mesh(tp=4, fake=True)
        with pytest.raises(
            ValueError,
            match=r"Kraken with kraken_degree=2 runs at TP degree 2 \(rank i holds stream i\), not at TP degree 4; "
            r"TP degrees that fit this model: \[1, 2\]",
        ):
            parallel.parallelize(build(), mesh)
    finally:
        torch.distributed.destroy_process_group()


def adamw(model) -> torch.optim.AdamW:
    """Two param groups, as train.module builds them (a group filters every stream alike)."""
    params = list(model.parameters())
    return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2]}, {"params": [p for p in params if p.ndim < 2]}])


def _check_tp(rank, world_size):
    """TP k == the one-process k-stream model, on every count that matters (one spawn per degree)."""
    mesh = parallel.init_mesh(tp=world_size)
    group = mesh.get_group("tp")
    reference, sharded = build(kraken_degree=world_size), build(kraken_degree=world_size)
    parallel.parallelize(sharded, mesh)
    inner, config = sharded.model, sharded.config
    assert all(list(layer.streams) == [str(rank)] for layer in inner.layers)
    d = config.hidden_size

    # Logits and gradients.
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    ref_out = reference(ids, labels=ids)
    ref_out.loss.backward()
    out = sharded(ids, labels=ids)
    out.loss.backward()
    torch.testing.assert_close(out.logits, ref_out.logits, rtol=0, atol=ATOL)
    ref_params = dict(reference.named_parameters())
    for name, p in sharded.named_parameters():
        expected = ref_params[name].grad  # stream parameters keep their names: stream `rank`'s grads
        if name == "model.conjunction.weight":
            expected = expected[:, rank * d : (rank + 1) * d]
        torch.testing.assert_close(p.grad, expected, rtol=0, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    torch.testing.assert_close(grad_norm(sharded, group), ref_norm, rtol=1e-6, atol=0)

    # Collectives in one forward: L-1 all-reduces of the stream sum and one for the conjunction, each
    # B x T x d' fp32; none with mode=none.
    comm.reset_counters()
    with torch.no_grad():
        sharded(ids[:, :8])
    layers = config.num_hidden_layers
    assert comm.snapshot_counters() == {"all_reduce": {"calls": (layers - 1) + 1, "bytes": layers * 2 * 8 * d * 4}}
    comm.reset_counters()
    with comm.use_mode("none"), torch.no_grad():
        sharded(ids[:, :8])
    assert comm.snapshot_counters() == {}

    # Prefill + cached decode under TP == the full forward; the rank caches its own stream only.
    with torch.no_grad():
        full = reference(ids, use_cache=False).logits
        step = sharded(ids[:, :5], use_cache=True)
        pieces, cache = [step.logits], step.cache
        step = sharded(ids[:, 5:8], cache=cache, use_cache=True)
        pieces.append(step.logits)
        for t in range(8, ids.shape[1]):
            step = sharded(ids[:, t : t + 1], cache=cache, use_cache=True)
            pieces.append(step.logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=ATOL)
    assert len(cache.layers) == layers and cache.get_seq_length() == ids.shape[1]

    # Checkpoints: the gathered state dict is the reference's, names and order included ...
    state = full_state_dict(sharded, group)
    ref_state = reference.state_dict()
    assert list(state) == list(ref_state) and all(torch.equal(state[n], ref_state[n]) for n in state)
    fresh = parallel.parallelize(build(kraken_degree=world_size, initializer_range=0.5), mesh)
    load_full_state_dict(fresh, state, rank, world_size)
    for (n, a), b in zip(fresh.state_dict().items(), sharded.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    # ... and so is the optimizer state, in the unsharded optimizer's numbering, which loads back into
    # each rank's own stream.
    ref_opt, opt = adamw(reference), adamw(sharded)
    ref_opt.step()
    opt.step()
    full_opt, ref_opt_state = full_optimizer_state(sharded, opt, group), ref_opt.state_dict()
    assert [g["params"] for g in full_opt["param_groups"]] == [g["params"] for g in ref_opt_state["param_groups"]]
    assert full_opt["state"].keys() == ref_opt_state["state"].keys()
    for i, entry in ref_opt_state["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(full_opt["state"][i][key], value, rtol=0, atol=ATOL)
    fresh_opt = adamw(fresh)
    load_full_optimizer_state(fresh, fresh_opt, full_opt, rank, world_size)
    for i, entry in opt.state_dict()["state"].items():
        assert all(torch.equal(fresh_opt.state_dict()["state"][i][key], v) for key, v in entry.items())


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_k_equals_one_process_k_streams(tp):
    run_ranks(_check_tp, tp)
