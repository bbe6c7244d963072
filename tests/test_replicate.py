"""eval.replicate's plumbing at 3 steps (moe and moepp, 2 seeds): the spread of each label is computed from its
per-seed values as numpy computes it, differences to the baseline are per-seed paired, a rerun skips the runs
already done (and reruns one whose settings changed), k_eff is counted (moe top-2: exactly 2), and the README and
plot are written. The numbers themselves mean nothing at 3 steps."""

import json
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

import eval.replicate as replicate_app

CONF = str(Path(__file__).resolve().parents[1] / "conf")
SEEDS = [42, 43]


def run(out_dir: Path, *extra: str) -> dict:
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("replicate", overrides=[
            "archs=[moepp]", f"seeds=[{','.join(map(str, SEEDS))}]", "max_steps=3", "val_batches=2",
            "keff_batches=1", f"out_dir={out_dir}", "comparisons=[]", *extra,
        ])  # fmt: skip
        return replicate_app.replicate(cfg)


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    out = tmp_path_factory.mktemp("replicate")
    return out, run(out)


def test_spread_and_paired_differences_from_the_per_seed_values(first):
    out, result = first
    rows = {r["arch"]: r for r in result["rows"]}
    assert list(rows) == ["moe", "moepp"]  # moepp's baseline trained with it, first
    per_seed = {label: {s: json.loads((out / "seeds" / f"{label}-seed{s}.json").read_text()) for s in SEEDS}
                for label in rows}  # fmt: skip
    for label, row in rows.items():
        v = np.array([per_seed[label][s]["val_loss"] for s in SEEDS])
        assert row["val_loss"]["values"] == pytest.approx(list(v))
        assert row["val_loss"]["mean"] == pytest.approx(v.mean())
        assert row["val_loss"]["std"] == pytest.approx(v.std(ddof=1))
        assert (row["val_loss"]["min"], row["val_loss"]["max"]) == pytest.approx((v.min(), v.max()))
    assert rows["moe"]["baseline"] is None and "diff_loss" not in rows["moe"]
    d = np.array([per_seed["moepp"][s]["val_loss"] - per_seed["moe"][s]["val_loss"] for s in SEEDS])
    diff = rows["moepp"]["diff_loss"]
    assert diff["values"] == pytest.approx(list(d)) and diff["seeds"] == SEEDS
    assert diff["mean"] == pytest.approx(d.mean()) and diff["std"] == pytest.approx(d.std(ddof=1))
    assert diff["same_sign"] == bool(np.all(d > 0) or np.all(d < 0))
    # Seeds differ: the runs are not copies of one another.
    assert per_seed["moe"][42]["val_loss"] != per_seed["moe"][43]["val_loss"]


def test_k_eff_counted_on_the_moe_rows(first):
    _, result = first
    rows = {r["arch"]: r for r in result["rows"]}
    assert rows["moe"]["k_eff"]["values"] == [2.0, 2.0]  # top-2 of FFN experts only
    assert all(0 <= k <= 2 for k in rows["moepp"]["k_eff"]["values"])
    assert rows["moepp"]["expert_rows_per_token"]["mean"] == pytest.approx(rows["moepp"]["k_eff"]["mean"] * 176)


def test_report_written(first):
    out, _ = first
    readme = (out / "README.md").read_text()
    assert "| moepp | moe |" in readme and "k_eff" in readme and "quality_seeds.png" in readme
    assert (out / "quality_seeds.png").stat().st_size > 1000
    assert json.loads((out / "results.json").read_text())["settings"]["seeds"] == SEEDS


def test_rerun_skips_done_runs_and_reruns_changed_ones(first, monkeypatch):
    out, result = first
    trained = []
    real = replicate_app.train_one
    monkeypatch.setattr(replicate_app, "train_one", lambda cfg, label, spec, seed, o: trained.append((label, seed)) or real(cfg, label, spec, seed, o))  # noqa: E501
    again = run(out)
    assert trained == []
    assert [r["val_loss"] for r in again["rows"]] == [r["val_loss"] for r in result["rows"]]
    # A killed run: one record missing is trained again, alone.
    (out / "seeds" / "moepp-seed43.json").unlink()
    run(out)
    assert trained == [("moepp", 43)]
    # Other settings are other runs: a record is reused for its own overrides only.
    path = out / "seeds" / "moe-seed42.json"
    overrides = json.loads(path.read_text())["overrides"]
    assert replicate_app.done_record(path, overrides) is not None
    assert replicate_app.done_record(path, [o.replace("max_steps=3", "max_steps=4") for o in overrides]) is None


def test_train_false_reports_what_is_on_disk_and_names_the_rest(first, monkeypatch):
    out, result = first
    monkeypatch.setattr(replicate_app, "train_one", lambda *a: pytest.fail("train=false trained a run"))
    (out / "seeds" / "moepp-seed43.json").unlink(missing_ok=True)
    partial = run(out, "train=false")
    assert partial["missing"] == [{"arch": "moepp", "seed": 43}]
    rows = {r["arch"]: r for r in partial["rows"]}
    assert rows["moe"]["val_loss"]["n"] == 2 and rows["moepp"]["val_loss"]["n"] == 1
    assert rows["moepp"]["diff_loss"]["seeds"] == [42]  # paired over the seeds both have
    assert "Partial report" in (out / "README.md").read_text() and "moepp (seeds 43)" in (out / "README.md").read_text()
