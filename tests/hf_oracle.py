"""The titan_lite side of the family tests against transformers: a saved HF folder read into the decoder."""

import json
from dataclasses import replace

from titan_lite.checkpoint.hf import load_hf_weights
from titan_lite.models.decoder import Llama
from titan_lite.models.hf.config import args_from_hf_config


def load_titan(folder, **overrides) -> Llama:
    """The folder's config.json as args (with `overrides`), its safetensors loaded, in eval mode."""
    args = replace(args_from_hf_config(json.loads((folder / "config.json").read_text())), **overrides)
    model = Llama(args)
    load_hf_weights([model], str(folder), args)
    return model.eval()
