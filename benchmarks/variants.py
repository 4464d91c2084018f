"""The variants the catalogue's cases compare: titan_lite's (or transformers') training steps, a matmul peak, Wanda,
the paired kernel-floor runs, distillation, DRY_RUN, chat packing, preference tuning and GRPO, each a worker command
and the reading of its result line."""

import statistics
import sys
from dataclasses import dataclass, field

from benchmarks.framework import REPO, RunOutput, Settings, Variant, foreign_cores, single_result, worker_results


@dataclass
class TrainVariant(Variant):
    """Training steps of titan_lite or transformers on a shape, in 1 process or N FSDP processes (torchrun)."""

    impl: str = "titan_lite"
    shape: str = "debug"
    compile: bool = False
    nproc: int = 1
    batch: int | None = None  # sequences per step on each rank; None = the shape's
    optimizer: str | None = None  # titan_lite's optimizer.implementation; None = the config default
    lora: str | None = None  # [lora] overrides: train LoRA adapters instead of every weight
    overrides: str | None = None  # more titan_lite config overrides (e.g. a converter and its section's keys)
    env: dict[str, str] = field(default_factory=dict)  # extra environment (A/B of a switch)
    tensor_peak: bool = False  # one more step measuring the peak of live tensor bytes (peak_tensor_gib)
    plan: bool = False  # DRY_RUN's estimate of the same run (planned_peak_gib), the base's storage against bf16

    def command(self, settings: Settings) -> tuple[list[str], dict[str, str]]:
        args = ["-m", "benchmarks.worker", "--impl", self.impl, "--shape", self.shape,
                "--steps", str(settings.steps), "--warmup", str(settings.warmup + (2 if self.compile else 0))]
        args += ["--compile"] if self.compile else []
        args += ["--batch", str(self.batch)] if self.batch else []
        args += ["--optimizer", self.optimizer] if self.optimizer else []
        args += ["--lora", self.lora] if self.lora else []
        args += ["--overrides", self.overrides] if self.overrides else []
        args += ["--tensor_peak"] if self.tensor_peak else []
        args += ["--plan"] if self.plan else []
        if self.nproc > 1:
            args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(self.nproc)] + args[:1] + \
                ["benchmarks.worker"] + args[2:]
        env = {"OMP_NUM_THREADS": str(max(1, settings.threads // self.nproc)), **self.env}
        return [sys.executable, *args], env

    def metrics(self, out: RunOutput) -> dict[str, float]:
        ranks = sorted(worker_results(out.stdout), key=lambda r: r["rank"])
        if out.returncode != 0 or len(ranks) != self.nproc:
            raise RuntimeError(f"{self.label}: exit code {out.returncode}, {len(ranks)} of {self.nproc} results\n"
                               + out.stdout[-3000:])
        first = ranks[0]
        step_s = statistics.median(first["step_s"])
        own_cpu = sum(r["own_cpu_s"] for r in ranks)
        busy = first["machine_busy_s"]
        return {
            "tokens_per_s": first["tokens_per_step"] / step_s,
            "step_s": step_s,
            "step_spread": max(first["step_s"]) / min(first["step_s"]),
            # CPU seconds of all ranks per step: a measure of the work done that foreign load disturbs less.
            "cpu_s_per_step": own_cpu / len(first["step_s"]),
            "sys_s_per_step": sum(r["sys_cpu_s"] for r in ranks) / len(first["step_s"]),
            "flops_per_token": first["flops_per_token"],
            "peak_rss_gib": max(r["peak_rss_bytes"] for r in ranks) / 2**30,
            # Cores busy with other processes over the timed steps, on average.
            "foreign_cores": (busy - own_cpu) / first["wall_s"] if busy is not None else 0.0,
            "loss_last": first["losses"][-1],
        } | ({"peak_tensor_gib": max(r["peak_tensor_bytes"] for r in ranks) / 2**30}
             if "peak_tensor_bytes" in first else {}) | _plan_metrics(first)


def _plan_metrics(r: dict) -> dict[str, float]:
    """DRY_RUN's estimate beside the measured live-tensor peak, and the base's storage against bfloat16."""
    if "planned_peak_bytes" not in r:
        return {}
    out = {"planned_peak_gib": r["planned_peak_bytes"] / 2**30, "base_vs_bf16": r["base_bytes"] / r["base_bf16_bytes"]}
    if "peak_tensor_bytes" in r:
        out["plan_error_pct"] = 100 * (r["planned_peak_bytes"] / r["peak_tensor_bytes"] - 1)
    return out


@dataclass
class MatmulPeakVariant(Variant):
    """The fp32 matmul rate of the machine with the benchmark's thread count: the physical limit MFU refers to."""

    def command(self, settings: Settings) -> tuple[list[str], dict[str, str]]:
        env = {"OMP_NUM_THREADS": str(settings.threads)}
        return [sys.executable, "-m", "benchmarks.worker", "--impl", "matmul"], env

    def metrics(self, out: RunOutput) -> dict[str, float]:
        result = worker_results(out.stdout)
        if out.returncode != 0 or not result:
            raise RuntimeError(f"matmul peak: exit code {out.returncode}\n{out.stdout[-3000:]}")
        return {"gflops": result[0]["flops"] / 1e9, "foreign_cores": result[0]["foreign_cores"]}


@dataclass
class WandaVariant(Variant):
    """One-shot Wanda 50% on a shape (random weights) and its floor: one forward pass over the same windows."""

    shape: str = "smollm2_135M"
    nsamples: int = 32

    def command(self, settings: Settings) -> tuple[list[str], dict[str, str]]:
        args = ["-m", "benchmarks.worker", "--impl", "wanda", "--shape", self.shape, "--nsamples", str(self.nsamples)]
        return [sys.executable, *args], {"OMP_NUM_THREADS": str(settings.threads)}

    def metrics(self, out: RunOutput) -> dict[str, float]:
        r = single_result(self.label, out)
        return {"prune_s": r["prune_s"], "floor_s": r["floor_s"], "peak_rss_gib": r["peak_rss_bytes"] / 2**30,
                "foreign_cores": foreign_cores(r)}


@dataclass
class PairedVariant(Variant):
    """titan_lite's and transformers' steps alternating in one process, with each step's kernel floor (its matmuls
    and attention kernels replayed alone) measured between them: benchmarks.worker --impl paired."""

    shape: str = "debug"
    steps: int = 6  # alternating rounds of the two steps and the two floor replays
    impl: str = "paired"  # needs transformers (select_cases drops it without)

    def command(self, settings: Settings) -> tuple[list[str], dict[str, str]]:
        args = ["-m", "benchmarks.worker", "--impl", "paired", "--shape", self.shape, "--steps", str(self.steps),
                "--warmup", str(settings.warmup)]
        return [sys.executable, *args], {"OMP_NUM_THREADS": str(settings.threads)}

    def metrics(self, out: RunOutput) -> dict[str, float]:
        r = single_result(self.label, out)
        return {"step_s": statistics.median(r["step_s"]),
                "transformers_step_s": statistics.median(r["transformers_step_s"]),
                "kernel_floor_s": min(f["floor_s"] for f in r["kernel_floor"].values()),
                "step_spread": max(r["step_s"]) / min(r["step_s"]),
                "peak_rss_gib": r["peak_rss_bytes"] / 2**30, "foreign_cores": foreign_cores(r)}


@dataclass
class DistillVariant(Variant):
    """Distillation's step cost on a shape: plain steps, distilled steps and the teacher's forward alone, alternating
    in one process (benchmarks.worker --impl distill); the teacher is a random model of `teacher`'s flavor."""

    shape: str = "debug"
    teacher: str | None = None  # a flavor; None = the shape's own (a teacher the student's size)

    def command(self, settings: Settings) -> tuple[list[str], dict[str, str]]:
        args = ["-m", "benchmarks.worker", "--impl", "distill", "--shape", self.shape, "--steps", str(settings.steps),
                "--warmup", str(settings.warmup)] + (["--teacher", self.teacher] if self.teacher else [])
        return [sys.executable, *args], {"OMP_NUM_THREADS": str(settings.threads)}

    def metrics(self, out: RunOutput) -> dict[str, float]:
        r = single_result(self.label, out)
        plain, distilled = statistics.median(r["step_s"]), statistics.median(r["distill_step_s"])
        return {"step_s": plain, "distill_step_s": distilled, "teacher_forward_s": statistics.median(
                r["teacher_forward_s"]), "teacher_cost_s": distilled - plain,
                "peak_rss_gib": r["peak_rss_bytes"] / 2**30, "foreign_cores": foreign_cores(r)}


@dataclass
class DryRunVariant(Variant):
    """DRY_RUN=1 planning of a full-size job, as `run_train.sh` runs it: wall time and peak RSS of the process."""

    config: str = "train_configs/llama3_8b.toml"
    ngpu: int = 8
    nnodes: int = 1
    # A folder with data files: DRY_RUN checks that the dataset path holds some (and exits 5 if not), reads none.
    data_dir: str = str(REPO / "titan_lite" / "data" / "corpus" / "shakespeare" / "train")
    overrides: tuple[str, ...] = ()
    checkout: str | None = None  # another checkout's titan_lite (a baseline commit), else this one

    def command(self, settings: Settings) -> tuple[list[str], dict[str, str]]:
        args = [sys.executable, "-m", "titan_lite.train", "--job.config_file", self.config,
                "--model.hf_assets_path", "assets/tokenizer", "--training.dataset_path", self.data_dir, *self.overrides]
        env = {"DRY_RUN": "1", "NGPU": str(self.ngpu), "NNODES": str(self.nnodes), "OMP_NUM_THREADS": "1"}
        return args, env | ({"PYTHONPATH": self.checkout} if self.checkout else {})

    def metrics(self, out: RunOutput) -> dict[str, float]:
        if out.returncode != 0 or "dry run OK" not in out.stdout:
            raise RuntimeError(f"{self.label}: exit code {out.returncode}\n{out.stdout[-3000:]}")
        return {"wall_s": out.wall_s, "cpu_s": out.child_cpu_s, "peak_rss_gib": out.child_peak_rss_bytes / 2**30,
                "foreign_cores": 0.0}


@dataclass
class ChatPackingVariant(Variant):
    """The trainer's steps on chat-like examples (benchmarks/chat_packing.py): packed whole with block-causal
    attention, the same windows attended causally, or one example per padded sequence."""

    layout: str = "packed"

    def command(self, settings: Settings) -> tuple[list[str], dict[str, str]]:
        args = ["-m", "benchmarks.chat_packing", "--layout", self.layout, "--steps", str(settings.steps),
                "--warmup", str(settings.warmup)]
        return [sys.executable, *args], {"OMP_NUM_THREADS": str(settings.threads)}

    def metrics(self, out: RunOutput) -> dict[str, float]:
        r = single_result(self.label, out)
        seconds = sum(r["step_s"])
        return {"trained_tokens_per_s": sum(r["trained_per_step"]) / seconds,
                "tokens_per_s": sum(r["total_per_step"]) / seconds, "step_s": statistics.median(r["step_s"]),
                "trained_pct": 100 * sum(r["trained_per_step"]) / sum(r["total_per_step"]),
                "real_pct": 100 * sum(r["real_per_step"]) / sum(r["total_per_step"]),
                "peak_rss_gib": r["peak_rss_bytes"] / 2**30, "foreign_cores": foreign_cores(r),
                "flops_per_token": r["flops_per_token"]}


@dataclass
class PreferenceVariant(Variant):
    """Preference tuning's steps (benchmarks/preference.py): packed pairs or one per padded sequence (mode packing),
    prompt copies against a shared prompt (mode prompt), the reference's cost in a step (mode reference)."""

    mode: str = "packing"
    layout: str = "packed"
    reference: str = "base"

    def command(self, settings: Settings) -> tuple[list[str], dict[str, str]]:
        args = ["-m", "benchmarks.preference", "--mode", self.mode, "--layout", self.layout, "--reference",
                self.reference, "--steps", str(settings.steps), "--warmup", str(settings.warmup)]
        return [sys.executable, *args], {"OMP_NUM_THREADS": str(settings.threads)}

    def metrics(self, out: RunOutput) -> dict[str, float]:
        r = single_result(self.label, out)
        common = {"peak_rss_gib": r["peak_rss_bytes"] / 2**30, "foreign_cores": foreign_cores(r)}
        if self.mode == "packing":
            seconds = sum(r["step_s"])
            return common | {"trained_tokens_per_s": sum(r["trained_per_step"]) / seconds,
                             "pairs_per_s": sum(r["pairs_per_step"]) / seconds,
                             "step_s": statistics.median(r["step_s"]),
                             "trained_pct": 100 * sum(r["trained_per_step"]) / sum(r["total_per_step"])}
        if self.mode == "prompt":
            pairs = sum(r["pairs"][:len(r["duplicated_s"])]) / len(r["duplicated_s"]) or 1
            return common | {"duplicated_s_per_pair": statistics.median(r["duplicated_s"]) / pairs,
                             "shared_s_per_pair": statistics.median(r["shared_s"]) / pairs,
                             "duplicated_tokens_per_pair": sum(r["duplicated_tokens"]) / sum(r["pairs"]),
                             "shared_tokens_per_pair": sum(r["shared_tokens"]) / sum(r["pairs"]),
                             "logps_max_difference": r["logps_max_difference"]}
        dpo, given = statistics.median(r["dpo_step_s"]), statistics.median(r["given_step_s"])
        return common | {"dpo_step_s": dpo, "given_step_s": given, "reference_cost_s": dpo - given,
                         "reference_forward_s": statistics.median(r["reference_forward_s"]),
                         "parameter_gib_held": r["parameter_bytes_held"] / 2**30}


@dataclass
class GRPOVariant(Variant):
    """GRPO's steps (benchmarks/grpo.py): the step split into generation, scoring, the reference's forwards and the
    policy's forward and backward; completions packed into windows or one per padded row."""

    layout: str = "packed"

    def command(self, settings: Settings) -> tuple[list[str], dict[str, str]]:
        # at most 2 timed steps after 1 warmup: each run decodes and trains whole rollouts, the slowest part of a case
        args = ["-m", "benchmarks.grpo", "--layout", self.layout, "--steps", str(min(settings.steps, 2)),
                "--warmup", str(min(settings.warmup, 1))]
        return [sys.executable, *args], {"OMP_NUM_THREADS": str(settings.threads)}

    def metrics(self, out: RunOutput) -> dict[str, float]:
        r = single_result(self.label, out)
        median = {key: statistics.median(r[key]) for key in ("generation_s", "scoring_s", "reference_s",
                                                             "policy_s")}
        train = sum(r["train_s"])
        return median | {"step_s": statistics.median(a + b for a, b in zip(r["rollout_s"], r["train_s"],
                                                                           strict=True)),
                         "rollout_tokens_per_s": sum(r["completion_tokens"]) / sum(r["generation_s"]),
                         "train_tokens_per_s": sum(r["real_tokens"]) / train,
                         "trained_tokens_per_s": sum(r["trained_tokens"]) / train,
                         "padding_pct": 100 * (1 - sum(r["real_tokens"]) / sum(r["total_tokens"])),
                         "peak_rss_gib": r["peak_rss_bytes"] / 2**30, "foreign_cores": foreign_cores(r)}


@dataclass
class RolloutFoldVariant(Variant):
    """A rollout's decoding with the adapters folded into the base against applied apart (benchmarks/rollout_fold.py),
    alternating in one run, on a float32 (LoRA) or NF4 (QLoRA) base."""

    base: str = "float32"

    def command(self, settings: Settings) -> tuple[list[str], dict[str, str]]:
        args = ["-m", "benchmarks.rollout_fold", "--base", self.base, "--rounds", str(min(max(settings.steps, 1), 3)),
                "--warmup", str(min(settings.warmup, 1))]
        return [sys.executable, *args], {"OMP_NUM_THREADS": str(settings.threads)}

    def metrics(self, out: RunOutput) -> dict[str, float]:
        r = single_result(self.label, out)
        n = r["tokens"] * len(r["apart_s"])
        return {"apart_tokens_per_s": n / sum(r["apart_s"]), "folded_tokens_per_s": n / sum(r["folded_s"]),
                "logps_max_difference": r["max_logp_diff"], "same_tokens": float(r["same_tokens"]),
                "peak_rss_gib": r["peak_rss_bytes"] / 2**30, "foreign_cores": foreign_cores(r)}


@dataclass
class RolloutVariant(Variant):
    """The rollout's decode engine against the static batch and transformers' generate (benchmarks/rollout.py)."""

    parts: str = "lengths,prefill,transformers"

    def command(self, settings: Settings) -> tuple[list[str], dict[str, str]]:
        return [sys.executable, "-m", "benchmarks.rollout", "--parts", self.parts], \
            {"OMP_NUM_THREADS": str(settings.threads)}

    def metrics(self, out: RunOutput) -> dict[str, float]:
        r = single_result(self.label, out)
        m = {"peak_rss_gib": r["peak_rss_bytes"] / 2**30}
        if "lengths" in r:
            x = r["lengths"]
            m |= {f"{k}_ms_per_token": 1e3 * x[f"{k}_s"] / x["tokens"] for k in ("static", "chunked", "engine")}
            m |= {"engine_working_pct": 100 * x["engine_working_share"],
                  "static_working_pct": 100 * x["static_working_share"]}
        if "prefill" in r:
            x = r["prefill"]
            m |= {k: x[k] for k in ("static_prefill_s", "unshared_prefill_s", "shared_prefill_s")}
        if "transformers" in r:
            x = r["transformers"]
            m |= {"transformers_tokens_per_s": x["hf_tokens"] / x["hf_s"],
                  "engine_tokens_per_s": x["tokens"] / min(v for k, v in x.items() if k.startswith("engine_"))}
        return m


@dataclass
class Qwen35Variant(Variant):
    """A Qwen3.5 step of titan_lite against transformers' and the chunked delta rule against its recurrent form at 2k
    tokens (benchmarks/qwen3_5.py), each pair alternating in one run."""

    def command(self, settings: Settings) -> tuple[list[str], dict[str, str]]:
        args = ["-m", "benchmarks.qwen3_5", "--steps", str(min(max(settings.steps, 1), 3)),
                "--warmup", str(min(settings.warmup, 1))]
        return [sys.executable, *args], {"OMP_NUM_THREADS": str(settings.threads)}

    def metrics(self, out: RunOutput) -> dict[str, float]:
        r = single_result(self.label, out)
        step, rule = r["step"], r["rule"]["times"]
        ours, theirs = statistics.median(step["step_s"]), statistics.median(step["transformers_step_s"])
        return {"step_s": ours, "transformers_step_s": theirs, "titan_lite_tokens_per_s": step["tokens"] / ours,
                "transformers_tokens_per_s": step["tokens"] / theirs, "logits_max_difference": step["logits_max_diff"],
                **{f"{form}_rule_s": statistics.median(rule[f"{form}_s"]) for form in ("chunked", "recurrent")},
                **{f"{form}_rule_train_s": statistics.median(rule[f"{form}_train_s"])
                   for form in ("chunked", "recurrent")},
                "peak_rss_gib": r["peak_rss_bytes"] / 2**30, "foreign_cores": foreign_cores(r)}
