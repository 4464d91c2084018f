"""Generation with a KV cache, used by evaluation, scripts/generate.py and RL rollouts alike: the cache
(cache.py), the choice of the next token and its log-probability (sampling.py), batched decoding on one process or a
sharded model (decode.py), and text prompts in, text out (text.py)."""

from titan_lite.generate.cache import KVCache, LayerView, kv_cache_bytes, latent_expansion_bytes
from titan_lite.generate.decode import Decoded, GenerationConfig, Lockstep, generate, left_padded, prompts_of, sample
from titan_lite.generate.sampling import Sampling, choose, chosen_logps, filtered_probabilities, kept_tokens
from titan_lite.generate.text import Completion, generate_text, iter_completions

__all__ = ["Completion", "Decoded", "GenerationConfig", "KVCache", "LayerView", "Lockstep", "Sampling",
           "choose", "chosen_logps", "filtered_probabilities", "generate", "generate_text", "iter_completions",
           "kept_tokens", "kv_cache_bytes", "latent_expansion_bytes", "left_padded", "prompts_of", "sample"]
