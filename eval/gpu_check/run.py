"""The run: `main` reads the flags, refuses to replace a report, then measures in two phases and rewrites the
report after each measurement. Phase 1, eager: every item at every batch size (cheap, so every row gets a
measured number first). Phase 2, compiled and the fla kernel check, in the planner's order and within the
time budget. The device model's predictions are submitted at the start and collected as they finish.
"""

import sys
from pathlib import Path

import torch

from eval.gpu_check.build import free, plan_items, size_items
from eval.gpu_check.environment import environment
from eval.gpu_check.errors import error_record
from eval.gpu_check.kernel import kernel_check
from eval.gpu_check.planner import MIN_LAYERS, CompileClock, choose_layers, compiled_queue
from eval.gpu_check.predictions import Predictions
from eval.gpu_check.report import Report
from eval.gpu_check.settings import parse_args
from eval.gpu_check.timed import run_compiled, run_eager


def main(argv: list[str] | None = None) -> Path:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, s = parse_args(argv)
    # the one rule for every command that writes a report: never replace one unasked
    from train.cli import exit_if_output_exists

    exit_if_output_exists(args.out, args.overwrite, flag="--overwrite", other="--out <dir>")
    device = torch.device(s.device)
    report = Report(Path(args.out), s, argv)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # a shared CPU: more threads than free cores stall every parallel region
    preds = None
    try:
        report.env = environment(device)
        report.write()
        items = plan_items(s)
        size_items(items, s, report.errors)
        report.items = items
        preds = Predictions(s)
        for item in items:
            for batch in s.batches:
                preds.submit(item, batch, item.layers)
                report.row(item, batch, item.layers)
        report.merge_predictions(preds)
        report.write()

        # 1. Eager, every item and batch size (cheap, so first: every row gets a measured number).
        for item in items:
            if report.elapsed() > s.budget_s:
                report.skipped.append(
                    f"eager {item.shape} {item.label} (batches {s.batches}): at {report.elapsed():.0f} s, past the "
                    f"{s.budget_s:.0f} s budget"
                )
                continue
            run_eager(item, item.layers, s.batches, s, device, report)
            preds.collect()
            report.merge_predictions(preds)
            report.write()

        # 2. Compiled (CUDA graphs on a GPU) and the fla kernel check, as compiled_queue orders them.
        clock = CompileClock(*s.compile_prior)
        queue = compiled_queue(items, s.compiled_batches)
        for n, (kind, item, batch, policy) in enumerate(queue):
            if kind == "kernel":
                if report.elapsed() + (20.0 if device.type == "cuda" else 0.0) > s.budget_s:
                    report.skipped.append(
                        f"fla / zoo kernel check: at {report.elapsed():.0f} s, near the budget"
                    )
                    continue
                try:
                    report.kernel = kernel_check(s, device)
                except Exception as err:  # noqa: BLE001 - reported
                    report.kernel = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                    report.errors.append(error_record("kernel check", err))
                finally:
                    free(device)
                report.write()
                continue
            what = f"compiled {item.shape} {item.label} batch {batch}"
            fair_left = sum(1 for q in queue[n:] if q[3] == "fair")
            layers, need = choose_layers(item, batch, policy, fair_left, s, clock, report)
            if layers is None:
                report.skipped.append(
                    f"{what}: about {need:.0f} s needed, {max(0.0, s.budget_s - report.elapsed()):.0f} s left of "
                    f"the {s.budget_s:.0f} s budget (not even {MIN_LAYERS} layers fit its share)"
                )
                row = report.row(item, batch, item.layers)
                row["compiled"] = row["compiled"] or {"status": "skipped (time)"}
                report.write()
                continue
            if layers != item.layers:
                report.notes.append(
                    f"{what}: compiled with {layers} of {item.layers_full} layers ({item.layers} were estimated at "
                    f"{need:.0f} s, past its share of the time budget); its eager and predicted numbers at {layers} too"
                )
                preds.submit(item, batch, layers)
            run_compiled(item, layers, batch, s, device, report, eager_too=layers != item.layers)
            compiled = report.row(item, batch, layers).get("compiled") or {}
            if "compile_s" in compiled:
                clock.add(layers, compiled["compile_s"])
            preds.collect()
            report.merge_predictions(preds)
            report.write()

        preds.collect(wait_s=max(30.0, s.budget_s + 60.0 - report.elapsed()))
        for key in list(preds.futures):
            report.skipped.append(
                f"prediction {key[0]} {key[1]} batch {key[2]} layers {key[3]}: not finished in time"
            )
        report.merge_predictions(preds)
        report.finished = True
    except Exception as err:  # noqa: BLE001 - the report says what happened
        report.errors.append(error_record("gpu_check", err))
    finally:
        if preds is not None:
            preds.close()
        torch.set_num_threads(threads)
        report.write()
    print(f"[gpu_check] done in {report.elapsed():.0f} s: {report.out / 'README.md'}", flush=True)
    return report.out
