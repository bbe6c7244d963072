"""Kraken's conjunction initialisation (`conjunction_init`, models/kraken/configuration.py): each choice gives
the function its docstring states at init (random: N(0, initializer_range^2) as in the authors' code; mean:
y = LN_f(mean_i s_i); identity: y = LN_f(sum_i s_i)); the choice touches W_conj alone; a checkpoint keeps its
trained W_conj; TP k still equals the one-process model from a non-random W_conj; a bad value is one clear error.
"""

import pytest
import torch

import models
import parallel
from models.kraken import ZooKrakenConfig, ZooKrakenForCausalLM
from tests.distributed import run_ranks

ATOL = 1e-5


def build(seed: int = 0, **overrides) -> ZooKrakenForCausalLM:
    torch.manual_seed(seed)
    return ZooKrakenForCausalLM(models.ZOO["kraken"].tiny(**overrides)).eval()


def conjunction_io(model: ZooKrakenForCausalLM, ids: torch.Tensor):
    """(the conjunction's input concat_i(s_i), the final hidden states y) of one forward."""
    seen = {}
    hook = model.model.conjunction.register_forward_hook(lambda m, args, out: seen.update(x=args[0]))
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state
    hook.remove()
    return seen["x"], hidden


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("how", ["mean", "identity"])
def test_init_gives_the_stated_function(how, k):
    model = build(kraken_degree=k, conjunction_init=how)
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    x, y = conjunction_io(model, ids)
    streams = x.unflatten(-1, (k, model.config.hidden_size))  # [B, T, k, d']
    combined = streams.mean(-2) if how == "mean" else streams.sum(-2)
    torch.testing.assert_close(y, model.model.norm(combined), rtol=0, atol=ATOL)
    assert torch.equal(model.model.conjunction_bias, torch.zeros(model.config.hidden_size))
    if k == 1:  # one stream: the conjunction is the identity
        assert torch.equal(model.model.conjunction.weight, torch.eye(model.config.hidden_size))
    # Not a tautology of the final norm: the streams differ, so a random W_conj gives another y.
    other = build(kraken_degree=k)
    other.model.conjunction.weight.data.normal_(0, 0.02, generator=torch.Generator().manual_seed(3))
    assert not torch.allclose(other(ids).logits, model(ids).logits, atol=1e-3)


def test_random_is_the_default_and_the_authors_init():
    config = models.ZOO["kraken"].tiny()
    assert config.conjunction_init == "random"
    model = build()
    weight = model.model.conjunction.weight
    assert weight.std().item() == pytest.approx(config.initializer_range, rel=0.05)
    assert abs(weight.mean().item()) < 0.002


@pytest.mark.parametrize("how", ["mean", "identity"])
def test_choice_touches_the_conjunction_alone(how):
    base, other = dict(build().named_parameters()), dict(build(conjunction_init=how).named_parameters())
    assert base.keys() == other.keys()
    differ = [n for n in base if not torch.equal(base[n], other[n])]
    assert differ == ["model.conjunction.weight"]


def test_checkpoint_keeps_its_trained_conjunction(tmp_path):
    model = build(conjunction_init="mean")
    with torch.no_grad():
        model.model.conjunction.weight.add_(0.1)  # "trained"
    model.save_pretrained(tmp_path)
    loaded = ZooKrakenForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.conjunction_init == "mean"
    assert torch.equal(loaded.model.conjunction.weight, model.model.conjunction.weight)


@pytest.mark.parametrize("value", ["average", "Random", None, 1])
def test_bad_value_is_one_clear_error(value):
    with pytest.raises(ValueError, match=r"conjunction_init=.* must be one of random, mean, identity"):
        ZooKrakenConfig(vocab_size=64, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                        intermediate_size=16, num_hidden_layers=2, conjunction_init=value)  # fmt: skip


def _check_tp_mean(rank, world_size):
    """TP k == one process from the mean init (logits and the conjunction's gradient slice)."""
    mesh = parallel.init_mesh(tp=world_size)
    reference = build(kraken_degree=world_size, conjunction_init="mean")
    sharded = build(kraken_degree=world_size, conjunction_init="mean")
    parallel.parallelize(sharded, mesh)
    d = sharded.config.hidden_size
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    ref_out, out = reference(ids, labels=ids), sharded(ids, labels=ids)
    ref_out.loss.backward()
    out.loss.backward()
    torch.testing.assert_close(out.logits, ref_out.logits, rtol=0, atol=ATOL)
    expected = reference.model.conjunction.weight.grad[:, rank * d : (rank + 1) * d]
    torch.testing.assert_close(sharded.model.conjunction.weight.grad, expected, rtol=0, atol=ATOL)


def test_tp_parity_from_the_mean_init():
    run_ranks(_check_tp_mean, 2)
