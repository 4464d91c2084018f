"""Tokenizers, data sources, packing and the stateful loader."""
