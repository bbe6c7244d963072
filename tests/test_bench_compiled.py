"""eval.bench's compiled program (`compile=true|both`, eval.bench.steps): the whole prefill and the whole decode
step compiled, on the static cache. One run with `compile=both` times eager and compiled rows side by side
(`program`; speed-ups compare compiled with compiled), eager rows count the kernels of a decode step; with the
real gloo ranks (slow) the compiled rows' collectives, read off the compiled graph, are the eager rows' call
for call and byte for byte. aot_eager
(the same graphs without inductor's code generation) keeps it quick; the CPU report
(reports/bench-compiled-cpu) is inductor's. No speed is asserted."""

import pytest
import torch

from eval.bench import check_settings, run_bench
from tests.benchkit import bench_settings, run_cli


def test_compiled_and_eager_rows_of_one_process(tmp_path):
    threads = torch.get_num_threads()
    try:
        results = run_bench(
            bench_settings(
                "archs=[llama,ladder]", "tp=[2]", "batch_sizes=[1]", "prompt_len=8", "new_tokens=3", "warmup=0",
                "repeats=1", "simulated.enabled=false", "real.enabled=false", "compile=both", "compile_backend=aot_eager",
            ),
            tmp_path,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    rows = {(r["arch"], r["program"]): r for r in results["rows"]}
    assert set(rows) == {(a, p) for a in ("llama", "ladder") for p in ("eager", "compiled")}
    for arch in ("llama", "ladder"):
        eager, compiled = rows[(arch, "eager")], rows[(arch, "compiled")]
        assert compiled["speedup_compiled"] == pytest.approx(compiled["decode_tok_s"] / eager["decode_tok_s"])
        assert eager["speedup_compiled"] is None and eager["decode_kernels_per_step"] > 0
    assert rows[("ladder", "compiled")]["speedup_decode"] == pytest.approx(
        rows[("ladder", "compiled")]["decode_tok_s"] / rows[("llama", "compiled")]["decode_tok_s"]
    )  # speed-ups compare like with like: compiled against compiled
    readme = (tmp_path / "README.md").read_text()
    assert "## upper_bound (compiled)" in readme and "compiled / eager" in readme


@pytest.mark.slow  # the real ranks' compiled collectives are also checked by tests/test_compile.py (TP 2)
def test_compiled_and_eager_rows_in_one_run(tmp_path):
    results = run_cli(
        tmp_path, "bench_shape=tiny", "archs=[ladder]", "baseline=ladder", "tp=[2]", "batch_sizes=[1]", "prompt_len=8",
        "new_tokens=3", "warmup=0", "repeats=1", "simulated.enabled=false", "real.tp=[2]", "compile=both",
        "compile_backend=aot_eager",
    )  # fmt: skip
    rows = {(r["arch"], r["variant"], r["program"]): r for r in results["rows"]}
    variants = ("upper_bound", "real", "upper_bound_real")
    assert set(rows) == {("ladder", v, p) for v in variants for p in ("eager", "compiled")}
    for arch in ("ladder",):
        eager, compiled = rows[(arch, "real", "eager")], rows[(arch, "real", "compiled")]
        assert eager["decode_comm_calls"] > 0
        for key in ("decode_comm_calls", "decode_comm_bytes", "prefill_comm_calls", "prefill_comm_bytes"):
            assert compiled[key] == eager[key], (arch, key)
        assert compiled["speedup_compiled"] == pytest.approx(compiled["decode_tok_s"] / eager["decode_tok_s"])
        assert eager["speedup_compiled"] is None
        assert eager["decode_kernels_per_step"] > 0
        assert compiled["decode_kernels_per_step"] is None  # aot_eager generates no kernels to count
        assert rows[(arch, "upper_bound_real", "compiled")]["decode_comm_calls"] == 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["compile=maybe"], r"compile='maybe': use false .*, true .* or both"),
        (["compile=true", "static_cache=false"], r"compile=True needs static_cache=true"),
    ],
)
def test_compile_settings_are_checked(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_settings(bench_settings(*overrides))
