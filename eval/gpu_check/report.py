"""The GPU check's report: `Report` holds what was measured so far and writes it to `--out` as results.json
(everything, tracebacks included) and README.md (the tables: decode step per batch size beside the device
model's prediction, eager prefill beside the predicted one, the kernel check, notes, skipped, errors). It is
rewritten after every measurement, so a run killed at its limit leaves everything measured so far.
"""

import json
import time
from dataclasses import asdict
from pathlib import Path

from eval.gpu_check.build import Item
from eval.gpu_check.predictions import Predictions
from eval.gpu_check.settings import Settings, device_model_constants, predict_device


def _fmt(x, digits=3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


class Report:
    """The rows (one per shape, architecture path, batch size and layer count), the kernel check, the
    environment, what was skipped and what failed; `write` rewrites README.md and results.json."""

    def __init__(self, out: Path, s: Settings, argv: list[str]):
        self.out, self.s, self.argv = out, s, argv
        self.start = time.monotonic()
        self.started_at = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        self.env, self.kernel, self.rows, self.items = {}, None, {}, []
        self.errors, self.skipped, self.notes = [], [], []
        self.finished = False

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def row(self, item: Item, batch: int, layers: int) -> dict:
        key = (item.shape, item.label, batch, layers)
        if key not in self.rows:
            self.rows[key] = {
                "shape": item.shape, "arch": item.arch, "label": item.label, "layout": item.layout,
                "degrees": dict(item.degrees), "batch": batch, "layers": layers, "layers_full": item.layers_full,
                "params_gb": item.params_gb if layers == item.layers else None, "dispatch": None,
                "eager": None, "compiled": None, "predicted": None, "notes": list(item.notes),
            }  # fmt: skip
        return self.rows[key]

    def merge_predictions(self, preds: Predictions) -> None:
        """The finished predictions into their rows; their failures into the errors."""
        for key, row in self.rows.items():
            if key in preds.done:
                row["predicted"] = preds.done[key]
            elif key in preds.errors:
                row["predicted"] = {"error": preds.errors[key]["error"]}
        for err in preds.errors.values():
            if err not in self.errors:
                self.errors.append(err)

    def _derive(self, row: dict) -> None:
        pred = row.get("predicted") or {}
        for mode in ("eager", "compiled"):
            m = row.get(mode) or {}
            ok = "step_ms" in m and "decode_ms" in pred
            row[f"{mode}_over_predicted"] = m["step_ms"] / pred["decode_ms"] if ok else None
        e = row.get("eager") or {}
        row["eager_prefill_over_predicted"] = (
            e["prefill_ms"] / pred["prefill_ms"] if "prefill_ms" in e and "prefill_ms" in pred else None
        )
        c = row.get("compiled") or {}
        row["compiled_GBps"] = (
            pred["decode_gb"] / c["step_ms"] * 1e3 if "step_ms" in c and "decode_gb" in pred else None
        )

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        rows = list(self.rows.values())
        for row in rows:
            self._derive(row)
        s = self.s
        data = {
            "command": "python -m eval.gpu_check " + " ".join(self.argv),
            "started_at": self.started_at,
            "elapsed_s": self.elapsed(),
            "finished": self.finished,
            "settings": {
                **{k: v for k, v in asdict(s).items() if k != "dtype"},
                "dtype": str(s.dtype).removeprefix("torch."),
                "cache_tokens": s.capacity,
                "predicted_new_tokens": s.new_tokens,
                "predict_device": predict_device(),
                "device_model": device_model_constants(),
            },  # fmt: skip
            "environment": self.env,
            "rows": rows,
            "kernel": self.kernel,
            "skipped": self.skipped,
            "errors": self.errors,
            "notes": self.notes,
        }
        (self.out / "results.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
        (self.out / "README.md").write_text(self.markdown(data))

    def markdown(self, data: dict) -> str:
        s, env = self.s, self.env
        dm = data["settings"]["device_model"]
        lines = [
            "# GPU check: measured per-rank decode steps beside the device model",
            "",
            f"`{data['command']}` (eval/gpu_check/), started {data['started_at']}, "
            f"{data['elapsed_s']:.0f} s{'' if data['finished'] else ' so far (not finished: the report is rewritten as it runs)'}.",
            "",
            f"Device: {env.get('gpu', env.get('device', '?'))}; torch {env.get('torch')}, CUDA {env.get('cuda_runtime')}, "
            f"triton {env.get('triton')}, fla {env.get('fla')}; NCCL env vars "
            f"{'set: ' + ', '.join(env['nccl_env']) if env.get('nccl_env') else 'not set'}. Everything in results.json.",
            "",
            f"Each row: rank 0's shard on one device, {str(s.dtype).removeprefix('torch.')}, comm mode `none` (every "
            f"collective skipped: the per-rank compute), prompt {s.prompt_len} into the architecture's static cache of "
            f"{s.capacity} tokens; decode step = median over {s.repeats} repeats of the mean of {s.eager_steps} (eager) / "
            f"{s.compiled_steps} (compiled: `compile_steps(mode={s.mode!r})`, backend {s.backend}) steps after "
            f"{s.warmup} warm-up steps, the cache reset and re-filled by an eager prefill before each repeat. "
            f"Predicted: `record_generation` (same config, same cache length) replayed on the `{predict_device()}` "
            f"device model with free communication (eff_hbm {dm['eff_hbm']}, eff_flops {dm['eff_flops']}, "
            f"{dm['kernel_overhead_us']} us per kernel: conf/bench.yaml). Ratios are measured / predicted; GB/s "
            "compiled = the predicted step's bytes over the measured compiled step; layers `N of M`: a model cut "
            "to fit the GPU's memory or the time budget (its prediction at N too); graphs: the compiled decode "
            "step's graphs (1: no recompile); cudagraph skips: inductor's count of graphs run without CUDA graphs.",
            "",
        ]
        for batch in sorted({r["batch"] for r in data["rows"]}):
            lines += [
                f"## Decode step, batch {batch} (ms)",
                "",
                "| shape | architecture | layout | layers | MoE dispatch | eager | compiled | predicted | eager / pred "
                "| compiled / pred | compile s | graphs | cudagraph skips | GB/s compiled |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for r in data["rows"]:
                if r["batch"] != batch:
                    continue
                e, c, p = r.get("eager") or {}, r.get("compiled") or {}, r.get("predicted") or {}
                layers = f"{r['layers']}" + (
                    "" if r["layers"] == r["layers_full"] else f" of {r['layers_full']}"
                )
                lines.append(
                    f"| {r['shape']} | {r['label']} | {r['layout']} | {layers} | {r['dispatch'] or '-'} "
                    f"| {_fmt(e.get('step_ms'))} | {_fmt(c.get('step_ms'), 3) if c.get('step_ms') else c.get('status', '-')} "
                    f"| {_fmt(p.get('decode_ms'))} | {_fmt(r['eager_over_predicted'])} | {_fmt(r['compiled_over_predicted'])} "
                    f"| {_fmt(c.get('compile_s'))} | {_fmt(c.get('graphs'))} | {_fmt(c.get('cudagraph_skips'))} "
                    f"| {_fmt(r['compiled_GBps'])} |"
                )
            lines.append("")
        lines += [
            "## Prefill (eager) beside the predicted prefill (ms)",
            "",
            "| shape | architecture | batch | layers | eager prefill | predicted | eager / pred |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in data["rows"]:
            e, p = r.get("eager") or {}, r.get("predicted") or {}
            if e.get("prefill_ms") is not None or p.get("prefill_ms") is not None:
                lines.append(
                    f"| {r['shape']} | {r['label']} | {r['batch']} | {r['layers']} | {_fmt(e.get('prefill_ms'))} "
                    f"| {_fmt(p.get('prefill_ms'))} | {_fmt(r['eager_prefill_over_predicted'])} |"
                )
        lines += ["", "## Linear attention: fla's chunk kernel vs the zoo's chunked kernel", ""]
        k = data["kernel"]
        if not k:
            lines.append("Not run.")
        elif "error" in k:
            lines.append(f"Failed: {k['error']}")
        else:
            shape = ", ".join(f"{a}={b}" for a, b in k["shape"].items())
            lines += [
                f"{shape}, {k['dtype']}, layout {k['layout']}, {k['decay']} decay; forward only. fla: {k.get('fla')}.",
                "",
                "| kernel | first call s | forward ms (median) | max abs diff vs zoo | max abs zoo output | speed-up |",
                "|---|---|---|---|---|---|",
            ]
            for name, m in k["kernels"].items():
                lines.append(
                    f"| {name} | {_fmt(m['first_call_s'])} | {_fmt(m['forward_ms'])} | {_fmt(m.get('max_abs_diff_vs_zoo'))} "
                    f"| {_fmt(m.get('max_abs_zoo_output'))} | {_fmt(m.get('speedup_over_zoo'))} |"
                )
        notes = sorted({n for r in data["rows"] for n in r["notes"]} | set(data["notes"]))
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes] if notes else []
        lines += ["", "## Skipped", ""] + ([f"- {x}" for x in data["skipped"]] or ["Nothing."])
        lines += ["", "## Errors", ""]
        lines += [f"- {e['what']}: `{e['error']}` (traceback in results.json)" for e in data["errors"]] or [
            "None."
        ]
        return "\n".join(lines) + "\n"
