"""The speed simulator: an architecture's own `forward()` at any shape, every aten op charged to a device model
and every collective to a link model, replayed on any device and link preset.

| module | job |
|---|---|
| `device.py` | the device model: GPU presets, the roofline with its efficiencies and per-kernel overhead (`DeviceModel`), and `DeviceClock`, the dispatch mode that records each aten op as FLOPs and HBM bytes |
| `kernels.py` | kernel cost models: fused GPU kernels the meta device does not run (fla's chunk kernel, flash attention's backward), charged through `DeviceClock.quiet()` / `charge` |
| `replay.py` | the clock replay: build on the meta device, shard on a fake process group, record prefill and one decode step, replay under a device model and a link (`Recording.predict`) |
| `costmodel.py` | the fit against the Ladder paper's 70B record: tokens/s and the reference's logged prefill latencies (`python -m eval.costmodel`; in sample) |
| `heldout/` | the held-out validation: Kraken, ScMoE, MoE++ and LASP-2 each at the paper's own setting (shapes, spec-sheet hardware presets, baselines, what is timed), the committed constants, nothing fitted |
| `audit.py` | every aten op the zoo's models run on meta without a FLOP formula, each given one or shown memory-bound (`python -m eval.simulator.audit`) |

The link model (presets, the virtual clock, `ClockRecorder`) is communication and lives in parallel/link.py,
which `parallel.comm`'s simulated mode uses. What each architecture would buy at scale, predicted by the bench
on this simulator, is `python -m eval.at_scale` (eval/at_scale.py: an app over eval.bench, kept beside it so
that the simulator does not import the bench that imports it). Both parts of the validation, the Ladder record
(fitted) and the held-out papers, are one report: `python -m eval.validation` (eval/validation.py,
reports/simulator-validation).
"""
