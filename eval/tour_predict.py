"""The tour's step 5, predicted at a real shape: each architecture's speed-up over its baseline from the speed
simulator (eval/simulator/replay.py, `compute=h100-sxm`: the device model eval.costmodel fitted, every collective
charged to the link model), at the Llama 3 8B shape, as `python -m eval.at_scale` predicts it.

Families (`predict.families` in conf/tour.yaml):
- `kind: generation`: one eval.bench run per architecture (`archs=[<arch>]`, timed apart, so each row carries the
  seconds its prediction took), generation at prompt 1024, 512 new tokens, batch 1 and 16; speed-up = tokens/s over
  the family baseline's at the same degrees, link and batch (prefill and decode step apart too).
- `kind: sequence_parallel`: linear attention's own layout is sequence parallelism (its tensor-parallel layout is
  Llama's, nothing hidden), and it does not decode under SP (one device decodes), so what the simulator predicts for
  it is its training step under SP: eval.bench's
  sequence_parallel section, forward + backward per layer at N tokens over P ranks, of each layer type by the zoo's
  schedule (LASP-2 / LASP-2H) against the baselines' (LASP-1 / ring attention); an architecture's step is the sum
  over its layer pattern (linear "L", the hybrid "LLLN").

A generation family may name `system_overlap`, its baseline under a system-level overlap schedule
(`llama+token_split`, parallel/overlap.py): predicted once more, and each architecture's tokens/s set over it as well
(`vs_overlap_b<batch>`), so the report's line says whether a speed-up survives against the baseline that overlaps
too. An architecture of `archs` in no family gets a row saying so.
"""

import time
from pathlib import Path

from omegaconf import DictConfig

from eval.bench.settings import degrees_label, link_label


def predict_all(cfg: DictConfig, run_dir: Path) -> dict:
    """{"rows": one per architecture of `cfg.archs` (in that order), "commands": {family: the bench command}}."""
    from eval.bench import run_bench_overrides

    spec = cfg.predict
    rows: dict[str, dict] = {}
    commands: dict[str, str] = {}
    for family, fam in spec.families.items():
        archs = [a for a in cfg.archs if a in fam.archs or a == fam.get("baseline")]
        if not archs:
            continue
        overrides = [*spec.common, *fam.overrides]
        if fam.kind == "sequence_parallel":
            for arch in archs:  # one run per architecture, of the methods its layer pattern needs
                pattern = fam.archs[arch]
                methods = ",".join(dict.fromkeys(m for t in pattern for m in (fam.methods[t], fam.against[t])))
                print(f"[tour] predicting {arch} at {spec.shape} ({family})", flush=True)
                started = time.perf_counter()
                run = run_bench_overrides([*overrides, f"sequence_parallel.methods=[{methods}]"], run_dir / "predict" / arch)
                commands[f"{family} ({arch})"] = run["command"]
                rows[arch] = sp_row(arch, fam, run["sequence_parallel"]["timed"], time.perf_counter() - started)
                print(f"[tour] predicted {arch} in {rows[arch]['seconds']:.0f} s", flush=True)
            continue
        baseline = fam.baseline
        results = {}
        for arch in dict.fromkeys([baseline, *archs]):  # the baseline first, once, even where not in archs
            print(f"[tour] predicting {arch} at {spec.shape} ({family})", flush=True)
            started = time.perf_counter()
            results[arch] = run_bench_overrides(alone(overrides, arch), run_dir / "predict" / arch)
            results[arch]["seconds"] = time.perf_counter() - started
            print(f"[tour] predicted {arch} in {results[arch]['seconds']:.0f} s", flush=True)
        commands[family] = results[baseline]["command"].replace(f"archs=[{baseline}] baseline={baseline}", "archs=[<arch>] baseline=<arch>")
        for arch in results:  # the baseline's own row too: 1 by definition, and the seconds it took
            if arch in cfg.archs:
                rows[arch] = generation_row(arch, baseline, results[arch], results[baseline])
        overlapped = fam.get("system_overlap")
        if overlapped:
            print(f"[tour] predicting {overlapped} at {spec.shape} ({family})", flush=True)
            results[overlapped] = run_bench_overrides(alone(overrides, overlapped), run_dir / "predict" / overlapped)
            commands[f"{family}, system overlap"] = results[overlapped]["command"]
            own = _simulated(results[overlapped])
            for arch in results:
                if arch in rows:
                    rows[arch]["overlap_baseline"] = overlapped
                    rows[arch].update({f"vs_overlap_b{b}": r["total_tok_s"] / own[b]["total_tok_s"]
                                       for b, r in _simulated(results[arch]).items() if b in own})  # fmt: skip
    out = []
    for arch in cfg.archs:
        out.append(rows.get(arch) or {"arch": arch, "against": None,
                                      "note": "no family of predict.families lists it: not predicted"})  # fmt: skip
    return {"rows": out, "commands": commands, "shape": spec.shape}


def alone(overrides: list[str], arch: str) -> list[str]:
    """`overrides` for a bench run of `arch` alone: its own baseline, the other architectures' `config_overrides`
    (a preset's, e.g. bench_preset=moe's moe_layer_freq for moe) dropped, which the bench refuses for an
    architecture not in `archs`; a ladder variant keeps its standard sibling's, which it takes (moe_ladder: moe's)."""
    from hydra import compose

    from eval.report import standard_sibling

    others = compose(config_name="bench", overrides=list(overrides)).get("config_overrides") or {}
    own = (arch, standard_sibling(arch))
    return [*overrides, f"archs=[{arch}]", f"baseline={arch}", *[f"~config_overrides.{k}" for k in others if k not in own]]


def _simulated(results: dict) -> dict:
    """{batch: the run's first simulated row at that batch} (one degree point and one link in the tour)."""
    out = {}
    for r in results["rows"]:
        if r["variant"] == "simulated":
            out.setdefault(r["batch"], r)
    return out


def generation_row(arch: str, baseline: str, mine: dict, base: dict) -> dict:
    """One architecture's predicted speed-ups over `baseline` per batch size: tokens/s (prefill + decode of the
    whole generation), prefill and decode step apart."""
    own, ref = _simulated(mine), _simulated(base)
    first = next(iter(own.values()), None)
    row = {"arch": arch, "against": baseline, "seconds": mine["seconds"]}
    if first is None:
        return {**row, "note": "; ".join(mine.get("skipped") or ["no simulated row"])}
    row["at"] = f"{degrees_label(first['degrees'])}, {link_label(first['link'])}"
    row["what"] = "generation"
    for batch, r in own.items():
        b = ref.get(batch)
        if b is None:
            continue
        row[f"speedup_b{batch}"] = r["total_tok_s"] / b["total_tok_s"]
        row[f"prefill_speedup_b{batch}"] = b["prefill_ms"] / r["prefill_ms"]
        row[f"decode_speedup_b{batch}"] = b["decode_ms_per_step"] / r["decode_ms_per_step"]
        row[f"tok_s_b{batch}"] = r["total_tok_s"]
    return row


def sp_row(arch: str, fam: DictConfig, timed: list[dict], seconds: float) -> dict:
    """One architecture's training step under sequence parallelism: the per-layer fwd + bwd times of its layer
    pattern by the zoo's schedule over the same pattern by the baselines' methods."""
    pattern = fam.archs[arch]
    ms = {r["method"]: r for r in timed}
    point = next(iter(timed), None)
    row = {"arch": arch, "seconds": seconds}
    missing = [m for t in pattern for m in (fam.methods[t], fam.against[t]) if m not in ms]
    if point is None or missing:
        return {**row, "against": None, "note": f"no timed row of {sorted(set(missing))}"}
    row["against"] = " / ".join(dict.fromkeys(ms[fam.against[t]]["label"] for t in pattern))
    mine = sum(ms[fam.methods[t]]["fwd_bwd_ms"] for t in pattern)
    theirs = sum(ms[fam.against[t]]["fwd_bwd_ms"] for t in pattern)
    row.update({
        "at": f"sp={point['p']}, {point['link']}",
        "what": f"training step (fwd + bwd), {point['n']:,} tokens, layers {pattern}",
        "speedup_b1": theirs / mine,
        "schedule": " + ".join(dict.fromkeys(ms[fam.methods[t]]["label"] for t in pattern)),
    })  # fmt: skip
    return row
