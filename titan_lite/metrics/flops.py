"""FLOP accounting: model FLOPs per token and the peak FLOP/s of a device, the two halves of MFU."""

import logging
import time
from collections.abc import Iterable

import torch

logger = logging.getLogger("titan_lite.metrics")

A100_BF16_PEAK = 312e12

# Dense (no 2:4 sparsity) bf16 tensor-core peaks in FLOP/s from the vendors' datasheets, matched as
# substrings of torch.cuda.get_device_name(). Order matters: the first match wins, so more specific
# names (H100 PCIe, L40S) come before the names they contain (H100, L40, L4).
_GPU_BF16_PEAKS: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM5; the name is e.g. "NVIDIA H100 80GB HBM3"
    ("H800", 989e12),
    ("H200", 989e12),  # also matches GH200
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("A10G", 125e12),
    ("A10", 125e12),
    ("A40", 149.7e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("RTX 4090", 165.2e12),  # bf16 with fp32 accumulate
    ("RTX 3090", 71e12),
    ("MI355X", 2.5e15),
    ("MI325X", 1307.4e12),
    ("MI300X", 1307.4e12),
    ("MI300A", 980.6e12),
    ("MI250X", 191.5e12),  # per GCD: each GCD is its own torch device
)

_measured_peaks: dict[tuple[str, int], float] = {}


def num_flops_per_token(num_params: int, num_embedding_params: int, n_layers: int, n_heads: int,
                        head_dim: int, seq_len: int, frozen_params: int = 0) -> int:
    """Training FLOPs (forward + backward) per token of a decoder-only transformer.

    Convention (Chinchilla / PaLM appendix B, as torchtitan reports):
      6 * (num_params - num_embedding_params) + 12 * n_layers * n_heads * head_dim * seq_len
    - 6N: every parameter used in a matmul costs 2 FLOPs per token forward (multiply + add) and 4 backward.
      The token-embedding lookup is a gather, not a matmul, so its parameters are subtracted.
    - 12*L*H*hd*T: per layer, Q@K^T and scores@V cost 2*T*hd each per head per token forward, times 3 for
      forward + backward. Attention is counted as full (not causal), the usual convention. L counts the
      softmax-attention layers only: a Gated DeltaNet layer's delta rule is linear in T, its FLOPs are
      delta_rule_flops_per_token's (its projections are in 6N).

    Tied embeddings (Llama 3.2 1B/3B): the shared matrix is also the output projection, a real matmul, so
    it must stay in the 6N term; with num_params counting that shared tensor once, pass
    num_embedding_params=0. Untied: pass tok_embeddings.weight.numel().

    frozen_params: parameters (among the 6N ones) that get no gradient (a LoRA base): their backward computes
    only the input gradient, 4 FLOPs per token instead of 6.
    """
    dense = 6 * (num_params - num_embedding_params) - 2 * frozen_params
    attention = 12 * n_layers * n_heads * head_dim * seq_len
    return dense + attention


def delta_rule_flops_per_token(args) -> int:
    """Training FLOPs per token of the chunked gated delta rule in a model's Gated DeltaNet layers (Qwen3.5; args: a
    LlamaArgs), the part of such a layer that 6N does not count (its projections and depthwise conv are parameters
    used once per token, in 6N).

    Per value head and chunk of C steps, as models/parts/gated_deltanet.py computes it forward: (beta K) K^T and
    Q K^T, 2 C^2 dk each; the two unit-triangular solves, C^2 dv (U) and C^2 dk (W); the scores times the new
    values, 2 C^2 dv; W S, (decayed Q) S and the state update, 2 C dk dv each. Per token that is
    5 C dk + 3 C dv + 6 dk dv; x 3 for forward + backward, as the attention term counts it.
    """
    layers = sum(kind == "linear_attention" for kind in args.schedule)
    chunk, dk, dv = args.linear_chunk_size, args.linear_key_head_dim, args.linear_value_head_dim
    per_head = 5 * chunk * dk + 3 * chunk * dv + 6 * dk * dv
    return 3 * layers * args.linear_n_value_heads * per_head


def attention_flops_per_token(layers: Iterable[tuple[int, int, int, int | None]], seq_len: int) -> float:
    """Training FLOPs per token of the attention matmuls of `layers` (query heads, score width, value width, window):
    per head, Q@K^T costs 2 x score width and scores@V 2 x value width per key, times 3 for forward + backward.
    A full layer counts seq_len keys per token (the convention's full, not causal, attention: with score = value =
    head_dim it is num_flops_per_token's 12 H hd T); a sliding layer only its window: the token at position p
    (1-based) attends to min(p, window) keys, averaged over the sequence."""
    total = 0.0
    for heads, score_width, value_width, window in layers:
        total += 6 * heads * (score_width + value_width) * _mean_keys(seq_len, window)
    return total


def _mean_keys(seq_len: int, window: int | None) -> float:
    """Keys a token attends to, averaged over positions 1..seq_len: seq_len without a window, else min(p, window)."""
    if window is None:
        return float(seq_len)
    w = min(window, seq_len)
    return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len


def model_flops_per_token(num_params: int, num_embedding_params: int,
                          attention_layers: Iterable[tuple[int, int, int, int | None]], seq_len: int,
                          frozen_params: int = 0) -> float:
    """num_flops_per_token with the attention term counted per layer (attention_flops_per_token): latent
    attention's score and value widths, sliding layers' windows."""
    dense = 6 * (num_params - num_embedding_params) - 2 * frozen_params
    return dense + attention_flops_per_token(attention_layers, seq_len)


def gpu_peak_flops_by_name(device_name: str) -> float:
    """Dense bf16 peak FLOP/s of a GPU from its name; unknown names warn and fall back to A100's 312 TFLOP/s."""
    for pattern, flops in _GPU_BF16_PEAKS:
        if pattern.lower() in device_name.lower():
            return flops
    logger.warning("Peak FLOP/s of GPU '%s' is unknown; MFU uses A100's %.0f TFLOP/s",
                   device_name, A100_BF16_PEAK / 1e12)
    return A100_BF16_PEAK


# A CPU's matmul rate depends on the size: on an AVX-512 core 1024 x 1024 fp32 ran at 26-35 GFLOP/s against ~100 for
# 256 and 512 (their operands stay in cache), so a peak of 1024 alone was below what a small model's matmuls reach
# (an SFT log printed mfu: 129.99%). The peak is the fastest of these sizes.
PEAK_SIZES = (256, 512, 1024)


def _measure_peak(device: torch.device, dtype: torch.dtype) -> float:
    """The fastest rate of square matmuls of PEAK_SIZES (each best of enough repetitions for about 1 GFLOP)."""
    return max(_measure_matmul_flops(device, dtype, size, max(5, 10**9 // (2 * size**3))) for size in PEAK_SIZES)


def _measure_matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 1024, reps: int = 5) -> float:
    """Best-of-`reps` rate of a size x size matmul on `device`, with the current thread count."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    flops_per_mm = 2 * size**3
    _sync(device)
    torch.mm(a, b)  # warm-up: first call pays for allocation and kernel selection
    _sync(device)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return flops_per_mm / max(best, 1e-9)


def _sync(device: torch.device) -> None:
    if device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize(device)


def peak_flops(device: torch.device) -> float:
    """The FLOP/s that MFU is measured against on `device`.

    CUDA (NVIDIA or ROCm): the datasheet dense bf16 peak looked up by device name. CPU: the fastest measured fp32
    rate of square matmuls (PEAK_SIZES) using torch's current thread count (no published peak to look up), cached
    per process and thread count. Other accelerators: a measured bf16 matmul rate, also cached. A measured peak is a
    lower bound: the metrics raise it when training runs faster (MFU never reads above 100%).
    """
    if device.type == "cuda":
        return gpu_peak_flops_by_name(torch.cuda.get_device_name(device))
    key = (device.type, torch.get_num_threads())
    if key not in _measured_peaks:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        _measured_peaks[key] = _measure_peak(device, dtype)
        logger.info("Measured %s %s matmul peak: %.1f GFLOP/s with %d threads",
                    device.type, str(dtype).removeprefix("torch."), _measured_peaks[key] / 1e9, key[1])
    return _measured_peaks[key]
