"""Tests of the prepared-data pipeline on corpora the tests write: preparation (shards, manifest, workers,
interruption), reading by window without loading, mixtures, exact resume, data-parallel shares, and the
bad inputs, each one error naming the setting with nothing written.

Everything runs offline; caches go to temporary folders (OVERLAP_ZOO_CACHE).
"""

from __future__ import annotations

import json
import sys
import tracemalloc

import numpy as np
import pytest
import torch

from tests.test_data import _ids
from train import data
from train.data.documents import in_validation
from train.module import CausalLMModule

prepare_module = sys.modules["train.data.prepare"]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OVERLAP_ZOO_CACHE", str(tmp_path / "cache"))


def _write_jsonl(path, n_docs, seed=0, words=60, column="text"):
    rng = np.random.default_rng(seed)
    vocabulary = "the king queen a sword crown night day love death speak hear now then fair foul".split()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n_docs):
            text = " ".join(rng.choice(vocabulary, size=int(rng.integers(5, words)))) + f" {i}."
            f.write(json.dumps({column: text, "id": i}) + "\n")
    return path


def _tokens(folder, split):
    manifest = data.read_manifest(folder)
    shards = manifest["splits"][split]["shards"]
    return np.concatenate([np.fromfile(folder / s["file"], dtype=manifest["dtype"]) for s in shards])


# ----------------------------------------------------------------------------------------------- prepare


def test_shards_and_manifest_do_not_depend_on_the_number_of_processes(tmp_path):
    source = _write_jsonl(tmp_path / "corpus" / "part-0.jsonl", 3000)
    _write_jsonl(tmp_path / "corpus" / "part-1.jsonl", 1000, seed=1)
    settings = data.SourceSettings(str(tmp_path / "corpus"), validation_fraction=0.1, split_seed=3)
    one = data.prepare_corpus(settings, folder=tmp_path / "one", num_proc=1, shard_tokens=5000, progress=False)
    two = data.prepare_corpus(settings, folder=tmp_path / "two", num_proc=2, shard_tokens=5000, progress=False)
    m1, m2 = data.read_manifest(one), data.read_manifest(two)
    assert m1["splits"] == m2["splits"] and len(m1["splits"]["train"]["shards"]) > 3
    assert m1["dtype"] == "uint16" and m1["key"]["source"]["files"][0][0] == "part-0.jsonl"
    assert not (one / "progress.json").exists()
    for split in ("train", "validation"):
        assert np.array_equal(_tokens(one, split), _tokens(two, split))
    # Every document once, eos after each, split by the seeded hash of its index.
    tokenizer = data.load_tokenizer()
    texts = [json.loads(line)["text"] for p in sorted(source.parent.glob("*.jsonl")) for line in open(p)]
    expected = {"train": [], "validation": []}
    for i, text in enumerate(texts):
        split = "validation" if in_validation(i, 0.1, 3) else "train"
        expected[split] += tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    for split in ("train", "validation"):
        assert _tokens(one, split).tolist() == expected[split]
    assert 300 < m1["splits"]["validation"]["documents"] < 500
    assert m1["splits"]["train"]["documents"] + m1["splits"]["validation"]["documents"] == 4000


def test_an_interrupted_preparation_is_never_read_and_continues(tmp_path, monkeypatch, capsys):
    _write_jsonl(tmp_path / "corpus" / "train.jsonl", 4000)
    settings = data.SourceSettings(str(tmp_path / "corpus"))
    reference = data.prepare_corpus(settings, folder=tmp_path / "ref", num_proc=1, progress=False)

    monkeypatch.setattr(prepare_module, "_BATCH_CHARS", 4096)
    monkeypatch.setattr(prepare_module, "_PROGRESS_EVERY", 3)
    real = prepare_module._batches

    def killed_after(stream):
        for i, batch in enumerate(real(stream)):
            if i == 10:
                raise KeyboardInterrupt  # the process dies mid-preparation
            yield batch

    monkeypatch.setattr(prepare_module, "_batches", killed_after)
    folder = tmp_path / "prepared"
    with pytest.raises(KeyboardInterrupt):
        data.prepare_corpus(settings, folder=folder, num_proc=1, shard_tokens=3000, progress=False)
    assert (folder / "progress.json").exists() and data.read_manifest(folder) is None
    # A run pointed at it does not read it as complete: it continues the preparation.
    monkeypatch.setattr(prepare_module, "_batches", real)
    dm = data.LMDataModule(prepared_dir=str(folder), source=str(tmp_path / "corpus"), seq_len=16, batch_size=2)
    dm.folders(progress=False)
    assert "continuing an interrupted preparation after" in capsys.readouterr().err
    for split in ("train", "validation"):
        assert np.array_equal(_tokens(folder, split), _tokens(reference, split))


def test_errors_name_the_setting_and_write_nothing(tmp_path):
    def refused(match, prepares=False, **kwargs):
        before = set((tmp_path / "cache").rglob("*")) if (tmp_path / "cache").exists() else set()
        with pytest.raises(data.DataError, match=match):
            data.LMDataModule(**{"seq_len": 16, "batch_size": 2, **kwargs}).setup()
        after = set((tmp_path / "cache").rglob("*")) if (tmp_path / "cache").exists() else set()
        written = {p for p in after - before if p.is_file() and not p.name.endswith(".lock")}
        # A corpus too small for a batch is a complete preparation; the rest leave nothing behind.
        assert not written or (prepares and any(p.name == "manifest.json" for p in written))

    folder = tmp_path / "corpus"
    _write_jsonl(folder / "train.jsonl", 50, column="content")
    refused(r"data\.hf_config='sample-10BT'.*local path; set data\.hf_config=null", source=str(folder),
            hf_config="sample-10BT")
    refused(r"no column 'text'; set data\.text_column to one of \['content', 'id'\]", source=str(folder))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "train.jsonl").write_text("")
    refused(r"empty file, .*train\.jsonl", source=str(empty))
    latin = tmp_path / "latin"
    latin.mkdir()
    (latin / "train.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1") * 10)
    refused(r"not UTF-8", source=str(latin))
    refused(r"fewer than one batch per data replica \(data\.batch_size=64 x 1", source=str(folder),
            text_column="content", batch_size=64, seq_len=256, prepares=True)


def test_a_folder_of_another_tokenizer_is_refused(tmp_path):
    _write_jsonl(tmp_path / "corpus" / "train.jsonl", 200)
    folder = data.prepare_corpus(data.SourceSettings(str(tmp_path / "corpus")), folder=tmp_path / "p",
                                 progress=False)
    other = data.load_tokenizer()
    other.add_tokens(["sword-crown"])
    other.save_pretrained(tmp_path / "tok")
    with pytest.raises(data.DataError, match=r"prepared with another tokenizer .* than data\.tokenizer="):
        data.LMDataModule(sources=[{"path": str(folder)}], tokenizer=str(tmp_path / "tok"), seq_len=16,
                          batch_size=2).setup()


def test_an_embedding_smaller_than_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match=r"model\.config\.vocab_size=1000 cannot hold the 8192 token ids"):
        CausalLMModule("llama", {"vocab_size": 1000, "hidden_size": 32, "num_hidden_layers": 1,
                                 "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 64},
                       vocab_size=8192, optimizer={})


# ------------------------------------------------------------------------------------ sampling, resume


def test_permutation_is_a_bijection_keyed_by_its_key():
    for n in (1, 2, 7, 1000, 4097):
        values = data.Permutation(n, 5, 0).take(np.arange(n))
        assert sorted(values.tolist()) == list(range(n))
    a, b = (data.Permutation(1000, 5, e).take(np.arange(1000)) for e in (0, 1))
    assert not np.array_equal(a, b) and np.array_equal(a, data.Permutation(1000, 5, 0).take(np.arange(1000)))


def _mixture(tmp_path, **kwargs):
    folders = []
    for i, docs in enumerate((1500, 400)):
        if not (tmp_path / f"src{i}").exists():
            _write_jsonl(tmp_path / f"src{i}" / "train.jsonl", docs, seed=i)
        folders.append(data.prepare_corpus(data.SourceSettings(str(tmp_path / f"src{i}")),
                                           folder=tmp_path / f"p{i}", num_proc=1, progress=False))
    sources = [{"path": str(folders[0]), "weight": 0.25, "name": "big"},
               {"path": str(folders[1]), "weight": 0.75, "name": "small"}]
    dm = data.LMDataModule(sources=sources, **{"seq_len": 32, "batch_size": 4, "seed": 7, **kwargs})
    dm.setup()
    return dm


def test_a_mixture_takes_each_source_by_weight(tmp_path):
    dm = _mixture(tmp_path)
    counts = dm.train_dataset.counts
    assert counts[0] > 3 * counts[1]
    sampler = dm.train_dataloader().sampler
    drawn = np.asarray(list(sampler))
    from_small = drawn >= dm.train_dataset.offsets[1]
    # Exact proportions over the epoch; the small source repeated, each pass in another order.
    assert abs(from_small.mean() - 0.75) < 2 / len(drawn)
    small = drawn[from_small] - dm.train_dataset.offsets[1]
    assert set(small.tolist()) == set(range(counts[1]))
    assert len(drawn) == sum(counts)
    # Per-source validation: every validation row says which source it is from.
    sources = torch.cat([batch["source"] for batch in dm.val_dataloader()])
    assert set(sources.tolist()) == {0, 1} and dm.source_names == ["big", "small"]


def test_a_mixture_resumes_exactly_mid_epoch(tmp_path):
    dm = _mixture(tmp_path)
    reference = dm.train_dataloader()
    reference.sampler.set_epoch(1)
    full = _ids(reference)
    interrupted = dm.train_dataloader()
    interrupted.sampler.set_epoch(1)
    _ids(interrupted, limit=9)
    state = interrupted.state_dict()
    resumed = _mixture(tmp_path).train_dataloader()  # a fresh process: a new data module
    resumed.load_state_dict(state)
    rest = _ids(resumed)
    assert len(rest) == len(full) - 9
    assert all(torch.equal(a, b) for a, b in zip(rest, full[9:], strict=True))
    # Other weights are another epoch order: refused rather than resumed somewhere else.
    other = data.LMDataModule(sources=[{**s, "weight": 1.0} for s in _sources(dm)], seq_len=32, batch_size=4,
                              seed=7).train_dataloader()
    with pytest.raises(ValueError, match="the mixture"):
        other.load_state_dict(state)


def _sources(dm):
    return [{"path": e["path"], "name": e["name"]} for e in dm.entries]


def test_data_parallel_ranks_take_disjoint_windows(tmp_path):
    dm = _mixture(tmp_path)
    single = list(dm.train_dataloader().sampler)
    shares = [list(_mixture(tmp_path, dp_size=2, dp_rank=r).train_dataloader().sampler) for r in (0, 1)]
    assert len(shares[0]) == len(shares[1]) == len(single) // 2
    assert [shares[i % 2][i // 2] for i in range(len(single) // 2 * 2)] == single[: len(single) // 2 * 2]
    # Disjoint where the epoch holds each window once: the large source, given less than its size.
    big = [set(i for i in share if i < dm.train_dataset.offsets[1]) for share in shares]
    assert big[0] and big[1] and not big[0] & big[1]


def test_a_rank_does_not_hold_the_corpus(tmp_path):
    """An epoch over a 50 MB prepared corpus: Python allocations and anonymous memory stay within a few MB."""
    _write_jsonl(tmp_path / "tiny" / "train.jsonl", 400)
    folder = data.prepare_corpus(data.SourceSettings(str(tmp_path / "tiny")), folder=tmp_path / "big",
                                 num_proc=1, progress=False)
    manifest = data.read_manifest(folder)
    tokens = 25 * 2**20  # 50 MB of uint16
    rng = np.random.default_rng(0)
    shards = []
    for i in range(5):
        name = f"train-{i:05d}.bin"
        rng.integers(0, 8192, tokens // 5, dtype=np.uint16).tofile(folder / name)
        shards.append({"file": name, "tokens": tokens // 5, "documents": 1})
    manifest["splits"]["train"] = {"tokens": tokens, "documents": 5, "shards": shards}
    (folder / "manifest.json").write_text(json.dumps(manifest))

    dm = data.LMDataModule(sources=[{"path": str(folder)}], seq_len=512, batch_size=64)
    dm.setup()
    loader = dm.train_dataloader()
    rss_before = _anonymous_kb()
    tracemalloc.start()
    seen = 0
    for batch in loader:
        seen += batch["input_ids"].numel()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    grown_mb = (_anonymous_kb() - rss_before) / 1024
    assert seen > 0.95 * tokens
    assert peak < 4 * 2**20, peak
    assert grown_mb < 8, grown_mb


def _anonymous_kb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError("no RssAnon in /proc/self/status")


def test_pretrain_on_a_mixture_reports_validation_per_source(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir

    from tests.test_train import REPO, TINY
    from train.pretrain import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    dm = _mixture(tmp_path)
    sources = ", ".join(f"{{path: '{e['path']}', weight: {e['weight']}, name: {e['name']}}}" for e in dm.entries)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("pretrain", overrides=[
            *TINY, "trainer=cpu", "logger=csv", "trainer.max_steps=2", f"data.sources=[{sources}]",
            "trainer.limit_val_batches=1.0",
            f"paths.output_dir={tmp_path / 'run'}",
        ])
    train(cfg)
    metrics = (tmp_path / "run" / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    assert {"val/loss", "val/loss/big", "val/loss/small"} <= set(header)
    last = [row.split(",") for row in metrics[1:] if row.split(",")[header.index("val/loss/big")]][-1]
    overall, big, small = (float(last[header.index(k)]) for k in ("val/loss", "val/loss/big", "val/loss/small"))
    # The overall loss is the token-weighted mean of the sources' (every row predicts seq_len - 1 tokens).
    rows = dm.val_dataset.counts
    assert all(rows) and overall == pytest.approx((big * rows[0] + small * rows[1]) / sum(rows), rel=1e-5)


def test_concurrent_preparers_of_one_folder_prepare_it_once(tmp_path):
    import subprocess

    _write_jsonl(tmp_path / "corpus" / "train.jsonl", 6000)
    script = (
        "import sys; from train import data; "
        "data.prepare_corpus(data.SourceSettings(sys.argv[1]), folder=sys.argv[2], num_proc=1, progress=False)"
    )
    command = [sys.executable, "-c", script, str(tmp_path / "corpus"), str(tmp_path / "p")]
    procs = [subprocess.Popen(command, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    assert data.read_manifest(tmp_path / "p") is not None
    # One took the lock and tokenized; the other waited (if it came while the first held it) and read.
    assert sum("Waiting for another process preparing" in e for e in errors) <= 1
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["manifest.json", "train-00000.bin",
                                                                  "validation-00000.bin"]


def test_a_prepared_dir_of_files_that_changed_is_refused(tmp_path):
    corpus = _write_jsonl(tmp_path / "corpus" / "train.jsonl", 300)
    kwargs = {"source": str(corpus.parent), "prepared_dir": str(tmp_path / "p"), "seq_len": 16, "batch_size": 2}
    data.LMDataModule(**kwargs).setup()
    _write_jsonl(corpus, 310)  # another corpus under the same name
    with pytest.raises(data.DataError, match=r"prepared from other files .* overwrite=true"):
        data.LMDataModule(**kwargs).setup()


def test_parquet_and_text_sources_give_the_documents_tokens(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"the king speaks {i} times" for i in range(40)]
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"body": texts}), tmp_path / "pq" / "train.parquet")
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "train.txt").write_text("\n".join(texts) + "\n")
    (tmp_path / "txt" / "validation.txt").write_text("a held out line\n")
    tokenizer = data.load_tokenizer()
    parquet = data.prepare_corpus(data.SourceSettings(str(tmp_path / "pq"), text_column="body"),
                                  folder=tmp_path / "a", progress=False)
    text = data.prepare_corpus(data.SourceSettings(str(tmp_path / "txt")), folder=tmp_path / "b", progress=False)
    both = _tokens(parquet, "train").tolist() + _tokens(parquet, "validation").tolist()
    assert sorted(both) == sorted(t for s in texts for t in tokenizer.encode(s) + [tokenizer.eos_token_id])
    # A file named validation* is the validation split; one document per line of a text file.
    assert _tokens(text, "train").tolist() == [t for s in texts for t in tokenizer.encode(s) + [tokenizer.eos_token_id]]
    assert data.read_manifest(text)["splits"]["validation"]["documents"] == 1


def test_source_edge_cases_are_one_error_or_work(tmp_path):
    """A file as the source, an edited file, mixed file types, a non-text value, a corpus of one line."""
    corpus = _write_jsonl(tmp_path / "c" / "train.jsonl", 300)

    def tokens():
        folder = data.LMDataModule(source=str(corpus), seq_len=16, batch_size=2).folders(progress=False)[0]
        return _tokens(folder, "train")

    before = tokens()
    _write_jsonl(corpus, 300, seed=9)  # edited in place: another corpus, prepared again
    assert not np.array_equal(before, tokens())
    (tmp_path / "c" / "notes.txt").write_text("a line\n")
    with pytest.raises(data.DataError, match=r"mixes file types"):
        data.LMDataModule(source=str(tmp_path / "c"), seq_len=16, batch_size=2).setup()
    (tmp_path / "n").mkdir()
    (tmp_path / "n" / "train.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(data.DataError, match=r"data\.text_column='text' .* holds int values, not text"):
        data.LMDataModule(source=str(tmp_path / "n"), seq_len=16, batch_size=2).setup()
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "train.txt").write_text("just one line of text\n")
    with pytest.raises(data.DataError, match=r"1 document|no window"):
        data.LMDataModule(source=str(tmp_path / "one"), seq_len=16, batch_size=2).setup()
