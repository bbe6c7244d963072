"""The prepared GPU check: one script, one GPU, about six minutes, a Markdown + JSON report.

    python -m eval.gpu_check [--out reports/gpu-check-h200] [--quick] [--budget 420]
    python -m eval.gpu_check --device cpu --quick            # the same code path on a CPU, tiny shape (tests)

What it measures, on ONE GPU (bf16, comm mode `none`: the GPU holds one rank's shards and skips every
collective, so this is the per-rank compute the device model predicts):

1. Decode-step latency of rank 0's shard of each architecture (llama, ladder, kraken, moe, scmoe, gqla on its
   gqa and its absorb path) at the Llama 3 8B and 70B bench shapes at TP 8 (conf/bench_shape/): the model
   built on the meta device, sharded on a fake 8-way process group and materialised (eval.bench.generation's
   `build_sharded`), a prompt of 128 tokens into the architecture's own static cache
   (`model.model.make_cache(..., static=True)`, prompt + warm-up + timed steps), then (a) eager
   `eval.bench.steps.decode_step` and (b) the same step compiled by `compile_steps(mode="reduce-overhead")`
   (inductor, fullgraph, CUDA graphs), each the median over repeats of the mean of N steps (the cache is reset
   and re-filled by an eager prefill before each repeat, so every timed step fits). Beside them the device
   model's prediction of the same step (`eval.simulator.replay.record_generation` on the same config and cache
   length, replayed with `DeviceModel` on the `h200` preset, conf/bench.yaml's `device_model` constants, and
   free communication), and measured / predicted. Layouts: TP 8 for the dense family; the MoE family (moe,
   scmoe) at EP 8 (their tp layouts split attention only and keep every expert whole on each rank: at the 70B
   shape 8 experts of a 28672-wide MLP per layer would not fit one GPU, and EP 8 is what eval.at_scale
   predicts), with `model.set_moe_dispatch("padded")` (host-known all-to-all sizes: the dispatch a compiled
   step needs) where the model has it; gqla's absorb path runs unsharded only, so its rows are the tp=1 model of
   the same shape (the whole model on one GPU). A model whose rank-0 weights would not fit `--mem-frac` of the
   GPU's memory (the 70B shape's MoE at EP 8 and unsharded absorb path: about 140 GB) runs with fewer layers,
   and its prediction is made at the same layer count (the row says how many). Eager rows at batch 1 and 8
   (`--batches`); the compiled step at batch 1 for every row the time budget allows (llama and ladder first:
   the device model's calibration anchors), then batch 8.
2. fla's chunk kernel (`models.linear.ops.linear_attention_fla`, fla-core's `chunk_simple_gla`) against the
   zoo's chunked kernel (`linear_attention_chunked`) at B=1, H=16, T=8192, D=128, bf16, a per-head decay:
   forward time of each and the largest absolute difference of their outputs (fla may not be installed: the
   report says so).
3. The environment: torch, CUDA, GPU, driver, fla / triton versions, the NCCL environment variables set.

Each measurement runs in its own try/except: one failure is recorded in the report and the run goes on. A time
guard (`--budget` seconds, default 420, from the start) skips what would not finish in time and lists it: a
compiled row whose compile (estimated from the compiles so far) would overrun is run with fewer layers where at
least 4 fit, else skipped. The report (README.md + results.json in `--out`) is rewritten after every
measurement, so a run killed at its limit leaves everything measured so far. The device model's recordings run
on the CPU in worker processes (`--workers`) while the GPU measures.

One module per job:

| module | job |
|---|---|
| `__main__.py` | `python -m eval.gpu_check` |
| `run.py` | `main`: the two phases, the time guard, the report rewritten after each measurement |
| `settings.py` | the flags (`parse_args`) read into `Settings`; bench shapes and device-model constants from conf/ |
| `build.py` | the items measured (`Item`, `plan_items`), their sizes, their models built and freed |
| `timed.py` | the timed eager and compiled runs of one item, through eval.bench.timing (`Program`, `WallTimer`, `decode_steps`) |
| `predictions.py` | the device model's predictions, in CPU worker processes |
| `planner.py` | the compiled phase's order and layer counts within the budget |
| `kernel.py` | fla's chunk kernel against the zoo's chunked kernel |
| `environment.py` | versions, GPU, driver, NCCL environment |
| `report.py` | README.md and results.json |
| `errors.py` | one failure as the report records it |
"""

from eval.gpu_check.build import Item, plan_items
from eval.gpu_check.planner import MIN_LAYERS, CompileClock, choose_layers, compiled_queue
from eval.gpu_check.run import main
from eval.gpu_check.settings import Settings, parse_args

__all__ = [
    "MIN_LAYERS",
    "CompileClock",
    "Item",
    "Settings",
    "choose_layers",
    "compiled_queue",
    "main",
    "parse_args",
    "plan_items",
]
