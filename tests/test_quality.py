"""Quality evaluation: bundled lm-eval tasks, the "zoo" lm-eval model, perplexity, `python -m eval.quality`.

Everything runs offline on tiny random models with a few examples per task (lm-eval's `limit`).
"""

import json
import math
import os
from pathlib import Path

# Nothing here may reach the network (the bundled tasks never do; these make any slip fail fast). `datasets`
# reads its flag when first imported, hence before the imports below when this module is run alone.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import lm_eval  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from omegaconf import OmegaConf, open_dict  # noqa: E402

import models  # noqa: E402
from eval import quality  # noqa: E402
from eval.lm_eval_adapter import ZooLM  # noqa: E402
from eval.perplexity import evaluate_loss  # noqa: E402
from eval.tasks import BUNDLED_TASKS, TASKS_DIR  # noqa: E402
from eval.tasks import build as task_build  # noqa: E402
from train.data import LMDataModule, load_tokenizer, shakespeare_works, split_works  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"
TINY = {k: v for k, v in models.TINY_LLAMA.items() if k != "vocab_size"}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def tiny_model(vocab_size: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return models.build_model("llama", **TINY, vocab_size=vocab_size).eval()


@pytest.fixture(scope="module")
def zoo_lm(tokenizer):
    return ZooLM(tiny_model(len(tokenizer)), tokenizer=tokenizer, device="cpu", batch_size=4)


@pytest.fixture(scope="module")
def task_manager():
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


def read_rows(task: str) -> list[dict]:
    with open(TASKS_DIR / "data" / f"{task}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_zoo_lm_runs_bundled_tasks_offline(zoo_lm, task_manager):
    assert set(BUNDLED_TASKS) <= set(task_manager.all_subtasks)
    out = lm_eval.simple_evaluate(
        model=zoo_lm,
        tasks=["shakespeare_next_line", "shakespeare_cloze"],
        task_manager=task_manager,
        limit=4,
        bootstrap_iters=0,
        log_samples=False,
    )
    results = out["results"]
    for task in ("shakespeare_next_line", "shakespeare_cloze"):
        assert out["n-samples"][task]["effective"] == 4
    for metric in ("acc,none", "acc_norm,none", "acc_mutual_info,none"):
        assert 0.0 <= results["shakespeare_next_line"][metric] <= 1.0
    assert 0.0 <= results["shakespeare_cloze"]["acc,none"] <= 1.0
    assert results["shakespeare_cloze"]["perplexity,none"] > 1.0


def test_every_bundled_request_encodes(zoo_lm, task_manager):
    """Each (context, continuation) pair tokenizes into two non-empty parts.

    lm-eval asserts this only when it reaches the pair, deep into a run; a continuation without its
    leading space can merge into the context's last token ("but a" + "while" -> "awhile") and trip it.
    """
    for name in ("shakespeare_next_line", "shakespeare_cloze"):
        task = task_manager.load([name])["tasks"][name]
        task.build_all_requests(rank=0, world_size=1)
        # next_line: each choice with the context and, for acc_mutual_info, without it
        per_doc = 2 * 4 if name == "shakespeare_next_line" else 1
        assert len(task.instances) == len(read_rows(name)) * per_doc
        for instance in task.instances:
            context, continuation = instance.args
            assert continuation[0].isspace(), (name, instance.doc["id"], continuation)
            if not context:  # lm-eval puts the prefix token (eos) before a context-free continuation
                assert zoo_lm.tok_encode(continuation, add_special_tokens=False), (name, instance.doc["id"])
                continue
            context_enc, continuation_enc = zoo_lm._encode_pair(context, continuation)
            assert context_enc and continuation_enc, (name, instance.doc["id"])


def test_uniform_model_perplexity_equals_vocab_size(tokenizer):
    model = tiny_model(len(tokenizer))
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: the uniform distribution over the vocabulary
    datamodule = LMDataModule(seq_len=64, batch_size=4, max_val_batches=2)
    measured = evaluate_loss(model, datamodule.val_dataloader(), max_batches=2)
    assert measured["tokens"] == 2 * 4 * 63
    assert measured["ppl"] == pytest.approx(len(tokenizer), rel=1e-4)


def save_checkpoint(folder: Path, tokenizer) -> Path:
    """A tiny zoo model and the bundled tokenizer, saved as `train.pretrain` saves its final model."""
    tiny_model(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_zoo_lm_loads_a_checkpoint_folder(tmp_path, tokenizer):
    folder = save_checkpoint(tmp_path / "hf", tokenizer)
    lm = ZooLM(str(folder), device="cpu", batch_size="2")  # as lm-eval's command line passes them
    assert lm.model.config.model_type == models.ZOO["llama"].config_class.model_type
    assert lm.tokenizer.get_vocab() == tokenizer.get_vocab()  # the folder's own tokenizer
    assert lm.batch_size == 2 and str(lm.device) == "cpu"
    expected = tiny_model(len(tokenizer)).state_dict()
    for name, tensor in lm.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert lm.get_model_info()["model_num_parameters"] == sum(t.numel() for t in expected.values())


@pytest.mark.parametrize("source", ["random weights", "checkpoint"])
def test_quality_run_writes_report(tmp_path, monkeypatch, tokenizer, source):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub task must be recorded as skipped, not fetched
    checkpoint = save_checkpoint(tmp_path / "hf", tokenizer) if source == "checkpoint" else None
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            "quality",
            overrides=[
                f"checkpoint={checkpoint}" if checkpoint else "checkpoint=null",
                f"out_dir={tmp_path}",
                f"paths.output_dir={tmp_path}",
                "logger=none",
                "perplexity.seq_len=64",
                "perplexity.max_batches=2",
                "tasks.limit=3",
                "tasks.batch_size=4",
                "tasks.bootstrap_iters=100",
                "tasks.hub=[hellaswag]",
            ],
        )
    with open_dict(cfg):
        cfg.model.config = OmegaConf.create(TINY)  # whatever conf/model/llama.yaml holds, keep it tiny
    result = quality.run(cfg)

    saved = json.loads((tmp_path / "quality.json").read_text())
    assert saved == json.loads(json.dumps(result, default=str))
    assert saved["model"]["source"] == source
    assert saved["tokenizer"] == (str(checkpoint) if checkpoint else "bundled (train/tokenizer)")
    ppl = saved["perplexity"]
    assert ppl["tokens"] == 2 * 8 * 63 and math.isfinite(ppl["ppl"]) and ppl["ppl"] > 1.0
    for task in BUNDLED_TASKS:
        entry = saved["tasks"][task]
        assert entry["status"] == "ok" and entry["n"] == 3, entry
        for name, metric in entry["metrics"].items():
            assert metric["value"] is not None and math.isfinite(metric["value"]), (task, name)
            if name.startswith("acc"):
                assert 0.0 <= metric["value"] <= 1.0
    assert saved["tasks"]["hellaswag"] == {"source": "hub", "status": "skipped: offline"}

    table = (tmp_path / "quality.md").read_text()
    assert "| task | source | metric | value | ± stderr | better | n |" in table
    for task in (*BUNDLED_TASKS, "hellaswag", "skipped: offline", "perplexity"):
        assert task in table


def test_task_builder_is_deterministic_and_up_to_date(tmp_path):
    counts = task_build.build(tmp_path / "a")
    task_build.build(tmp_path / "b")
    assert counts == {"shakespeare_next_line": 300, "shakespeare_cloze": 300, "shakespeare_passages": 48}
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert len(files) == 2 * len(BUNDLED_TASKS)
    for rel in files:
        built = (tmp_path / "a" / rel).read_bytes()
        assert built == (tmp_path / "b" / rel).read_bytes(), rel
        # The committed files are what the script writes: rerun it after changing it.
        assert built == (TASKS_DIR / rel).read_bytes(), f"{rel} is stale: run python -m eval.tasks.build"


def test_task_data_comes_from_validation_works_only():
    train, validation = split_works(
        shakespeare_works(), task_build.VALIDATION_FRACTION, task_build.SPLIT_SEED
    )
    texts = {w.name: w.path.read_text(encoding="utf-8") for w in validation}
    lines = {name: {line.strip() for line in text.split("\n")} for name, text in texts.items()}
    training = {line.strip() for w in train for line in w.path.read_text(encoding="utf-8").split("\n")}
    training = {line for line in training if len(line) >= task_build.MIN_LINE_CHARS}

    def check(row: dict, own_lines: list[str], text: str) -> None:
        assert row["work"] in texts, f"{row['id']} is not from a validation work"
        for line in own_lines:
            assert line.strip() in lines[row["work"]], (row["id"], line)
        leaked = {s for s in (line.strip() for line in text.split("\n")) if s in training}
        assert not leaked, (row["id"], leaked)

    for row in read_rows("shakespeare_next_line"):
        assert len(row["choices"]) == 4 and len(set(row["choices"])) == 4 and 0 <= row["label"] < 4
        own = [*row["context"].split("\n"), *row["choices"]]
        check(row, own, "\n".join(own))
    for row in read_rows("shakespeare_cloze"):
        *context, prefix = row["context"].split("\n")
        line = f"{prefix} {row['target']}"
        assert any(s.startswith(line) for s in lines[row["work"]]), row["id"]
        check(row, context, "\n".join([*context, line]))
    for row in read_rows("shakespeare_passages"):
        assert row["text"] in texts[row["work"]], row["id"]
        check(row, [], row["text"])
