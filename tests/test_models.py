"""The shared model harness: every architecture in `models.ZOO` passes the same checks.

Tolerances: fp32 comparisons use atol 1e-5 (different but equivalent op orders, e.g. cached vs full
attention, differ by a few ulps); exact equality is required where the same ops run on the same data.
"""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

import models
from train.data import load_tokenizer

ARCHS = sorted(models.ZOO) + models.variants()  # the ladder variants through their registry entries
ATOL = 1e-5


def tiny_model(name: str, **overrides):
    torch.manual_seed(0)
    model = models.get(name).model_class(models.get(name).tiny(**overrides))
    return model.eval()


def tokens(batch: int, length: int, vocab: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


@pytest.mark.parametrize("name", ARCHS)
def test_registered_with_auto_classes(name):
    entry = models.get(name)
    config = entry.tiny()
    assert isinstance(AutoConfig.for_model(config.model_type), entry.config_class)
    assert type(AutoModelForCausalLM.from_config(config)) is entry.model_class


@pytest.mark.parametrize("name", ARCHS)
def test_parameter_count_matches_config_formula(name):
    for tie in (False, True):
        model = tiny_model(name, tie_word_embeddings=tie)
        counted = sum(p.numel() for p in model.parameters())  # tied weights are counted once
        assert counted == model.config.num_parameters_formula()


# Loads every checkpoint named on the command line in one fresh process (that imported nothing but `models`),
# runs it on the saved ids, and records what it saw; one architecture's failure does not hide the others'.
FRESH_LOAD = """\
import json, sys, traceback
import torch, models
from transformers import AutoModelForCausalLM
root, report = sys.argv[1], {}
for name in sys.argv[2:]:
    try:
        m = AutoModelForCausalLM.from_pretrained(root + '/' + name).eval()
        with torch.no_grad():
            torch.save(m(torch.load(root + '/' + name + '.ids.pt')).logits, root + '/' + name + '.logits.pt')
        report[name] = {'class': type(m).__name__}
    except Exception:
        report[name] = {'error': traceback.format_exc()}
open(root + '/report.json', 'w').write(json.dumps(report))
"""


@pytest.fixture(scope="module")
def fresh_process_loads(tmp_path_factory):
    """Every architecture's tiny model saved with save_pretrained, then loaded in one fresh process: starting
    an interpreter that imports the zoo costs more than all the loads together."""
    root = tmp_path_factory.mktemp("fresh_load")
    saved = {}
    for name in ARCHS:
        saved[name] = tiny_model(name)
        saved[name].save_pretrained(root / name)
        torch.save(tokens(2, 12, saved[name].config.vocab_size), root / f"{name}.ids.pt")
    subprocess.run([sys.executable, "-c", FRESH_LOAD, str(root), *ARCHS], capture_output=True, text=True, check=True)
    return root, saved, json.loads((root / "report.json").read_text())


@pytest.mark.parametrize("name", ARCHS)
def test_save_load_round_trip_in_fresh_process(name, fresh_process_loads):
    root, saved, report = fresh_process_loads
    model = saved[name]
    assert "error" not in report[name], report[name]["error"]
    assert report[name]["class"] == type(model).__name__
    with torch.no_grad():
        expected = model(torch.load(root / f"{name}.ids.pt")).logits
    assert torch.equal(torch.load(root / f"{name}.logits.pt"), expected)
    saved_config = json.loads((root / name / "config.json").read_text())
    assert saved_config["model_type"] == model.config.model_type


class ScriptedTokens(LogitsProcessor):
    """Makes greedy decoding emit `script[t]` at new-token step t, whatever the model says."""

    def __init__(self, script: list[int], prompt_len: int):
        self.script, self.prompt_len = script, prompt_len

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.script[input_ids.shape[1] - self.prompt_len]] = 0.0
        return forced


@pytest.mark.parametrize("name", ARCHS)
def test_save_checkpoint_uses_tokenizer_special_tokens(name, tmp_path):
    """config.json and generation_config.json carry the tokenizer's bos / eos / pad, and generate() with
    the saved generation config stops at the tokenizer's eos (not at Llama's default eos id 2)."""
    tokenizer = load_tokenizer()  # the bundled one: bos = eos = 0, pad = 1
    models.save_checkpoint(tiny_model(name), tokenizer, tmp_path)
    want = {key: getattr(tokenizer, key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    for file in ("config.json", "generation_config.json"):
        saved = json.loads((tmp_path / file).read_text())
        assert {key: saved.get(key) for key in want} == want, file

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    prompt = tokens(1, 4, loaded.config.vocab_size)
    eos, old_default_eos = tokenizer.eos_token_id, 2
    # The script passes through the old default eos before the tokenizer's eos, then would go on.
    script = [5, old_default_eos, 7, eos, 9, 9, 9, 9]
    scripted = LogitsProcessorList([ScriptedTokens(script, prompt.shape[1])])
    out = loaded.generate(prompt, max_new_tokens=len(script), do_sample=False, logits_processor=scripted)
    assert out[0, prompt.shape[1] :].tolist() == script[:4]
    # Sanity of the test itself: with eos id 2 (the Llama default) generation would stop one step after 5.
    out = loaded.generate(
        prompt,
        max_new_tokens=len(script),
        do_sample=False,
        logits_processor=scripted,
        eos_token_id=old_default_eos,
    )
    assert out[0, prompt.shape[1] :].tolist() == script[:2]


@pytest.mark.parametrize("name", ARCHS)
def test_cached_decode_equals_full_forward(name):
    model = tiny_model(name)
    ids = tokens(2, 16, model.config.vocab_size)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        # Prefill 5 tokens, then a chunk of 4 (cached prefix + several new tokens), then one at a time.
        out = model(ids[:, :5], use_cache=True)
        pieces, cache = [out.logits], out.cache
        out = model(ids[:, 5:9], cache=cache, use_cache=True)
        pieces.append(out.logits)
        for t in range(9, ids.shape[1]):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", ARCHS)
def test_causality(name):
    model = tiny_model(name)
    ids = tokens(1, 16, model.config.vocab_size)
    j = 9
    changed = ids.clone()
    changed[0, j] = (ids[0, j] + 1) % model.config.vocab_size
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :j], b[:, :j], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, j:], b[:, j:], atol=1e-4), "changing token j must change logits at j"


@pytest.mark.parametrize("name", ARCHS)
def test_generate_with_cache_equals_greedy_loop_without_cache(name):
    model = tiny_model(name)
    prompt = tokens(2, 6, model.config.vocab_size)
    new = 10
    generated = model.generate(
        prompt, max_new_tokens=new, do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None
    )
    seq = prompt
    with torch.no_grad():
        for _ in range(new):
            next_token = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, next_token], dim=1)
    assert torch.equal(generated, seq)


@pytest.mark.parametrize("name", ARCHS)
def test_left_padding_matches_unpadded(name):
    """A left-padded row with matching position_ids gives the same logits as the unpadded row."""
    model = tiny_model(name)
    ids = tokens(1, 10, model.config.vocab_size)
    pad = 3
    padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(ids)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = model(ids).logits
        out = model(padded, attention_mask=mask, position_ids=positions).logits
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, pad:], ref, rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", ARCHS)
def test_training_step_reduces_loss(name):
    model = tiny_model(name).train()
    ids = tokens(4, 32, model.config.vocab_size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_unknown_architecture_is_one_clear_error():
    with pytest.raises(ValueError, match=r"Unknown architecture 'lama'; the zoo has: .*llama"):
        models.build_model("lama")


def test_heads_not_divisible_by_kv_heads_is_one_clear_error():
    with pytest.raises(ValueError, match=r"num_attention_heads=4 is not divisible by num_key_value_heads=3.*\[1, 2, 4\]"):
        models.ZOO["llama"].tiny(num_key_value_heads=3)


def test_checkpoint_with_wrong_shapes_is_one_clear_error(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"does not fit .*intermediate|does not fit .*mlp\.\w+_proj\.weight has shape"):
        AutoModelForCausalLM.from_pretrained(tmp_path, intermediate_size=96)
