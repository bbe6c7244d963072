"""Damaged sharded checkpoints are refused, never loaded; a full disk leaves nothing; tied weights are written once.

One process, DCP without a process group (what `train.export_checkpoint` does); the same code runs on every rank
of a sharded run (tests/test_train_parallel.py damages the dp 2 x tp 2 run's checkpoint end to end).

- a record with 1 KB overwritten, or a shard file replaced by random bytes of its size: `DamagedCheckpoint`
  naming the file and the record, found while loading (the weights were loaded silently without the CRC-32);
- a shard file missing or cut short, a `.metadata` that cannot be read, a `last.ckpt` link whose directory is
  gone: `problem` names it without reading a record; resume=auto falls back to the newest checkpoint that
  loads and says so, or refuses in one line when there is none;
- a checkpoint written by plain `dcp.save` (no checksums) still loads;
- a full disk during a sharded save: one line, no directory left;
- the tied embedding and head: one record, loaded into both names.
"""

import errno
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

import models
from parallel.checkpoint import model_views
from train import sharded_checkpoint
from train.checkpoint_space import CheckpointWriteError
from train.errors import TrainingError
from train.export_checkpoint import main as export_main
from train.run_directory import find_resume_checkpoint, readable_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"state_dict": {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}, "step": 3}


def zeros_like(s: dict) -> dict:
    return {"state_dict": {k: torch.zeros_like(v) for k, v in s["state_dict"].items()}, "step": 0}


def records(directory) -> dict[str, tuple[str, int, int]]:
    """{tensor name: (file, offset, length)} from `.metadata`."""
    with open(directory / ".metadata", "rb") as file:
        metadata = pickle.load(file)
    return {i.fqn: (s.relative_path, s.offset, s.length) for i, s in metadata.storage_data.items()}


def checkpoint(tmp_path, name: str = "last.ckpt", seed: int = 0):
    """A sharded checkpoint `name` (link + directory) in tmp_path/checkpoints, as the strategy writes it."""
    link = tmp_path / "checkpoints" / name
    directory = sharded_checkpoint.new_directory(link)
    directory.mkdir(parents=True)
    s = state(seed)
    meta = {"global_step": 3, "hyper_parameters": {"model_name": "llama"}}
    sharded_checkpoint.write(directory, {"state_dict": s["state_dict"]}, meta, needed_bytes=0)
    sharded_checkpoint.swap_in(link, directory)
    return link, s


def overwrite(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(data)


def test_a_checksummed_checkpoint_loads_what_was_saved(tmp_path):
    link, s = checkpoint(tmp_path)
    assert sharded_checkpoint.problem(link) is None
    loaded = zeros_like(s)
    sharded_checkpoint.load({"state_dict": loaded["state_dict"]}, link, no_dist=True)
    for name, tensor in s["state_dict"].items():
        assert torch.equal(loaded["state_dict"][name], tensor)


@pytest.mark.parametrize("damage", ["1 KB inside a record", "random file"])
def test_changed_bytes_are_refused_while_loading(tmp_path, damage):
    link, s = checkpoint(tmp_path)
    file, offset, length = records(link.resolve())["state_dict.w"]
    path = link.resolve() / file
    if damage == "1 KB inside a record":
        overwrite(path, offset + length // 2, os.urandom(1024))
    else:
        path.write_bytes(os.urandom(path.stat().st_size))
    assert sharded_checkpoint.problem(link) is None  # sizes intact: only the records' checksums can tell
    loaded = zeros_like(s)
    with pytest.raises(sharded_checkpoint.DamagedCheckpoint) as caught:
        sharded_checkpoint.load({"state_dict": loaded["state_dict"]}, link, no_dist=True)
    message = str(caught.value)
    assert message.startswith(f"{link} is damaged: the record at byte {offset:,} of {file} fails its CRC-32 check")
    assert "\n" not in message


@pytest.mark.parametrize("damage", ["missing", "truncated", "metadata"])
def test_missing_or_short_files_are_found_without_reading_a_record(tmp_path, damage):
    link, _ = checkpoint(tmp_path)
    file, _, _ = records(link.resolve())["state_dict.w"]
    path = link.resolve() / file
    if damage == "missing":
        path.unlink()
        expected = f"its shard file {file} is missing"
    elif damage == "truncated":
        os.truncate(path, path.stat().st_size - 100)
        expected = f"its shard file {file} is cut short"
    else:
        (link.resolve() / ".metadata").write_bytes(b"not a pickle " * 16)  # random bytes may fail as another error
        expected = ".metadata cannot be read (UnpicklingError"
    assert sharded_checkpoint.problem(link).startswith(expected)
    # resume=<path>: one line naming it; resume=auto falls back to the newest one that loads
    with pytest.raises(TrainingError) as caught:
        readable_checkpoint(str(link), fall_back=False)
    message = str(caught.value)
    assert message.startswith(f"Cannot resume: {link} cannot be loaded ({expected}")
    assert "\n" not in message and "resume=never overwrite=true" in message
    step2, _ = checkpoint(tmp_path, "step2.ckpt", seed=1)
    assert readable_checkpoint(str(link), fall_back=True) == str(step2)


def test_export_refuses_a_damaged_checkpoint_in_one_line(tmp_path, capsys):
    link, _ = checkpoint(tmp_path)
    file, offset, length = records(link.resolve())["state_dict.w"]
    overwrite(link.resolve() / file, offset + length // 2, os.urandom(1024))
    # the model of the meta: a checkpoint of llama whose state holds two tensors of another name is refused at
    # load; write one of the real model instead
    model = models.get("llama").model_class(models.get("llama").tiny())
    directory = sharded_checkpoint.new_directory(link)
    directory.mkdir()
    meta = {"global_step": 3, "hyper_parameters": {"model_name": "llama"}, "model_config": model.config.to_dict()}
    sharded_checkpoint.write(directory, {"state_dict": model_views(model, None, prefix="model.")}, meta, 0)
    sharded_checkpoint.swap_in(link, directory)
    out = tmp_path / "hf"
    assert export_main([str(link), str(out)]) == 0  # intact: exported
    capsys.readouterr()
    file, offset, length = records(directory)["state_dict.model.model.embed_tokens.weight"]
    overwrite(directory / file, offset + length // 2, os.urandom(1024))
    assert export_main([str(link), str(tmp_path / "hf2")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"Error: cannot export {link}: the record at byte {offset:,} of {file} fails") and "\n" not in err
    assert not (tmp_path / "hf2").exists()
    os.truncate(directory / file, 10)
    assert export_main([str(link), str(tmp_path / "hf2")]) == 1
    assert f"its shard file {file} is cut short" in capsys.readouterr().err


def test_a_checkpoint_without_checksums_still_loads(tmp_path):
    s = state()
    dcp.save({"state_dict": s["state_dict"]}, checkpoint_id=tmp_path / "plain", no_dist=True)
    loaded = zeros_like(s)
    sharded_checkpoint.load({"state_dict": loaded["state_dict"]}, tmp_path / "plain", no_dist=True)
    assert torch.equal(loaded["state_dict"]["w"], s["state_dict"]["w"])


def test_a_dangling_last_link_falls_back_or_is_refused(tmp_path, capsys):
    link, _ = checkpoint(tmp_path)
    target = os.readlink(link)
    shutil.rmtree(link.resolve())
    assert link.is_symlink() and not link.exists()
    # resume=auto still names it (it used to be taken for "no checkpoint": a silent restart from step 0) ...
    assert find_resume_checkpoint("auto", tmp_path) == str(link)
    assert sharded_checkpoint.problem(link).startswith(f"it links to {target}, which does not exist")
    # ... and, with no other checkpoint, refuses in one line
    with pytest.raises(TrainingError, match="Cannot resume: .* which does not exist"):
        readable_checkpoint(str(link), fall_back=True)
    assert export_main([str(link), str(tmp_path / "hf")]) == 1
    assert "which does not exist" in capsys.readouterr().err
    step2, _ = checkpoint(tmp_path, "step2.ckpt")
    assert readable_checkpoint(str(link), fall_back=True) == str(step2)


def test_a_full_disk_during_a_sharded_save_leaves_no_directory(tmp_path, monkeypatch):
    link, _ = checkpoint(tmp_path)
    real_save = torch.save

    def full_disk(obj, file, *args, **kwargs):
        file.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    directory = sharded_checkpoint.new_directory(link)
    directory.mkdir()
    with pytest.raises(CheckpointWriteError) as caught:
        sharded_checkpoint.write(directory, {"state_dict": state()["state_dict"]}, {"global_step": 4}, 2_000_000)
    monkeypatch.setattr(torch, "save", real_save)
    message = str(caught.value)
    assert str(directory) in message and "No space left on device" in message and "needs about 2.0 MB" in message
    assert "\n" not in message
    assert not directory.exists() and sharded_checkpoint.problem(link) is None  # the previous one kept


def test_tied_weights_are_written_once_and_load_into_both(tmp_path):
    entry = models.get("llama")
    model = entry.model_class(entry.tiny(tie_word_embeddings=True))
    views = model_views(model, None)
    assert "model.embed_tokens.weight" in views and "lm_head.weight" not in views
    assert len(views) == len({id(p) for p in model.state_dict(keep_vars=True).values()})
    directory = tmp_path / "tied"
    directory.mkdir()
    sharded_checkpoint.write(directory, {"state_dict": views}, None, 0)
    # against the same views with the head's name added back: one matrix less on disk
    twice = tmp_path / "twice"
    twice.mkdir()
    sharded_checkpoint.write(twice, {"state_dict": {**views, "lm_head.weight": model.lm_head.weight.detach()}}, None, 0)
    head = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    saved = (twice / "__0_0.distcp").stat().st_size - (directory / "__0_0.distcp").stat().st_size
    assert head <= saved < head + 4096  # the matrix and its record's framing
    fresh = entry.model_class(entry.tiny(tie_word_embeddings=True))
    sharded_checkpoint.load({"state_dict": model_views(fresh, None)}, directory, no_dist=True)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
