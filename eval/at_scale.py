"""What would each architecture buy at scale? `python -m eval.at_scale [out_dir=reports/at-scale]`.

One `eval.bench` run per entry of `runs` (conf/at_scale.yaml) with `compute=<device preset>`: the speed
simulator (eval/simulator/replay.py) runs each architecture's own `forward()` at the run's shape on the meta device,
sharded on a fake process group, every aten op charged to the device model that eval.costmodel fitted to the
Ladder paper's 70B table (reports/costmodel) and every collective to the link model. Nothing is timed on this
machine; the numbers are the same on any machine. Each run's rows are set against its baseline, beside the
published number of the architecture where one exists (`published`), and written to one README with the
bench runs' own reports under it. A run of the bench's training section (`bench_preset=train`) gives training-step
rows instead (`train_rows`, the training simulator: eval/simulator/training.py).
"""

import json
import math
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from eval import report
from eval.bench import run_bench_overrides
from eval.bench.settings import degrees_key, degrees_label

COLUMNS = [
    ("run", "run"),
    ("arch", "arch"),
    ("against", "against"),
    ("at", "at"),
    ("batch", "batch"),
    ("tok_s", "tokens/s"),
    ("speedup_total", "speed-up (tokens/s)"),
    ("speedup_prefill", "prefill speed-up"),
    ("speedup_decode", "decode speed-up"),
    ("ttft_change", "time to first token, change"),
    ("exposed_share", "link time exposed (decode)"),
    ("collectives", "collectives/step"),
]
MOE_COLUMNS = [("a2a_hidden", "all-to-all hidden (decode)"), ("a2a_published", "published hidden")]
# A ladder variant (`gqla_ladder`) against its standard sibling (`gqla`) at the same link and batch.
SIBLING_COLUMNS = [
    ("arch", "variant"),
    ("sibling", "sibling"),
    ("at", "at"),
    ("batch", "batch"),
    ("decode_ms", "decode ms/token"),
    ("sibling_decode_ms", "sibling's"),
    ("vs_sibling_decode", "decode tokens/s over sibling"),
    ("vs_sibling_total", "tokens/s over sibling"),
    ("vs_sibling_prefill", "prefill speed-up over sibling"),
    ("ttft_change_vs_sibling", "time to first token, change"),
    ("hidden_decode", "link time hidden (decode)"),
    ("sibling_hidden_decode", "sibling's"),
    ("hidden_prefill", "link time hidden (prefill)"),
    ("sibling_hidden_prefill", "sibling's"),
    ("speedup_total", "tokens/s over baseline"),
]
SIBLING_MOE_COLUMNS = [
    ("a2a_hidden", "all-to-all hidden (decode)"),
    ("sibling_a2a_hidden", "sibling's"),
    ("combine_hidden", "combine hidden by the ladder"),
]


def _hidden(exposed_share: float | None) -> float | None:
    """The share of the link's time covered by compute: 1 - exposed / link busy (the bench's exposed share); a
    rounding error off 0 (a schedule that hides nothing) is 0."""
    if exposed_share is None:
        return None
    hidden = 1 - exposed_share
    return 0.0 if abs(hidden) < 1e-9 else hidden


def sibling_columns(r: dict, sib: dict | None) -> dict:
    """A ladder variant's row `r` against its standard sibling's `sib` (same link, batch and degrees): tokens/s and
    prefill ratios, the share of link time each hides, and for MoE the all-to-all's. The combine all-to-all returns
    the rows the dispatch sent, so it is half of a MoE layer's token all-to-all link time; `combine_hidden` is the
    exposed all-to-all time per MoE layer the variant saves over its sibling, as a share of that half."""
    if sib is None:
        return {"sibling": None}
    out = {
        "sibling": sib["arch"],
        "sibling_decode_ms": sib["decode_ms_per_step"],
        "vs_sibling_decode": r["decode_tok_s"] / sib["decode_tok_s"],
        "vs_sibling_total": r["total_tok_s"] / sib["total_tok_s"],
        "vs_sibling_prefill": sib["prefill_ms"] / r["prefill_ms"],
        "ttft_change_vs_sibling": r["prefill_ms"] / sib["prefill_ms"] - 1,
        "sibling_hidden_decode": _hidden(sib.get("decode_exposed_share")),
        "sibling_hidden_prefill": _hidden(sib.get("prefill_exposed_share")),
        "sibling_exposed_ms": sib.get("decode_exposed_ms"),
        "sibling_a2a_hidden": sib.get("decode_a2a_hidden_share"),
        "sibling_a2a_exposed_ms": sib.get("decode_a2a_exposed_ms_per_layer"),
    }
    link, exposed = r.get("decode_a2a_link_ms_per_layer"), r.get("decode_a2a_exposed_ms_per_layer")
    if link and exposed is not None and out["sibling_a2a_exposed_ms"] is not None:
        out["combine_hidden"] = (out["sibling_a2a_exposed_ms"] - exposed) / (link / 2)
    return out


def scale_rows(name: str, results: dict) -> list[dict]:
    """The simulated rows of one bench run, each with its speed-ups over the run's baseline, and a ladder variant's
    (`gqla_ladder`) also against its standard sibling (`gqla`) where the run has it (`sibling_columns`)."""
    base_name = results["settings"]["baseline"]
    rows = [r for r in results["rows"] if r["variant"] == "simulated"]
    index = {(r["arch"], r["link"], r["batch"], degrees_key(r["degrees"])): r for r in rows}
    out = []
    for r in rows:
        base = index.get((base_name, r["link"], r["batch"], degrees_key(r["degrees"])))
        sibling = report.standard_sibling(r["arch"])
        sib = index.get((sibling, r["link"], r["batch"], degrees_key(r["degrees"]))) if sibling else None
        out.append({
            "run": name,
            "arch": r["arch"],
            "against": base_name,
            "at": f"{degrees_label(r['degrees'])}, {r['link']}",
            "batch": r["batch"],
            "tok_s": r["total_tok_s"],
            "speedup_total": r["total_tok_s"] / base["total_tok_s"] if base else None,
            "speedup_prefill": r.get("speedup_prefill"),
            "speedup_decode": r.get("speedup_decode"),
            # prefill time over the baseline's, as a change: -0.3 = 30% less time to the first token
            "ttft_change": 1 / r["speedup_prefill"] - 1 if r.get("speedup_prefill") else None,
            "exposed_share": r.get("decode_exposed_share"),
            "collectives": r.get("decode_comm_calls"),
            "prompt_len": results["settings"]["prompt_len"],
            "a2a_hidden": r.get("decode_a2a_hidden_share"),
            "a2a_published": r.get("a2a_hidden_anchor"),
            "decode_tok_s": r["decode_tok_s"],
            "decode_ms": r["decode_ms_per_step"],
            "prefill_ms": r["prefill_ms"],
            "link_ms": r.get("decode_comm_busy_ms"),  # per decode step
            "exposed_ms": r.get("decode_exposed_ms"),
            "hidden_decode": _hidden(r.get("decode_exposed_share")),
            "hidden_prefill": _hidden(r.get("prefill_exposed_share")),
            "a2a_link_ms": r.get("decode_a2a_link_ms_per_layer"),  # per MoE layer and decode step
            "a2a_exposed_ms": r.get("decode_a2a_exposed_ms_per_layer"),
            "moe_layers": r.get("decode_moe_layers"),
            **sibling_columns(r, sib),
        })  # fmt: skip
    # The baseline with every link free (the bench's upper bound) on each link's row: what no communication buys.
    empty = dict.fromkeys(out[0] if out else (), None)
    for r in results["rows"]:
        if r["variant"] != "upper_bound" or r["arch"] != base_name:
            continue
        for link in sorted({x["link"] for x in rows}):
            base = index.get((base_name, link, r["batch"], degrees_key(r["degrees"])))
            if base is not None:
                out.append({**empty, "run": name, "arch": f"{base_name} (no communication)", "against": base_name,
                            "at": f"{degrees_label(r['degrees'])}, {link}", "batch": r["batch"], "tok_s": r["total_tok_s"],
                            "speedup_total": r["total_tok_s"] / base["total_tok_s"],
                            "speedup_prefill": base["prefill_ms"] / r["prefill_ms"],
                            "speedup_decode": base["decode_ms_per_step"] / r["decode_ms_per_step"],
                            "ttft_change": r["prefill_ms"] / base["prefill_ms"] - 1,
                            "prompt_len": results["settings"]["prompt_len"], "decode_tok_s": r["decode_tok_s"],
                            "decode_ms": r["decode_ms_per_step"], "prefill_ms": r["prefill_ms"]})  # fmt: skip
    return out


TRAIN_COLUMNS = [
    ("arch", "arch"), ("against", "against"), ("layout", "layout"), ("tokens_per_s_per_device", "tokens/s per GPU"),
    ("speedup_vs_baseline", "step speed-up"), ("mfu", "MFU"), ("exposed_ms", "exposed ms"),
]  # fmt: skip


def train_rows(name: str, results: dict) -> list[dict]:
    """The predicted training-step rows of one bench run (its training section), each over the run's baseline at
    the same layout and AC mode."""
    base = results["settings"]["baseline"]
    return [{"run": name, "against": base, **{k: r[k] for k in ("arch", "layout", "ac", "tokens_per_s_per_device",
                                                                  "speedup_vs_baseline", "mfu", "exposed_ms")}}
            for r in results.get("training") or [] if r.get("compute") != "measured"]  # fmt: skip


def run_all(cfg: DictConfig, out_dir: Path) -> dict:
    started = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    runs, rows, training, skipped = {}, [], [], []
    for name, spec in cfg.runs.items():
        # A run with `prompt_lens` runs once per prompt length (e.g. the Kraken paper's contexts 128 and 2048).
        for prompt_len in spec.get("prompt_lens") or [None]:
            label = name if prompt_len is None else f"{name}@{prompt_len}"
            overrides = [*cfg.common, *spec.overrides, *([f"prompt_len={prompt_len}"] if prompt_len else [])]
            print(f"[at_scale] {label}: python -m eval.bench {' '.join(overrides)}", flush=True)
            results = run_bench_overrides(overrides, out_dir / label)
            runs[label] = {"title": spec.title + ("" if prompt_len is None else f", prompt {prompt_len}"),
                           "command": results["command"], "compute": results["compute"]}  # fmt: skip
            rows += scale_rows(label, results)
            training += train_rows(label, results)
            skipped += [f"{label}: {s}" for s in results["skipped"]]
    published = OmegaConf.to_container(cfg.published)
    result = {"runs": runs, "rows": rows, "training": training, "skipped": skipped, "published": published,
              "elapsed_s": time.perf_counter() - started}  # fmt: skip
    report.write_json(out_dir / "at_scale.json", result)
    (out_dir / "README.md").write_text(markdown(result), encoding="utf-8")
    return result


def ttft_summary(rows: list[dict]) -> list[str]:
    """Per architecture measured at several prompt lengths (runs with `prompt_lens`): the geometric mean of its
    time-to-first-token change over those rows, and the speed-up it is (the Kraken paper states its headline as a
    mean speed-up: "35.6%" is 1.356x, about -26% time)."""
    by_arch: dict[str, list[float]] = {}
    for r in rows:
        if "@" in r["run"] and r["arch"] != r["against"] and r["ttft_change"] is not None:
            by_arch.setdefault(r["arch"], []).append(1 + r["ttft_change"])
    lines = []
    for arch, ratios in by_arch.items():
        geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        lines += [f"**{arch}: time to first token {geomean - 1:+.1%}, a {1 / geomean:.3f}x speed-up** (geometric mean "
                  f"over the {len(ratios)} prompt-length x shape x TP rows above).", ""]  # fmt: skip
    return lines


FORMATS = {"x": lambda v: f"{v:.2f}x", "ms": lambda v: f"{v:.3g} ms", "%": lambda v: f"{v:.0%}",
           "+%": lambda v: f"{v:+.1%}"}  # fmt: skip


def per_batch(group: list[dict], key: str, fmt: str) -> str:
    """`key` of each row of `group` (one per batch), formatted as FORMATS[fmt], joined by " / "."""
    return " / ".join("n/a" if r.get(key) is None else FORMATS[fmt](r[key]) for r in group)


def variant_notes(rows: list[dict]) -> list[str]:
    """One paragraph per ladder variant and link of a run, from its rows against its sibling's: what the schedule
    hides and what it buys at each batch (the rows' numbers, in words)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if r.get("sibling"):
            groups.setdefault((r["arch"], r["at"]), []).append(r)
    lines = []
    for (arch, at), rows_at in groups.items():
        group = sorted(rows_at, key=lambda r: r["batch"])
        sib, against = group[0]["sibling"], group[0]["against"]
        batches = " / ".join(str(r["batch"]) for r in group)
        text = [f"- **{arch}** ({at}): `{sib}` with the ladder residual schedule on every layer."]
        if all(r.get("combine_hidden") is not None for r in group):
            text.append(
                f"A MoE layer's two token all-to-alls (dispatch, combine) keep the link busy "
                f"{per_batch(group, 'a2a_link_ms', 'ms')} per decode step at batch {batches}; {sib} leaves "
                f"{per_batch(group, 'sibling_a2a_exposed_ms', 'ms')} of it exposed, {arch} "
                f"{per_batch(group, 'a2a_exposed_ms', 'ms')}: the next layer's attention sub-block, run while the "
                f"combine is in flight, hides {per_batch(group, 'combine_hidden', '%')} of the combine's link time "
                f"(half the layer's), averaged over the {group[0]['moe_layers']:.0f} MoE layers."
            )
        elif all(r.get("hidden_decode") is not None and r.get("sibling_hidden_decode") is not None for r in group):
            text.append(
                f"Each decode step keeps the link busy {per_batch(group, 'link_ms', 'ms')} at batch {batches}; {sib} "
                f"hides {per_batch(group, 'sibling_hidden_decode', '%')} of it behind compute, {arch} "
                f"{per_batch(group, 'hidden_decode', '%')} (each sub-block's collective in flight while the next "
                f"sub-block computes); in prefill {per_batch(group, 'sibling_hidden_prefill', '%')} against "
                f"{per_batch(group, 'hidden_prefill', '%')}."
            )
        text.append(
            f"A decode step takes {per_batch(group, 'decode_ms', 'ms')} instead of "
            f"{per_batch(group, 'sibling_decode_ms', 'ms')}: decode tokens/s {per_batch(group, 'vs_sibling_decode', 'x')} "
            f"over {sib}, prefill {per_batch(group, 'vs_sibling_prefill', 'x')} (time to first token "
            f"{per_batch(group, 'ttft_change_vs_sibling', '+%')}), generation tokens/s "
            f"{per_batch(group, 'vs_sibling_total', 'x')}"
            + ("." if sib == against else f"; over {against}, the run's baseline, {per_batch(group, 'speedup_total', 'x')}.")
        )
        lines.append(" ".join(text))
    return lines


def markdown(result: dict) -> str:
    compute = next(iter(result["runs"].values()))["compute"]
    dm = compute.get("device_model", {})
    lines = [
        "# What would it buy at scale? (speed simulator)",
        "",
        "`python -m eval.at_scale`: predicted, not measured. Each architecture's own `forward()` at the run's "
        "shape on the meta device, sharded on a fake process group; every aten op charged to the device model "
        f"(`{compute.get('setting')}`" + (f", constants {json.dumps(dm)}" if dm else "") + ") that "
        "eval.costmodel fitted to the Ladder paper's 70B record (reports/costmodel: tokens/s within 10%, prefill "
        "within 15%; in sample), every collective to the link model. These rows are at the zoo's Llama 3 shapes, "
        "not at the other papers' own settings: those, held out, are reports/simulator-validation. Generation as the "
        "Ladder paper's benchmark unless a run's command says otherwise (the Kraken runs: 8 x A100-80GB, prompts of "
        "128 and 2048 tokens, time to first token; the training runs: one optimizer step): prompt 1024, "
        "512 new tokens, a static KV cache; tokens/s = batch x new tokens / (prefill + (new tokens - 1) decode "
        "steps). Speed-ups are over the run's baseline on the same link; time to first token, change = prefill "
        "time over the baseline's, minus 1. The same numbers come out on any machine "
        f"({result['elapsed_s']:.0f} s here, 2 CPU cores).",
        "",
    ]
    for name, run in result["runs"].items():
        steps = [r for r in result.get("training", []) if r["run"] == name]
        if steps:
            lines += [f"## {run['title']}", "", f"`{run['command']}` ([its bench report]({name}/README.md))", "",
                      "One optimizer step, predicted by the training simulator (eval/simulator/training.py); step "
                      "speed-up = tokens/s over the baseline's at the same layout.", "",
                      report.write_markdown_table(steps, TRAIN_COLUMNS), ""]  # fmt: skip
            continue
        rows = [r for r in result["rows"] if r["run"] == name]
        columns = COLUMNS + (MOE_COLUMNS if any(r["a2a_hidden"] is not None for r in rows) else [])
        lines += [f"## {run['title']}", "", f"`{run['command']}` ([its bench report]({name}/README.md))", "",
                  report.write_markdown_table([r for r in rows if r["arch"] != r["against"]] or rows, columns), ""]  # fmt: skip
        variants = [r for r in rows if r.get("sibling")]
        if variants:
            columns = SIBLING_COLUMNS + (SIBLING_MOE_COLUMNS if any(r.get("combine_hidden") is not None for r in variants) else [])
            lines += ["### Ladder variants against their standard siblings", "",
                      "Each `<name>_ladder` against `<name>` on the same link and batch (the variant over the sibling; "
                      "time to first token, change = prefill time over the sibling's, minus 1; link time hidden = 1 - "
                      "exposed / link busy on the virtual clock; tokens/s over baseline: over the run's baseline).", "",
                      report.write_markdown_table(variants, columns), "", *variant_notes(variants), ""]  # fmt: skip
    lines += ttft_summary(result["rows"])
    lines += ["## Published numbers", "", "Their settings differ from the rows above where they say so.", ""]
    lines += [f"- **{arch}**: {text}" for arch, text in result["published"].items()]
    lines.append("")
    if result["skipped"]:
        lines += ["## Not predicted", ""] + [f"- {s}" for s in result["skipped"]] + [""]
    return "\n".join(lines)


@hydra.main(config_path="../conf", config_name="at_scale", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from train.cli import refuse_existing_output

    report.refuse_wandb_logger(cfg, "eval.at_scale")
    out_dir = Path(cfg.out_dir) if cfg.out_dir else Path(HydraConfig.get().runtime.output_dir)
    refuse_existing_output(out_dir, bool(cfg.get("overwrite")))  # one rule: a report is not replaced unasked
    result = run_all(cfg, out_dir)
    print(markdown(result), flush=True)
    print(f"[at_scale] -> {out_dir}/README.md", flush=True)


if __name__ == "__main__":
    # a bad input: one line and exit status 1 (HYDRA_FULL_ERROR=1: the full traceback)
    from train.cli import one_sentence_errors

    one_sentence_errors(main)()
