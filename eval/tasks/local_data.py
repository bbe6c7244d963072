"""Dataset loader of the bundled tasks: JSONL files next to this module, read without the network.

The task YAMLs name it as `custom_dataset: !function local_data.load_jsonl`. lm-eval resolves that
reference relative to the YAML's folder, whereas relative `data_files` given to `dataset_path: json`
would be resolved by `datasets` against the current working directory, so the tasks would only load
when run from one particular folder. Here the paths are resolved against this folder instead, and
the rows become an in-memory `datasets.Dataset` (nothing is written to the `datasets` cache).
"""

import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_jsonl(data_files: dict[str, str], **metadata) -> datasets.DatasetDict:
    """{split: JSONL path relative to this folder} -> DatasetDict.

    `metadata` takes what lm-eval passes along with `dataset_kwargs` (the task's metadata: version,
    config_source, ...); the data does not depend on it.
    """
    return datasets.DatasetDict(
        {split: datasets.Dataset.from_list(read_jsonl(HERE / path)) for split, path in data_files.items()}
    )
