"""Qwen3.5 in one process: a training step (forward and backward, float32) of titan_lite's model against
transformers' Qwen3_5ForCausalLM holding the same weights (its pure-PyTorch delta rule and conv where fla-core and
causal-conv1d are absent), the two alternating; and the gated delta rule by chunks (titan_lite's) against its
recurrent form on 2048 tokens, forward and forward + backward, with FLA's chunk_gated_delta_rule beside them where
fla-core imports and the device is CUDA.

    export OMP_NUM_THREADS=1
    .venv/bin/python -m benchmarks.qwen3_5                # dim 256, 4 layers (3 Gated DeltaNet : 1 attention), 1 x 1024
    .venv/bin/python -m benchmarks.qwen3_5 --smoke        # tiny shapes: seconds
    .venv/bin/python -m benchmarks.qwen3_5 --parts rule --device cuda --rule_heads 16,32,128,128

The model is debugmodel_qwen3_5 cut to --layers (a multiple of 4, the 3:1 schedule); both sides train on the same
random tokens with the same cross entropy on the logits. Both parts print one line each and a last line of JSON."""

import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from benchmarks.cli import parser
from benchmarks.worker import RESULT_PREFIX, machine_busy_seconds, peak_rss_bytes
from titan_lite.models.args import LlamaArgs
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args
from titan_lite.models.hf.config import args_to_hf_config
from titan_lite.models.hf.state_dict import to_hf_state_dict
from titan_lite.models.parts.gated_deltanet import FLA_INSTALLED, chunked_delta_rule, recurrent_delta_rule

RULE_TOKENS = 2048


# ------------------------------------------------------------------------------------------ the step


def model_args(flavor: str, layers: int, seq_len: int) -> LlamaArgs:
    """The flavor cut to `layers` layers in Qwen3.5's schedule (three Gated DeltaNet layers before each attention)."""
    if layers % 4:
        raise SystemExit(f"error: --layers {layers}: Qwen3.5's schedule repeats every 4 layers (3:1)")
    schedule = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
    return replace(flavor_args(flavor), n_layers=layers, layer_types=schedule, max_seq_len=seq_len)


def transformers_twin(model: Llama, device: torch.device) -> torch.nn.Module:
    """transformers' Qwen3_5ForCausalLM with the model's weights (titan_lite's HF export of its state dict)."""
    try:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # optional: a benchmark-only dependency
    except ImportError:
        raise SystemExit("error: transformers (5.x, with Qwen3.5) is not importable; it is the other side of the "
                         "step part (run --parts rule without it)") from None
    config = Qwen3_5TextConfig(**args_to_hf_config(model.args, torch.float32))
    config.use_cache = False
    with torch.device(device):
        twin = Qwen3_5ForCausalLM(config).float()
    twin.load_state_dict(to_hf_state_dict(model.state_dict(), model.args), strict=True)
    return twin.train()


def training_step(forward: Callable[[torch.Tensor], torch.Tensor], params: list[torch.nn.Parameter],
                  tokens: torch.Tensor) -> Callable[[], float]:
    """One forward and backward of the next-token cross entropy; the gradients dropped after it."""
    def step() -> float:
        logits = forward(tokens)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        for p in params:
            p.grad = None
        return loss.item()
    return step


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alternate(steps: dict[str, Callable[[], object]], rounds: int, warmup: int, device: torch.device
              ) -> dict[str, list[float]]:
    """Seconds of each named step over `rounds` rounds, the order reversed every other round (drift hits all alike)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(warmup + rounds):
        for name in list(steps) if i % 2 == 0 else list(steps)[::-1]:
            synchronize(device)
            start = time.perf_counter()
            steps[name]()
            synchronize(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def step_part(opts, device: torch.device) -> dict:
    args = model_args(opts.flavor, opts.layers, opts.seq)
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(args)
    model.init_weights(seed=0)
    model.train()
    twin = transformers_twin(model, device)
    tokens = torch.randint(0, args.vocab_size, (opts.batch, opts.seq), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(device)
    with torch.no_grad():
        diff = (model(tokens) - twin(input_ids=tokens).logits).abs().max().item()
    steps = {"titan_lite": training_step(model, list(model.parameters()), tokens),
             "transformers": training_step(lambda t: twin(input_ids=t).logits, list(twin.parameters()), tokens)}
    times = alternate(steps, opts.steps, opts.warmup, device)
    ours, theirs = statistics.median(times["titan_lite"]), statistics.median(times["transformers"])
    n = opts.batch * opts.seq
    print(f"qwen3_5 step: dim {args.dim}, {args.n_layers} layers (3 Gated DeltaNet : 1 attention), {opts.batch} x "
          f"{opts.seq} tokens, float32, {device.type}, {torch.get_num_threads()} thread(s), medians of {opts.steps} "
          f"alternating forward + backward: titan_lite {ours:.3f} s ({n / ours:,.0f} tokens/s), transformers "
          f"{theirs:.3f} s ({n / theirs:,.0f} tokens/s): transformers / titan_lite {theirs / ours:.2f}x; logits "
          f"max difference {diff:.1e}", flush=True)
    return {"step_s": times["titan_lite"], "transformers_step_s": times["transformers"], "tokens": n,
            "logits_max_diff": diff, "dim": args.dim, "layers": args.n_layers}


# ------------------------------------------------------------------------------------------ the rule


@dataclass(frozen=True)
class RuleShape:
    """The delta rule's inputs: one sequence of `tokens`, key heads shared by groups of value heads."""

    tokens: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int

    @classmethod
    def parse(cls, text: str, tokens: int) -> "RuleShape":
        keys, values, dk, dv = (int(x) for x in text.split(","))
        return cls(tokens, keys, values, dk, dv)

    def inputs(self, device: torch.device, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
        """q, k, v, g (log decay, <= 0) and beta as the mixer hands them over, each requiring its gradient."""
        g = torch.Generator().manual_seed(seed)
        n = self.tokens
        q, k = (torch.randn(1, n, self.key_heads, self.key_dim, generator=g) for _ in range(2))
        v = torch.randn(1, n, self.value_heads, self.value_dim, generator=g)
        decay = -F.softplus(torch.randn(1, n, self.value_heads, generator=g)) * 0.5
        beta = torch.rand(1, n, self.value_heads, generator=g)
        return [t.to(device, dtype if t is not decay else torch.float32).requires_grad_() for t in (q, k, v, decay,
                                                                                                  beta)]


def fla_rule(q, k, v, g, beta):
    from titan_lite.models.parts.gated_deltanet import fla_delta_rule  # runs fla-core's triton kernel

    return fla_delta_rule(q, k, v, g, beta)


def rule_forms(device: torch.device, chunk: int) -> dict[str, Callable]:
    """The delta rule's forms that run here: chunked and recurrent, and FLA's kernel on CUDA where fla-core is."""
    forms = {"chunked": lambda *x: chunked_delta_rule(*x, chunk=chunk), "recurrent": recurrent_delta_rule}
    if FLA_INSTALLED and device.type == "cuda":
        forms["fla"] = fla_rule
    return forms


def rule_runs(forms: dict[str, Callable], inputs: list[torch.Tensor]) -> dict[str, Callable]:
    """Each form's forward alone (no autograd) and its forward + backward, on the same inputs."""
    runs = {}
    for name, form in forms.items():
        runs[f"{name}_s"] = lambda form=form: forward_of(form, inputs)

        def train(form=form):
            form(*inputs)[0].float().square().sum().backward()
            for t in inputs:
                t.grad = None
        runs[f"{name}_train_s"] = train
    return runs


def forward_of(form: Callable, inputs: list[torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return form(*inputs)[0].float()


def rule_part(opts, device: torch.device) -> dict:
    shape = RuleShape.parse(opts.rule_heads, opts.rule_tokens)
    dtype = torch.bfloat16 if device.type == "cuda" and opts.rule_dtype == "auto" else \
        torch.float32 if opts.rule_dtype == "auto" else getattr(torch, opts.rule_dtype)
    forms, inputs = rule_forms(device, opts.chunk), shape.inputs(device, dtype)
    outputs = {name: forward_of(form, inputs) for name, form in forms.items()}
    times = alternate(rule_runs(forms, inputs), opts.rule_rounds, 1, device)
    med = {name: statistics.median(t) for name, t in times.items()}
    diff = (outputs["chunked"] - outputs["recurrent"]).abs().max().item()
    fla = ""
    if "fla" in outputs:
        fla_diff = (outputs["fla"] - outputs["recurrent"]).abs().max().item()
        fla = (f"; FLA's chunk_gated_delta_rule forward {med['fla_s'] * 1e3:.1f} ms, forward + backward "
               f"{med['fla_train_s'] * 1e3:.1f} ms (chunked / FLA {med['chunked_train_s'] / med['fla_train_s']:.1f}x, "
               f"its outputs within {fla_diff:.1e} of the recurrent form)")
    elif device.type == "cuda":
        fla = "; FLA's kernel skipped: fla-core is not installed"
    print(f"delta rule: {shape.tokens} tokens, {shape.value_heads} value heads of {shape.key_dim} x {shape.value_dim} "
          f"({shape.key_heads} key heads), {str(dtype).removeprefix('torch.')} in, float32 state, {device.type}, "
          f"medians of {opts.rule_rounds}: chunked ({opts.chunk}) forward {med['chunked_s'] * 1e3:.1f} ms, recurrent "
          f"{med['recurrent_s'] * 1e3:.1f} ms: recurrent / chunked {med['recurrent_s'] / med['chunked_s']:.1f}x; "
          f"forward + backward chunked {med['chunked_train_s'] * 1e3:.1f} ms, recurrent "
          f"{med['recurrent_train_s'] * 1e3:.1f} ms: {med['recurrent_train_s'] / med['chunked_train_s']:.1f}x; "
          f"outputs within {diff:.1e}{fla}", flush=True)
    return {"times": times, "max_diff": diff, "tokens": shape.tokens, "dtype": str(dtype)}


# ------------------------------------------------------------------------------------------ command line


def parse(argv: list[str] | None):
    p = parser(__doc__, ".venv/bin/python -m benchmarks.qwen3_5")
    p.add_argument("--parts", default="step,rule", help="comma list: step, rule")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (seconds): checks the plumbing")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--flavor", default="debugmodel_qwen3_5", help="the step's model (cut to --layers)")
    p.add_argument("--layers", type=int, default=4, help="layers, a multiple of 4 (the 3:1 schedule)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=1024, help="the step's sequence length")
    p.add_argument("--steps", type=int, default=3, help="timed steps of each side, alternating")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps of each side first")
    p.add_argument("--rule_tokens", type=int, default=RULE_TOKENS)
    p.add_argument("--rule_heads", default="4,8,32,32",
                   help="key heads, value heads, key and value head dims (default: debugmodel_qwen3_5's; "
                        "Qwen3.5-35B-A3B's: 16,32,128,128)")
    p.add_argument("--rule_rounds", type=int, default=3, help="timed rounds of each form")
    p.add_argument("--rule_dtype", default="auto", help="q, k, v and beta's dtype (auto: bfloat16 on CUDA, else "
                                                        "float32)")
    p.add_argument("--chunk", type=int, default=64, help="the chunked form's chunk (FLA's is 64)")
    opts = p.parse_args(argv)
    if opts.smoke:
        opts.flavor, opts.layers, opts.seq, opts.steps, opts.warmup = "tiny_qwen3_5", 4, 64, 1, 0
        opts.rule_tokens, opts.rule_rounds, opts.rule_heads = 128, 1, "2,4,16,16"
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    device = torch.device(opts.device)
    parts = {"step": step_part, "rule": rule_part}
    result = {}
    busy0, cpu0, wall0 = machine_busy_seconds(), time.process_time(), time.perf_counter()
    for name in opts.parts.split(","):
        result[name] = parts[name](opts, device)
    wall, cpu, busy1 = time.perf_counter() - wall0, time.process_time() - cpu0, machine_busy_seconds()
    result.update(rank=0, world=1, peak_rss_bytes=peak_rss_bytes(), threads=torch.get_num_threads(), wall_s=wall,
                  own_cpu_s=cpu, machine_busy_s=None if busy0 is None or busy1 is None else busy1 - busy0)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
