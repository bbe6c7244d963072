"""Tokenize the corpus of a data config once, on every core: `python -m train.prepare_data data=...`.

    python -m train.prepare_data                                  # the bundled corpus
    python -m train.prepare_data data.source=/data/my_jsonl_dir data.num_proc=16
    python -m train.prepare_data data=hf                          # FineWeb-edu sample-10BT, streamed

Writes the prepared folder of every source of the data config, the folders `train.pretrain` reads with the
same data overrides (`train.data.prepare`: token shards and a manifest, continued after an interruption),
and prints one line per source: where, how many tokens and documents, at what speed. `train.pretrain` does
the same on first use, on one process per node while the others wait.
"""

import sys

import hydra
from omegaconf import DictConfig

from train.cli import one_sentence, one_sentence_errors
from train.data.prepare import read_manifest


def summary(folder) -> str:
    """One line about a prepared folder, from its manifest."""
    manifest = read_manifest(folder)
    train, validation = manifest["splits"]["train"], manifest["splits"]["validation"]
    return (
        f"{folder}: {train['tokens']:,} train tokens ({train['documents']:,} documents, {len(train['shards'])} "
        f"shard(s)), {validation['tokens']:,} validation tokens, {manifest['dtype']}; prepared by "
        f"{manifest['num_proc']} process(es) at {manifest['tokens_per_s']:,} tokens/s"
    )


@one_sentence_errors
@hydra.main(config_path="../conf", config_name="prepare_data", version_base="1.3")
def main(cfg: DictConfig) -> None:
    with one_sentence():
        datamodule = hydra.utils.instantiate(cfg.data, _convert_="all")
        for folder in datamodule.folders(overwrite=bool(cfg.overwrite)):
            print(summary(folder), file=sys.stdout)


if __name__ == "__main__":
    main()
