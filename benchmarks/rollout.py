"""The rollout's decode engine (titan_lite/generate/engine.py) against today's static batch (generate/decode.py's
`sample`: every completion decoded together until the longest ends) and transformers' `generate`, on random weights,
greedy-free sampling at temperature 1, G = 8 completions per prompt; one process.

    .venv/bin/python -m benchmarks.rollout                  # every part (SmolLM2-135M's shape for `transformers`)
    .venv/bin/python -m benchmarks.rollout --smoke          # tiny shapes: seconds

Three parts, each printing a line: `lengths`: completion lengths log-uniform over an 8-fold range, the time per
generated token of the static batch and of the engine's slots, with the share of slot-steps (rows x decode steps) that
produced a token; `prefill`: 200-token prompts, the prefill's seconds (and share of the rollout) of the static batch,
of the engine with the prompt prefilled once per completion and once per group; `transformers`: rollout tokens/s of
the engine and of transformers' `generate` (num_return_sequences G, the same prompts, weights and lengths) at batch
64. Lengths are set exactly on both sides: the completion's stop token is the last id, which a draw picks only with
a uniform number of 1 - 2^-24 (given at its last token, the others below 0.99); transformers gets it by a logits
processor. vLLM is measured where it is importable (not on CPU)."""

import json
import math
import sys
import time
from dataclasses import dataclass, replace

import torch

from benchmarks.cli import parser
from benchmarks.worker import RESULT_PREFIX, peak_rss_bytes
from titan_lite.generate import GenerationConfig, sample
from titan_lite.generate.engine import EngineStats, decode_slots
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args

CPU = torch.device("cpu")
LAST = 1 - 2 ** -24  # the largest float32 below 1: the draw lands on the last id of the CDF


@dataclass
class Workload:
    """G completions of each prompt, their lengths, and the uniform numbers that end each at its length."""

    prompts: list[list[int]]
    lengths: list[int]
    uniforms: torch.Tensor
    stop: int

    @classmethod
    def draw(cls, vocab: int, n_prompts: int, group: int, prompt_len: int, longest: int, spread: int,
             seed: int = 0) -> "Workload":
        g = torch.Generator().manual_seed(seed)
        prompts = [p for _ in range(n_prompts) for p in [torch.randint(1, vocab - 1, (prompt_len,),
                                                                       generator=g).tolist()] * group]
        low, high = math.log(longest / spread), math.log(longest)
        lengths = [max(1, round(math.exp(low + (high - low) * float(x)))) for x in torch.rand(len(prompts),
                                                                                              generator=g)]
        uniforms = torch.rand(len(prompts), longest, generator=g) * 0.99
        for i, n in enumerate(lengths):
            uniforms[i, n - 1] = LAST
        return cls(prompts, lengths, uniforms, vocab - 1)

    def config(self, **kw) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=max(self.lengths), temperature=1.0, stop_ids=(self.stop,),
                                keep_stop=True, **kw)

    def check(self, decoded) -> int:
        got = [len(d.tokens) for d in decoded]
        if got != self.lengths:
            raise RuntimeError(f"completion lengths {got[:8]}... are not the workload's {self.lengths[:8]}...")
        return sum(got)


def model_of(flavor: str, vocab: int | None = None) -> Llama:
    args = flavor_args(flavor)
    if vocab:
        args.vocab_size = vocab
    model = Llama(args)
    model.init_weights(seed=0)
    return model.eval()


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def static_batch(model, w: Workload, **kw):
    return timed(lambda: sample(model, w.prompts, w.config(**kw), CPU, w.uniforms))


def engine(model, w: Workload, share: bool = True, **kw):
    stats = EngineStats()
    out, seconds = timed(lambda: decode_slots(model, w.prompts, w.config(**kw), CPU, w.uniforms,
                                              share_prefill=share, stats=stats))
    return out, seconds, stats


def lengths_part(opts) -> dict:
    model = model_of(opts.flavor)
    w = Workload.draw(model.args.vocab_size, opts.length_prompts, 8, 32, opts.longest, 8)
    engine(model, replace(w, prompts=w.prompts[:8], lengths=w.lengths[:8], uniforms=w.uniforms[:8]),
           slots=opts.slots)  # warm-up
    out, static_s = static_batch(model, w)
    tokens = w.check(out)
    slots = stats_slots(opts.slots, len(w.prompts))
    chunks = [replace(w, prompts=w.prompts[i:i + slots], lengths=w.lengths[i:i + slots],
                      uniforms=w.uniforms[i:i + slots]) for i in range(0, len(w.prompts), slots)]
    chunked_s = sum(static_batch(model, c)[1] for c in chunks)
    out, engine_s, stats = engine(model, w, slots=opts.slots)
    w.check(out)
    static_share = tokens / (len(w.prompts) * max(w.lengths))
    chunked_share = tokens / sum(len(c.prompts) * max(c.lengths) for c in chunks)
    r = {"completions": len(w.prompts), "tokens": tokens, "static_s": static_s, "chunked_s": chunked_s,
         "engine_s": engine_s, "slots": slots, "static_working_share": static_share,
         "chunked_working_share": chunked_share, "engine_working_share": stats.working_share}
    print(f"lengths: {opts.flavor}, {len(w.prompts)} completions of {min(w.lengths)}-{max(w.lengths)} tokens "
          f"(log-uniform over 8x), {tokens} tokens, ms per generated token: static batch of all "
          f"{1e3 * static_s / tokens:.2f} ({100 * static_share:.0f}% of slot-steps working), static batches of "
          f"{slots} {1e3 * chunked_s / tokens:.2f} ({100 * chunked_share:.0f}%), engine with {slots} slots "
          f"{1e3 * engine_s / tokens:.2f} ({100 * stats.working_share:.0f}%): {static_s / engine_s:.2f}x and "
          f"{chunked_s / engine_s:.2f}x better", flush=True)
    return r


def stats_slots(slots: int, completions: int) -> int:
    return min(slots or completions, completions)


def prefill_part(opts) -> dict:
    model = model_of(opts.flavor)
    w = Workload.draw(model.args.vocab_size, opts.prompts, 8, opts.prompt_len, opts.longest, 8, seed=1)
    _, static_prefill_s = timed(lambda: sample(model, w.prompts, replace(w.config(), max_new_tokens=1), CPU,
                                               w.uniforms[:, :1]))
    _, static_s = static_batch(model, w)
    _, alone_s, alone = engine(model, w, share=False, slots=opts.slots)
    _, shared_s, shared = engine(model, w, share=True, slots=opts.slots)
    r = {"static_prefill_s": static_prefill_s, "static_s": static_s, "unshared_prefill_s": alone.prefill_s,
         "unshared_s": alone_s, "shared_prefill_s": shared.prefill_s, "shared_s": shared_s,
         "prefills": shared.prefills, "unshared_prefills": alone.prefills}
    print(f"prefill: {opts.flavor}, {opts.prompts} prompts of {opts.prompt_len} tokens x G = 8: static batch "
          f"{static_prefill_s:.2f} s ({100 * static_prefill_s / static_s:.0f}% of its rollout), engine once per "
          f"completion {alone.prefill_s:.2f} s ({alone.prefills} prefills, {100 * alone.prefill_s / alone_s:.0f}%), "
          f"once per group {shared.prefill_s:.2f} s ({shared.prefills} prefills, "
          f"{100 * shared.prefill_s / shared_s:.0f}%): {static_prefill_s / shared.prefill_s:.1f}x less than the "
          f"static batch's, {alone.prefill_s / shared.prefill_s:.1f}x less than unshared", flush=True)
    return r


def transformers_part(opts) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

    from titan_lite.models.hf.config import args_to_hf_config

    model = model_of(opts.hf_flavor)
    args = model.args
    hf = LlamaForCausalLM(LlamaConfig(**args_to_hf_config(args, torch.float32))).eval()
    hf.load_state_dict(hf_weights(model), strict=False)
    hf.tie_weights()
    w = Workload.draw(args.vocab_size, 8, 8, 32, opts.hf_longest, 8, seed=2)
    prompts = torch.tensor(w.prompts[::8])
    lengths = torch.tensor(w.lengths)

    class EndAtLength(LogitsProcessor):
        """Row i ends with the stop id at its workload length, never before."""

        def __call__(self, input_ids, scores):
            at = input_ids.shape[1] - prompts.shape[1] + 1
            scores[:, w.stop] = float("-inf")
            ending = lengths == at
            scores[ending] = float("-inf")
            scores[ending, w.stop] = 0.0
            return scores

    def hf_generate():
        with torch.no_grad():
            return hf.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=0,
                               max_new_tokens=max(w.lengths), num_return_sequences=8, eos_token_id=w.stop,
                               pad_token_id=w.stop, logits_processor=LogitsProcessorList([EndAtLength()]))

    hf_generate()  # warm-up
    out, hf_s = timed(hf_generate)
    new = out[:, prompts.shape[1]:]
    ended = new == w.stop  # padding after the end is the stop id too
    hf_tokens = int(torch.where(ended.any(1), ended.int().argmax(1) + 1, new.shape[1]).sum())
    results = {"hf_s": hf_s, "hf_tokens": hf_tokens}
    line = f"transformers: {opts.hf_flavor}, batch 64 (8 prompts x G = 8), lengths {min(w.lengths)}-" \
           f"{max(w.lengths)}: transformers' generate {hf_tokens / hf_s:,.1f} tokens/s"
    engine(model, w, slots=opts.slots)  # warm-up
    for slots in sorted({64, opts.slots}, reverse=True):
        decoded, seconds, _ = engine(model, w, slots=slots)
        tokens = w.check(decoded)
        results[f"engine_{slots}_s"], results["tokens"] = seconds, tokens
        line += f"; engine, {slots} slots, {tokens / seconds:,.1f} tokens/s " \
                f"({tokens / seconds / (hf_tokens / hf_s):.2f}x transformers')"
    print(line, flush=True)
    return results


def hf_weights(model: Llama) -> dict[str, torch.Tensor]:
    from titan_lite.models.hf.state_dict import to_hf_state_dict

    return to_hf_state_dict(model.state_dict(), model.args)


def parse(argv):
    p = parser(__doc__, ".venv/bin/python -m benchmarks.rollout")
    p.add_argument("--parts", default="lengths,prefill,transformers")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (seconds): checks the plumbing")
    p.add_argument("--flavor", default="debugmodel", help="the model of the lengths and prefill parts")
    p.add_argument("--hf_flavor", default="smollm2_135M", help="the model compared with transformers")
    p.add_argument("--prompts", type=int, default=8, help="the prefill part's prompts (x G = 8 completions)")
    p.add_argument("--length_prompts", type=int, default=16, help="the lengths part's prompts (x G = 8)")
    p.add_argument("--slots", type=int, default=32, help="the engine's slots (grpo.generation_batch_size)")
    p.add_argument("--longest", type=int, default=128, help="the longest completion (lengths and prefill parts)")
    p.add_argument("--hf_longest", type=int, default=32, help="the longest completion against transformers")
    p.add_argument("--prompt_len", type=int, default=200, help="the prefill part's prompt length")
    opts = p.parse_args(argv)
    if opts.smoke:
        opts.flavor = opts.hf_flavor = "tiny"
        opts.prompts, opts.length_prompts, opts.slots = 2, 2, 8
        opts.longest, opts.hf_longest, opts.prompt_len = 16, 8, 24
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    torch.manual_seed(0)
    parts = {"lengths": lengths_part, "prefill": prefill_part, "transformers": transformers_part}
    result = {}
    for name in opts.parts.split(","):
        result[name] = parts[name](opts)
    result.update(rank=0, world=1, peak_rss_bytes=peak_rss_bytes(), threads=torch.get_num_threads())
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
