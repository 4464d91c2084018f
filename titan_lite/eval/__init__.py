"""Evaluation: the held-out loss during training; perplexity, generation and answer accuracy build on it."""
