"""Shard layouts and unsharded state: the role registry (an architecture's own role is applied, an
unknown role is one clear error naming the known ones), the (mesh dimension, tensor dimension) recorded
for every sharded parameter, `check_layout` errors naming the degrees that fit, Lightning's mesh names,
and checkpoints gathered at TP 2 that re-slice at TP 4 and load at TP 1 (Kraken included: k = 2 runs
at TP 2 and 1 only).

Single-process checks use PyTorch's fake process group (sharding happens, no collective runs); the
state round trip spawns gloo ranks. Tolerances: fp32, atol 1e-5 where ranks sum in another order,
exact where a state is only sliced and gathered.
"""

import contextlib

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import models
import parallel
from models.llama.sharding import PLAN as LLAMA_PLAN
from parallel.layout import ROLES, register_role, shard_specs
from parallel.state import (
    full_optimizer_state,
    full_state_dict,
    grad_norm,
    load_full_optimizer_state,
    load_full_state_dict,
)
from tests.distributed import run_ranks

ATOL = 1e-5
ARCHS = ("kraken", "ladder", "llama", "parallel")
# Shapes every TP degree up to 4 divides.
TP4 = dict(num_attention_heads=4, num_key_value_heads=4)


def build(name: str, **overrides):
    torch.manual_seed(0)
    streams = {"kraken_degree": 2} if name == "kraken" else {}
    return models.ZOO[name].model_class(models.ZOO[name].tiny(**TP4, **streams, **overrides)).eval()


@contextlib.contextmanager
def fake_mesh(tp: int):
    try:
        yield parallel.init_mesh(tp=tp, fake=True)
    finally:
        torch.distributed.destroy_process_group()


@register_role("test_mark")
def mark(name, module, dim):
    """A role as an architecture would register one in its sharding.py."""
    module.marked = (name, dim.name, dim.rank, dim.size)


# --- roles -------------------------------------------------------------------------------------------


def test_architecture_registered_role_is_applied():
    assert ROLES["streams"].__module__ == "models.kraken.sharding"  # Kraken's own, registered by its layout
    model = build("llama")
    model.shard_plan = {"tp": {**LLAMA_PLAN["tp"], "model.norm": "test_mark"}}
    with fake_mesh(2) as mesh:
        parallel.parallelize(model, mesh)
    assert model.model.norm.marked == ("model.norm", "tp", 0, 2)


def test_unknown_role_is_one_clear_error_before_anything_is_sharded():
    model = build("llama")
    model.shard_plan = {"tp": {**LLAMA_PLAN["tp"], "model.norm": "no_such_role"}}
    with (
        fake_mesh(2) as mesh,
        pytest.raises(
            ValueError,
            match=r"Unknown shard role 'no_such_role' for 'model.norm' in the tp plan of ZooLlamaForCausalLM; "
            r"known roles: attention, colwise, .*streams, swiglu, test_mark",
        ),
    ):
        parallel.parallelize(model, mesh)
    assert model.model.layers[0].self_attn.q_proj.weight.shape[0] == 4 * model.config.head_dim
    assert shard_specs(model) == {}


# --- what is recorded --------------------------------------------------------------------------------


def test_llama_at_tp2_records_mesh_dim_and_tensor_dim_of_every_sharded_parameter():
    # Built on the meta device and materialised after sharding, as eval.bench does: `to_empty` replaces
    # every Parameter object, the records (on the modules) must survive it, and a load_state_dict.
    with torch.device("meta"):
        model = build("llama")
    with fake_mesh(2) as mesh:
        parallel.parallelize(model, mesh)
    model.to_empty(device="cpu")
    model.load_state_dict(model.state_dict())
    expected = {}
    for i in range(model.config.num_hidden_layers):
        for proj, tensor_dim in [("q_proj", 0), ("k_proj", 0), ("v_proj", 0), ("o_proj", 1)]:
            expected[f"model.layers.{i}.self_attn.{proj}.weight"] = [("tp", tensor_dim, 0, 2)]
        for proj, tensor_dim in [("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)]:
            expected[f"model.layers.{i}.mlp.{proj}.weight"] = [("tp", tensor_dim, 0, 2)]
    recorded = {
        n: [(s.mesh_dim, s.tensor_dim, s.rank, s.size) for s in specs]
        for n, specs in shard_specs(model).items()
    }
    assert recorded == expected  # embedding, norms and LM head replicated: no record
    assert model.tp_degree == 2 and model.model.layers[0].tp_group is not None


def test_kraken_streams_are_owned_whole():
    with fake_mesh(2) as mesh:
        model = parallel.parallelize(build("kraken"), mesh)
    specs = shard_specs(model)
    stream_params = [n for n, _ in model.named_parameters() if ".streams." in n]
    assert stream_params and all(n.split(".streams.")[1].startswith("0.") for n in stream_params)
    assert all([(s.mesh_dim, s.tensor_dim) for s in specs[n]] == [("tp", None)] for n in stream_params)
    assert [(s.mesh_dim, s.tensor_dim) for s in specs["model.conjunction.weight"]] == [("tp", 1)]


def test_lightning_mesh_names_map_to_ours():
    """train.module calls `parallelize(model, device_mesh, dim="tensor_parallel")` on Lightning's mesh."""
    model = build("llama")
    with fake_mesh(2):
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
        parallel.parallelize(model, mesh, dim="tensor_parallel")
    assert model.tp_degree == 2
    assert {s.mesh_dim for specs in shard_specs(model).values() for s in specs} == {"tp"}


# --- check_layout ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "parallel", "ladder"])
def test_check_layout_names_the_degrees_that_fit(name):
    model = models.ZOO[name].model_class(models.ZOO[name].tiny())  # 4 heads, 2 KV heads, MLP 176
    model.check_layout({"dp": 8, "tp": 2})
    with pytest.raises(
        ValueError,
        match=r"TP degree 3 does not divide num_attention_heads=4; TP degrees that fit this model: \[1, 2\]\.",
    ):
        model.check_layout({"dp": 1, "tp": 3})
    with pytest.raises(ValueError, match=r"sp=2 does not fit; SP degrees that fit this model: \[1\]"):
        model.check_layout({"sp": 2, "tp": 1})


def test_kraken_check_layout_names_k():
    model = build("kraken")
    model.check_layout({"tp": 2})
    with pytest.raises(ValueError, match=r"not at TP degree 4; TP degrees that fit this model: \[1, 2\]"):
        model.check_layout({"tp": 4})


# --- state round trip: gathered at TP 2, re-sliced at TP 4, loaded at TP 1 ---------------------------


def adamw(model) -> torch.optim.AdamW:
    """Two param groups, as train.module builds them."""
    params = list(model.parameters())
    return torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2]}, {"params": [p for p in params if p.ndim < 2]}]
    )


def ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))


def _save_at_tp2(rank, world_size, path):
    mesh = parallel.init_mesh(tp=world_size)
    saved = {}
    for name in ARCHS:
        model = parallel.parallelize(build(name), mesh)
        out = model(ids(), labels=ids())
        out.loss.backward()
        # New signatures: every group comes from the recorded specs. The model state is taken before the
        # optimizer step (so it is exactly the unsharded init), the optimizer state after it. (Cloned: like
        # `state_dict()`, it shares storage with the replicated parameters, which the step updates.)
        state = {n: t.clone() for n, t in full_state_dict(model).items()}
        opt = adamw(model)
        opt.step()
        saved[name] = {
            "state": state,
            "optimizer": full_optimizer_state(model, opt),
            "logits": out.logits.detach(),
            "grad_norm": grad_norm(model),
        }
    if rank == 0:
        torch.save(saved, path)


def _reslice_at_tp4(rank, world_size, path):
    mesh = parallel.init_mesh(tp=world_size)
    saved = torch.load(path, weights_only=False)
    for name in ARCHS:
        if name == "kraken":  # k = 2: runs at TP 2 (or 1) only
            continue
        model = parallel.parallelize(build(name, initializer_range=0.5), mesh)
        load_full_state_dict(model, saved[name]["state"])
        opt = adamw(model)
        load_full_optimizer_state(model, opt, saved[name]["optimizer"])
        # Slicing then gathering is exact: the same full state comes back ...
        state = full_state_dict(model)
        assert list(state) == list(saved[name]["state"])
        assert all(torch.equal(state[n], saved[name]["state"][n]) for n in state), name
        full_opt = full_optimizer_state(model, opt)
        assert full_opt["param_groups"] == saved[name]["optimizer"]["param_groups"]
        for i, entry in saved[name]["optimizer"]["state"].items():
            assert all(torch.equal(full_opt["state"][i][k], v) for k, v in entry.items()), (name, i)
        # ... and it is the same model: the TP-4 forward gives the TP-2 logits.
        with torch.no_grad():
            torch.testing.assert_close(model(ids()).logits, saved[name]["logits"], rtol=0, atol=ATOL)


def test_state_gathered_at_tp2_reslices_at_tp4_and_loads_at_tp1(tmp_path):
    path = str(tmp_path / "tp2.pt")
    run_ranks(_save_at_tp2, 2, path)
    saved = torch.load(path, weights_only=False)

    # TP 1: the gathered state is the unsharded model's (optimizer numbering included), and loads as is.
    for name in ARCHS:
        reference = build(name)
        state, ref_state = saved[name]["state"], reference.state_dict()
        assert list(state) == list(ref_state) and all(torch.equal(state[n], ref_state[n]) for n in state), (
            name
        )
        out = reference(ids(), labels=ids())
        out.loss.backward()
        torch.testing.assert_close(saved[name]["logits"], out.logits, rtol=0, atol=ATOL)
        ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
        torch.testing.assert_close(saved[name]["grad_norm"], ref_norm, rtol=1e-6, atol=0)
        ref_opt = adamw(reference)
        ref_opt.step()
        ref_opt_state, full_opt = ref_opt.state_dict(), saved[name]["optimizer"]
        assert full_opt["param_groups"] == ref_opt_state["param_groups"], name
        assert full_opt["state"].keys() == ref_opt_state["state"].keys(), name
        for i, entry in ref_opt_state["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(full_opt["state"][i][key], value, rtol=0, atol=ATOL)
        fresh = build(name, initializer_range=0.5)
        load_full_state_dict(fresh, state)
        fresh_opt = adamw(fresh)
        load_full_optimizer_state(fresh, fresh_opt, full_opt)
        assert all(torch.equal(a, state[n]) for n, a in fresh.state_dict().items())
        assert fresh_opt.state_dict()["state"].keys() == full_opt["state"].keys()

    run_ranks(_reslice_at_tp4, 4, path)
