"""Builds the bundled lm-eval tasks from the held-out (validation) works of the bundled corpus.

    python -m eval.tasks.build [--seed 1234] [--out eval/tasks]

writes `data/<task>.jsonl` and `<task>.yaml` (lm-eval 0.4 task configs) for three tasks:

- `shakespeare_next_line` (multiple_choice; acc, acc_norm, acc_mutual_info; chance 0.25): a speaker's
  name and up to four lines of the speech; choose the true next line among four. The three
  distractors are other lines of the same play whose length is within 20% of the true line's, so
  that neither length nor the play's vocabulary gives the answer away. acc and acc_norm pick the
  likeliest line, which for small models is mostly the line that is likeliest whatever the context
  (a 1.8M-parameter llama after 300 steps scores chance); acc_mutual_info divides out each line's
  probability without the context, so it measures the use of the context and separates such a
  model from a random one (0.35 against 0.22).
- `shakespeare_cloze` (loglikelihood; acc, perplexity): LAMBADA-style last word. Up to six lines of a
  speech and the next line without its last word; acc counts the examples where greedy decoding
  produces exactly that word, perplexity is over the word's tokens.
- `shakespeare_passages` (loglikelihood_rolling; word_perplexity, byte_perplexity, bits_per_byte):
  wikitext-style perplexity of verbatim passages (whole blank-line-separated blocks, 1000 to 2000
  characters, starting at a speaker's name).

The works are split as `train.data.LMDataModule` splits them by default (validation_fraction 0.1,
split seed 0: the split the bundled tokenizer was trained on), so the examples come from plays that
no model trained on the bundled corpus has seen. As a second guard against leakage, an example is
dropped when any of its lines of `MIN_LINE_CHARS` or more also occurs verbatim in a training work
(there are a few stock lines such as "[Enter a Messenger.]").

Deterministic: the same seed and corpus give byte-identical files. Examples are shuffled across plays
so that the first N (lm-eval's `limit`) are a fair sample.
"""

import argparse
import json
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from eval.tasks import TASKS_DIR
from train.data import Work, shakespeare_works, split_works

SEED = 1234
# The split of LMDataModule's defaults (validation_fraction, split_seed).
VALIDATION_FRACTION = 0.1
SPLIT_SEED = 0

NEXT_LINE_EXAMPLES = 300
CLOZE_EXAMPLES = 300
PASSAGE_EXAMPLES = 48
NEXT_LINE_CONTEXT = 4  # lines of the speech before the one to choose
CLOZE_CONTEXT = 6
MIN_CONTEXT = 2  # a target line has at least this many lines of its speech before it
NUM_CHOICES = 4
MIN_LINE_CHARS = 20  # shorter lines ("Exeunt.", "O Romeo!") are too generic to be targets or evidence
MAX_LINE_CHARS = 100
PASSAGE_CHARS = (1000, 2000)

# A speech block starts with the speaker's name on a line of its own: "ROMEO.", "Lady Capulet.".
SPEAKER = re.compile(r"^[A-Z][A-Za-z'\- ]{0,30}\.$")
# A line ending in a word (trailing punctuation allowed): the cloze target is that word.
LAST_WORD = re.compile(r"^(?P<prefix>.*\S)\s+(?P<word>[A-Za-z][A-Za-z']*[A-Za-z])[.,;:!?]*$")
BLOCK_SEPARATOR = re.compile(r"\n\s*\n")


@dataclass(frozen=True)
class Speech:
    index: int  # position among the work's blocks
    speaker: str  # the heading as printed, e.g. "ROMEO."
    lines: tuple[str, ...]  # the spoken lines, stripped; stage directions ("[Exit.]") left out


def block_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of every blank-line-separated block of `text`, so passages can be cut verbatim."""
    spans, start = [], 0
    for separator in BLOCK_SEPARATOR.finditer(text):
        spans.append((start, separator.start()))
        start = separator.end()
    spans.append((start, len(text)))
    return [(a, b) for a, b in spans if text[a:b].strip()]


def as_speech(index: int, block: str) -> Speech | None:
    lines = block.split("\n")
    speaker = lines[0].strip()
    if len(lines) < 2 or not SPEAKER.match(speaker):
        return None
    spoken = tuple(s for s in (line.strip() for line in lines[1:]) if s and not s.startswith("["))
    return Speech(index, speaker, spoken) if spoken else None


def is_clean(line: str) -> bool:
    """A line fit to be a target or a distractor: long enough, no stage direction, some letters."""
    return (
        MIN_LINE_CHARS <= len(line) <= MAX_LINE_CHARS
        and "[" not in line
        and "]" not in line
        and any(c.isalpha() for c in line)
    )


def long_lines(texts: Iterable[str]) -> set[str]:
    """The stripped lines of `MIN_LINE_CHARS` or more in `texts`: the unit the leakage guard compares."""
    return {
        s for text in texts for s in (line.strip() for line in text.split("\n")) if len(s) >= MIN_LINE_CHARS
    }


def quotas(total: int, works: list[Work]) -> dict[str, int]:
    """`total` examples shared out evenly over the works (the first ones get the remainder)."""
    base, extra = divmod(total, len(works))
    return {w.name: base + (i < extra) for i, w in enumerate(works)}


def next_line_examples(
    work: Work, speeches: list[Speech], banned: set[str], k: int, rng: random.Random
) -> list[dict]:
    pool = sorted({line for s in speeches for line in s.lines if is_clean(line)})
    eligible = [(s, i) for s in speeches for i in range(MIN_CONTEXT, len(s.lines)) if is_clean(s.lines[i])]
    rows = []
    for speech, i in rng.sample(eligible, len(eligible)):
        target = speech.lines[i]
        context = speech.lines[max(0, i - NEXT_LINE_CONTEXT) : i]
        similar = [
            line
            for line in pool
            if line != target and line not in context and abs(len(line) - len(target)) <= len(target) // 5
        ]
        if len(similar) < NUM_CHOICES - 1:
            continue
        choices = [target, *rng.sample(similar, NUM_CHOICES - 1)]
        rng.shuffle(choices)
        if long_lines([*context, *choices]) & banned:
            continue
        rows.append(
            {
                "id": f"{work.name}:{speech.index}:{i}",
                "work": work.name,
                "title": work.title,
                "context": "\n".join([speech.speaker, *context]),
                "choices": choices,
                "label": choices.index(target),
            }
        )
        if len(rows) == k:
            break
    return rows


def cloze_examples(
    work: Work, speeches: list[Speech], banned: set[str], k: int, rng: random.Random
) -> list[dict]:
    eligible = [
        (s, i)
        for s in speeches
        for i in range(MIN_CONTEXT, len(s.lines))
        if is_clean(s.lines[i]) and LAST_WORD.match(s.lines[i])
    ]
    rows = []
    for speech, i in rng.sample(eligible, len(eligible)):
        line = speech.lines[i]
        match = LAST_WORD.match(line)
        if len(match["word"]) < 3:  # "I", "me", "so": too little to predict
            continue
        context = speech.lines[max(0, i - CLOZE_CONTEXT) : i]
        if long_lines([*context, line]) & banned:
            continue
        rows.append(
            {
                "id": f"{work.name}:{speech.index}:{i}",
                "work": work.name,
                "title": work.title,
                "context": "\n".join([speech.speaker, *context, match["prefix"]]),
                "target": match["word"],
            }
        )
        if len(rows) == k:
            break
    return rows


def passage_examples(work: Work, text: str, banned: set[str], k: int, rng: random.Random) -> list[dict]:
    spans = block_spans(text)
    starts_speech = [as_speech(i, text[a:b]) is not None for i, (a, b) in enumerate(spans)]
    # Consecutive, non-overlapping passages, each starting at a speech and ending at a block boundary.
    passages = []
    i = 0
    while i < len(spans):
        if not starts_speech[i]:
            i += 1
            continue
        j = i
        while j < len(spans) and spans[j][1] - spans[i][0] < PASSAGE_CHARS[0]:
            j += 1
        if j == len(spans):
            break
        start, end = spans[i][0], spans[j][1]
        if end - start <= PASSAGE_CHARS[1]:
            passages.append((i, text[start:end]))
        i = j + 1
    candidates = [(i, p) for i, p in passages if not long_lines([p]) & banned]
    chosen = sorted(rng.sample(candidates, min(k, len(candidates))))
    return [{"id": f"{work.name}:{i}", "work": work.name, "title": work.title, "text": p} for i, p in chosen]


# ------------------------------------------------------------------------------------- task configs

_YAML = {
    "shakespeare_next_line": """\
task: shakespeare_next_line
tag: shakespeare
custom_dataset: !function local_data.load_jsonl
dataset_kwargs:
  data_files:
    test: data/shakespeare_next_line.jsonl
output_type: multiple_choice
test_split: test
num_fewshot: 0
doc_to_text: "{{context}}"
doc_to_choice: choices
doc_to_target: label
# the context ends at the end of a line; each choice is the whole next line
target_delimiter: "\\n"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
  # ranks by log P(line | context) - log P(line): one more, context-free, request per choice
  - metric: acc_mutual_info
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""",
    "shakespeare_cloze": """\
task: shakespeare_cloze
tag: shakespeare
custom_dataset: !function local_data.load_jsonl
dataset_kwargs:
  data_files:
    test: data/shakespeare_cloze.jsonl
output_type: loglikelihood
test_split: test
num_fewshot: 0
doc_to_text: "{{context}}"
# loglikelihood requests ignore target_delimiter: the space before the word is part of the target
doc_to_target: "{{' ' + target}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""",
    "shakespeare_passages": """\
task: shakespeare_passages
tag: shakespeare
custom_dataset: !function local_data.load_jsonl
dataset_kwargs:
  data_files:
    test: data/shakespeare_passages.jsonl
output_type: loglikelihood_rolling
test_split: test
num_fewshot: 0
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
metadata:
  version: 1.0
""",
}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def build(out_dir: str | Path = TASKS_DIR, seed: int = SEED) -> dict[str, int]:
    """Writes every task's data and YAML under `out_dir`; returns {task: number of examples}."""
    out_dir = Path(out_dir)
    train, validation = split_works(shakespeare_works(), VALIDATION_FRACTION, SPLIT_SEED)
    banned = long_lines(w.path.read_text(encoding="utf-8") for w in train)
    texts = {w.name: w.path.read_text(encoding="utf-8") for w in validation}
    speeches = {
        w.name: [
            s
            for i, (a, b) in enumerate(block_spans(texts[w.name]))
            if (s := as_speech(i, texts[w.name][a:b]))
        ]
        for w in validation
    }

    def rng(task: str, work: str = "") -> random.Random:
        return random.Random(f"{seed}:{task}:{work}")  # str seeds hash with sha512: stable across runs

    tasks: dict[str, list[dict]] = {name: [] for name in _YAML}
    counts = {
        "shakespeare_next_line": quotas(NEXT_LINE_EXAMPLES, validation),
        "shakespeare_cloze": quotas(CLOZE_EXAMPLES, validation),
        "shakespeare_passages": quotas(PASSAGE_EXAMPLES, validation),
    }
    for w in validation:
        task = "shakespeare_next_line"
        tasks[task] += next_line_examples(
            w, speeches[w.name], banned, counts[task][w.name], rng(task, w.name)
        )
        task = "shakespeare_cloze"
        tasks[task] += cloze_examples(w, speeches[w.name], banned, counts[task][w.name], rng(task, w.name))
        task = "shakespeare_passages"
        tasks[task] += passage_examples(w, texts[w.name], banned, counts[task][w.name], rng(task, w.name))

    works = "; ".join(w.title for w in validation)
    for task, rows in tasks.items():
        rng(task).shuffle(rows)
        write_jsonl(out_dir / "data" / f"{task}.jsonl", rows)
        header = (
            f"# Generated by `python -m eval.tasks.build --seed {seed}`: edit the script, not this file.\n"
            f"# {len(rows)} examples (data/{task}.jsonl) from the validation works: {works}.\n"
        )
        (out_dir / f"{task}.yaml").write_text(header + _YAML[task], encoding="utf-8")
    return {task: len(rows) for task, rows in tasks.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument(
        "--out", default=str(TASKS_DIR), help="folder for the YAMLs (data goes to <out>/data)"
    )
    args = parser.parse_args(argv)
    for task, n in build(args.out, args.seed).items():
        print(f"{task}: {n} examples")


if __name__ == "__main__":
    main()
