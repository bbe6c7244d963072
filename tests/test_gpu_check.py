"""The prepared GPU check (eval/gpu_check/) on a CPU: its quick mode in-process at the tiny
shape (llama at TP 2, moe at EP 2 with the padded dispatch), writes README.md and results.json with one row per
architecture holding eager, compiled and predicted decode-step numbers, the kernel check and the environment.
The compiled step runs under aot_eager here (inductor's C++ compile takes 30-70 s per model on 2 shared
cores); on a GPU the script compiles with inductor and CUDA graphs. No speed is asserted. And the time
planner: a compile that would overrun its share of the budget runs with fewer layers, or is skipped."""

import json

import pytest

from eval import gpu_check


def test_quick_cpu_run_writes_one_row_per_architecture(tmp_path):
    out = gpu_check.main(
        ["--device", "cpu", "--quick", "--backend", "aot_eager", "--out", str(tmp_path / "r")]
    )
    readme, results = out / "README.md", out / "results.json"
    assert readme.is_file() and results.is_file()
    data = json.loads(results.read_text())
    assert data["finished"] and not data["errors"], data["errors"]
    assert sorted(r["arch"] for r in data["rows"]) == ["llama", "moe"]
    for row in data["rows"]:
        for mode in ("eager", "compiled"):
            assert row[mode]["step_ms"] > 0 and len(row[mode]["step_ms_runs"]) == 2, (row["arch"], mode)
        assert row["predicted"]["decode_ms"] > 0 and row["predicted"]["device"] in ("h200", "h100-sxm")
        assert row["compiled_over_predicted"] > 0 and row["compiled"]["graphs"] == 1
    moe = next(r for r in data["rows"] if r["arch"] == "moe")
    assert moe["dispatch"] == "padded" and moe["layout"] == "ep=2 rank 0"
    assert data["environment"]["torch"] and "nccl_env_set" in data["environment"]
    assert "zoo linear_attention_chunked (chunk 64)" in data["kernel"]["kernels"] and data["kernel"]["fla"]
    text = readme.read_text()
    assert "| tiny | llama | tp=2 rank 0 |" in text and "| tiny | moe | ep=2 rank 0 |" in text


class _Clock:
    def __init__(self, elapsed):
        self.rows, self._elapsed = {}, elapsed

    def elapsed(self):
        return self._elapsed


@pytest.mark.parametrize(("elapsed", "policy", "fair_left", "want"), [
    (0.0, "max", 0, 32),  # the whole budget left: every layer
    (370.0, "max", 0, "fewer"),  # 50 s left: fewer layers
    (0.0, "fair", 20, "fewer"),  # a twentieth of the budget
    (410.0, "max", 0, None),  # not even MIN_LAYERS fit
])  # fmt: skip
def test_compile_planner_cuts_layers_to_the_time_left(elapsed, policy, fair_left, want):
    _, s = gpu_check.parse_args(["--device", "cpu", "--budget", "420"])
    item = gpu_check.Item("llama3-8b", "llama", "llama", {"tp": 8}, {}, 32, layers=32, params_gb=3.8)
    clock = gpu_check.CompileClock(15.0, 2.0)
    clock.add(32, 60.0)
    layers, need = gpu_check.choose_layers(item, 1, policy, fair_left, s, clock, _Clock(elapsed))
    assert need > 60.0
    if want == "fewer":
        assert gpu_check.MIN_LAYERS <= layers < 32 and layers % 2 == 0
    else:
        assert layers == want
    queue = gpu_check.compiled_queue(gpu_check.plan_items(s), [1, 8])
    assert [q[0] for q in queue[:2]] == ["compiled", "kernel"] and queue[0][1].arch == "llama"
    assert (
        len([q for q in queue if q[0] == "compiled"]) == 2 * 14
    )  # 6 archs (gqla twice) x 2 shapes x 2 batches


def test_ladder_variants_are_names_the_check_takes():
    from eval.gpu_check.settings import check_names

    check_names(["gqla", "gqla_ladder", "moe_ladder"], ["tiny"])
    with pytest.raises(SystemExit, match=r"'gqla_ladr' \(gqla_ladr: did you mean gqla_ladder\?\).* ladder variants .*moe_ladder"):
        check_names(["gqla_ladr"], ["tiny"])
