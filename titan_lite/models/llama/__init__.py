"""The Llama family: args and flavors, the model, HF conversion."""

from titan_lite.models.llama.args import FLAVORS, LlamaArgs, flavor_args
from titan_lite.models.llama.model import Llama

__all__ = ["FLAVORS", "Llama", "LlamaArgs", "flavor_args"]
