"""One-shot pruning (magnitude, Wanda, SparseGPT; unstructured and N:M) as the 'prune' transform ([pruning])."""

from titan_lite.transforms.pruning.transform import PruneTransform

__all__ = ["PruneTransform"]
