"""float8 training of linears with torchao (torchtitan's 'quantize.linear.float8' converter)."""

from titan_lite.transforms.float8.transform import Float8Transform

__all__ = ["Float8Transform"]
