"""The layout planner: every training (or generation) layout of an architecture on a cluster, predicted, ranked.

Training (`plan_training`): every dp x tp x ep x sp the architecture's layout takes on `gpus` GPUs (tp and the
dimensions inside it within a node), FSDP on / off, each activation-checkpointing mode and micro-batch whose
gradient accumulation reaches the global batch, predicted by the simulator's training replay
(eval.simulator.training: step time, tokens/s per device, MFU, exposed communication) and its memory replay
(eval.simulator.memory: peak bytes per rank); a layout fits when its peak is within the device's memory. Ranked
by tokens/s; the best one's `train.pretrain` command line is printed.

Generation (`plan_generation`): every tp (x ep) within a node, the prefill and decode step replayed
(eval.simulator.replay), the static cache's memory; the best tokens/s whose decode step meets `latency_ms`.

Links per mesh dimension: a group inside one node runs on the node's NVLink preset; one that spans nodes on a
`HierarchicalLink` (NVLink inside, one NIC per GPU between nodes). Ranks are numbered node by node, tp innermost,
then sp, ep, dp (parallel.init_mesh's order), so a dimension's group spans `size x stride` consecutive ranks.

Memory is replayed at micro-batch 1 and 2 for each (mesh, engine, AC) and taken as linear in the micro-batch
between and beyond them (activations and the step's temporaries grow with the tokens, parameters and optimizer
state do not): two replays per layout family instead of one per micro-batch (one where the family has one
micro-batch). Time is replayed for every layout that fits (`prune=False`: for every layout); what cannot fit is
not replayed at all (`_replay`: a family whose lighter setting is already over the memory). Every replay is of
shallow stacks of the model's layers, combined to its depth (eval.simulator.stack: exact where the layers
repeat), so a plan's time does not grow with the depth. The replays run on a process per core (`workers`).
"""

import math
import multiprocessing
import sys
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, replace

import torch
from tqdm.auto import tqdm

import models
from eval.simulator.device import DeviceModel
from eval.simulator.memory import GiB, predict_inference_memory
from eval.simulator.replay import build_meta, record_generation, release
from eval.simulator.stack import (
    MEMORY_SETTLE,
    TIME_SETTLE,
    memory_from_parts,
    memory_of,
    predict_from_parts,
    stack_terms,
    time_parts,
    train_flops,
)
from eval.simulator.training import EXPERT_DIM, FSDP_DIM, TrainLayout
from parallel.fsdp import shards_over
from parallel.link import HierarchicalLink, get_link

# Device memory per GPU, from the spec sheets (bytes). What fits is judged against this less `headroom_gib`.
DEVICE_MEMORY_GIB = {"h100-sxm": 80, "h200": 141, "a100-sxm": 80, "a100-40gb": 40, "a800": 80, "a30": 24}
ORDER = ("dp", "ep", "sp", "tp")  # parallel.init_mesh's mesh order: tp varies fastest


def strides(degrees: dict[str, int]) -> dict[str, int]:
    """Each dimension's rank stride in the mesh (tp 1, sp tp, ep sp x tp, dp ep x sp x tp)."""
    out, stride = {}, 1
    for dim in reversed(ORDER):
        out[dim] = stride
        stride *= degrees.get(dim, 1)
    return out


def links_for(layout: TrainLayout, gpus_per_node: int, intra: str, inter: str) -> dict:
    """{dimension: link} for every mesh dimension and FSDP's groups (module docstring)."""
    degrees, stride = layout.degrees, strides(layout.degrees)
    intra_link, inter_link = get_link(intra), get_link(inter)

    def link(size: int, step: int):
        if size * step <= gpus_per_node:
            return intra_link
        per_node = max(1, gpus_per_node // step)
        return HierarchicalLink(
            f"{intra}+{inter}", intra_link, inter_link, ranks_per_node=per_node, nics_per_node=per_node
        )

    out = {dim: link(degrees[dim], stride[dim]) for dim in ORDER}
    # FSDP's groups: dp x ep x sp (stride tp) for the replicated parameters, dp x sp for the experts.
    out[FSDP_DIM] = link(layout.dp * layout.ep * layout.sp, layout.tp)
    out[EXPERT_DIM] = link(layout.dp * layout.sp, layout.tp)
    return out


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(
    arch: str, config, gpus: int, gpus_per_node: int, tp=None, ep=None, sp=None
) -> tuple[list[dict], list[dict]]:
    """(meshes the architecture takes, [{degrees, why}] it refuses): tp x ep x sp within a node, dp the rest."""
    entry = models.get(arch)
    dims = set(entry.degrees)
    choices = {
        "tp": tp or (divisors(gpus_per_node) if "tp" in dims else [1]),
        "ep": ep or (divisors(gpus_per_node) if "ep" in dims else [1]),
        "sp": sp or (divisors(gpus_per_node) if "sp" in dims else [1]),
    }
    ok, refused = [], []
    for t in choices["tp"]:
        for e in choices["ep"]:
            for s in choices["sp"]:
                inner = t * e * s
                if inner > gpus_per_node or gpus % inner:
                    continue
                degrees = {"dp": gpus // inner, "ep": e, "sp": s, "tp": t}
                try:
                    entry.check_layout(config, {k: v for k, v in degrees.items() if k != "dp"})
                except ValueError as err:
                    refused.append({"degrees": degrees, "why": str(err)})
                    continue
                ok.append(degrees)
    return ok, refused


def plan_training(
    arch: str,
    config,
    *,
    gpus: int,
    gpus_per_node: int,
    device: DeviceModel,
    memory_gib: float,
    seq_len: int,
    global_batch_tokens: int,
    micro_batches=(1, 2, 4),
    ac_modes=("none", "selective", "full"),
    fsdp=(True, False),
    intra: str = "nvlink-h100",
    inter: str = "ib-hdr-200g",
    tp=None,
    ep=None,
    sp=None,
    workers: int = 1,
    prune: bool = True,
    show_progress: bool = True,
) -> dict:
    """Every layout predicted (module docstring): {"rows": [...] ranked, fitting first; "refused": [...]}, its
    replays on `workers` processes. With `prune`, a layout whose memory does not fit is not timed (its row has
    no tokens/s), nor replayed in memory where a lighter one of its family is over already (no peak either; its
    `not_replayed` says why). A progress bar on stderr counts the layouts done and left (`show_progress=False`)."""
    if gpus % gpus_per_node and gpus > gpus_per_node:
        raise ValueError(f"gpus={gpus} is not a whole number of nodes of gpus_per_node={gpus_per_node}.")
    if global_batch_tokens % seq_len:
        raise ValueError(f"global_batch_tokens={global_batch_tokens} is not a multiple of seq_len={seq_len}.")
    sequences = global_batch_tokens // seq_len
    found, refused = meshes(arch, config, gpus, gpus_per_node, tp, ep, sp)
    layouts = []
    for degrees in found:
        replicas = degrees["dp"] * degrees["ep"]  # ranks with sequences of their own (sp and tp share one)
        for use_fsdp in fsdp:
            if use_fsdp and not shards_over(degrees) and False in fsdp:
                continue  # one replica: FSDP on and off are the same run
            for ac in ac_modes:
                for mb in micro_batches:
                    if sequences % (replicas * mb):
                        refused.append({"degrees": degrees, "why": f"{sequences} sequences per step do not split "
                                        f"into {replicas} replicas x micro-batch {mb}"})  # fmt: skip
                        continue
                    layouts.append(TrainLayout(**degrees, fsdp=use_fsdp, ac=ac, micro_batch=mb, seq_len=seq_len,
                                               grad_accum=sequences // (replicas * mb)))  # fmt: skip
    # the full depth from replays of shallow stacks (eval.simulator.stack): memory's, time's
    terms = stack_terms(arch, config, MEMORY_SETTLE), stack_terms(arch, config, TIME_SETTLE)
    for shallow, _ in terms[1]:
        train_flops(arch, shallow, seq_len)  # counted here once, not in each worker
    bar = tqdm(
        total=len(layouts), desc="[plan] layouts", unit="layout", file=sys.stderr, disable=not show_progress
    )
    limit = memory_gib * GiB if prune else math.inf
    peaks, skipped, times = _replay(arch, terms, layouts, limit, bar.update, workers,
                                    lambda layout: (device, links_for(layout, gpus_per_node, intra, inter)))  # fmt: skip
    bar.close()
    rows = []
    for layout in layouts:
        peak = peaks.get(layout)
        row = {"label": layout.label(), "layout": asdict(layout), **layout.degrees, "fsdp": layout.fsdp,
               "ac": layout.ac, "micro_batch": layout.micro_batch, "grad_accum": layout.grad_accum,
               "tokens_per_s_per_device": None, "mfu": None, "step_s": None, "exposed_s": None, "exposed_share": None,
               "peak_gib": None if peak is None else peak / GiB, "fits": peak is not None and peak <= memory_gib * GiB,
               "not_replayed": skipped.get(layout)}  # fmt: skip
        if layout in times:
            links = links_for(layout, gpus_per_node, intra, inter)
            pred = predict_from_parts(times[layout], terms[1], layout, device, links)
            row.update({"tokens_per_s_per_device": pred["tokens_per_s_per_device"], "mfu": pred["mfu"],
                        "step_s": pred["step_s"], "exposed_s": pred["exposed_s"],
                        "exposed_share": pred["exposed_s"] / pred["step_s"]})  # fmt: skip
        rows.append(row)
    # fitting first, fastest first; then the rest, the least memory first
    rows.sort(
        key=lambda r: (
            not r["fits"],
            -r["tokens_per_s_per_device"] if r["fits"] else r["peak_gib"] or math.inf,
        )
    )
    return {"rows": rows, "refused": refused, "best": next((r for r in rows if r["fits"]), None)}


# The activation-checkpointing modes from the least memory to the most (at one mesh, engine and micro-batch).
AC_BY_MEMORY = ("full", "selective", "none")


def _replay(arch: str, terms, layouts: list[TrainLayout], limit: float, done, workers: int, where):
    """The replays of `layouts`, each once, on `workers` processes: ({layout: peak bytes}, {layout: why it was not
    replayed}, {layout: its shallow stacks' time parts}); `done()` once per layout finished. `terms`: the shallow
    stacks (eval.simulator.stack.stack_terms) of the memory replays and of the time replays.

    Memory per family (mesh, engine, AC): at micro-batches 1 and 2 (or at its one micro-batch), one replay per
    shallow stack; then the time of each of its layouts whose peak is within `limit` (`where(layout)`: the device
    and links it is timed on). What cannot fit is not replayed: memory grows with the micro-batch and from full to
    selective to no activation checkpointing, so a family whose first micro-batch is over `limit` is not replayed
    at the second, and one whose lightest AC mode is over it has its other AC modes skipped."""
    families: dict = {}
    for layout in layouts:
        families.setdefault((tuple(layout.degrees.values()), layout.fsdp, layout.ac), []).append(layout)
    modes = {}  # (mesh, engine) -> its families, the lightest AC first
    for family in families:
        modes.setdefault(family[:2], []).append(family)
    for group in modes.values():
        group.sort(
            key=lambda family: (
                AC_BY_MEMORY.index(family[2]) if family[2] in AC_BY_MEMORY else len(AC_BY_MEMORY)
            )
        )
    micro = {family: _memory_micro_batches(members) for family, members in families.items()}
    memory_terms, time_terms = terms
    peaks, skipped, times, found = {}, {}, {}, {}

    def memory(family, mb) -> dict:
        layout = replace(families[family][0], micro_batch=mb, grad_accum=1)
        return {
            ("memory", family, mb, i): (memory_of, (arch, shallow, layout))
            for i, (shallow, _) in enumerate(memory_terms)
        }

    def skip(family, why: str) -> None:
        for layout in families[family]:
            skipped[layout] = why
            done()

    def then(key, results) -> dict:
        """The jobs a finished one makes possible (the order in the docstring)."""
        if key[0] == "time":
            layout = key[1]
            if all(("time", layout, i) in results for i in range(len(time_terms))):
                times[layout] = [results[("time", layout, i)] for i in range(len(time_terms))]
                done()
            return {}
        _, family, mb, _ = key
        if not all(("memory", family, mb, i) in results for i in range(len(memory_terms))):
            return {}
        parts = [results[("memory", family, mb, i)] for i in range(len(memory_terms))]
        found[family, mb] = memory_from_parts(parts, memory_terms).peak_bytes
        follow = {}
        first = micro[family][0]
        if mb == first and limit < math.inf and family == modes[family[:2]][0]:
            # the lightest AC mode: the others follow if it fits
            for other in modes[family[:2]][1:]:
                if found[family, mb] <= limit:
                    follow.update(memory(other, micro[other][0]))
                else:
                    skip(other, f"not replayed: ac={family[2]} (less memory) needs {found[family, mb] / GiB:.1f} "
                                f"GiB at micro-batch {mb}")  # fmt: skip
        if mb == first and found[family, mb] > limit and len(micro[family]) > 1:
            for layout in families[family]:  # micro-batch 1 is over the limit: larger ones are too
                if layout.micro_batch != first:
                    skipped[layout] = (
                        f"not replayed: micro-batch {first} needs {found[family, mb] / GiB:.1f} GiB"
                    )
                    done()
                else:
                    peaks[layout] = found[family, mb]
                    done()
            return follow
        if mb == first and len(micro[family]) > 1:
            follow.update(memory(family, micro[family][1]))
            return follow
        for layout in families[family]:  # every micro-batch replayed: the family's peaks, its layouts timed
            m = layout.micro_batch
            if (family, m) in found:
                peaks[layout] = found[family, m]
            else:  # linear in the micro-batch (module docstring)
                peaks[layout] = found[family, 1] + (found[family, 2] - found[family, 1]) * (m - 1)
            if peaks[layout] > limit:
                done()
                continue
            device, links = where(layout)
            for i, (shallow, _) in enumerate(time_terms):
                follow[("time", layout, i)] = (time_parts, (arch, shallow, layout, device, links))
        return follow

    start = {}
    for group in modes.values():
        # with a limit, the lightest AC mode first (the others wait on it); without, every family at once
        for family in group[:1] if limit < math.inf else group:
            start.update(memory(family, micro[family][0]))
    run_jobs(start, then, workers)
    return peaks, skipped, times


def _memory_micro_batches(layouts: list[TrainLayout]) -> tuple[int, ...]:
    """The micro-batches a family's memory is replayed at: 1 and 2, linear in between and beyond (activations and
    the step's temporaries grow with the tokens, parameters and optimizer state do not); its one where it has one."""
    micro_batches = {layout.micro_batch for layout in layouts}
    return tuple(micro_batches) if len(micro_batches) == 1 else (1, 2)


def run_jobs(jobs: dict, then, workers: int) -> dict:
    """{key: function(*args)} for `jobs` ({key: (function, args)}) and for the jobs that `then(key, results)` returns
    as each one ends, on `workers` processes (1: in this one)."""
    results: dict = {}
    # the memory replays first (the longest), so that the processes end together
    queue = deque(sorted(jobs, key=lambda key: key[0] != "memory"))
    jobs = dict(jobs)

    def done(key, value) -> None:
        results[key] = value
        more = then(key, results)
        jobs.update(more)
        queue.extend(more)

    if workers <= 1:
        while queue:
            key = queue.popleft()
            done(key, jobs[key][0](*jobs[key][1]))
        return results
    # Workers forked from this process, as torch's DataLoader forks its workers: they start at once with everything
    # imported and the FLOP counts cached (a fork server or spawn would import torch and transformers again,
    # seconds of a plan that takes tens); each job builds its own models and process group. This process works
    # too, on the jobs at the queue's other end.
    context = multiprocessing.get_context("fork")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ProcessPoolExecutor(workers - 1, mp_context=context, initializer=_one_thread) as pool:
            pending: dict = {}
            while queue or pending:
                while queue and len(pending) < 2 * (workers - 1):
                    key = queue.popleft()
                    pending[pool.submit(jobs[key][0], *jobs[key][1])] = key
                if queue:
                    key = queue.pop()
                    done(key, jobs[key][0](*jobs[key][1]))
                else:
                    wait(pending, return_when=FIRST_COMPLETED)
                for future in [f for f in pending if f.done()]:
                    done(pending.pop(future), future.result())
    finally:
        torch.set_num_threads(threads)
    return results


def _one_thread() -> None:
    import torch

    torch.set_num_threads(
        1
    )  # a worker per core: torch's own threads would only compete with the other workers


def pretrain_command(arch: str, row: dict, shape: dict, seq_len: int, gpus_per_node: int) -> str:
    """The `train.pretrain` command line of a planned layout: torchrun over the nodes, the model at the bench
    shape's fields (`model.config.<field>=`), the layout, engine, AC mode and batch the plan chose."""
    gpus = row["dp"] * row["ep"] * row["sp"] * row["tp"]
    nodes, per_node = max(1, gpus // gpus_per_node), min(gpus, gpus_per_node)
    # bf16 compute: FSDP's mixed precision where FSDP shards over data ranks, Lightning's autocast otherwise
    precision = (
        "parallel.param_dtype=bfloat16"
        if row["fsdp"] and shards_over(row)
        else "trainer.precision=bf16-mixed"
    )
    # `++`: a field the model group's config does not list is added (vocab_size among them: the embedding the plan
    # sized, which holds a smaller tokenizer's ids too); a ladder variant is its sibling's group with the ladder
    # schedule on every layer, as the variant's bench config has it.
    fields = " ".join(f"++model.config.{k}={v}" for k, v in shape.items() if k != "name")
    sibling = models.standard_sibling(arch)
    model = f"model={sibling} model.config.residual=ladder" if sibling else f"model={arch}"
    return (
        f"torchrun --nnodes={nodes} --nproc-per-node={per_node} -m train.pretrain {model} {fields} "
        f"parallel.dp={row['dp']} parallel.tp={row['tp']} parallel.ep={row['ep']} parallel.sp={row['sp']} "
        f"parallel.fsdp={str(row['fsdp']).lower()} {precision} "
        f"trainer.activation_checkpointing={row['ac']} data.batch_size={row['micro_batch']} data.seq_len={seq_len} "
        f"trainer.accumulate_grad_batches={row['grad_accum']}"
    )


def plan_generation(
    arch: str,
    config_at,
    *,
    gpus_per_node: int,
    device: DeviceModel,
    memory_gib: float,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    latency_ms: float | None,
    intra: str = "nvlink-h100",
    log=print,
) -> dict:
    """Every tp (x ep) within a node for generation (module docstring). `config_at(degrees)`: the config there."""
    entry = models.get(arch)
    dims = [d for d in ("tp", "ep") if d in entry.degrees]
    options = [
        {d: n for d, n in zip(dims, combo, strict=True)} for combo in _products(dims, gpus_per_node)
    ] or [{}]
    rows, refused = [], []
    for degrees in options:
        label = " x ".join(f"{d}{n}" for d, n in degrees.items() if n > 1) or "1 GPU"
        config = config_at(degrees)
        try:
            entry.check_layout(config, degrees)
        except ValueError as err:
            refused.append({"degrees": degrees, "why": str(err)})
            continue
        log(f"[plan] generate {label}")
        model = build_meta(arch, config, degrees)
        try:
            run = record_generation(model, batch, prompt_len, new_tokens)
        finally:
            release()
        pred = run.predict(device, get_link(intra))
        memory = predict_inference_memory(arch, config, degrees, batch, prompt_len, prompt_len + new_tokens)
        decode_ms = 1e3 * pred["decode"]["time"]
        gpus = math.prod(degrees.values()) if degrees else 1
        rows.append({
            "label": label, **degrees, "gpus": gpus, "tokens_per_s": pred["tok_s"], "tokens_per_s_per_gpu": pred["tok_s"] / gpus,
            "decode_ms": decode_ms, "prefill_ms": 1e3 * pred["prefill"]["time"], "peak_gib": memory["peak_bytes"] / GiB,
            "fits": memory["peak_bytes"] <= memory_gib * GiB,
            "meets_latency": latency_ms is None or decode_ms <= latency_ms,
        })  # fmt: skip
    rows.sort(key=lambda r: (not (r["fits"] and r["meets_latency"]), -r["tokens_per_s"]))
    best = next((r for r in rows if r["fits"] and r["meets_latency"]), None)
    return {"rows": rows, "refused": refused, "best": best}


def _products(dims: list[str], limit: int):
    if not dims:
        return []
    combos = [()]
    for _ in dims:
        combos = [c + (d,) for c in combos for d in divisors(limit)]
    return [c for c in combos if math.prod(c) <= limit and limit % math.prod(c) == 0]
