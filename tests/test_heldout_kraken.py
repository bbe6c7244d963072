"""eval.simulator.heldout.kraken: the Kraken paper's TTFT headline predicted at its own setting (quick: tiny shapes,
the same code path; the full setting is `pytest -m slow`)."""

import math

import pytest

from eval.simulator import heldout
from eval.simulator.heldout import kraken

KEYS = set(heldout.ROW_KEYS)  # the interface (eval/simulator/heldout/__init__.py)


@pytest.fixture(scope="module")
def row():
    return kraken.validate(quick=True)


def test_the_row_has_every_key_of_the_interface(row):
    assert KEYS <= set(row)
    assert heldout.module("kraken") is kraken and kraken.PAPER == "kraken"
    assert row["published"] == 1.356  # 35.6% read as the paper states it: a speed-up, not -35.6% time
    for cell in row["cells"]:
        assert {"label", "published", "predicted", "what"} <= set(cell)
    for run in row["sensitivity"]:
        assert {"effect", "value", "predicted"} <= set(run)
    assert isinstance(row["lacks"], str) and isinstance(row["notes"], list)


def test_cells_are_finite_and_the_headline_is_the_papers_geomean_of_them(row):
    headline = [c for c in row["cells"] if c["in_headline"]]
    # every size x context x TP point once, Kraken over the standard Transformer
    assert len(headline) == len(kraken.QUICK_SIZES) * len(kraken.QUICK_CONTEXTS) * len(kraken.TPS)
    assert all(c["label"].startswith("kraken vs standard") for c in headline)
    for cell in row["cells"]:
        assert math.isfinite(cell["predicted"]) and cell["predicted"] > 0
        assert cell["predicted"] == pytest.approx(_ratio(cell))
    geomean = math.exp(sum(math.log(c["predicted"]) for c in headline) / len(headline))
    assert row["predicted"] == pytest.approx(geomean, rel=1e-12)
    assert all(math.isfinite(s["predicted"]) for s in row["sensitivity"])
    assert row["sensitivity"][0]["predicted"] == pytest.approx(row["predicted"])  # the committed constants


def _ratio(cell):
    over, _, under = cell["label"].split(",")[0].partition(" vs ")
    names = {"standard": "llama", "parallel": "parallel", "kraken": "kraken"}
    return cell["ttft_ms"][names[under]] / cell["ttft_ms"][names[over]]


def test_two_quick_runs_give_identical_rows(row):
    assert kraken.validate(quick=True) == row


def test_the_gpt_shapes_have_the_parameter_counts_of_their_names():
    # 12 L h^2 + V h: GPT-3 XL 1.31B, 175B 174.6B; the Llama-style config (SwiGLU 8h/3) within 1% of it,
    # and the parameter-matched Kraken within 3% of the Llama.
    for name, (layers, hidden, heads) in kraken.SIZES.items():
        nominal = float(name.rstrip("B")) * 1e9
        gpt = kraken.gpt_parameters(layers, hidden)
        assert gpt == pytest.approx(nominal, rel=0.03), name
        llama = kraken.config("llama", kraken.gpt_shape(layers, hidden, heads), 8).num_parameters_formula()
        assert llama == pytest.approx(gpt, rel=0.01), name
        for k in kraken.TPS:
            matched = kraken.config(
                "kraken", kraken.gpt_shape(layers, hidden, heads), k
            ).num_parameters_formula()
            assert matched == pytest.approx(llama, rel=0.03), (name, k)
    assert kraken.gpt_parameters(24, 2048) == 24 * 12 * 2048**2 + 50304 * 2048  # 1,311,768,576


@pytest.mark.slow
def test_the_full_setting_runs():
    row = kraken.validate()
    assert len([c for c in row["cells"] if c["in_headline"]]) == len(kraken.SIZES) * 2 * 2
    assert math.isfinite(row["predicted"])
