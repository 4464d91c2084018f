"""A rollout's memory on one rank beside the training state it keeps, as the decode engine (generate/engine.py)
holds it: its slots' cache (the completions decoded together, each a prompt + max_completion_length columns), the
staging area a prefill of the groups its slots reach fills, that prefill's working set and the decode step's logits
(DRY_RUN's rollout pass, and the run's choice of gathering FSDP's weights once per rollout)."""

from dataclasses import dataclass

from titan_lite.config.schema import JobConfig
from titan_lite.generate import kv_cache_bytes, latent_expansion_bytes
from titan_lite.models.args import LlamaArgs
from titan_lite.parallel.memory_estimate import deltanet_prefill_bytes


def decoded_together(cfg: JobConfig, per_rank: int) -> int:
    """Completions a rank decodes together (the engine's slots), of the `per_rank` it samples each step."""
    return min(cfg.grpo.generation_batch_size or per_rank, per_rank)


def cache_capacity(cfg: JobConfig, tp: int) -> tuple[int, int]:
    """(the longest prompt that fits, the columns of each engine slot: that prompt and max_completion_length; a slot
    caches one token per decode step, whatever the TP degree)."""
    prompt = cfg.training.seq_len + 1 - cfg.grpo.max_completion_length
    return prompt, prompt + cfg.grpo.max_completion_length


def staged_prompts(cfg: JobConfig, together: int) -> int:
    """Prompts one prefill stages: the groups of G completions the free slots reach, at least one."""
    return max(1, together // cfg.grpo.num_generations)


@dataclass(frozen=True)
class RolloutMemory:
    """Bytes of one rank's rollout on a device, by part."""

    together: int
    slots: int
    staged: int
    prompt_tokens: int
    cache: int
    stage: int
    prefill: int
    logits: int

    @property
    def total(self) -> int:
        return self.cache + self.stage + self.prefill + self.logits


def rollout_memory(cfg: JobConfig, args: LlamaArgs, tp: int, together: int, compute_bytes: int) -> RolloutMemory:
    """The engine's cache of `together` slots and its staging area (the staged prompts, each padded to a multiple of
    tp), a layer's prefill working set over the staged prompts (no gradients; a Gated DeltaNet layer's chunked rule
    where it is the larger) with its attention mask (and a latent attention layer's keys and values expanded
    from every slot), and a decode step's logits (tp positions a slot under sequence
    parallelism) with their float32 scaled copy, probabilities and CDF."""
    prompt, columns = cache_capacity(cfg, tp)
    staged, width = staged_prompts(cfg, together), -(-prompt // tp) * tp
    cache = kv_cache_bytes(args, together, columns, compute_bytes, tp)
    stage = kv_cache_bytes(args, staged, width, compute_bytes, tp)
    tokens = staged * width
    hidden = 4 * args.dim + 3 * max(args.ffn_dim_of(layer) for layer in range(args.n_layers)) // tp
    working = max(tokens * hidden * compute_bytes, deltanet_prefill_bytes(args, staged, width, tp))
    prefill = working + staged * width * width + latent_expansion_bytes(args, together, columns, compute_bytes, tp)
    logits = together * tp * args.vocab_size * (compute_bytes + 4 * 4)
    return RolloutMemory(together, columns, staged, tokens, cache, stage, prefill, logits)
