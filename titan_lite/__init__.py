"""titan_lite: a PyTorch-native distributed trainer for Llama models."""
