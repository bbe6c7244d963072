"""How the sequence-parallel section is shown: LASP-2's speed-ups over the baselines, tables, plots, notes."""

from pathlib import Path

from eval import report


def add_sp_comparisons(sp: dict, anchor: dict) -> None:
    """Per (N, P, rank, link) where LASP-2 was timed, a `compare` row: each method's forward + backward ms and
    exposed ms per layer, LASP-2's speed-up over each other = T_other / T_lasp2 - 1 (the paper's throughput
    gain: the same tokens in less time), and over LASP-1 from the exposed communication alone
    (T_lasp2 - exposed_lasp2 + exposed_lasp1) / T_lasp2 - 1: LASP-1 runs the same local compute, so this is
    its schedule's cost without the compute-time noise between runs. `headline`: per rank and link, the
    largest (N, P) where LASP-2, LASP-1 and ring attention all ran, beside the published `anchor` (settings
    `anchors.sp_speedup`)."""
    methods = list(sp["methods"])
    index = {(r["n"], r["p"], r["rank"], r["link"], r["method"]): r for r in sp["timed"]}
    compare = []
    for (n, p, rank, link, method), base in index.items():
        if method != "lasp2":
            continue
        row = {"n": n, "p": p, "chunk": base["chunk"], "rank": rank, "link": link}
        for m in methods:
            other = index.get((n, p, rank, link, m))
            row[f"{m}_ms"] = other["fwd_bwd_ms"] if other else None
            row[f"{m}_exposed_ms"] = other["exposed_ms"] if other else None
            row[f"{m}_link_ms"] = other["link_ms"] if other else None
        lasp1, ring = index.get((n, p, rank, link, "lasp1")), index.get((n, p, rank, link, "ring"))
        row["speedup_over_lasp1"] = lasp1["fwd_bwd_ms"] / base["fwd_bwd_ms"] - 1 if lasp1 else None
        row["speedup_over_ring"] = ring["fwd_bwd_ms"] / base["fwd_bwd_ms"] - 1 if ring else None
        row["comm_speedup_over_lasp1"] = (
            (base["fwd_bwd_ms"] - base["exposed_ms"] + lasp1["exposed_ms"]) / base["fwd_bwd_ms"] - 1 if lasp1 else None
        )
        # The softmax layers of a hybrid: LASP-2H against ring attention, the same layer's compute.
        lasp2h = index.get((n, p, rank, link, "lasp2h"))
        row["lasp2h_speedup_over_ring"] = ring["fwd_bwd_ms"] / lasp2h["fwd_bwd_ms"] - 1 if ring and lasp2h else None
        # With a device preset's P = 1 point (the single-GPU baseline): each method's T(N, 1) / T(N, P) - 1, a gain
        # as the section's other speed-ups.
        for m in methods:
            one, mine = index.get((n, 1, rank, link, m)), index.get((n, p, rank, link, m))
            row[f"{m}_speedup_over_one_gpu"] = one["fwd_bwd_ms"] / mine["fwd_bwd_ms"] - 1 if one and mine else None
        compare.append(row)
    sp["compare"] = compare
    headline = []
    for rank in dict.fromkeys(r["rank"] for r in compare):
        full = [r for r in compare if r["rank"] == rank and r.get("lasp1_ms") is not None and r.get("ring_ms") is not None]
        if not full:
            continue
        n, p = max((r["n"], r["p"]) for r in full)
        for r in full:
            if (r["n"], r["p"]) == (n, p):
                over = anchor.get("over") or {}
                headline.append({**r, "anchor_over_lasp1": over.get("lasp1"), "anchor_over_ring": over.get("ring"),
                                 "anchor_n": anchor.get("n"), "anchor_p": anchor.get("sp")})  # fmt: skip
    sp["headline"] = headline


def _percent(row: dict) -> dict:
    """Speed-ups (and their published anchors) as signed percentages for the tables."""
    return {k: f"{v:+.1%}" if ("speedup" in k or k.startswith("anchor_over")) and isinstance(v, float) else v
            for k, v in row.items()}  # fmt: skip


def _method_label(sp: dict, method: str) -> str:
    return sp["methods"][method]["label"]


SP_BYTES_NOTE = (
    "Bytes per layer per rank that cross the link (what the rank receives; it sends as much), from "
    "`comm.counters` over one forward + backward on the meta device (the real code path without values): an "
    "all-gather's or reduce-scatter's counter holds the whole gathered tensor, of which (P-1)/P crosses; a ring "
    "shift's holds what is sent. **formula**: LASP-2's and ring attention's per-layer volumes: LASP-2 (P-1) B H d_k d_v per "
    "all-gather (one forward, one backward; fp32 states); LASP-1 P-1 hops of one rank's B H d_k d_v states each "
    "way; ring attention (P-1) B (N/P) 2 H_kv d_h forward, backward those shifts again plus P hops of each K/V "
    "block's gradient accumulator (fp32); LASP-2H the same (P-1) B (N/P) 2 H_kv d_h in one all-gather of K and "
    "V, and as many in the backward's reduce-scatter of dK, dV."
)


MEASURED_HEADLINE_NOTE = (
    "> Only the communication side is comparable with the paper. Our compute is this machine's at a small "
    "shape: a layer's forward + backward here takes orders of magnitude longer than its link time on any "
    "preset, so every schedule hides almost everything and the measured speed-ups are compute and noise "
    "(a shared CPU), not communication; against ring attention they also compare a softmax layer's compute "
    "with a linear layer's. What carries over is the exposed communication per layer (and the bytes and "
    "link times above) and how it grows with P and N. At small chunks LASP-1 also pays on the compute side: "
    "each of its 2 (P-1) serial hops is a call of its own (Python here, a kernel launch and a NCCL call on "
    "GPUs), which the clock counts as compute. Paper-scale compute: `compute=h100-sxm` (the device model's "
    "prediction, any N and P, the paper's point included)."
)


def sp_device_model_text(compute: dict) -> str:
    """The device model's constants, in words, for the sequence-parallel section."""
    d = compute["device"]
    return (
        f"{d['peak_flops'] / 1e12:.0f} TFLOP/s, {d['hbm_Bps'] / 1e12:.2f} TB/s HBM; every aten op of the forward and "
        f"the backward of the trunk, built on the meta device in {compute['dtype']}, charged max(FLOPs / (peak x "
        f"{compute['eff_flops']}), bytes / (HBM x {compute['eff_hbm']})) + {compute['kernel_overhead_us']:.3g} us per "
        f"kernel, elementwise ops fused; contention {compute['contention']} (latency-bound) to "
        f"{compute.get('contention_bw', compute['contention'])} (bandwidth-bound link time) of every overlapped second "
        "of communication added; nothing timed on this machine"
    )


def sp_kernels(sp: dict) -> str:
    return (sp.get("device_kernels") or {}).get("setting", "as_run")


def sp_predicted_headline(sp: dict, compute: dict) -> list[str]:
    """Below the headline table with a device preset: what the compute is, and the device model's compute per
    layer of each method at the headline point (forward and backward apart: the backward's ops are charged too)."""
    h0 = sp["headline"][0]
    n, p, link = h0["n"], h0["p"], h0["link"]
    ranks = list(dict.fromkeys(h["rank"] for h in sp["headline"]))
    sel = [r for rank in ranks for r in sp["timed"] if (r["n"], r["p"], r["rank"], r["link"]) == (n, p, rank, link)]
    table = [
        {"rank": r["rank"], "method": _method_label(sp, r["method"]), "fwd_ms": r["fwd_compute_ms"], "bwd_ms": r["bwd_compute_ms"],
         "fwd_kernels": r["fwd_kernels"], "bwd_kernels": r["bwd_kernels"], "fwd_gflop": r["fwd_flops"] / 1e9,
         "bwd_gflop": r["bwd_flops"] / 1e9, "bwd_over_fwd": r["bwd_flops"] / r["fwd_flops"] if r["fwd_flops"] else None,
         "link_ms": r["link_ms"], "exposed_ms": r["exposed_ms"], "contention_ms": r["contention_ms"]}
        for r in sel
    ]  # fmt: skip
    return [
        f"> **Compute here is the device model's prediction for {compute['setting']}, not a measurement** "
        f"({sp_device_model_text(compute)}; kernels `{sp_kernels(sp)}`). The link side is the same alpha-beta model "
        "as in the measured rows. "
        "The model is this bench shape's (see the top of the section), not the paper's Linear-Llama3, so the "
        "share of communication in a step, hence the speed-ups, differ with the shape; against ring attention "
        "they compare a softmax layer with a linear layer, as the paper's throughput does. Ring attention's blocks "
        "are PyTorch ops here (parallel/sequence.py: each block's C x C scores materialised in fp32, no flash "
        "kernel), charged as such, so its time is this implementation's, HBM-bound on the scores, not that of a "
        "ring of flash-attention blocks.",
        "",
        f"The device model's compute per layer at N={n:,}, P={p} (ms, kernels, GFLOP; link and exposed ms on {link}):",
        "",
        report.write_markdown_table(
            table,
            [("rank", "rank"), ("method", "method"), ("fwd_ms", "fwd compute ms"), ("bwd_ms", "bwd compute ms"), ("fwd_kernels", "fwd kernels"),
             ("bwd_kernels", "bwd kernels"), ("fwd_gflop", "fwd GFLOP"), ("bwd_gflop", "bwd GFLOP"),
             ("bwd_over_fwd", "bwd / fwd FLOPs"), ("link_ms", "link ms"), ("exposed_ms", "exposed ms"),
             ("contention_ms", "contention ms")],
        ),  # fmt: skip
    ]



def sp_section(results: dict, images: dict[str, Path]) -> list[str]:
    """The README section of the sequence-parallel rows: bytes vs N and P, simulated time and exposure per
    link, LASP-2's speed-ups beside the paper's."""
    sp, cfg = results.get("sequence_parallel") or {}, results["settings"]
    if not sp:
        return []
    s, shape = cfg["sequence_parallel"], cfg["bench_shape"]
    methods = list(sp["methods"])
    label = {m: _method_label(sp, m) for m in methods}
    lines = [
        "## Sequence parallelism: LASP-2 vs LASP-1 vs ring attention over long sequences",
        "",
        f"Linear-Llama at the `{shape['name']}` shape (hidden {shape['hidden_size']}, {shape['num_attention_heads']} "
        f"heads of {shape['hidden_size'] // shape['num_attention_heads']}, {shape['num_key_value_heads']} KV head(s) "
        f"in softmax layers, {shape['num_hidden_layers']} layer(s), batch {s['batch']}, dtype {sp.get('dtype', results['dtype'])}), "
        "one process playing one rank of a P-way fake process group, collectives on the simulated link "
        "(parallel/sequence.py through parallel.comm). Methods:",
        "",
    ]
    lines += [f"- **{label[m]}** (`{m}`): {sp['methods'][m]['what']}." for m in methods]
    lines += ["", "### Bytes per layer vs sequence length", "", SP_BYTES_NOTE, ""]
    rows = sp["bytes"]
    exact = sum(r["fwd_link_bytes"] == r["fwd_link_bytes_formula"] and r["bwd_link_bytes"] == r["bwd_link_bytes_formula"]
                for r in rows)  # fmt: skip
    lines += [f"Counted == formula, forward and backward: **{exact} of {len(rows)}** (N, P, method) rows.", ""]
    by = {(r["n"], r["p"], r["method"]): r for r in rows}
    points = sorted({(r["p"], r["n"]) for r in rows})
    table = []
    for p, n in points:
        entry = {"p": p, "n": n, "chunk": n // p}
        for m in methods:
            r = by.get((n, p, m))
            entry[f"{m}_fwd"] = r["fwd_link_bytes"] if r else None
            entry[f"{m}_bwd"] = r["bwd_link_bytes"] if r else None
        table.append(entry)
    cols = [("p", "P"), ("n", "N"), ("chunk", "N/P")]
    cols += [(f"{m}_{ph}", f"{label[m]} {ph}") for m in methods for ph in ("fwd", "bwd")]
    lines += [report.write_markdown_table(table, cols)]
    if "sp_bytes" in images:
        lines += [f"![sp_bytes]({images['sp_bytes'].name})", ""]
    big = max(points, key=lambda pn: (pn[1], pn[0]))
    paper = [by[(big[1], big[0], m)] for m in methods if (big[1], big[0], m) in by]
    link_cols = [(f"link_ms:{link}", f"link ms, {link}") for link in s["links"]]
    lines += [
        f"Link time per layer per rank at N={big[1]:,}, P={big[0]} (forward + backward, the alpha-beta model of each "
        "preset on the counted collectives, nothing hidden; LASP-2's all-gather costs base + (P-1) (alpha + state / "
        "beta), LASP-1's P-1 serial hops (P-1) (base + alpha + state / beta): the same bytes, LASP-2 pays the fixed "
        "latency once, and wins mostly by overlapping the rest):",
        "",
        report.write_markdown_table(
            [{**r, "method": label[r["method"]]} for r in paper],
            [("method", "method"), ("fwd_link_bytes", "bytes fwd"), ("bwd_link_bytes", "bytes bwd"), *link_cols],
        ),
    ]
    # Timed rows.
    compute = results.get("compute") or {"setting": "measured"}
    predicted = compute["setting"] != "measured"
    if predicted:
        how = (
            f"Per layer, on the virtual clock: this rank's compute **predicted by the device model for "
            f"{compute['setting']}** ({sp_device_model_text(compute)}; `device_kernels={sp_kernels(sp)}`: "
            f"{(sp.get('device_kernels') or {}).get('what', '')}), each collective on the link preset, "
            "**exposed** = the part of the link time the rank waited for"
        )
        runs = (
            "One recorded run per row, deterministic (no warm-up, no repeats: min = max), replayed on every "
            "preset, so the presets see the same compute; no max_chunk / max_attended limit (nothing is computed). "
        )
    else:
        how = (
            f"Per layer, on the virtual clock: this rank's compute measured for real on this machine "
            f"({results['hardware'].get('gpu', results['hardware']['cpu'])}), each collective on the link preset, "
            "**exposed** = the part of the link time the rank waited for"
        )
        runs = (
            f"{s['warmup']} warm-up + {s['repeats']} repeats interleaved across methods (median; min-max per row in "
            "results.json, `fwd_bwd_ms_min` / `_max`); each run is recorded "
            "once and replayed on every preset, so the presets see the same compute. "
        )
    lines += [
        "### Simulated forward + backward time vs N and P",
        "",
        how
        + ". Ranks played: "
        + ", ".join(f"`{r}` ({'0' if r == 'first' else 'P-1'})" for r in s["ranks"])
        + ". A causal softmax layer costs rank r (r+1) blocks of attention: the last rank sets the step time, while "
        "rank 0 computes one block and waits for ring attention's shifts with nothing left to compute (its ring "
        "exposure is the worst case, its compute the least). Linear layers cost every rank the same. "
        + runs
        + "**LASP-2 over X** = T_X / T_LASP-2 - 1 "
        "(throughput gain; LASP-2H over ring: T_ring / T_LASP-2H - 1, the softmax layers of a hybrid); **over LASP-1, comm only** = (T_LASP-2 - exposed_LASP-2 + exposed_LASP-1) / "
        "T_LASP-2 - 1: LASP-1's schedule on LASP-2's compute, free of the noise between runs.",
        "",
    ]
    ms_cols = [(f"{m}_ms", f"{label[m]} ms") for m in methods] + [(f"{m}_exposed_ms", f"{label[m]} exposed") for m in methods]
    cmp_cols = [("rank", "rank"), ("n", "N"), ("p", "P"), ("chunk", "N/P"), *ms_cols]
    cmp_cols += [("speedup_over_lasp1", "LASP-2 over LASP-1"), ("comm_speedup_over_lasp1", "over LASP-1, comm only"),
                 ("speedup_over_ring", "LASP-2 over ring"), ("lasp2h_speedup_over_ring", "LASP-2H over ring")]  # fmt: skip
    if any(r.get(f"{m}_speedup_over_one_gpu") is not None for r in sp["compare"] for m in methods):
        cmp_cols += [(f"{m}_speedup_over_one_gpu", f"{label[m]} over 1 GPU") for m in methods]  # T(N, 1) / T(N, P) - 1
    for link in s["links"]:
        sel = sorted((r for r in sp["compare"] if r["link"] == link), key=lambda r: (r["rank"], r["n"], r["p"]))
        lines += [f"#### {link}", "", report.write_markdown_table([_percent(r) for r in sel], cmp_cols)]
    for name in ("sp_time", "sp_exposed"):
        if name in images:
            lines += [f"![{name}]({images[name].name})", ""]
    # Headline beside the paper.
    if sp.get("headline"):
        h0 = sp["headline"][0]
        lines += [
            "### LASP-2's speed-up at the largest point, beside the paper",
            "",
            f"Published (LASP-2 paper, Linear-Llama3 on {h0['anchor_p']} GPUs at {h0['anchor_n']:,} tokens): "
            f"**{h0['anchor_over_lasp1']:+.1%} over LASP-1, {h0['anchor_over_ring']:+.1%} over ring attention** "
            "(throughput).",
            "",
            report.write_markdown_table(
                [_percent(h) for h in sp["headline"]],
                [("rank", "rank"), ("link", "link"), ("n", "N"), ("p", "P"), ("speedup_over_lasp1", "over LASP-1"),
                 ("comm_speedup_over_lasp1", "over LASP-1, comm only"), ("anchor_over_lasp1", "published"),
                 ("speedup_over_ring", "over ring"), ("anchor_over_ring", "published"),
                 ("lasp2_exposed_ms", "LASP-2 exposed ms"), ("lasp1_exposed_ms", "LASP-1 exposed ms"),
                 ("ring_exposed_ms", "ring exposed ms"), ("lasp2_ms", "LASP-2 ms")],
            ),  # fmt: skip
        ]
        lines += sp_predicted_headline(sp, compute) if predicted else [MEASURED_HEADLINE_NOTE, ""]
    if sp.get("skipped"):
        lines += ["Not timed (the bytes above cover every point):", ""] + [f"- {x}" for x in sp["skipped"]] + [""]
    return lines


def sp_plots(results: dict, out_dir: Path) -> dict[str, Path]:
    """sp_bytes: link bytes per layer vs N (counted and formula) at the smallest and largest P; sp_time:
    forward + backward ms per layer vs N (largest P) and vs P (the N timed at the most degrees) per rank
    played, first preset; sp_exposed: exposed ms per layer vs P at that N, one panel per preset."""
    sp = results.get("sequence_parallel") or {}
    if not sp:
        return {}
    s = results["settings"]["sequence_parallel"]
    methods, images = list(sp["methods"]), {}
    label = {m: _method_label(sp, m) for m in methods}
    grid = [r for r in sp["bytes"] if r["n"] in s["bytes"]["lengths"] and r["p"] in s["bytes"]["sp"]]
    if grid:
        panels = []
        for p in sorted({min(r["p"] for r in grid), max(r["p"] for r in grid)}):
            series = {}
            for m in methods:
                sel = sorted((r["n"], r["link_bytes"], r["link_bytes_formula"]) for r in grid if r["p"] == p and r["method"] == m)
                series[label[m]] = ([n for n, _, _ in sel], [b for _, b, _ in sel])
                series[f"{label[m]} (formula)"] = ([n for n, _, _ in sel], [f for _, _, f in sel])
            panels.append((f"P={p}", series))
        images["sp_bytes"] = report.plot_panels(
            out_dir / "sp_bytes.png", panels, xlabel="sequence length N", ylabel="bytes per layer per rank (fwd + bwd)",
            logy=True, ncols=len(panels), title="communication per layer: counted (markers) and the published formula (dotted, in its method's colour)",
        )  # fmt: skip
    timed = sp["timed"]
    setting = (results.get("compute") or {}).get("setting", "measured")
    whose = "this machine's" if setting == "measured" else f"the device model's ({setting})"
    if timed:
        first_link = s["links"][0]
        # Across P: the N timed at the most degrees (the largest such N); across N: the largest P.
        degrees_at = {n: len({r["p"] for r in timed if r["n"] == n}) for n in {r["n"] for r in timed}}
        big_n = max(degrees_at, key=lambda n: (degrees_at[n], n))
        big_p = max(r["p"] for r in timed)
        panels = []
        for rank in s["ranks"]:
            for axis, fixed in (("n", ("p", big_p)), ("p", ("n", big_n))):
                series = {}
                for m in methods:
                    sel = sorted((r[axis], r["fwd_bwd_ms"]) for r in timed if r["link"] == first_link and r["rank"] == rank
                                 and r["method"] == m and r[fixed[0]] == fixed[1])  # fmt: skip
                    if sel:
                        series[label[m]] = ([x for x, _ in sel], [y for _, y in sel])
                panels.append((f"rank {rank}, {fixed[0].upper()}={fixed[1]}, {first_link}", series))
        images["sp_time"] = report.plot_panels(
            out_dir / "sp_time.png", panels, xlabel="N (left) / P (right)", ylabel="fwd + bwd ms per layer (virtual clock)",
            logy=True, ncols=2, title=f"simulated-link time of one rank: {whose} compute + exposed communication",
        )  # fmt: skip
        panels = []
        for link in s["links"]:
            series = {}
            for m in methods:
                for rank in s["ranks"]:
                    sel = sorted((r["p"], r["exposed_ms"]) for r in timed if r["link"] == link and r["rank"] == rank
                                 and r["method"] == m and r["n"] == big_n)  # fmt: skip
                    if sel:
                        series[f"{label[m]} ({rank})"] = ([x for x, _ in sel], [y for _, y in sel])
            panels.append((f"{link}, N={big_n}", series))
        images["sp_exposed"] = report.plot_panels(
            out_dir / "sp_exposed.png", panels, xlabel="sp degree P", ylabel="exposed communication ms per layer",
            logy=False, ncols=len(panels), title="communication left exposed (fwd + bwd), by rank played",
        )  # fmt: skip
    return images


SP_PLOTS = ("sp_bytes", "sp_time", "sp_exposed")
