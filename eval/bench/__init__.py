"""Speed benchmark of the zoo's architectures over mesh degrees (tp, ep, ...): `python -m eval.bench`.

Random weights at a given shape (`conf/bench_shape/`), greedy generation from a random prompt: prefill (time
to first token) and the decode loop are timed separately after warm-up, the device synchronised at each
boundary, median and min/max over repeats (gpt-fast's benchmark loop). Each architecture is measured at each
degree point (`tp: [2, 4]` gives {"tp": 2} and {"tp": 4}, `ep: [2]` gives {"ep": 2}, `degrees: [{ep: 2, tp: 2}]`
a point of several dimensions) in one run in three ways (docs/speed.md, "The bench"): `simulated`
(one process plays rank 0, collectives on a link model's virtual clock), `upper_bound` (the same compute, no
collectives) and `real` (P processes, real collectives). With `compute=<device preset>` the simulated and
upper-bound rows are predicted by the speed simulator (eval/simulator/) instead of measured here.

One module per job; each section's reporting beside it:

| module | job |
|---|---|
| `__main__.py` | the Hydra app: `python -m eval.bench` |
| `app.py` | `check_settings`, `run_bench` (every section in turn), results.json; `run_bench_overrides` for the tour and eval.at_scale |
| `settings.py` | the settings read once from the config, a frozen dataclass per section (compute, a shape as an architecture's config, degree points, threads) |
| `checks.py`, `degrees.py`, `machine.py` | the generation section's value checks; degree points and link names; device, dtype, hardware |
| `timing.py` | one timed generation (prefill + decode steps), interleaved repeats, a row's numbers |
| `generation.py`, `generation_report.py` | the generation section's variants (simulated / upper bound / device model / real processes); speed-ups, hidden fractions, tables, plots, notes |
| `moe.py`, `moe_report.py` | MoE all-to-all bytes and exposure per layer; one expert layer's throughput |
| `sp.py`, `sp_report.py` | the linear model's sequence parallelism over long sequences (`bench_preset=sp`) |
| `decode_paths.py`, `decode_paths_report.py` | decode paths on one device (`bench_preset=gqla`) |
| `report.py` | README.md, the plots, W&B |

Nothing here names an architecture, except the sequence-parallel section, which measures the linear model's
algorithms by name: how the bench shape becomes an architecture's config (`bench_config`), which degrees fit it
(`check_layout`) and what it sends (`collectives_per_forward`) come from its registry entry
(models/<name>/entry.py and sharding.py).
"""

from eval.bench.app import check_settings, run_bench, run_bench_overrides

__all__ = ["check_settings", "run_bench", "run_bench_overrides"]
