"""Structured (shape-changing) pruning: keep-sets, materialisation into a smaller dense Llama, export."""

from titan_lite.transforms.structured.materialize import StructureKeep, materialize_state_dict

__all__ = ["StructureKeep", "materialize_state_dict"]
