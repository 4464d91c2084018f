"""The local tasks' data: a JSONL file next to this one, read into a datasets.DatasetDict with one "test" split (no
download; lm_eval calls `load` through each task YAML's `custom_dataset`)."""

import json
from pathlib import Path


def load(file: str, **_metadata):
    import datasets  # lm_eval's own dependency: this module runs only inside lm_eval

    rows = [json.loads(line) for line in (Path(__file__).parent / file).read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
