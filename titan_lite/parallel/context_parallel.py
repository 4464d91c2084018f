"""Context parallelism: sequence sharding (head-tail balancing), all-gather K/V attention, RoPE at global positions,
the block-causal mask of packed documents for a rank's query chunks, and the Gated DeltaNet's conv windows and
recurrent states passed between the chunks.

Each CP rank holds a slice of every sequence. Attention all-gathers K and V over the CP group (the Llama 3 paper's
approach, which runs on any backend including gloo) and attends its local queries to the whole sequence under the
causal mask of their global positions (within a layer's sliding window, and with gpt-oss's sink logit per head in
each softmax's denominator). With the head-tail load balancer the sequence is cut into 2 x CP chunks and
rank i holds chunks i and 2 x CP - 1 - i, so every rank does the same amount of causal work.
"""

import torch
import torch.distributed as dist
from torch import nn

from titan_lite.config.schema import JobConfig
from titan_lite.errors import ConfigError
from titan_lite.models.parts.gated_deltanet import GatedDeltaNet, SplitSequence
from titan_lite.models.parts.masks import block_causal_mask, within_window
from titan_lite.models.parts.sdpa import grouped_attention, sink_attention

HEADTAIL = "headtail"

# torch >= 2.10 renamed the single-tensor collectives; both run on gloo and NCCL.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ------------------------------------------------------------------------------------ positions


def normalise_load_balancer(name: str | None) -> str | None:
    """'headtail' or None (the config also accepts the string 'none')."""
    return None if name in (None, "none") else name


def chunks_per_sequence(cp_size: int, load_balancer: str | None) -> int:
    """How many equal chunks a sequence is cut into: 2 x CP with head-tail balancing, else CP."""
    return 2 * cp_size if normalise_load_balancer(load_balancer) == HEADTAIL else cp_size


def shard_positions(seq_len: int, cp_rank: int, cp_size: int, load_balancer: str | None,
                    device: torch.device | None = None) -> torch.Tensor:
    """The global positions (in local order) of the tokens that CP rank cp_rank holds; seq_len // cp_size of them."""
    n_chunks = chunks_per_sequence(cp_size, load_balancer)
    if seq_len % n_chunks:
        raise ConfigError(f"sequence length {seq_len} is not divisible by the {n_chunks} context-parallel chunks "
                          f"(context_parallel_degree {cp_size}, load balancer {load_balancer})")
    chunk = seq_len // n_chunks
    chunk_ids = [cp_rank, n_chunks - 1 - cp_rank] if n_chunks == 2 * cp_size else [cp_rank]
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunk_ids])


def check_sequence_lengths(cfg: JobConfig) -> None:
    """Context parallel cuts each sequence into equal chunks (2 x CP with head-tail balancing), which sequence
    parallel then splits over TP again: training and validation lengths must divide evenly."""
    p = cfg.parallelism
    if p.context_parallel_degree == 1:
        return
    if p.context_parallel_rotate_method != "allgather":
        raise ConfigError(f"'parallelism.context_parallel_rotate_method' = {p.context_parallel_rotate_method!r} is "
                          "not supported: titan_lite's context parallel all-gathers K/V; use allgather")
    chunks = chunks_per_sequence(p.context_parallel_degree, p.context_parallel_load_balancer)
    factor = chunks * p.tensor_parallel_degree
    parts = ["2"] if chunks > p.context_parallel_degree else []
    parts.append(f"context_parallel_degree {p.context_parallel_degree}")
    if p.tensor_parallel_degree > 1:
        parts.append(f"tensor_parallel_degree {p.tensor_parallel_degree}")
    lengths = [("training.seq_len", cfg.training.seq_len)]
    if cfg.validation.enable:
        lengths.append(("validation.seq_len", cfg.validation.seq_len))
    for key, seq_len in lengths:
        if seq_len % factor:
            raise ConfigError(f"'{key}' = {seq_len} must be divisible by {factor} ({' x '.join(parts)}) "
                              "for context parallelism")


def all_shard_positions(seq_len: int, cp_size: int, load_balancer: str | None,
                        device: torch.device | None = None) -> torch.Tensor:
    """[cp_size, seq_len // cp_size]: row r holds rank r's global positions, the order an all-gather stacks them."""
    return torch.stack([shard_positions(seq_len, r, cp_size, load_balancer, device) for r in range(cp_size)])


def shard_sequence(t: torch.Tensor, positions: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The entries of t at the given sequence positions along dim."""
    return t.index_select(dim, positions.to(t.device))


# --------------------------------------------------------------------------- differentiable all-gather


class _GatherShards(torch.autograd.Function):
    """All-gather into a new leading dimension; backward reduce-scatters, so each rank's shard gets the sum of
    the gradients every rank computed for it."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        # The single-tensor collectives concatenate along dim 0 (gloo insists on that shape).
        out = shard.new_empty((size * shard.shape[0], *shard.shape[1:]))
        _all_gather_single(out, shard.contiguous(), group=group)
        return out.unflatten(0, (size, shard.shape[0]))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shard_grad = grad.new_empty(grad.shape[1:])
        _reduce_scatter_single(shard_grad, grad.flatten(0, 1).contiguous(), group=ctx.group)
        return shard_grad, None


def gather_shards(shard: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[group size, *shard.shape]: every rank's shard, in group-rank order; gradients flow back to their owners."""
    return _GatherShards.apply(shard, group)


# ------------------------------------------------------------------------------------ attention


class ContextParallelAttention(nn.Module):
    """Causal attention of this rank's query chunks against K/V all-gathered over the CP group.

    q: [batch, heads, local_seq, head_dim], k, v: [batch, kv_heads, local_seq, head_dim], in this rank's local order.
    K/V are gathered with their kv_heads (GQA) and only the attention kernel shares them among the query heads, so the
    all-gather moves heads / kv_heads times fewer bytes than gathering expanded K/V.
    """

    def __init__(self, group: dist.ProcessGroup, load_balancer: str | None, window: int | None = None):
        super().__init__()
        self.window = window  # a sliding window (Mistral v0.1), on global positions like the causal mask
        self.group = group
        self.load_balancer = normalise_load_balancer(load_balancer)
        self.cp_size = dist.get_world_size(group)
        self.cp_rank = dist.get_rank(group)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """`mask`: the packed documents' mask from document_mask, else causal over global positions. `sinks` [heads]:
        gpt-oss's sink logits; each query's softmax runs over the whole gathered sequence at once, so its sink is in
        its denominator exactly once."""
        seq_len = q.shape[2] * self.cp_size
        positions = all_shard_positions(seq_len, self.cp_size, self.load_balancer, q.device)
        to_global_order = positions.flatten().argsort()
        k, v = (self.gather_in_global_order(t, to_global_order) for t in (k, v))
        if mask is None:
            keys = torch.arange(seq_len, device=q.device)
            mask = positions[self.cp_rank][:, None] >= keys[None, :]
            if self.window is not None:
                mask &= within_window(positions[self.cp_rank], keys, self.window)
        if sinks is not None:
            return sink_attention(q, k, v, sinks, attn_mask=mask)
        return grouped_attention(q, k, v, attn_mask=mask)

    def document_mask(self, documents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Block-causal mask rows of this rank's query chunks against the whole sequence of documents [batch, seq]
        (the keys, gathered in global order): each query sees the keys of its own document at or before it."""
        mine = shard_positions(documents.shape[1], self.cp_rank, self.cp_size, self.load_balancer, documents.device)
        return block_causal_mask(documents.index_select(1, mine), mine, documents, dtype, self.window)

    def gather_in_global_order(self, t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        gathered = gather_shards(t, self.group)  # [cp, b, h, local, d]
        b, h, d = t.shape[0], t.shape[1], t.shape[3]
        stacked = gathered.permute(1, 2, 0, 3, 4).reshape(b, h, -1, d)
        return stacked.index_select(2, order)

    def extra_repr(self) -> str:
        window = f", window={self.window}" if self.window is not None else ""
        return f"cp_size={self.cp_size}, load_balancer={self.load_balancer}{window}"


# ------------------------------------------------------------------------------------------ recurrent layers


class ContextParallelScan(SplitSequence):
    """A Gated DeltaNet layer's sequence over the CP group: this rank's chunks (one, or the head-tail pair), each
    scanned from the conv window and recurrent state of the chunks before it in time. Every chunk's last conv inputs
    and its affine map [A | C] are all-gathered (gradients flow back to their owners) and each rank composes the
    maps of the chunks before its own: exact, whatever the layout."""

    def __init__(self, group: dist.ProcessGroup, load_balancer: str | None):
        self.group, self.load_balancer = group, normalise_load_balancer(load_balancer)
        self.cp_size, self.cp_rank = dist.get_world_size(group), dist.get_rank(group)
        n_chunks = chunks_per_sequence(self.cp_size, self.load_balancer)
        self.chunks_of = [[r, n_chunks - 1 - r] if n_chunks == 2 * self.cp_size else [r] for r in range(self.cp_size)]
        self.pieces = len(self.chunks_of[0])
        self.mine = self.chunks_of[self.cp_rank]

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, shard_positions(t.shape[1], self.cp_rank, self.cp_size, self.load_balancer,
                                                 t.device))

    def by_chunk(self, per_piece: list[torch.Tensor]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """Every rank's per-piece tensors, by their chunk's place in the sequence, and a zero of a piece's shape that
        depends on them: the first chunk's zero window and state, through which every rank's backward reaches the
        all-gather's (a reduce-scatter every rank must join, whether or not its chunks need the others')."""
        gathered = gather_shards(torch.stack(per_piece), self.group)  # [cp, pieces, ...]
        chunks = {chunk: gathered[r, i] for r, mine in enumerate(self.chunks_of) for i, chunk in enumerate(mine)}
        zero = torch.cat([torch.zeros_like(per_piece[0]), gathered[0, 0][..., :0]], dim=-1)  # no value: no NaN
        return chunks, zero

    def conv_windows(self, tails: list[torch.Tensor]) -> list[torch.Tensor]:
        tails_by_chunk, zero = self.by_chunk(tails)
        return [zero if c == 0 else tails_by_chunk[c - 1] for c in self.mine]

    def initial_states(self, finals: list[torch.Tensor], key_dim: int) -> list[torch.Tensor]:
        maps, zero = self.by_chunk(finals)
        state, starts = zero[..., key_dim:], {}
        for chunk in range(max(self.mine) + 1):
            starts[chunk] = state
            state = maps[chunk][..., :key_dim] @ state + maps[chunk][..., key_dim:]
        return [starts[c] for c in self.mine]


# ------------------------------------------------------------------------------------------ RoPE


class GlobalRopePositions:
    """A forward pre-hook for attention: hands it the RoPE rows of its tokens' global positions.

    The model slices rope[:local_seq]; this hook swaps the full cache for the rows of this rank's positions, so the
    model needs no change and the full cache (recomputed by init_weights) stays untouched for any sequence length.
    """

    def __init__(self, cp_rank: int, cp_size: int, load_balancer: str | None):
        self.cp_rank, self.cp_size, self.load_balancer = cp_rank, cp_size, normalise_load_balancer(load_balancer)

    def __call__(self, attention: nn.Module, args: tuple) -> tuple | None:
        x, rope, *rest = args
        if rope is None or rope.dim() == 4:  # a KV cache's own rows, or each token's own rows already (packed
            return None                      # documents: positions within each document)
        positions = shard_positions(x.shape[1] * self.cp_size, self.cp_rank, self.cp_size, self.load_balancer,
                                    rope.device)
        return (x, rope.index_select(0, positions), *rest)


# ------------------------------------------------------------------------------------------ apply


def apply_cp(model: nn.Module, parallel_dims, cfg) -> None:
    """Swap every block's inner attention for ContextParallelAttention and make RoPE use global positions, give every
    Gated DeltaNet its ContextParallelScan; MoE layers sum their per-sequence expert counts over the CP group."""
    group = parallel_dims.submesh("cp").get_group()
    load_balancer = cfg.parallelism.context_parallel_load_balancer
    rope_hook = GlobalRopePositions(dist.get_rank(group), dist.get_world_size(group), load_balancer)
    for block in model.layers.values():
        if isinstance(block.attention, GatedDeltaNet):  # its state and conv window passed between the chunks
            block.attention.split = ContextParallelScan(group, load_balancer)
        else:
            window = block.attention.inner_attention.window
            block.attention.inner_attention = ContextParallelAttention(group, load_balancer, window)
            # On attention, after TP's input hook: there x holds the whole CP-local sequence (a block's input is
            # further split over TP by sequence parallel).
            block.attention.register_forward_pre_hook(rope_hook)
        if block.moe_enabled:  # the load-balancing loss counts experts over whole sequences
            block.moe.cp_group = group


def shard_batch(tensors: tuple[torch.Tensor, ...], parallel_dims,
                load_balancer: str | None) -> tuple[torch.Tensor, ...]:
    """This CP rank's chunks of each [batch, seq] tensor (token ids, labels, RoPE positions), in the order the model
    expects."""
    cp_mesh = parallel_dims.submesh("cp")
    seq_len = tensors[0].shape[1]
    positions = shard_positions(seq_len, cp_mesh.get_local_rank(), cp_mesh.size(), load_balancer, tensors[0].device)
    return tuple(shard_sequence(t, positions) for t in tensors)
