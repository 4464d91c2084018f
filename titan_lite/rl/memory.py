"""A rollout's memory on one rank beside the training state it keeps: the KV cache of the completions decoded
together, a prefill's working set and the decode step's logits (DRY_RUN's rollout pass, and the run's choice of
gathering FSDP's weights once per rollout)."""

from dataclasses import dataclass

from titan_lite.config.schema import JobConfig
from titan_lite.generate import kv_cache_bytes, latent_expansion_bytes
from titan_lite.models.args import LlamaArgs


def decoded_together(cfg: JobConfig, per_rank: int) -> int:
    """Completions a rank decodes together, of the `per_rank` it samples each step."""
    return min(cfg.grpo.generation_batch_size or per_rank, per_rank)


def cache_capacity(cfg: JobConfig, tp: int) -> tuple[int, int]:
    """(the longest prompt that fits, the KV cache's slots for it): under TP every decode step opens tp slots."""
    prompt = cfg.training.seq_len + 1 - cfg.grpo.max_completion_length
    prompt_slots = -(-prompt // tp) * tp
    return prompt, prompt_slots + cfg.grpo.max_completion_length * tp


@dataclass(frozen=True)
class RolloutMemory:
    """Bytes of one generation batch's rollout on a device, by part."""

    together: int
    slots: int
    prompt_tokens: int
    cache: int
    prefill: int
    logits: int

    @property
    def total(self) -> int:
        return self.cache + self.prefill + self.logits


def rollout_memory(cfg: JobConfig, args: LlamaArgs, tp: int, together: int, compute_bytes: int) -> RolloutMemory:
    """The KV cache of `together` completions, a layer's prefill working set over their prompts (no gradients) with
    its attention mask (and a latent attention layer's keys and values expanded from every slot), and the next
    token's logits with their float32 scaled copy, probabilities and CDF."""
    prompt, slots = cache_capacity(cfg, tp)
    cache = kv_cache_bytes(args, together, slots, compute_bytes, tp)
    tokens = together * -(-prompt // tp) * tp
    width = 4 * args.dim + 3 * max(args.ffn_dim_of(layer) for layer in range(args.n_layers)) // tp
    prefill = tokens * width * compute_bytes + together * slots * slots
    prefill += latent_expansion_bytes(args, together, slots, compute_bytes, tp)
    logits = together * args.vocab_size * (compute_bytes + 4 * 4)
    return RolloutMemory(together, slots, tokens, cache, prefill, logits)
