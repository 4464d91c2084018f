"""The Gated DeltaNet mixer of Qwen3.5's "linear_attention" layers: its projections (named as transformers', so
the HF mapping is a rename), the causal depthwise conv, L2-normalised q/k, beta and the decay g, the gated delta rule
in its chunked form (training, prefill; pure PyTorch, float32 state) and its recurrent form (decoding, the check of
the chunked one), the gated RMSNorm with the z gate, the out projection. Packed documents each start from a zero
state and a zero conv window, exactly as one document per row. Where fla-core (the `gpu` extra) is installed and
the tensors are on CUDA, FLA's chunk_gated_delta_rule runs in place of the chunked form, packed documents laid end
to end with its cu_seqlens; the log says which runs."""

import importlib.util
import logging
from dataclasses import dataclass
from functools import cache
from itertools import accumulate

import torch
from torch import nn
from torch.nn import functional as F

from titan_lite.dtensor import local_share, local_tensor, replicated_like
from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.models.parts.cache import RecurrentCache
from titan_lite.models.parts.masks import DocumentSpans
from titan_lite.models.parts.norms import GatedRMSNorm

logger = logging.getLogger("titan_lite")
FLA_INSTALLED = importlib.util.find_spec("fla") is not None  # looked up, not imported: it imports triton


def check_linear_heads(args: LlamaArgs, source: str = "model args") -> None:
    """A ConfigError in one line where the Gated DeltaNet's head counts cannot be built."""
    keys, values = args.linear_n_key_heads, args.linear_n_value_heads
    if keys <= 0 or values <= 0:
        raise ConfigError(f"{source}: 'linear_attention' layers need linear_num_key_heads and linear_num_value_heads "
                          f"of at least 1; got {keys} and {values}")
    if values % keys:
        raise ConfigError(f"{source}: linear_num_value_heads = {values} is not a multiple of linear_num_key_heads = "
                          f"{keys}; each key head serves a whole group of value heads")
    if args.linear_conv_kernel < 1 or args.linear_chunk_size < 1:
        raise ConfigError(f"{source}: linear_conv_kernel_dim = {args.linear_conv_kernel} and the chunk size "
                          f"{args.linear_chunk_size} must be at least 1")


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum x^2 + eps) over the last dim (FLA's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_first(q, k, v, g, beta):
    """[batch, seq, heads, d] (and [batch, seq, heads]) -> float32 [batch, heads, seq, ...], k/q repeated to the value
    heads (consecutive value heads share a key head), q/k L2-normalised and q scaled by dk^-1/2."""
    group = v.shape[2] // k.shape[2]
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    q, k, v, g, beta = (t.transpose(1, 2).float() for t in (q, k, v, g, beta))
    q, k = l2_normalise(q), l2_normalise(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent_delta_rule(q, k, v, g, beta, state: torch.Tensor | None = None):
    """The gated delta rule one step at a time: S <- exp(g_t) S; S += k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t.
    q, k: [batch, seq, key_heads, dk]; v: [batch, seq, value_heads, dv]; g, beta: [batch, seq, value_heads]; state:
    [batch, value_heads, dk, dv] float32 (None: zeros). Returns (o [batch, seq, value_heads, dv] in v's dtype, the
    final state)."""
    dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    batch, heads, seq, dk = k.shape
    if state is None:
        state = torch.zeros(batch, heads, dk, v.shape[-1], dtype=torch.float32, device=v.device)
    outs = []
    for t in range(seq):
        state = state * g[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - (state * k[:, :, t, :, None]).sum(-2)) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outs, dim=2).transpose(1, 2).to(dtype), state


def chunked_delta_rule(q, k, v, g, beta, chunk: int = 64, state: torch.Tensor | None = None,
                       offsets: torch.Tensor | None = None):
    """The gated delta rule by chunks of `chunk` steps (the WY form: within a chunk a triangular solve, between chunks
    the state carried in order). Same arguments and results as recurrent_delta_rule; the sequence is right-padded to
    a whole chunk, which changes no output before the padding. offsets [batch, seq]: packed documents, each
    position's offset in its document; each offset 0 starts from a zero state (no step of another document reaches
    it, inside a chunk or carried in)."""
    dtype, seq = v.dtype, v.shape[1]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    pad = -seq % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    batch, heads, length, dk = k.shape
    q, k, v = (t.reshape(batch, heads, length // chunk, chunk, -1) for t in (q, k, v))
    g, beta = (t.reshape(batch, heads, length // chunk, chunk) for t in (g, beta))
    gamma = g.cumsum(-1)  # log of the decay from the chunk's start to each step
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).triu(1)
    apart = later if offsets is None else later | _other_documents(offsets, pad, chunk)
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(apart, float("-inf")).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # what the state carried into a chunk reaches (its steps before a document starts) and what reaches the state
    # carried out (the steps of the chunk's last document)
    from_start, to_end = gamma.exp(), (gamma[..., -1:] - gamma).exp()
    if offsets is not None:
        carried_in, carried_out = _carried(offsets, pad, chunk)
        from_start, to_end = from_start * carried_in, to_end * carried_out
    # I + L, L the strictly lower part of ((beta K) K^T) .* decay; T = (I + L)^-1 applied by unit-triangular solves:
    # U = T (beta V), W = T (beta exp(gamma) K)
    system = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1) + torch.eye(chunk, device=v.device)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * from_start[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * from_start[..., None]
    k_to_end = k * to_end[..., None]
    chunk_decay = from_start[..., -1][..., None, None]
    if state is None:
        state = torch.zeros(batch, heads, dk, v.shape[-1], dtype=torch.float32, device=v.device)
    outs = []
    for i in range(length // chunk):
        v_new = u[:, :, i] - w[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + attn[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=2).reshape(batch, heads, length, -1)[:, :, :seq]
    return out.transpose(1, 2).to(dtype), state


def _documents_by_chunk(offsets: torch.Tensor, pad: int, chunk: int) -> torch.Tensor:
    """Each step's document number in its row [batch, 1, chunks, chunk] (the padding continues the last one)."""
    starts = F.pad(offsets == 0, (0, pad))
    return starts.long().cumsum(-1).reshape(offsets.shape[0], 1, -1, chunk)


def _other_documents(offsets: torch.Tensor, pad: int, chunk: int) -> torch.Tensor:
    """[batch, 1, chunks, chunk, chunk]: step j is of another document than step i."""
    docs = _documents_by_chunk(offsets, pad, chunk)
    return docs[..., :, None] != docs[..., None, :]


def _carried(offsets: torch.Tensor, pad: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, 1, chunks, chunk] each: 1 where the state carried into the chunk reaches the step (no document starts
    in the chunk up to it), 1 where the step reaches the state carried out (of the chunk's last document)."""
    docs = _documents_by_chunk(offsets, pad, chunk)
    starts = F.pad(offsets == 0, (0, pad)).reshape(docs.shape)
    before = docs[..., :1] - starts[..., :1].long()  # the document of the step before the chunk
    return (docs == before).float(), (docs == docs[..., -1:]).float()


def uses_fla(t: torch.Tensor) -> bool:
    """FLA's kernel runs where fla-core is installed and the tensors are on CUDA; the pure-PyTorch form elsewhere."""
    return FLA_INSTALLED and t.is_cuda


def say_which_rule(t: torch.Tensor) -> None:
    """Log, once per kind, which delta rule runs (not inside a compiled graph: it would break it)."""
    if not torch.compiler.is_compiling():
        why = "" if FLA_INSTALLED else " (fla-core is not installed)"
        _say(f"FLA's chunk_gated_delta_rule on {t.device.type}" if uses_fla(t) else
             f"the pure-PyTorch chunked delta rule on {t.device.type}{why or ' (FLA needs CUDA)'}")


@cache
def _say(rule: str) -> None:
    logger.info(f"Gated DeltaNet layers: {rule}")


def fla_delta_rule(q, k, v, g, beta, state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None):
    """The chunked delta rule by FLA's kernel: same arguments and results as chunked_delta_rule (FLA's own chunk of
    64 steps); q/k L2-normalised and q scaled by dk^-1/2 in the kernel, key heads shared by consecutive value heads
    as ours, a float32 state; cu_seqlens [documents + 1]: the documents of one row laid end to end (batch 1), each
    from a zero state."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # optional (the gpu extra), and it imports triton

    out, final = chunk_gated_delta_rule(q, k, v.to(q.dtype), g.float(), beta.to(q.dtype), initial_state=state,
                                        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    return out.to(v.dtype), final


@dataclass(frozen=True)
class DocumentOffsets:
    """Packed documents as tensors: each position's offset in its document [batch, seq] (a 0 starts one), and, where
    the documents are laid end to end in one row (FLA's path), their cumulative lengths [documents + 1]
    (cu_seqlens)."""

    offsets: torch.Tensor
    cu_seqlens: torch.Tensor | None = None

    @classmethod
    def end_to_end(cls, spans: DocumentSpans, device: torch.device) -> "DocumentOffsets":
        lengths = [end - start for row in spans.rows for start, end in row]
        offsets = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
        return cls(offsets, torch.tensor([0, *accumulate(lengths)], dtype=torch.long, device=device))

    @classmethod
    def of_rows(cls, documents: torch.Tensor) -> "DocumentOffsets":
        """From the document id of each token [batch, seq], in tensor ops (no host sync)."""
        index = torch.arange(documents.shape[-1], device=documents.device).expand_as(documents)
        starts = F.pad(documents[:, 1:] != documents[:, :-1], (1, 0), value=True)
        return cls(index - torch.cummax(torch.where(starts, index, 0), dim=-1).values)


def causal_conv(columns: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """The depthwise causal conv of columns [batch, channels, K - 1 + seq] (the window before the sequence, then the
    sequence) by weight [channels, 1, K]; offsets [batch, seq]: each position's offset in its document, so that no
    tap reaches into the document before it."""
    if offsets is None:
        return F.conv1d(columns, weight, groups=columns.shape[1])
    kernel, seq = weight.shape[-1], offsets.shape[-1]
    out = columns[..., kernel - 1:] * weight[:, :, -1]
    for lag in range(1, kernel):
        tap = columns[..., kernel - 1 - lag:kernel - 1 - lag + seq] * weight[:, :, kernel - 1 - lag]
        out = out + tap * replicated_like((offsets >= lag)[:, None, :].to(tap.dtype), tap)  # TP: columns replicated
    return out


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear attention: in_proj_qkv -> causal depthwise conv + SiLU -> q, k, v heads; beta = sigmoid(b),
    g = -exp(A_log) softplus(a + dt_bias); the gated delta rule; norm(o) * silu(z) per head; out_proj."""

    mask_key = "linear_attention"  # packed documents: every Gated DeltaNet layer shares one set of spans

    def __init__(self, args: LlamaArgs, layer_id: int):
        super().__init__()
        self.n_key_heads, self.n_value_heads = args.linear_n_key_heads, args.linear_n_value_heads
        self.key_dim = args.linear_n_key_heads * args.linear_key_head_dim
        self.value_dim = args.linear_n_value_heads * args.linear_value_head_dim
        self.key_head_dim, self.value_head_dim = args.linear_key_head_dim, args.linear_value_head_dim
        self.chunk = args.linear_chunk_size
        conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = nn.Linear(args.dim, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(args.dim, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(args.dim, self.n_value_heads, bias=False)
        self.in_proj_a = nn.Linear(args.dim, self.n_value_heads, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, args.linear_conv_kernel, groups=conv_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.n_value_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.n_value_heads))
        self.norm = GatedRMSNorm(self.value_head_dim, eps=args.norm_eps)
        self.out_proj = nn.Linear(self.value_dim, args.dim, bias=False)
        # context parallel: this rank's part of each sequence and the exchange of conv windows and states
        self.split: SplitSequence | None = None

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None, cache: RecurrentCache | None = None,
                mask=None) -> torch.Tensor:
        """x [batch, seq, dim] -> [batch, seq, dim]; `rope` is not used; `mask`: the packed documents' spans (each
        document then runs alone, from a zero state) or offsets (document_mask); `cache` (generation): continue
        from its conv window and state, and keep the new ones."""
        if cache is not None:
            return self.mix(x, cache)
        if self.split is not None:
            return self.mix_split(x, mask)
        if mask is None:
            return self.mix(x)
        if uses_fla(x):  # the documents end to end in one row, FLA's cu_seqlens resetting the state at each start
            return self.mix(x.flatten(0, 1)[None], documents=DocumentOffsets.end_to_end(mask, x.device)).view(x.shape)
        if isinstance(mask, DocumentOffsets):  # a compiled block's: the rows as they are, the resets by offsets
            return self.mix(x, documents=mask)
        spans = [(b, s, e) for b, row in enumerate(mask.rows) for s, e in row]
        longest = max(e - s for _, s, e in spans)
        docs = torch.stack([F.pad(x[b, s:e], (0, 0, 0, longest - (e - s))) for b, s, e in spans])
        mixed = self.mix(docs)  # right padding changes nothing before it: the conv and the rule are causal
        i = iter(range(len(spans)))
        return torch.stack([torch.cat([mixed[next(i), :e - s] for s, e in row]) for row in mask.rows])

    def mix(self, x: torch.Tensor, cache: RecurrentCache | None = None, documents: DocumentOffsets | None = None
            ) -> torch.Tensor:
        """One sequence per row, from a zero state and conv window, or from the cache's; `documents`: packed
        documents (in rows, or end to end in one), each from a zero state and conv window."""
        batch, seq, _ = x.shape
        window, state = cache.states() if cache is not None else (None, None)
        if cache is not None:  # padding slots (a left-padded prompt's) add nothing: a zero input keeps a zero state
            x = x * cache.real[..., None].to(x.dtype)
        qkv = self.in_proj_qkv(x).transpose(1, 2)
        kernel = self.conv1d.weight.shape[-1]
        if window is None:
            window = qkv.new_zeros(batch, qkv.shape[1], kernel - 1)
        columns = torch.cat([window, qkv], dim=-1)
        qkv = F.silu(causal_conv(columns, self.conv1d.weight, None if documents is None else documents.offsets))
        q, k, v, g, beta = self.rule_inputs(x, qkv)
        say_which_rule(v)
        if cache is not None and seq == 1:
            out, state = recurrent_delta_rule(q, k, v, g, beta, state=state)
        elif uses_fla(v) and (documents is None or documents.cu_seqlens is not None):
            out, state = fla_delta_rule(q, k, v, g, beta, state, None if documents is None else documents.cu_seqlens)
        else:
            out, state = chunked_delta_rule(q, k, v, g, beta, chunk=self.chunk, state=state,
                                            offsets=None if documents is None else documents.offsets)
        if cache is not None:
            cache.keep_states(columns[..., columns.shape[-1] - (kernel - 1):], state)
        return self.gated_out(x, out)

    def rule_inputs(self, x: torch.Tensor, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v heads of the conv's output qkv [batch, channels, seq], the decay g and beta of x."""
        batch, seq, _ = x.shape
        q, k, v = qkv.transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        # tensor parallel: qkv and the conv are replicated, each rank keeps its own key heads and their value heads
        q = local_share(q.reshape(batch, seq, -1, self.key_head_dim), dim=2)
        k = local_share(k.reshape(batch, seq, -1, self.key_head_dim), dim=2)
        v = local_share(v.reshape(batch, seq, -1, self.value_head_dim), dim=2)
        beta = self.in_proj_b(x).sigmoid()
        decay_rate = local_tensor(self.A_log).float().exp()
        g = -decay_rate * F.softplus(self.in_proj_a(x).float() + local_tensor(self.dt_bias))
        return q, k, v, g, beta

    def gated_out(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """norm(o) * silu(z) per head, then out_proj."""
        z = self.in_proj_z(x).reshape(*x.shape[:2], -1, self.value_head_dim)
        return self.out_proj(self.norm(out, z).reshape(*x.shape[:2], -1))

    def mix_split(self, x: torch.Tensor, documents: DocumentOffsets | None) -> torch.Tensor:
        """This rank's part of each sequence (context parallel): its pieces, each from the conv window and state of
        the sequence before it. The gated delta rule is affine in its initial state (S_end = A S_0 + C): each piece's
        [A | C] is its final state from [I | 0] with values [0 | v]; the split exchanges them and the windows and
        composes the earlier pieces' into each piece's initial state. Document starts reset both, by offsets."""
        split, batch = self.split, x.shape[0]
        if not torch.compiler.is_compiling():
            _say(f"the pure-PyTorch chunked delta rule on {x.device.type}, states passed between context-parallel "
                 "chunks")
        qkv = self.in_proj_qkv(x).transpose(1, 2)
        kernel = self.conv1d.weight.shape[-1]
        offsets = [None] * split.pieces if documents is None else documents.offsets.chunk(split.pieces, dim=-1)
        pieces = qkv.chunk(split.pieces, dim=-1)
        if pieces[0].shape[-1] < kernel - 1:  # a window reaching past the chunk before would need two ranks' inputs
            raise ConfigError(f"context parallel cuts each sequence into chunks of {pieces[0].shape[-1]} tokens, "
                              f"fewer than the Gated DeltaNet's conv window of linear_conv_kernel_dim - 1 = "
                              f"{kernel - 1}; use a longer seq_len or a lower context_parallel_degree")
        windows = split.conv_windows([p[..., p.shape[-1] - (kernel - 1):] for p in pieces])
        qkv = F.silu(torch.cat([causal_conv(torch.cat([w, p], dim=-1), self.conv1d.weight, o)
                                for w, p, o in zip(windows, pieces, offsets, strict=True)], dim=-1))
        inputs = list(zip(*(t.chunk(split.pieces, dim=1) for t in self.rule_inputs(x, qkv)), offsets, strict=True))
        finals = []
        for q, k, v, g, beta, o in inputs:
            dk, dv = k.shape[-1], v.shape[-1]
            unit = torch.eye(dk, dk + dv, dtype=torch.float32, device=v.device).expand(batch, v.shape[2], dk, dk + dv)
            values = torch.cat([v.new_zeros(*v.shape[:-1], dk), v], dim=-1)
            finals.append(chunked_delta_rule(q, k, values, g, beta, self.chunk, unit, o)[1])
        starts = split.initial_states(finals, dk)
        out = torch.cat([chunked_delta_rule(q, k, v, g, beta, self.chunk, start, o)[0]
                         for (q, k, v, g, beta, o), start in zip(inputs, starts, strict=True)], dim=1)
        return self.gated_out(x, out)

    def document_mask(self, documents: torch.Tensor, dtype: torch.dtype, compiled: bool = False):
        """The documents' runs of each row, each then run alone from a zero state and a zero conv window; for a
        compiled block (tensor masks only) each position's offset in its document, the rows run as they are; under
        context parallel (documents of the whole sequence) the offsets of this rank's positions."""
        if self.split is not None:
            return DocumentOffsets(self.split.local(DocumentOffsets.of_rows(documents).offsets))
        return DocumentOffsets.of_rows(documents) if compiled else DocumentSpans.of(documents)


class SplitSequence:
    """What a Gated DeltaNet needs of a sequence split over ranks (parallel/context_parallel.py builds it): this
    rank's part of it is `pieces` equal runs of consecutive positions (not necessarily adjacent to each other), and
    each piece's conv window and initial state come from the pieces before it in the sequence, wherever they are."""

    pieces: int

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's positions of a [batch, seq] tensor of the whole sequence, in local order."""
        raise NotImplementedError

    def conv_windows(self, tails: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each piece's conv window: the last kernel - 1 inputs before it (zeros before the sequence), from every
        piece's own last ones."""
        raise NotImplementedError

    def initial_states(self, finals: list[torch.Tensor], key_dim: int) -> list[torch.Tensor]:
        """Each piece's initial state from every piece's [A | C] ([..., dk, dk + dv])."""
        raise NotImplementedError
