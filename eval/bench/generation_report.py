"""What the generation section's rows mean and how they are shown: speed-ups, hidden fractions, tables, plots, notes.

`add_comparisons` adds to each row the speed-up over the baseline architecture and the hidden fraction
(T_base - T_arch) / (T_base - T_upper_bound) (eval.report.hidden_fraction), and, where a device preset predicts a
point of one rank (tp=1: the baseline unsharded, no collectives), the speed-up over that single GPU; the tables'
columns, the plots of
speed-up and hidden fraction vs batch and degree, the notes on what the rows can and cannot claim and the
section's introduction follow. Nothing here knows an architecture: archs are names in the rows.
"""

from pathlib import Path

from eval import report
from eval.bench.degrees import degrees_key, degrees_label, ranks
from eval.bench.settings import ComputeSettings
from eval.report import hidden_fraction

UPPER_BOUND_OF = {"simulated": "upper_bound", "real": "upper_bound_real"}


def add_comparisons(rows: list[dict], baseline: str, min_comm_fraction: float) -> None:
    """Speed-up over the baseline arch in the same variant, and hidden fractions, added in place."""

    def key(arch, r, variant, link, program=None):
        return (arch, degrees_key(r["degrees"]), variant, link, r["batch"], program or r.get("program", "eager"))

    index = {key(r["arch"], r, r["variant"], r["link"]): r for r in rows}
    for r in rows:  # the compiled program against the eager one, same architecture and variant, same run
        eager = index.get(key(r["arch"], r, r["variant"], r["link"], "eager"))
        compiled = r.get("program") == "compiled"
        r["speedup_compiled"] = r["decode_tok_s"] / eager["decode_tok_s"] if compiled and eager else None
    for r in rows:
        base = index.get(key(baseline, r, r["variant"], r["link"]))
        r["speedup_prefill"] = base["prefill_ms"] / r["prefill_ms"] if base else None
        r["speedup_decode"] = r["decode_tok_s"] / base["decode_tok_s"] if base else None
        r["hidden_fraction_prefill"] = r["hidden_fraction_decode"] = None
        r["exposed_hidden_fraction_decode"] = None
        upper = index.get(key(baseline, r, UPPER_BOUND_OF.get(r["variant"]), None))
        if base is None or upper is None or r["arch"] == baseline:
            continue
        r["hidden_fraction_prefill"] = hidden_fraction(
            base["prefill_ms"], r["prefill_ms"], upper["prefill_ms"], min_comm_fraction
        )
        r["hidden_fraction_decode"] = hidden_fraction(
            base["decode_ms_per_step"], r["decode_ms_per_step"], upper["decode_ms_per_step"], min_comm_fraction
        )
        # Simulated only: the same question asked of the virtual clock's exposed communication, which
        # does not depend on compute-time noise between architectures.
        if r.get("decode_exposed_ms") is not None and base.get("decode_exposed_ms"):
            r["exposed_hidden_fraction_decode"] = 1 - r["decode_exposed_ms"] / base["decode_exposed_ms"]
    # With a device preset, a point of one rank (tp=1, ep=1) is the single-GPU baseline: the baseline arch
    # unsharded, no collectives (the same prediction in every variant). Every row's speed-up over it.
    single = {(r["batch"], r.get("program", "eager")): r for r in rows
              if r["arch"] == baseline and ranks(r["degrees"]) == 1 and not r["variant"].startswith("real")}  # fmt: skip
    for r in rows:
        one = single.get((r["batch"], r.get("program", "eager")))
        r["speedup_prefill_vs_one_gpu"] = one["prefill_ms"] / r["prefill_ms"] if one else None
        r["speedup_decode_vs_one_gpu"] = r["decode_tok_s"] / one["decode_tok_s"] if one else None
    # MoE: the token all-to-all time exposed per layer against the baseline's (both from the virtual clock).
    # Against `moe` this mixes the schedule with the bytes sent (ScMoE routes top-1, moe top-2).
    for r in rows:
        base = index.get(key(baseline, r, r["variant"], r["link"]))
        for phase in ("prefill", "decode"):
            mine, theirs = r.get(f"{phase}_a2a_exposed_ms_per_layer"), (base or {}).get(f"{phase}_a2a_exposed_ms_per_layer")
            if mine is not None and theirs:
                r[f"{phase}_a2a_exposed_vs_baseline"] = mine / theirs


# --- tables and plots -------------------------------------------------------------------------

TABLE_COLUMNS = [
    ("arch", "arch"),
    ("degrees", "degrees"),
    ("batch", "batch"),
    ("prefill_ms", "prefill ms"),
    ("prefill_spread", "prefill min-max"),
    ("decode_tok_s", "decode tok/s"),
    ("decode_spread", "decode tok/s min-max"),
    ("speedup_decode", "decode speed-up"),
    ("speedup_prefill", "prefill speed-up"),
    ("hidden_fraction_decode", "hidden (decode)"),
    ("hidden_fraction_prefill", "hidden (prefill)"),
    ("decode_kernels_per_step", "kernels/step"),
    ("speedup_compiled", "compiled / eager"),
    ("decode_comm_calls", "calls/step"),
    ("decode_comm_bytes", "bytes/step"),
    ("prefill_comm_bytes", "bytes/prefill"),
]
# Shown where the run has a single-GPU point (tp=1 with a device preset): speed-ups over the baseline on one GPU.
ONE_GPU_COLUMNS = [
    ("speedup_decode_vs_one_gpu", "decode speed-up vs 1 GPU"),
    ("speedup_prefill_vs_one_gpu", "prefill speed-up vs 1 GPU"),
]
SIMULATED_COLUMNS = [
    ("decode_exposed_ms", "exposed ms/step"),
    ("decode_comm_busy_ms", "link busy ms/step"),
    ("decode_exposed_share", "exposed / link busy"),
    ("exposed_hidden_fraction_decode", "hidden (exposed, decode)"),
]
# Plots: the files `make_plots` writes (eval.tour copies some of them into its report).
PLOTS = ("speedup_vs_batch", "speedup_vs_degree", "hidden_fraction", "hidden_fraction_exposed")


def variant_key(row: dict) -> str:
    key = f"{row['variant']}:{row['link']}" if row["link"] else row["variant"]
    return f"{key} (compiled)" if row.get("program") == "compiled" else key


def display_rows(rows: list[dict]) -> list[dict]:
    """Rows as tables show them: degrees as `tp=2`, min-max spreads as one cell."""
    shown = []
    for r in rows:
        d = dict(r)
        d["degrees"] = degrees_label(r["degrees"])
        d["prefill_spread"] = f"{r['prefill_ms_min']:.4g}-{r['prefill_ms_max']:.4g}"
        d["decode_spread"] = f"{r['decode_tok_s_min']:.4g}-{r['decode_tok_s_max']:.4g}"
        shown.append(d)
    return shown


def _degree_axis(rows: list[dict]) -> str:
    dims = sorted({dim for r in rows for dim in r["degrees"]})
    return f"{dims[0]} degree" if len(dims) == 1 else f"ranks ({' x '.join(dims)})"


def make_plots(rows: list[dict], archs: list[str], baseline: str, out_dir: Path) -> dict[str, Path]:
    """Decode speed-up vs batch and vs degree (ranks), hidden fraction per architecture vs batch; one panel
    per variant (upper-bound variants are the reference, not plotted)."""
    if not rows:  # only the sequence-parallel section ran
        return {}
    variants = [v for v in dict.fromkeys(variant_key(r) for r in rows) if not v.startswith("upper_bound")]
    others = [a for a in archs if a != baseline]

    def pick(sel, arch, degrees, batch, key):
        for r in sel:
            if r["arch"] == arch and degrees_key(r["degrees"]) == degrees and r["batch"] == batch:
                return r.get(key)
        return None

    def panels(key, x_axis, only=None):
        out = {}
        for v in variants:
            if only and not v.startswith(only):
                continue
            sel = [r for r in rows if variant_key(r) == v]
            points = sorted({degrees_key(r["degrees"]) for r in sel}, key=lambda k: ranks(dict(k)))
            batches = sorted({r["batch"] for r in sel})
            if x_axis == "batch":
                out[v] = {
                    f"{a} {degrees_label(dict(d))}": (batches, [pick(sel, a, d, b, key) for b in batches])
                    for a in others
                    for d in points
                }
            else:
                xs = [ranks(dict(d)) for d in points]
                out[v] = {f"{a} b{b}": (xs, [pick(sel, a, d, b, key) for d in points]) for a in others for b in batches}
        return out

    plots = {
        "speedup_vs_batch": (panels("speedup_decode", "batch"), "batch size", f"decode speed-up over {baseline}"),
        "speedup_vs_degree": (panels("speedup_decode", "degree"), _degree_axis(rows), f"decode speed-up over {baseline}"),
        "hidden_fraction": (
            panels("hidden_fraction_decode", "batch"),
            "batch size",
            f"hidden fraction (decode) vs {baseline}",
        ),
        "hidden_fraction_exposed": (
            panels("exposed_hidden_fraction_decode", "batch", only="simulated"),
            "batch size",
            "hidden fraction of exposed comm (decode)",
        ),
    }
    # A hidden fraction is 0..1 where the schedule hides some of the baseline's communication; a slower
    # architecture can sit at -12 or -15, which would flatten every other line: those are clipped to the edge
    # of HIDDEN_FRACTION_RANGE and counted in the panel's title.
    clipped = {"hidden_fraction": HIDDEN_FRACTION_RANGE, "hidden_fraction_exposed": HIDDEN_FRACTION_RANGE}
    images = {}
    for name, (data, xlabel, ylabel) in plots.items():
        if data:
            images[name] = report.plot_lines(
                out_dir / f"{name}.png", data, xlabel=xlabel, ylabel=ylabel, hline=1.0, logx=True,
                ylim=clipped.get(name),
            )
    return images


HIDDEN_FRACTION_RANGE = (-1.0, 1.5)

# --- notes ------------------------------------------------------------------------------------


def device_model_note(settings: ComputeSettings) -> str:
    """What rows predicted by a device model (`compute` a device preset) are."""
    compute, dm = settings.setting, settings.constants
    cache = (
        "a static KV cache of prompt + new tokens, read in full at every step as gpt-fast's"
        if settings.static_cache
        else "the architecture's default growing cache"
    )
    return (
        f"Simulated and upper-bound rows are the device model's prediction for {compute}, not timings: each aten op "
        f"of the model's own forward (built on the meta device in bfloat16, rank 0's shards) is charged to {compute}'s "
        f"roofline, max(FLOPs / (peak x {dm.get('eff_flops')}), bytes / (HBM x {dm.get('eff_hbm')})) + "
        f"{dm.get('kernel_overhead_us')} us per kernel (elementwise ops fused; attention as the "
        f"`{settings.attention_program}` program, eval.simulator.attention.ATTENTION_PROGRAMS), contention {dm.get('contention')} "
        f"(latency-bound link time) to {dm.get('contention_bw', dm.get('contention'))} (bandwidth-bound), "
        f"{dm.get('collective_launch_us', 0)} us of compute-stream time per collective of the prefill (launched "
        "outside a CUDA graph; the decode step is one) (eval.costmodel's constants, settings `device_model`), and the link model's collectives are placed where "
        "forward() issues and waits them. Prefill is one recorded forward; a decode step is one recorded step with "
        f"the cache filled to the middle of the generation ({cache}), times the decode steps. Nothing is timed on "
        "this machine: the rows are deterministic (min = max = median, no warm-up or repeats) and any shape runs. "
        "The upper bound is the same prediction with free communication. A point of one rank (tp=1) is the "
        "single-GPU baseline: the model unsharded, nothing sent. The real variant is not run with a "
        "device preset (it measures this machine)."
    )


def notes_for(
    compute: ComputeSettings, real_points: list[dict[str, int]], device_type: str, hw: dict, rows: list[dict] = ()
) -> list[str]:
    """What the rows can and cannot claim, given the compute, the real variant's points (`real_points`), the
    device and the hardware."""
    if compute.predicted:
        # No CPU compute, no gloo ranks, no shared load in these rows: only the device model's note applies (to
        # the generation rows; the sequence-parallel section, alone in bench_preset=sp, says its own).
        return [device_model_note(compute)] if rows else []
    notes = [
        "Simulated rows time one rank's real compute on this machine plus the link model's communication; "
        "they show what each schedule hides on that link, not what this machine would do with P devices."
    ]
    if any(r.get("prefill_a2a_link_ms_per_layer") is not None for r in rows):
        notes.append(
            "What an MoE schedule hides depends on how long the compute issued before each wait takes: here it "
            "is this machine's compute, beside a link model of GPU interconnects. The published shares (ScMoE: "
            "70% on PCIe, 100% on NVLink) come from GPUs whose compute is orders of magnitude faster, so the "
            "comparable link time per layer is a larger share of the layer there; read the hidden shares as what "
            "the schedule can cover, and compare 'a2a link ms/layer' with the time per layer before reading more."
        )
    real_ranks = [ranks(d) for d in real_points]
    if real_ranks and device_type == "cpu":
        p, cores, threads = max(real_ranks), hw["cpu_cores"], hw["torch_threads"]
        if cores < p * (threads + 1):
            notes.append(
                f"Real rows ran up to {p} gloo processes of {threads} compute thread(s) each on {cores} CPU cores. "
                "gloo's communication thread has no free core here, so an asynchronous collective cannot run "
                "while the next sub-block computes: these rows measure gloo's cost on this box, not what an "
                "architecture can hide, and claim nothing about overlap."
            )
        else:
            notes.append(
                f"Real rows ran up to {p} gloo processes of {threads} compute thread(s) each on {cores} CPU cores, "
                "leaving a core per rank for gloo's communication thread; gloo on CPU is still no model of NCCL."
            )
    if hw["load_average_1m"] > 0.5 * hw["cpu_cores"]:
        notes.append(
            f"The machine was shared (load average {hw['load_average_1m']:.2f} on {hw['cpu_cores']} cores at "
            "the start): timings are noisy; compare the min-max spreads before reading small differences."
        )
    return notes


def clock_note(rows: list[dict], baseline: str) -> str | None:
    """A warning when the virtual clock let the baseline hide communication it waits for at once."""
    shares = [
        r["decode_exposed_share"]
        for r in rows
        if r["arch"] == baseline and r["variant"] == "simulated" and r.get("decode_exposed_share") is not None
    ]
    if not shares or min(shares) >= 0.9:
        return None
    return (
        f"On the virtual clock `{baseline}` left only {min(shares):.0%}-{max(shares):.0%} of its link time exposed "
        "(decode), though it waits for each collective right after issuing it (should be near 100%): the clock "
        "counted the Python time between issuing a collective and waiting for it as compute, which covers short "
        "transfers. The "
        "simulated rows understate the baseline's communication cost, so their speed-ups and hidden fractions "
        "are too small (or n/a)."
    )


def generation_intro(results: dict, points: str) -> list[str]:
    """What the generation bench's rows are: settings, compute, hardware, the columns."""
    cfg, hw = results["settings"], results["hardware"]
    compute = results.get("compute") or {"setting": "measured"}
    if compute["setting"] == "measured":
        how = (
            f"compute measured on this machine: {cfg['warmup']} warm-up + {cfg['repeats']} timed repeats "
            f"(median, min-max), dtype {results['dtype']}, compile={cfg['compile']}."
        )
        machine = f"Hardware: {hw.get('gpu', hw['cpu'])} ({hw['cpu_cores']} CPU cores, load average "
    else:
        d = compute["device"]
        how = (
            f"compute predicted for {d['name']} by the device model ({d['peak_flops'] / 1e12:.0f} TFLOP/s, "
            f"{d['hbm_Bps'] / 1e12:.2f} TB/s HBM; eff_flops {compute['eff_flops']}, eff_hbm {compute['eff_hbm']}, "
            f"{compute['kernel_overhead_us']:.3g} us per kernel, contention {compute['contention']} to "
            f"{compute.get('contention_bw', compute['contention'])} bandwidth-bound), dtype "
            f"{compute['dtype']}, {'static' if compute['static_cache'] else 'growing'} KV cache, attention charged as "
            f"`{compute.get('attention_program', 'flash')}`: one deterministic "
            "prediction per row."
        )
        machine = f"Predicted on: {hw['cpu']} ({hw['cpu_cores']} CPU cores, load average "
    return [
        f"Architectures {', '.join(cfg['archs'])} (baseline `{cfg['baseline']}`), degrees {points}, "
        f"batch {cfg['batch_sizes']}, prompt {cfg['prompt_len']} tokens, {cfg['new_tokens']} generated "
        f"({cfg['new_tokens'] - 1} decode steps), {how}",
        "",
        f"{machine}{hw['load_average_1m']:.2f} at start), torch {hw['torch']}, transformers {hw['transformers']}.",
        "",
        "- **decode tok/s** = batch x decode steps / decode time; **prefill ms** = time to first token.",
        f"- **speed-up** = the architecture over `{cfg['baseline']}` in the same variant, degrees and batch.",
        "- **hidden** = (T_base - T_arch) / (T_base - T_upper_bound), T = prefill time or time per decode "
        f"step, T_upper_bound = `{cfg['baseline']}` without collectives (`upper_bound` for simulated rows, "
        "`upper_bound_real` for real rows); n/a when T_base - T_upper_bound is below "
        f"{cfg['min_comm_fraction']:.0%} of T_base.",
        "- **hidden (exposed)** (simulated only) = 1 - exposed_arch / exposed_base on the virtual clock: "
        "the same question without compute-time noise between architectures.",
        "- **exposed / link busy** (simulated only): the share of the link's time that was not covered by compute. "
        f"`{cfg['baseline']}` waits each collective right after issuing it, so its share should be near 1"
        + (
            ": a lower value is Python time between issuing a collective and waiting for it that the virtual clock "
            "counted as compute."
            if compute["setting"] == "measured"
            else " (with the device model only ops placed between issue and wait count as compute)."
        ),
        "- Communication counts are per forward (prefill) and per decode step, summed over collective kinds "
        "(a compiled row's are read off its compiled graph).",
        "- **program**: the steps timed (eval.bench.steps, on the static cache): eager, or (sections marked "
        "compiled) the prefill and the decode step each compiled whole (torch.compile fullgraph, CUDA graphs on "
        "CUDA); a device model's rows predict the compiled program. **compiled / eager** = a compiled row's "
        "decode tok/s over the eager row's of the same run. **kernels/step**: eager, the aten ops of one decode "
        "step that are not views (nothing fused); compiled, the kernels inductor generated or called for it.",
        "",
    ]


