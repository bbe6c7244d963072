"""ScMoE (models/scmoe): the shortcut schedule, its equivalences and its expert-parallel layout.

- the overlapped schedule == the serial one (fp64, atol 1e-12: the same operations on the same values), and
  the order in which `_pair` issues and waits the all-to-alls around the dense MLP, the MoE block's attention
  and the shared expert is the documented one;
- with the shortcut fed the block's own stream (`shortcut=False`) and the shared expert silenced, ScMoE ==
  the top-1 `moe` with the same weights (Position 2 and Position 1; fp32 atol 1e-5);
- under expert parallelism, on the ranks of tests/test_ep.py (which checks ep 2, ep 4 and ep 2 x tp 2 == one
  process and the collectives for every ep architecture): the overlapped schedule == the serial one in one
  process, Position 2 and Position 1 (fp32 atol 1e-5; Position 2 in float64 too, atol 1e-10);
- on the simulated link, the overlapped pair exposes less of its all-to-alls than the serial one;
- bad inputs, one clear error each.
"""

import pytest
import torch

import models
import parallel
from parallel import comm
from tests.test_ep import build as build_at
from tests.test_ep import check_equivalence, fake_ep_mesh, ids_of

ATOL = 1e-5


def build(**overrides):
    return build_at("scmoe", {}, **overrides)


# --- the schedule -------------------------------------------------------------------------------------


@pytest.mark.parametrize("position", [2, 1])
def test_overlapped_schedule_equals_serial(position):
    ids = ids_of()
    results = []
    for overlap in (True, False):
        model = build(shortcut_position=position, moe_overlap=overlap, router_aux_loss_coef=0.5).double()
        out = model(ids, labels=ids)
        out.loss.backward()
        results.append((out, {n: p.grad for n, p in model.named_parameters()}))
    (fast, fast_grads), (serial, serial_grads) = results
    torch.testing.assert_close(fast.logits, serial.logits, rtol=0, atol=1e-12)
    torch.testing.assert_close(fast.loss, serial.loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(fast.aux_losses["load_balance"], serial.aux_losses["load_balance"], rtol=0, atol=1e-12)
    for name, grad in fast_grads.items():
        torch.testing.assert_close(grad, serial_grads[name], rtol=0, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def _record_schedule(model, monkeypatch) -> list[str]:
    """Run one forward and return, in order, each all-to-all's issue and wait and the sub-blocks that ran."""
    events = []
    issue = comm.all_to_all

    def logged_all_to_all(*args, **kwargs):
        handle = issue(*args, **kwargs)
        name = "dispatch" if sum(e.startswith("issue") for e in events) % 2 == 0 else "combine"
        events.append(f"issue {name}")
        wait = handle.wait

        def logged_wait():
            events.append(f"wait {name}")
            return wait()

        handle.wait = logged_wait
        return handle

    monkeypatch.setattr(comm, "all_to_all", logged_all_to_all)
    dense, moe = model.model.layers[0], model.model.layers[1]
    for module, name in [
        (dense.self_attn, "Attn_l"),
        (dense.mlp, "MLP_l"),
        (moe.self_attn, "Attn_l+1"),
        (moe.shared_expert, "SE"),
    ]:
        module.register_forward_hook(lambda *_, n=name: events.append(n))
    with torch.no_grad():
        model(ids_of(1, 6))
    return events[:8]  # the first pair (the hooks are on its sub-blocks only)


def test_pair_issues_early_and_waits_late(monkeypatch):
    """The overlapped pair: dispatch issued right after Attn_l and waited after MLP_l; combine issued there
    and waited only after Attn_{l+1} and the shared expert, at the final add."""
    events = _record_schedule(build().eval(), monkeypatch)
    assert events == [
        "Attn_l", "issue dispatch", "MLP_l", "wait dispatch", "issue combine", "Attn_l+1", "SE", "wait combine",
    ]  # fmt: skip


def test_serial_pair_waits_at_once(monkeypatch):
    events = _record_schedule(build(moe_overlap=False).eval(), monkeypatch)
    assert events == [
        "Attn_l", "issue dispatch", "wait dispatch", "issue combine", "wait combine", "MLP_l", "Attn_l+1", "SE",
    ]  # fmt: skip


# --- ScMoE without its shortcut and shared expert is the top-1 moe ---------------------------------------


@pytest.mark.parametrize("position", [2, 1])
def test_current_input_without_shared_expert_equals_top1_moe(position):
    """`shortcut=False` feeds the routed experts the block's own post-attention stream; with the shared
    expert's output projection zeroed, an MoE block is then moe's MoE layer, the shortcut norm in place of
    moe's post-attention norm."""
    torch.manual_seed(0)
    moe = models.ZOO["moe"].model_class(
        models.ZOO["moe"].tiny(num_local_experts=4, num_experts_per_tok=1, moe_layer_freq=position)
    ).train()
    for layer in moe.model.layers:
        if layer.is_moe:
            layer.mlp.router.renormalize = False  # ScMoE's top-1 gate is the softmax probability
    with torch.no_grad():  # norms away from 1, so that a wrong mapping shows
        for name, p in moe.named_parameters():
            if name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
    scmoe = build(shortcut_position=position, shortcut=False)
    state = {}
    for name, value in moe.state_dict().items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if layer is not None and moe.model.layers[int(layer)].is_moe:
            name = name.replace("post_attention_layernorm", "shortcut_layernorm")
        state[name] = value
    missing, unexpected = scmoe.load_state_dict(state, strict=False)
    assert unexpected == []
    assert {n.split(".", 3)[3].split(".")[0] for n in missing} == {
        "shared_expert", "shared_expert_gate", "post_attention_layernorm",
    }  # fmt: skip
    with torch.no_grad():
        for layer in scmoe.model.layers:
            if hasattr(layer, "shared_expert"):
                layer.shared_expert.down_proj.weight.zero_()

    ids = ids_of()
    ref, out = moe(ids, labels=ids), scmoe(ids, labels=ids)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=ATOL)
    torch.testing.assert_close(out.aux_losses["load_balance"], ref.aux_losses["load_balance"], rtol=0, atol=ATOL)
    torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=ATOL)
    # ... and the shortcut does change the function (the test would pass vacuously otherwise).
    scmoe.config.shortcut = True
    assert not torch.allclose(scmoe(ids).logits, ref.logits, atol=1e-3)


def test_balance_loss_only_in_training_mode():
    model = build()
    ids = ids_of()
    out = model(ids, labels=ids)
    assert set(out.aux_losses) == {"load_balance"}
    torch.testing.assert_close(out.loss, out.lm_loss + out.aux_losses["load_balance"])
    assert 0.5 * 0.01 < out.aux_losses["load_balance"].item() < 4 * 0.01  # coef * E sum f P, ~coef balanced
    assert model.eval()(ids, labels=ids).aux_losses == {}


def test_parameter_names_and_layout():
    model = build()
    layers = model.model.layers
    assert type(layers[0]).__name__ == "PreNormDecoderLayer" and type(layers[1]).__name__ == "ScMoeBlock"
    assert all(type(layer).__name__ == "ScMoeBlock" for layer in build(shortcut_position=1).model.layers)
    names = {n for n, _ in model.named_parameters() if n.startswith("model.layers.1.")}
    for part in ("mlp.router.gate.weight", "mlp.experts.gate_proj", "shared_expert.down_proj.weight",
                 "shared_expert_gate.weight", "shortcut_layernorm.weight", "post_attention_layernorm.weight"):  # fmt: skip
        assert f"model.layers.1.{part}" in names


def test_bad_inputs_are_one_clear_error_each():
    entry = models.ZOO["scmoe"]
    with pytest.raises(ValueError, match=r"num_hidden_layers=3 is odd, but shortcut_position=2 builds \(dense, MoE\) pairs; use 2 or 4"):
        entry.tiny(num_hidden_layers=3)
    entry.tiny(num_hidden_layers=3, shortcut_position=1)
    with pytest.raises(ValueError, match=r"shortcut_position=3 must be 1"):
        entry.tiny(shortcut_position=3)
    with pytest.raises(ValueError, match=r"num_experts_per_tok=5 experts per token does not fit 4 experts"):
        entry.tiny(num_experts_per_tok=5)
    with pytest.raises(ValueError, match=r"intermediate_size=100 do not fit grouped_mm"):
        entry.tiny(intermediate_size=100)
    with pytest.raises(ValueError, match=r"shared_expert_intermediate_size=0 must be a positive int"):
        entry.tiny(shared_expert_intermediate_size=0)
    with pytest.raises(ValueError, match=r"EP degree 3 does not divide num_local_experts=4; EP degrees that fit this model: \[1, 2, 4\]"):
        entry.check_layout(entry.tiny(), {"ep": 3})
    with pytest.raises(ValueError, match=r"TP degree 3 does not divide"):
        entry.check_layout(entry.tiny(), {"tp": 3})
    with pytest.raises(ValueError, match=r"has no sequence-parallel layout, so sp=2"):
        entry.check_layout(entry.tiny(), {"sp": 2})


# --- expert parallelism: this model's own checks, run by tests/test_ep.py on its ranks --------------------


def ep_checks(mesh):
    """The overlapped schedule under ep == the serial one in one process (which waits every all-to-all at
    once): Position 2 with a large balance-loss weight, and Position 1."""
    serial = {"moe_overlap": False}
    check_equivalence(mesh, "scmoe", reference_overrides=serial, router_aux_loss_coef=0.5)
    check_equivalence(mesh, "scmoe", reference_overrides=serial, shortcut_position=1)
    # In float64 to 1e-10 (routing and combine follow the model's dtype).
    check_equivalence(
        mesh, "scmoe", reference_overrides=serial, dtype=torch.float64, router_aux_loss_coef=0.5
    )


# --- comm modes on the fake process group ------------------------------------------------------------------


def test_simulated_link_overlapped_schedule_exposes_less():
    """On the simulated link the overlapped pair hides part of each all-to-all behind MLP_l, Attn_{l+1} and
    the shared expert; the serial schedule waits each at once, so all of it is exposed. (Only the direction
    is asserted: compute times are measured.)"""
    exposed = {}
    with fake_ep_mesh(2) as mesh:
        for overlap in (False, True):
            model = parallel.parallelize(build(moe_overlap=overlap).eval(), mesh)
            with comm.use_mode("simulated", link="ethernet-25g") as clock, torch.no_grad():
                model(ids_of(2, 8))  # warm-up
                clock.start()
                model(ids_of(2, 8))
                exposed[overlap] = clock.exposed
                assert clock.comm_busy > 0
    assert exposed[True] < exposed[False]
