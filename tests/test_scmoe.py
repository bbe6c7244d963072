"""ScMoE (models/scmoe): the shortcut schedule, its equivalences and its expert-parallel layout.

- the overlapped schedule == the serial one (fp64, atol 1e-12: the same operations on the same values), and
  the order in which `_pair` issues and waits the all-to-alls around the dense MLP, the MoE block's attention
  and the shared expert is the documented one;
- with the shortcut fed the block's own stream (`shortcut=False`) and the shared expert silenced, ScMoE ==
  the top-1 `moe` with the same weights (Position 2 and Position 1; fp32 atol 1e-5);
- on gloo: ep 2 == one process on the concatenated batch (logits, loss with the balance loss, every gradient
  after parallel.grad_sync; fp32 atol 1e-5), real collectives counted against the entry's declaration;
  ep 2 x tp 2 (slow);
- `simulated` mode on the fake process group: 2 all-to-alls and one count exchange per MoE block;
- bad inputs, one clear error each.
"""

import pytest
import torch

import models
import parallel
from parallel import comm
from parallel.layout import shard_specs
from tests.distributed import run_ranks

ATOL = 1e-5


def build(**overrides):
    torch.manual_seed(0)
    return models.ZOO["scmoe"].model_class(models.ZOO["scmoe"].tiny(**overrides)).train()


def ids_of(batch=2, seq=10, seed=1):
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


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


# --- expert parallelism on gloo --------------------------------------------------------------------------


def local_part(reference: torch.Tensor, specs) -> torch.Tensor:
    for spec in specs:
        reference = reference.chunk(spec.size, dim=spec.tensor_dim)[spec.rank]
    return reference


def _check_model_equivalence(mesh, batch_per_rank: int = 2, seq: int = 10, **overrides):
    """The sharded model on this rank's rows of a global batch == the one-process model on all of it."""
    from parallel.grad_sync import sync_gradients

    ep, ep_rank = mesh["ep"].size(), mesh.get_local_rank("ep")
    ids = ids_of(ep * batch_per_rank, seq, seed=7)
    rows = slice(ep_rank * batch_per_rank, (ep_rank + 1) * batch_per_rank)
    # The reference waits every all-to-all at once; the sharded model overlaps them.
    reference, sharded = build(moe_overlap=False, **overrides), build(**overrides)
    parallel.parallelize(sharded, mesh)

    ref_out = reference(ids, labels=ids)
    ref_out.loss.backward()
    out = sharded(ids[rows], labels=ids[rows])
    out.loss.backward()
    sync_gradients(sharded, mesh)

    torch.testing.assert_close(out.logits, ref_out.logits[rows], rtol=0, atol=ATOL)
    torch.testing.assert_close(out.aux_losses["load_balance"], ref_out.aux_losses["load_balance"], rtol=0, atol=ATOL)
    mean_loss = comm.all_reduce(out.loss.detach(), mesh.get_group("ep")).wait() / ep
    torch.testing.assert_close(mean_loss, ref_out.loss, rtol=0, atol=ATOL)
    specs = shard_specs(sharded)
    assert {s.mesh_dim for n in specs for s in specs[n] if ".experts." in n} == {"ep"}
    ref_params = dict(reference.named_parameters())
    for name, p in sharded.named_parameters():
        expected = local_part(ref_params[name].grad, specs.get(name, ()))
        torch.testing.assert_close(p.grad, expected, rtol=0, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


def _count_one_forward(mesh):
    """Real collectives of one eval forward == what models/scmoe/entry.py declares."""
    ep = mesh["ep"].size()
    model = parallel.parallelize(build().eval(), mesh)
    declared = models.ZOO["scmoe"].collectives_per_forward(model.config, {"ep": ep})
    comm.reset_counters()
    with torch.no_grad():
        model(ids_of(2, 8))
    counts = comm.snapshot_counters()
    assert set(counts) == set(declared) == {"all_to_all", "exchange_splits"}
    for kind, expected in declared.items():
        assert counts[kind]["calls"] == expected.calls, kind
    assert counts["all_to_all"]["calls"] == 2 * model.config.num_moe_layers
    # The dispatch sends T k rows; the combine sends back what the rank received (T k on average).
    sent = comm.all_reduce(torch.tensor(counts["all_to_all"]["bytes"]), mesh.get_group("ep")).wait()
    assert sent == ep * declared["all_to_all"].values_per_token * 2 * 8 * 4  # fp32


def _ep2_ranks(rank, world_size):
    mesh = parallel.init_mesh(ep=world_size)
    # A large balance-loss weight, so that a wrong scale of its gradient under ep is far above atol.
    _check_model_equivalence(mesh, router_aux_loss_coef=0.5)
    _check_model_equivalence(mesh, shortcut_position=1)
    _count_one_forward(mesh)


def test_ep2_equals_one_process():
    run_ranks(_ep2_ranks, 2)


def _ep2_tp2_ranks(rank, world_size):
    _check_model_equivalence(parallel.init_mesh(ep=2, tp=2), num_attention_heads=4, num_key_value_heads=4)


@pytest.mark.slow
def test_ep2_x_tp2_equals_one_process():
    run_ranks(_ep2_tp2_ranks, 4)


# --- comm modes on the fake process group ------------------------------------------------------------------


@pytest.fixture
def fake_ep2():
    try:
        yield parallel.init_mesh(ep=2, fake=True)
    finally:
        torch.distributed.destroy_process_group()


def test_simulated_mode_counts_two_all_to_alls_per_moe_block(fake_ep2):
    model = parallel.parallelize(build().eval(), fake_ep2)
    assert model.model.layers[1].mlp.experts.gate_proj.shape[0] == 2  # rank 0 of 2 keeps experts 0, 1
    declared = models.ZOO["scmoe"].collectives_per_forward(model.config, {"ep": 2})
    comm.reset_counters()
    with comm.use_mode("simulated", link="pcie4") as clock, torch.no_grad():
        clock.start()
        assert model(ids_of(2, 8)).logits.shape == (2, 8, 256)
        assert clock.comm_busy > 0
    counts = comm.snapshot_counters()
    assert counts["all_to_all"]["calls"] == declared["all_to_all"].calls == 2 * model.config.num_moe_layers
    assert counts["exchange_splits"]["calls"] == declared["exchange_splits"].calls == model.config.num_moe_layers
    assert counts["all_to_all"]["bytes"] == declared["all_to_all"].values_per_token * 16 * 4
    comm.reset_counters()
    with comm.use_mode("none"), torch.no_grad():
        model(ids_of(2, 8))
    assert comm.snapshot_counters() == {}  # `none` skips (and so does not count) every collective


def test_simulated_link_overlapped_schedule_exposes_less(fake_ep2):
    """On the simulated link the overlapped pair hides part of each all-to-all behind MLP_l, Attn_{l+1} and
    the shared expert; the serial schedule waits each at once, so all of it is exposed. (Only the direction
    is asserted: compute times are measured.)"""
    exposed = {}
    for overlap in (False, True):
        model = parallel.parallelize(build(moe_overlap=overlap).eval(), fake_ep2)
        with comm.use_mode("simulated", link="ethernet-25g") as clock, torch.no_grad():
            model(ids_of(2, 8))  # warm-up
            clock.start()
            model(ids_of(2, 8))
            exposed[overlap] = clock.exposed
            assert clock.comm_busy > 0
    assert exposed[True] < exposed[False]
