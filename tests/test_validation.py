"""eval.validation: the simulator's one validation report (the Ladder record in sample, the other papers held out).

The report's plumbing runs at tiny shapes (`quick=true`): every held-out row carries what the report needs, its ratio
is predicted / published, two runs give identical numbers. The held-out rows are recorded in the report and not
bounded here: a test that bounded them would invite tuning the constants to them. The Ladder cells' bounds at the
70B shape are tests/test_costmodel.py's."""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from eval import validation
from eval.simulator import heldout

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def _cfg(*overrides, quick: bool = True) -> dict:
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("validation", overrides=[f"quick={str(quick).lower()}", *overrides])
        ladder = compose("costmodel", overrides=[*cfg.ladder_overrides, *(cfg.quick_ladder_overrides if quick else [])])
    plain = lambda c: {k: v for k, v in OmegaConf.to_container(c, resolve=False).items() if k not in ("paths", "hydra")}  # noqa: E731
    return {**plain(cfg), "ladder": plain(ladder)}


def _numbers(result: dict) -> dict:
    """What must not change between two runs: everything but the timings and the paths."""
    out = json.loads(json.dumps(result))
    out.pop("elapsed_s")
    for row in out["heldout"]:
        row.pop("elapsed_s")
    return out


def test_the_config_names_every_held_out_paper():
    assert tuple(_cfg()["papers"]) == heldout.PAPERS
    with pytest.raises(ValueError, match=r"Unknown held-out paper 'gpt5'; choose from \['kraken', 'scmoe', 'moepp', 'lasp2'\]"):
        heldout.module("gpt5")


def test_a_row_without_its_published_number_is_refused():
    with pytest.raises(ValueError, match=r"A held-out row lacks \['published'\]"):
        validation.finish_row({"paper": "p", "source": "s", "headline": "h", "setting": "x", "predicted": 1.0, "cells": []})
    row = validation.finish_row({"paper": "p", "source": "s", "headline": "h", "setting": "x", "published": 1.2,
                                 "predicted": 1.5, "cells": [{"label": "a", "published": 2.0, "predicted": 1.0}]})  # fmt: skip
    assert row["ratio"] == pytest.approx(1.25) and not row["within"] and row["cells"][0]["ratio"] == 0.5
    assert validation.finish_row({**row, "predicted": 1.3})["within"]  # 1.3 / 1.2 = 1.083


def test_quick_report_twice_identical(tmp_path):
    cfg = _cfg()
    first = validation.run_validation(cfg, tmp_path / "a", "test")
    second = validation.run_validation(cfg, tmp_path / "b", "test")
    assert _numbers(first) == _numbers(second)
    assert [r["key"] for r in first["heldout"]] == list(heldout.PAPERS)
    for row in first["heldout"]:
        if row["published"] is not None:
            assert row["ratio"] == pytest.approx(row["predicted"] / row["published"])
            assert row["within"] == (abs(row["ratio"] - 1) <= heldout.TARGET)
        assert row["cells"] and all(c["predicted"] > 0 for c in row["cells"])
    cells = first["ladder"]["cells"]
    assert len([c for c in cells if c["kind"] == "tokens/s"]) == 16 and len([c for c in cells if c["kind"] == "prefill ms"]) == 15
    readme = (tmp_path / "a" / "README.md").read_text()
    for text in ("# Speed simulator validation", "## Headlines", "| paper | headline | published | predicted | ratio |",
                 "## What this validates and what it does not", "**quick**"):
        assert text in readme
    assert (tmp_path / "a" / "validation.png").stat().st_size > 1000
    assert (tmp_path / "a" / "ladder" / "README.md").exists()


@pytest.mark.slow
def test_full_report_computes_every_held_out_row(tmp_path):
    # At the papers' own settings (about 3 minutes): every row computed and compared with its published headline.
    # Not bounded: the report records how close each is; a bound here would invite tuning the constants to a row.
    cfg = _cfg(quick=False)
    result = validation.run_validation(cfg, tmp_path, "test")
    for row in result["heldout"]:
        assert row["published"] > 1 and row["predicted"] > 0
        assert row["ratio"] == pytest.approx(row["predicted"] / row["published"]) and row["within"] in (True, False)
        assert row["within"] or row["lacks"], f"{row['key']} misses its target without naming what the model lacks"
