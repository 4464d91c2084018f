"""The masked Llama of Sheared pruning: gate parameters at the root, masks handed to the blocks as tensors.

The masked forward (STRUCTURED_SPEC.md): hidden_z on the embeddings (the first block's input), on both branch
outputs and inside every RMSNorm (the variance over the kept dims only: a masked mean, no data-dependent shapes);
head_z on each head's output before wo; ffn_z on w3's output; layer_z on both branch outputs.

Masks are computed once per forward of the root module, in eager code (the root is neither compiled nor
checkpointed), from the gate logits (all-gathered by the root's FSDP unit) and noise drawn once per optimizer step
from a generator seeded by the step, so every rank of a TP group (indeed every rank) sees the same masks and a
resumed run the same noise. They reach the blocks as non-persistent buffers, read by the compiled blocks as graph
inputs: no graph break, no recompilation when they change. Under tensor parallelism each rank takes its slice of
heads and intermediate channels, and the gate logits' gradient is summed over the TP group (each rank sees only its
heads, channels and sequence shard).
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_lite.models.parts.attention import Attention
from titan_lite.models.parts.block import TransformerBlock
from titan_lite.models.parts.feed_forward import FeedForward
from titan_lite.models.parts.norms import RMSNorm
from titan_lite.parallel.tensor_parallel import SumGradOverGroup
from titan_lite.transforms.sheared import gates
from titan_lite.transforms.sheared.targets import KINDS, Targets


def masked_rms(x: torch.Tensor, hidden_z: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean of x^2 over the dims where hidden_z != 0 + eps) * hidden_z, computed in float32."""
    xf, z = x.float(), hidden_z.float()
    keep = (z != 0).float()
    var = (xf.square() * keep).sum(-1, keepdim=True) / keep.sum().clamp(min=1.0)
    return (xf * torch.rsqrt(var + eps) * z).type_as(x)


class MaskedRMSNorm(RMSNorm):
    """RMSNorm over the kept hidden dims, its output masked; the plain RMSNorm while `hidden_z` is None."""

    @classmethod
    def adopt(cls, norm: RMSNorm) -> "MaskedRMSNorm":
        norm.__class__ = cls
        norm.register_buffer("hidden_z", None, persistent=False)
        return norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hidden_z is None:
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        if isinstance(x, DTensor):  # sequence parallel: normalise the local rows, let DTensor handle the weight
            local = masked_rms(x.to_local(), self.hidden_z, eps)
            return DTensor.from_local(local, x.device_mesh, x.placements) * self.weight
        return masked_rms(x, self.hidden_z, eps) * self.weight


class GatedAttention(Attention):
    """Attention whose heads' outputs are scaled by `head_z` (this rank's heads) before wo."""

    @classmethod
    def adopt(cls, attention: Attention) -> "GatedAttention":
        attention.__class__ = cls
        attention.register_buffer("head_z", None, persistent=False)
        return attention

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache=None, mask=None) -> torch.Tensor:
        out = self.head_outputs(x, rope, cache, mask)
        if self.head_z is not None:
            out = out * self.head_z.to(out.dtype)[:, None]
        return self.wo(out.flatten(2))


class GatedFeedForward(FeedForward):
    """SwiGLU whose up projection (w3) output is scaled by `ffn_z` (this rank's channels)."""

    @classmethod
    def adopt(cls, ffn: FeedForward) -> "GatedFeedForward":
        ffn.__class__ = cls
        ffn.register_buffer("ffn_z", None, persistent=False)
        return ffn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.w3(x)
        if self.ffn_z is not None:
            up = up * self.ffn_z.to(up.dtype)
        return self.w2(F.silu(self.w1(x)) * up)


class ShearedBlock(TransformerBlock):
    """A block whose branch outputs are scaled by hidden_z and layer_z; the first block also masks its input (the
    embeddings) with `input_z`."""

    @classmethod
    def adopt(cls, block: TransformerBlock) -> "ShearedBlock":
        block.__class__ = cls
        for name in ("layer_z", "hidden_z", "input_z"):
            block.register_buffer(name, None, persistent=False)
        MaskedRMSNorm.adopt(block.attention_norm)
        MaskedRMSNorm.adopt(block.ffn_norm)
        GatedAttention.adopt(block.attention)
        GatedFeedForward.adopt(block.feed_forward)
        return block

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache=None, mask=None) -> torch.Tensor:
        if self.input_z is not None:
            x = x * self.input_z.to(x.dtype)
        h = x + self.gated(self.attention(self.attention_norm(x), rope, cache=cache, mask=mask))
        return h + self.gated(self.feed_forward(self.ffn_norm(h)))

    def gated(self, out: torch.Tensor) -> torch.Tensor:
        if self.hidden_z is not None:
            out = out * self.hidden_z.to(out.dtype)
        if self.layer_z is not None:
            out = out * self.layer_z.to(out.dtype)
        return out


class ShearedGates(nn.Module):
    """The gate logits (log_alpha) of the pruned types and the Lagrange multipliers: `lambdas[k] = (lambda1,
    lambda2)` of KINDS[k]. A root-level module: its parameters live in the root FSDP unit, replicated over TP."""

    def __init__(self, targets: Targets, seed: int = 0):
        super().__init__()
        self.targets = targets
        self.seed = seed
        for kind in targets.pruned:
            setattr(self, f"{kind}_log_alpha", nn.Parameter(torch.empty(targets.gate_shape(kind))))
        self.lambdas = nn.Parameter(torch.empty(len(KINDS), 2))
        self.noise: dict[str, torch.Tensor] = {}
        # Masks forced by the caller (deterministic masks, tests), by kind in gate shape; None: sample or eval.
        self.fixed: dict[str, torch.Tensor] | None = None
        self.tp_rank, self.tp_size, self.tp_group = 0, 1, None

    def param_init(self) -> dict:
        def init_log_alpha(tensor: torch.Tensor, generator: torch.Generator) -> None:
            gates.init_log_alpha(tensor, generator)
            tensor.clamp_(gates.LOG_ALPHA_MIN, gates.LOG_ALPHA_MAX)
        inits = {f"{kind}_log_alpha": init_log_alpha for kind in self.targets.pruned}
        return {**inits, "lambdas": lambda tensor, generator: tensor.zero_()}

    def log_alphas(self) -> dict[str, torch.Tensor]:
        return {kind: getattr(self, f"{kind}_log_alpha") for kind in self.targets.pruned}

    def draw_noise(self, step: int) -> None:
        """The uniform noise of this optimizer step: the same on every rank, and again on a resumed run."""
        device = self.lambdas.device
        generator = torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + step)
        self.noise = {kind: gates.uniform_noise(self.targets.gate_shape(kind), generator, device)
                      for kind in self.targets.pruned}

    def gate_values(self) -> dict[str, torch.Tensor]:
        """z of every gate (gate shape): forced, sampled (training) or deterministic at the expected counts."""
        if self.fixed is not None:
            return self.fixed
        log_alphas = self.log_alphas()
        if self.tp_size > 1 and torch.is_grad_enabled():
            log_alphas = {k: SumGradOverGroup.apply(v, self.tp_group) for k, v in log_alphas.items()}
        if self.training:
            if not self.noise:
                raise RuntimeError("sheared gates: draw_noise(step) must run before a training forward")
            return {k: gates.sample(v, self.noise[k]) for k, v in log_alphas.items()}
        return {k: deterministic_mask(v, expected_kept(v)) for k, v in log_alphas.items()}

    def unit_masks(self) -> dict[str, torch.Tensor]:
        """Masks per unit of the model: layer [L], head [L, n_heads], intermediate [L, ffn], hidden [dim]."""
        z = self.gate_values()
        if "head" in z:
            t = self.targets
            repeat = (z["head"].repeat(1, t.args.kv_heads) if t.head_mode == "per_group_query"
                      else z["head"].repeat_interleave(t.n_rep, dim=1))
            z = {**z, "head": repeat}
        return z

    def local_slice(self, mask: torch.Tensor) -> torch.Tensor:
        """This TP rank's contiguous share of the last dim (its heads or channels)."""
        if self.tp_size == 1:
            return mask
        width = mask.shape[-1] // self.tp_size
        return mask[..., self.tp_rank * width:(self.tp_rank + 1) * width]


def expected_kept(log_alpha: torch.Tensor) -> torch.Tensor:
    """Per row, the rounded expected number of non-zero gates."""
    return gates.prob_nonzero(log_alpha.detach()).sum(-1).round().long()


def deterministic_mask(log_alpha: torch.Tensor, kept) -> torch.Tensor:
    """Soft values of the `kept` highest-scoring gates of each row (an int, or a tensor per row), zero elsewhere."""
    soft = gates.soft_value(log_alpha)
    rows = soft.reshape(-1, soft.shape[-1])
    kept = torch.as_tensor(kept).expand(rows.shape[0]).tolist()
    keep = torch.zeros_like(rows)
    for r, k in enumerate(kept):
        keep[r, gates.keep_top(rows[r].detach(), int(k))] = 1.0
    return (rows * keep).reshape(soft.shape)


def convert_model(model: nn.Module, targets: Targets, seed: int) -> None:
    """Adds the gates (model.sheared_gates), makes every block, norm, attention and MLP maskable, and hooks the
    root so each forward hands out the masks."""
    model.sheared_gates = ShearedGates(targets, seed)
    for block in model.layers.values():
        ShearedBlock.adopt(block)
    if model.norm is not None:
        MaskedRMSNorm.adopt(model.norm)
    model.register_forward_pre_hook(hand_out_masks)


def hand_out_masks(model: nn.Module, _inputs) -> None:
    """Root forward pre-hook (after FSDP's, which gathers the gates): every maskable module gets its mask."""
    gates_module = model.sheared_gates
    z = gates_module.unit_masks()
    hidden = z.get("hidden")
    head = gates_module.local_slice(z["head"]) if "head" in z else None
    ffn = gates_module.local_slice(z["intermediate"]) if "intermediate" in z else None
    first = min(int(key) for key in model.layers.keys())
    for block in blocks_of(model):
        layer = block.layer_id
        block.layer_z = z["layer"][layer] if "layer" in z else None
        block.hidden_z = hidden
        block.input_z = hidden if layer == first else None
        block.attention_norm.hidden_z = block.ffn_norm.hidden_z = hidden
        block.attention.head_z = head[layer] if head is not None else None
        block.feed_forward.ffn_z = ffn[layer] if ffn is not None else None
    if model.norm is not None:
        model.norm.hidden_z = hidden


def blocks_of(model: nn.Module) -> list[ShearedBlock]:
    """The blocks, found under any compile/checkpoint wrapper."""
    return [m for m in model.layers.modules() if isinstance(m, ShearedBlock)]
