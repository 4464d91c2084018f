"""The model shapes the benchmarks train: a titan_lite flavor (or one registered here), sequence length and batch."""

from dataclasses import dataclass

from titan_lite.models.args import LlamaArgs
from titan_lite.models.flavors import FLAVORS, flavor_args

# A 512-dim, 8-layer Llama with a 32k vocabulary: a shape where the loss over the vocabulary is a large part of the
# step. Registered as a flavor in the benchmark processes only (register_benchmark_flavors).
_BENCH_FLAVORS = {
    "bench_512d_32k": LlamaArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=32000, ffn_dim=1376,
                                rope_theta=500000.0),
}


@dataclass(frozen=True)
class Shape:
    name: str
    flavor: str
    seq_len: int
    batch: int  # sequences per step on each rank

    def args(self) -> LlamaArgs:
        register_benchmark_flavors()
        args = flavor_args(self.flavor)
        args.max_seq_len = self.seq_len
        return args


SHAPES: dict[str, Shape] = {
    "debug": Shape("debug", "debugmodel", seq_len=256, batch=2),
    "smollm2_135M": Shape("smollm2_135M", "smollm2_135M", seq_len=512, batch=1),
    "512d_32k": Shape("512d_32k", "bench_512d_32k", seq_len=512, batch=2),
    "tiny": Shape("tiny", "tiny", seq_len=32, batch=2),  # smoke tests
    "moe_debug": Shape("moe_debug", "debugmodel_moe", seq_len=256, batch=2),  # Qwen3-MoE: 8 experts, top 2
}


def register_benchmark_flavors() -> None:
    for name, args in _BENCH_FLAVORS.items():
        FLAVORS.setdefault(name, args)
