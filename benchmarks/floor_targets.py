"""The LoRA kernel-floor target (issue 28): a LoRA step at most its own kernel floor times the full step's factor
(step / floor) plus 0.05. Both steps run alternating with replays of their floors (`benchmarks.worker --impl
floor`), each in its own process."""

import statistics
import sys
from dataclasses import dataclass

from benchmarks.framework import Case, Ratio, RunOutput, Settings, Variant, foreign_cores, single_result
from benchmarks.shapes import SHAPES

LORA_MARGIN = 0.05  # the LoRA step's factor may exceed the full step's by this much
LORA = "--lora.rank 16 --lora.alpha 32"


@dataclass
class FloorVariant(Variant):
    """titan_lite's steps (LoRA ones with `lora`) alternating with replays of their kernel floor, one process."""

    shape: str = "smollm2_135M"
    lora: str | None = None
    steps: int = 5

    def command(self, settings: Settings) -> tuple[list[str], dict[str, str]]:
        args = [sys.executable, "-m", "benchmarks.worker", "--impl", "floor", "--shape", self.shape,
                "--steps", str(self.steps), "--warmup", str(max(1, settings.warmup - 1))]
        return args + (["--lora", self.lora] if self.lora else []), {"OMP_NUM_THREADS": str(settings.threads)}

    def metrics(self, out: RunOutput) -> dict[str, float]:
        r = single_result(self.label, out)
        step_s, floor_s = statistics.median(r["step_s"]), r["kernel_floor"]["floor_s"]
        return {"step_s": step_s, "kernel_floor_s": floor_s, "floor_factor": step_s / floor_s,
                "floor_factor_plus_margin": step_s / floor_s + LORA_MARGIN,
                "step_spread": max(r["step_s"]) / min(r["step_s"]), "peak_rss_gib": r["peak_rss_bytes"] / 2**30,
                "foreign_cores": foreign_cores(r)}


def lora_floor(shape: str, steps: int) -> Case:
    """The case lora_floor_{shape}: full and LoRA steps against their kernel floors (cases.py registers it)."""
    full, lora = FloorVariant("full fine-tuning", shape=shape, steps=steps), \
        FloorVariant("LoRA r16, 7 projections", shape=shape, lora=LORA, steps=steps)
    return Case(f"lora_floor_{shape}", f"titan_lite's full and LoRA steps against their kernel floors, "
                f"{SHAPES[shape].batch} x {SHAPES[shape].seq_len} tokens, 1 process", [full, lora],
                [Ratio("full step / its kernel floor", "step_s", full.label, full.label, higher_is_better=False,
                       denominator_metric="kernel_floor_s"),
                 Ratio("LoRA step / its kernel floor", "step_s", lora.label, lora.label, higher_is_better=False,
                       denominator_metric="kernel_floor_s"),
                 Ratio(f"LoRA's factor / (full's factor + {LORA_MARGIN})", "floor_factor", lora.label, full.label,
                       target=1.0, higher_is_better=False, denominator_metric="floor_factor_plus_margin")],
                columns=("step_s", "kernel_floor_s", "peak_rss_gib"))
