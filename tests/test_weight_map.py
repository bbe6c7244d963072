"""models/weight_map.py: rules that rename and reshape a state dict, and their one-line errors."""

import pytest
import torch

from models.weight_map import Rule, check_mapped, chunks, concat, map_weights, stack_copies

MLP = "model.layers.{layer}.mlp."
FUSE = Rule((MLP + "gate_proj", MLP + "up_proj"), MLP + "gate_up_proj", concat(dim=1))
UNFUSE = Rule(MLP + "gate_up_proj", (MLP + "gate_proj", MLP + "up_proj"), chunks(2, dim=1))


def zoo_state(layers: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {"model.embed_tokens.weight": torch.randn(8, 4, generator=g)}
    for i in range(layers):
        state[f"model.layers.{i}.mlp.router.weight"] = torch.randn(3, 4, generator=g)
        state[f"model.layers.{i}.mlp.gate_proj"] = torch.randn(3, 5, 4, generator=g)
        state[f"model.layers.{i}.mlp.up_proj"] = torch.randn(3, 5, 4, generator=g)
    return state


def test_a_rule_renames_by_its_fields_and_the_rest_is_kept_in_order():
    state = zoo_state()
    out = map_weights(state, [Rule(MLP + "router.weight", MLP + "gate.weight")])
    assert list(out) == [name.replace("router.", "gate.") for name in state]
    assert out["model.layers.1.mlp.gate.weight"] is state["model.layers.1.mlp.router.weight"]
    assert out["model.embed_tokens.weight"] is state["model.embed_tokens.weight"]


def test_a_transform_joins_sources_and_splits_into_targets():
    state = zoo_state()
    fused = map_weights(state, [FUSE])
    assert sorted(fused) == sorted(
        ["model.embed_tokens.weight"]
        + [f"model.layers.{i}.mlp.{n}" for i in range(2) for n in ("router.weight", "gate_up_proj")]
    )
    assert fused["model.layers.0.mlp.gate_up_proj"].shape == (3, 10, 4)
    gate, up = map_weights(fused, [UNFUSE])["model.layers.0.mlp.gate_proj"], state["model.layers.0.mlp.up_proj"]
    assert torch.equal(gate, state["model.layers.0.mlp.gate_proj"]) and gate.is_contiguous()
    assert torch.equal(fused["model.layers.0.mlp.gate_up_proj"][:, 5:], up)


def test_round_trip_gives_back_every_tensor_and_consume_empties_the_source():
    state = zoo_state(3)
    fused = map_weights(dict(state), [FUSE], consume=True)
    back = map_weights(fused, [UNFUSE], consume=True)
    assert not fused  # every tensor popped as it was mapped
    assert set(back) == set(state) and all(torch.equal(back[k], v) for k, v in state.items())


def test_when_limits_a_rule_to_some_matches_and_stack_copies_into_every_slot():
    dense = {f"model.layers.{i}.mlp.up_proj.weight": torch.full((2, 3), float(i)) for i in range(3)}
    odd = lambda fields: int(fields["layer"]) % 2 == 1  # noqa: E731
    out = map_weights(dense, [Rule(MLP + "{proj:up_proj|down_proj}.weight", MLP + "experts.{proj}", stack_copies(4), odd)])
    assert set(out) == {"model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.experts.up_proj",
                        "model.layers.2.mlp.up_proj.weight"}
    experts = out["model.layers.1.mlp.experts.up_proj"]
    assert experts.shape == (4, 2, 3) and bool((experts == 1).all())
    experts[0].zero_()  # copies, not views of one another or of the source
    assert bool((experts[1] == 1).all()) and bool((dense["model.layers.1.mlp.up_proj.weight"] == 1).all())


def test_a_rule_without_target_drops_the_weight():
    out = map_weights(zoo_state(1), [Rule(MLP + "router.weight")])
    assert "model.layers.0.mlp.router.weight" not in out and len(out) == 3


def test_unmatched_name_is_one_clear_error_when_the_rest_is_not_kept():
    with pytest.raises(ValueError, match=r"^No rule of the weight map maps model\.embed_tokens\.weight\.$"):
        map_weights(zoo_state(), [FUSE, Rule(MLP + "router.weight", MLP + "gate.weight")], keep_rest=False)


def test_a_missing_partner_is_one_clear_error_either_way():
    state = zoo_state()
    del state["model.layers.1.mlp.up_proj"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.gate_proj maps together with .*up_proj.*lacks"):
        map_weights(state, [FUSE])
    state = zoo_state()
    del state["model.layers.1.mlp.gate_proj"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj maps only together with .*gate_proj"):
        map_weights(state, [FUSE])


def test_a_target_written_twice_is_refused():
    state = {"a.weight": torch.ones(1), "b.weight": torch.ones(1)}
    with pytest.raises(ValueError, match=r"writes c\.weight twice \(the second time from b\.weight\)"):
        map_weights(state, [Rule("{x}.weight", "c.weight")])


def test_bad_rules_are_refused_when_written():
    with pytest.raises(ValueError, match="give|transform"):
        Rule(("a", "b"), "c")
    with pytest.raises(ValueError, match=r"uses \['expert'\], not fields of"):
        Rule(MLP + "gate_proj", MLP + "experts.{expert}")
    with pytest.raises(ValueError, match="made 1 tensors for the 2 names"):
        map_weights({"a": torch.ones(1)}, [Rule("a", ("b", "c"), lambda t: t)])


def test_check_mapped_names_what_is_missing_and_unexpected():
    check_mapped({"a": torch.ones(1)}, ["a"], "Toy")
    with pytest.raises(RuntimeError, match=r"^Toy mapping bug: missing \['b'\], unexpected \['c'\]\.$"):
        check_mapped({"a": torch.ones(1), "c": torch.ones(1)}, ["a", "b"], "Toy")
