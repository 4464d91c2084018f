"""The decoder: embeddings, the blocks the args' schedule composes (models/parts/), the final norm and the output
head; its layout-independent initialisation (every parameter seeded by its name).

Llama, Qwen3, Qwen3-MoE, Qwen2.5, Mistral, Mixtral, Qwen3.5 and Gemma 3 are compositions of the same parts (their
config.json mapping and state-dict names: models/hf/). Module names follow Meta's checkpoints and torchtitan:
tok_embeddings, layers.{i} (attention.wq/wk/wv/wo, attention.q_norm/k_norm, feed_forward.w1/w2/w3, moe.router.gate,
moe.experts.w1/w2/w3, attention_norm, ffn_norm, Gemma 3's post_attention_norm and post_ffn_norm), norm, output.
"""

import zlib

import torch
from torch import nn

from titan_lite.dtensor import copy_into_shard
from titan_lite.models.args import LlamaArgs
from titan_lite.models.parameters import canonical_name, init_parameter, weight_count
from titan_lite.models.parts.block import TransformerBlock
from titan_lite.models.parts.cache import KVCache
from titan_lite.models.parts.mixers import check_layer_types
from titan_lite.models.parts.moe import MoE
from titan_lite.models.parts.norms import make_norm
from titan_lite.models.parts.rope import local_rope_cache, rope_cache


class Llama(nn.Module):
    """The decoder (named for the family it began as). Pipeline stages set tok_embeddings, norm or output to None and
    drop layers."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        check_layer_types(args)
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A dict keyed by the global layer id, so names stay stable when pipeline stages drop layers.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm = make_norm(args.dim, args)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_embeddings()
        self.register_buffer("rope_cache", rope_cache(args), persistent=False)
        # Gemma 3: the sliding layers' own rope (None: every layer rotates with rope_cache)
        self.register_buffer("rope_cache_local", local_rope_cache(args), persistent=False)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, *, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [batch, seq] (or hidden states on a later pipeline stage) -> logits or hidden states.

        `cache` (generation only, see titan_lite.generate): attention reads and extends the cache's keys and
        values at its positions (it holds their rotary rows: the blocks get no rope), and only the last position's
        logits are computed when its `last_only` says so. Training never passes one.
        `positions` and `documents` (packed documents, attn_mask_type block_causal): every input token's RoPE
        position [batch, seq] and the document id of every key position [batch, kv_seq] (the whole sequence under
        context parallel); each token attends only within its document. Each mask is built once, for every layer
        whose mixer takes it.
        """
        h = self.embed(tokens) if self.tok_embeddings is not None else tokens
        ropes, masks = {"global": self.rope_cache, "local": self.rope_cache_local}, None
        if documents is not None:
            ropes = {kind: None if rows is None else rows[positions] for kind, rows in ropes.items()}
            masks = self.document_masks(documents, h)
        for key, layer in self.layers.items():
            if cache is not None:
                h = layer(h, None, cache.layer(int(key)))
                continue
            rope = ropes[self.args.rope_of(int(key))]
            h = layer(h, rope) if masks is None else layer(h, rope, mask=masks[layer.attention.mask_key])
        if cache is not None and cache.last_only:
            h = h[:, -1:]
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The token embeddings; Gemma 3 (embed_scale) multiplies them by sqrt(dim) rounded to their dtype first."""
        h = self.tok_embeddings(tokens)
        if not self.args.embed_scale:
            return h
        return h * torch.tensor(self.args.dim ** 0.5, device=h.device).to(h.dtype)

    def document_masks(self, documents: torch.Tensor, h: torch.Tensor) -> dict:
        """The masks of documents the layers' mixers take (plain or context parallel), by their mask_key, in the
        compute dtype."""
        device = h.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
        masks = {}
        for block in self.layers.values():
            mixer = block.attention
            if mixer.mask_key not in masks:  # compiled blocks (torch.compile's wrapper) take tensor masks only
                masks[mixer.mask_key] = mixer.document_mask(documents, dtype, compiled=hasattr(block, "_orig_mod"))
        return masks

    def tie_embeddings(self) -> None:
        """Where the args tie them, make the output head share the embedding's parameter. Moving a model to real
        memory (`to_empty`) gives each module a tensor of its own, so materialising calls this again."""
        if self.args.tie_word_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | None = None) -> None:
        """Initialise every parameter from a generator seeded by (seed, parameter name).

        Each parameter's full tensor is drawn and this rank keeps its own shard, so the initial model is the
        same whatever the parallel layout: a sharded run starts exactly where a single-process run does. A module
        that owns the init of its parameters (a transform's adapter, say) declares it with `param_init()`.
        """
        device = buffer_device or self.rope_cache.device
        self.rope_cache = rope_cache(self.args, device)
        self.rope_cache_local = local_rope_cache(self.args, device)
        for module in self.modules():
            if isinstance(module, MoE):
                module.reset_stats()
        seen: set[int] = set()  # a tied head shares the embedding's parameter: initialise it once, as the embedding
        for module_name, module in self.named_modules():
            owned = module.param_init() if hasattr(module, "param_init") else {}
            for local_name, param in module.named_parameters(recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                name = canonical_name(f"{module_name}.{local_name}" if module_name else local_name)
                # a transform's own (small) parameters are drawn on the CPU: an adapter then starts the same on
                # every device (a CUDA generator draws other numbers), at no cost worth counting
                draw_on = torch.device("cpu") if local_name in owned else device
                full = torch.empty(param.shape, dtype=param.dtype, device=draw_on)
                generator = torch.Generator(device=draw_on).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                if local_name in owned:
                    owned[local_name](full, generator)
                else:
                    init_parameter(name, full, self.args, generator)
                copy_into_shard(param, full.to(device))

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameter count (tied weights counted once, a packed parameter as the weights it holds); optionally without
        the input embedding."""
        total = sum(weight_count(p) for p in self.parameters())
        if exclude_embedding and self.tok_embeddings is not None:
            total -= self.tok_embeddings.weight.numel()
        return total
