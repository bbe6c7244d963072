"""eval.ladder_conversions: which architectures it converts, and its report from train.convert's results (the runs
themselves are train.pretrain's and train.convert's, tested in tests/test_residual.py and tests/test_train*.py)."""

import pytest
from omegaconf import OmegaConf

from eval import ladder_conversions as lc


def cfg(**fields):
    return OmegaConf.create({"archs": None, "seed": 42, **fields})


def test_archs_default_to_every_architecture_with_a_ladder_variant_and_others_are_refused():
    assert lc.archs_of(cfg()) == ["moe", "moepp", "linear", "linear_hybrid", "gqla"]
    with pytest.raises(ValueError, match=r"archs=\['kraken'\] must name architectures that take the ladder schedule"):
        lc.archs_of(cfg(archs=["kraken"]))


def _val(arch, source, after, retrained):
    return {f"{arch} (source)": {"loss": source}, f"{arch}, no retraining": {"loss": after},
            f"{arch}, retrained": {"loss": retrained}}


def test_each_architecture_is_converted_by_the_converter_of_its_config_class():
    assert lc.converter_for("moe") == "moe_to_ladder"
    assert lc.converter_for("linear_hybrid") == "linear_to_ladder"  # linear and linear_hybrid share theirs


def test_a_row_reads_the_ladder_conversion_against_its_control():
    record = {
        "ladder": {"ladder_layers": 2, "target": "moe", "val": _val("moe", 5.0, 5.2, 4.9), "retrain": {"global_step": 150}},
        "control": {"ladder_layers": 0, "val": _val("moe", 5.0, 5.0, 4.95), "retrain": {"global_step": 150}},
    }
    row = lc.row("moe", record)
    assert row == {"arch": "moe", "ladder_layers": 2, "source": 5.0, "right_after": 5.2, "retrained": 4.9,
                   "control_retrained": 4.95, "retrain_steps": 150}
    table = lc.markdown([row], cfg())
    assert "| moe | 2 | 5.0000 | 5.2000 | 4.9000 (150 steps) | 4.9500 | -0.0500 |" in table
    assert "Not in this report: moepp, linear, linear_hybrid, gqla" in table
