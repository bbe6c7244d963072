"""The speed simulator: an architecture's own `forward()` at any shape, every aten op charged to a device model
and every collective to a link model, replayed on any device and link preset.

| module | job |
|---|---|
| `device.py` | the device model: GPU presets, the roofline with its efficiencies and per-kernel overhead (`DeviceModel`), and `DeviceClock`, the dispatch mode that records each aten op as FLOPs and HBM bytes |
| `kernels.py` | kernel cost models: fused GPU kernels the meta device does not run (fla's chunk kernel, flash attention's backward), charged through `DeviceClock.quiet()` / `charge` |
| `replay.py` | the clock replay: build on the meta device, shard on a fake process group, record prefill and one decode step, replay under a device model and a link (`Recording.predict`) |
| `costmodel.py` | the fit and validation against the Ladder paper's 70B table (`python -m eval.costmodel`) |

The link model (presets, the virtual clock, `ClockRecorder`) is communication and lives in parallel/link.py,
which `parallel.comm`'s simulated mode uses. What each architecture would buy at scale, predicted by the bench
on this simulator, is `python -m eval.at_scale` (eval/at_scale.py: an app over eval.bench, kept beside it so
that the simulator does not import the bench that imports it).
"""
