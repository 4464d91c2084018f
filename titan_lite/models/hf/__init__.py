"""Hugging Face interop of the decoder: the families table, state-dict names and layouts, config.json both ways."""
