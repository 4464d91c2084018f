"""The decoder in parts (args, flavors, the stack, its parts) and its Hugging Face families (models/hf/)."""
