"""Every Hydra config of the pretraining entry point composes, resolves and instantiates.

Composes `conf/pretrain.yaml` as Hydra would for `python -m train.pretrain`: with defaults, with every
option of every config group (one yaml file each), and with `experiment=demo`; resolves every
interpolation (Hydra's runtime ones included) and instantiates the cheap parts (trainer, callbacks,
loggers, model config). Nothing is trained and nothing is written.
"""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

import models
from train.pretrain import (
    find_resume_checkpoint,
    instantiate_group,
    lightning_trainer_config,
    resolve_precision,
)

CONF = Path(__file__).resolve().parents[1] / "conf"
# The groups of pretrain's defaults list (conf/ also holds other entry points' groups).
GROUPS = sorted(
    group
    for entry in OmegaConf.load(CONF / "pretrain.yaml").defaults
    if isinstance(entry, DictConfig)
    for group in entry
)
GROUP_OPTIONS = [(group, yaml.stem) for group in GROUPS for yaml in sorted((CONF / group).glob("*.yaml"))]


def compose_pretrain(overrides: list[str]) -> DictConfig:
    """The config `python -m train.pretrain <overrides>` runs with, fully resolved."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("pretrain", overrides=overrides, return_hydra_config=True)
    # Hydra fills hydra.runtime.output_dir from hydra.run.dir when it starts the job; do the same so
    # that ${hydra:runtime.output_dir} (paths.output_dir) resolves.
    with read_write(cfg.hydra), open_dict(cfg.hydra):
        cfg.hydra.runtime.output_dir = str(cfg.hydra.run.dir)
    HydraConfig.instance().set_config(cfg)
    job = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    return OmegaConf.create(OmegaConf.to_container(job, resolve=True, throw_on_missing=True))


def check_pretrain_config(cfg: DictConfig) -> None:
    assert cfg.model.name in models.ZOO
    models.build_config(cfg.model.name, vocab_size=1000, **cfg.model.config)
    assert cfg.data._target_ == "train.data.LMDataModule"
    assert cfg.data.seq_len <= cfg.model.config.max_position_embeddings
    assert cfg.paths.output_dir.startswith(str(cfg.paths.log_dir))
    assert cfg.optimizer.lr > 0 and len(cfg.optimizer.betas) == 2
    assert cfg.resume in ("auto", "never") or Path(cfg.resume).suffix == ".ckpt"
    precision = resolve_precision(cfg.trainer.precision, cfg.trainer.accelerator)
    trainer = instantiate(lightning_trainer_config(cfg.trainer), precision=precision, logger=False, _convert_="all")
    if not cfg.trainer.get("fast_dev_run"):
        assert trainer.max_steps == cfg.trainer.max_steps
    for callback in instantiate_group(cfg.get("callbacks")):
        assert callback is not None
    for logger in instantiate_group(cfg.get("logger")):
        assert logger is not None


def test_default_config():
    cfg = compose_pretrain([])
    check_pretrain_config(cfg)
    assert cfg.model.name == "llama"
    assert cfg.model.config.hidden_size == 128 and cfg.model.config.tie_word_embeddings
    assert cfg.data.source == "shakespeare" and cfg.data.tokenizer is None
    assert cfg.trainer.precision == "auto"
    assert cfg.logger.wandb.offline and cfg.logger.wandb.save_dir == cfg.paths.output_dir
    assert cfg.callbacks.model_checkpoint.dirpath == f"{cfg.paths.output_dir}/checkpoints"
    assert cfg.callbacks.model_checkpoint.save_last
    assert [cfg.parallel[d] for d in ("dp", "ep", "sp", "tp")] == [1, 1, 1, 1]


def test_groups_found():
    assert {
        "model",
        "data",
        "trainer",
        "logger",
        "callbacks",
        "paths",
        "debug",
        "experiment",
        "parallel",
    } <= set(GROUPS)


@pytest.mark.parametrize(("group", "option"), GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_group_option(group: str, option: str):
    cfg = compose_pretrain([f"{group}={option}"])
    check_pretrain_config(cfg)


def test_demo_experiment():
    cfg = compose_pretrain(["experiment=demo"])
    check_pretrain_config(cfg)
    assert cfg.task_name == "demo"
    assert "/demo/" in cfg.paths.output_dir
    assert cfg.sample.num_lines == 3
    assert cfg.trainer.val_check_interval <= cfg.trainer.max_steps
    assert cfg.trainer.limit_val_batches > 0
    assert "wandb" in cfg.logger


def test_ddp_trainer_config():
    cfg = compose_pretrain(["trainer=ddp"])
    assert cfg.trainer.devices == 2
    assert cfg.trainer.strategy._target_.endswith("DDPStrategy")


def test_fast_dev_run_debug_config():
    cfg = compose_pretrain(["debug=fdr"])
    assert cfg.trainer.fast_dev_run is True
    assert cfg.trainer.accelerator == "cpu"
    assert not instantiate_group(cfg.logger)


def test_wandb_mode_follows_environment(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    assert compose_pretrain([]).logger.wandb.mode == "online"
    monkeypatch.delenv("WANDB_MODE")
    assert compose_pretrain([]).logger.wandb.mode == "offline"


def test_precision_auto_is_fp32_on_cpu():
    assert resolve_precision("auto", "cpu") == "32-true"
    assert resolve_precision("16-mixed", "cpu") == "16-mixed"


def test_resume_checkpoint_choice(tmp_path):
    assert find_resume_checkpoint("auto", tmp_path) is None
    assert find_resume_checkpoint("never", tmp_path) is None
    last = tmp_path / "checkpoints" / "last.ckpt"
    last.parent.mkdir()
    last.write_bytes(b"")
    assert find_resume_checkpoint("auto", tmp_path) == str(last)
    assert find_resume_checkpoint("never", tmp_path) is None
    assert find_resume_checkpoint(str(last), tmp_path / "elsewhere") == str(last)
    with pytest.raises(FileNotFoundError, match="is not a checkpoint; use auto, never or a .ckpt path"):
        find_resume_checkpoint(str(tmp_path / "missing.ckpt"), tmp_path)
    # a sharded checkpoint: a link to a directory
    shards = tmp_path / "checkpoints" / "step3.ckpt.d1"
    shards.mkdir()
    last.unlink()
    last.symlink_to(shards.name)
    assert find_resume_checkpoint("auto", tmp_path) == str(last)
