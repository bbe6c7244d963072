"""The device model's predictions beside the measurements: `predict` records one item's prefill and decode step
on the meta device (eval.simulator.replay.record_generation, the same config and cache length as the timed run)
and replays it on the device model with free communication; `Predictions` runs them in CPU worker processes
(`--workers`) while the GPU measures, or in this process.
"""

import time
from concurrent.futures import BrokenExecutor, ProcessPoolExecutor
from dataclasses import asdict

import torch

from eval.gpu_check.build import Item, build_meta_model
from eval.gpu_check.errors import error_record
from eval.gpu_check.settings import Settings, device_model_constants, predict_device


def _worker_init() -> None:
    torch.set_num_threads(1)


def predict(spec: dict) -> dict:
    """The device model's prefill and decode step of one item (`spec`: plain values, picklable)."""
    from eval.simulator.device import DeviceModel
    from eval.simulator.replay import NO_COMM, record_generation, release

    start = time.perf_counter()
    item = Item(**spec["item"])
    try:
        model = build_meta_model(item, spec["layers"])
        recording = record_generation(model, spec["batch"], spec["prompt_len"], spec["new_tokens"], True)
    finally:
        model = None
        release()
    dm = DeviceModel.from_config(spec["device"], **spec["constants"])
    out = recording.predict(dm, NO_COMM)
    dec, pre = out["decode"], out["prefill"]
    return {
        "device": spec["device"],
        "decode_ms": dec["time"] * 1e3,
        "prefill_ms": pre["time"] * 1e3,
        "decode_kernels": dec["kernels"],
        "decode_gb": dec["bytes"] / 1e9,
        "decode_gflop": dec["flops"] / 1e9,
        "record_s": time.perf_counter() - start,
    }


class Predictions:
    """Recordings keyed by (shape, label, batch, layers): in a process pool, or in this process (workers 0)."""

    def __init__(self, s: Settings):
        self.s, self.futures, self.done, self.errors = s, {}, {}, {}
        self.device, self.constants = predict_device(), device_model_constants()
        self.pool = None
        if s.workers > 0:
            import multiprocessing

            try:
                self.pool = ProcessPoolExecutor(
                    s.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init
                )
            except Exception as err:  # noqa: BLE001 - in-process then
                print(f"[gpu_check] no prediction workers ({err}); predicting in this process", flush=True)

    def spec(self, item: Item, batch: int, layers: int) -> dict:
        return {
            "item": asdict(item), "layers": layers, "batch": batch, "prompt_len": self.s.prompt_len,
            "new_tokens": self.s.new_tokens, "device": self.device, "constants": self.constants,
        }  # fmt: skip

    def submit(self, item: Item, batch: int, layers: int) -> None:
        key = (item.shape, item.label, batch, layers)
        if key in self.futures or key in self.done or key in self.errors:
            return
        spec = self.spec(item, batch, layers)
        if self.pool is not None:
            try:
                self.futures[key] = (self.pool.submit(predict, spec), spec)
                return
            except Exception:  # noqa: BLE001 - a broken pool: in this process from here on
                self.pool = None
        self._run_here(key, spec)

    def _run_here(self, key, spec) -> None:
        try:
            self.done[key] = predict(spec)
        except Exception as err:  # noqa: BLE001 - reported
            self.errors[key] = error_record(f"{key[0]} {key[1]} batch {key[2]} layers {key[3]}: prediction", err)

    def collect(self, wait_s: float = 0.0) -> None:
        """Take the finished recordings (waiting up to `wait_s` for the rest); a recording whose worker died
        (a broken pool) is made in this process."""
        deadline = time.monotonic() + wait_s
        for key, (fut, spec) in list(self.futures.items()):
            remaining = deadline - time.monotonic()
            if not fut.done() and remaining <= 0:
                continue
            try:
                self.done[key] = fut.result(timeout=max(0.0, remaining))
            except TimeoutError:
                continue
            except BrokenExecutor:
                self.pool = None
                self._run_here(key, spec)
            except Exception as err:  # noqa: BLE001 - reported
                self.errors[key] = error_record(
                    f"{key[0]} {key[1]} batch {key[2]} layers {key[3]}: prediction", err
                )
            del self.futures[key]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
