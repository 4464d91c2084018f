"""Distributed checkpoints (DCP), Hugging Face safetensors import and export."""
