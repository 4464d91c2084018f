"""Check, or rewrite, the figures README.md and its guides (docs/*.md) quote from commands: every entry of FIGURES
below is a figure the documentation shows, the command that prints it, and a pattern for each side; the command runs
as the documentation gives it, from the checkout, and its figures must be the quoted ones. Quick commands (plans,
estimates: seconds) run by default, and the test suite runs them (tests/test_readme_figures.py); --slow adds the
training examples (minutes). Developer tooling beside the benchmarks (it measures what the documentation quotes), run
from the checkout as a module:

    .venv/bin/python -m benchmarks.figures --check            # the quick figures: exit 1 on a difference
    .venv/bin/python -m benchmarks.figures --check --slow     # every figure (REAP: 32 min, 2 busy cores)
    .venv/bin/python -m benchmarks.figures --check --slow --only reap_example   # one command's figures
    .venv/bin/python -m benchmarks.figures --slow             # run them all, write what they print
    .venv/bin/python -m benchmarks.figures --slow --from_logs # again from their saved output, no runs

A new figure is an entry in FIGURES: its `readme` pattern must match exactly once across README.md and docs/*.md
(in whichever file quotes it), its `printed` pattern the command's output; each has the same number of groups,
compared in order. A new command goes into COMMANDS (slow=True for anything that trains). Without --check, the quoted
groups are replaced by the printed values and the file that holds them is written; nothing else in it changes. Each
command's output is kept in outputs/readme_figures/<command>.log (--from_logs compares or rewrites from those).
"""

import argparse
import contextlib
import io
import logging
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from titan_lite.job.cli import ScriptParser  # its command-line parser only: the commands run in their own processes

REPO = Path(__file__).resolve().parents[1]
LOGS = REPO / "outputs" / "readme_figures"
NUMBER = r"(-?[\d,]+\.?\d*)"


@dataclass(frozen=True)
class Command:
    """A documented command (bash, from the checkout), whether it is slow (trains), and the exit codes that mean it
    printed its figures (a DRY_RUN without the data files exits 5 after the plan)."""

    line: str
    slow: bool = False
    exit_codes: tuple[int, ...] = (0,)


@dataclass(frozen=True)
class Figure:
    """Figures the documentation quotes (`readme`'s groups) and where the command prints them (`printed`'s groups)."""

    name: str
    command: str  # a key of COMMANDS
    printed: str
    readme: str


DRY = (0, 5)  # a plan is printed whether or not the data files are there
# The REAP example's models (docs/pruning.md's table rows -> their folders under outputs/).
REAP_MODELS = {"unpruned (step 200)": "debug_moe/checkpoint/step-200-hf", "REAP, 4 of 8 experts": "debug_moe_reap50",
               "frequency, 4 of 8 experts": "debug_moe_freq50",
               "REAP, then 40 steps distilled from the unpruned model": "reap_recovery/checkpoint/step-40-hf",
               "REAP, then 40 steps of plain training (control)": "reap_recovery_plain/checkpoint/step-40-hf"}
GSM8K_RUN = "outputs/lora_gsm8k_100"
GSM8K_CONFIG = "train_configs/lora_synthetic_gsm8k_cpu.toml"
GRPO_EXAMPLE_STEPS = (20, 40, 60)  # its evaluations (validation.freq 20)
COMMANDS = {
    "float8_plan": Command("DRY_RUN=1 NGPU=8 CONFIG_FILE=train_configs/llama3_8b_float8.toml ./run_train.sh "
                          "--model.hf_assets_path ./assets/tokenizer", exit_codes=DRY),
    "8b_plan": Command("DRY_RUN=1 NGPU=8 CONFIG_FILE=train_configs/llama3_8b.toml ./run_train.sh "
                       "--model.hf_assets_path ./assets/tokenizer", exit_codes=DRY),
    "qlora_8b_plan": Command("DRY_RUN=1 NGPU=1 CONFIG_FILE=train_configs/llama3_8b_qlora.toml ./run_train.sh "
                             "--dry_run.device_memory_gib 24", exit_codes=DRY),
    "qlora_70b_plan": Command("DRY_RUN=1 NGPU=2 CONFIG_FILE=train_configs/llama3_70b_qlora.toml ./run_train.sh "
                              "--dry_run.device_memory_gib 24", exit_codes=DRY),
    "lora_8b_plan": Command("DRY_RUN=1 NGPU=8 CONFIG_FILE=train_configs/llama3_8b_lora_gsm8k.toml ./run_train.sh "
                            "--model.hf_assets_path ./assets/tokenizer --training.dataset_path "
                            "/data/gsm8k/main/train-00000-of-00001.parquet", exit_codes=DRY),
    "chat_8b_plan": Command("DRY_RUN=1 NGPU=1 CONFIG_FILE=train_configs/llama3_8b_chat_lora.toml ./run_train.sh "
                            "--dry_run.device_memory_gib 24 --model.hf_assets_path ./assets/tokenizer", exit_codes=DRY),
    "chat_8b_qlora_plan": Command("DRY_RUN=1 NGPU=1 CONFIG_FILE=train_configs/llama3_8b_chat_lora.toml ./run_train.sh "
                                  "--dry_run.device_memory_gib 24 --model.hf_assets_path ./assets/tokenizer "
                                  "--lora.base_dtype nf4", exit_codes=DRY),
    **{f"{name}_plan": Command(f"DRY_RUN=1 NGPU={ngpu} CONFIG_FILE=train_configs/{name}.toml ./run_train.sh "
                               f"--model.hf_assets_path ./assets/tokenizer{memory}", exit_codes=DRY)
       for name, ngpu, memory in [("qwen3_8b_lora", 1, " --dry_run.device_memory_gib 24"),
                                  ("qwen3_8b_qlora", 1, " --dry_run.device_memory_gib 24"),
                                  ("mistral_7b_lora", 1, " --dry_run.device_memory_gib 24"),
                                  ("qwen2.5_7b_wanda", 8, ""), ("llama3_8b_minitron", 8, ""),
                                  ("qwen3_8b_lora_128k", 8, "")]},
    "ep_30b_plan": Command("DRY_RUN=1 NGPU=8 CONFIG_FILE=train_configs/debug_model.toml ./run_train.sh --model.name "
                           "qwen3 --model.flavor qwen3_30B_A3B --parallelism.expert_parallel_degree 8 "
                           "--training.seq_len 4096 --training.local_batch_size 1 "
                           "--training.mixed_precision_param bfloat16 --activation_checkpoint.mode full",
                           exit_codes=DRY),
    **{f"lora_30b_ep{ep}_plan": Command(f"DRY_RUN=1 NGPU=8 CONFIG_FILE=train_configs/qwen3_30b_a3b_lora.toml "
                                        f"./run_train.sh --model.hf_assets_path ./assets/tokenizer "
                                        f"--parallelism.expert_parallel_degree {ep}", exit_codes=DRY) for ep in (1, 8)},
    "moe_memory_plan": Command(".venv/bin/python -m benchmarks.memory_plan --shapes debugmodel_moe --cases full,ep2",
                               slow=True),
    **{f"{name}_plan": Command(f"DRY_RUN=1 NGPU={ngpu} CONFIG_FILE=train_configs/{name}.toml ./run_train.sh "
                               f"--dry_run.device_memory_gib 24{extra}", exit_codes=DRY)
       for name, ngpu, extra in [("llama3_8b_dpo_lora", 1, ""), ("llama3_8b_dpo_qlora", 1, ""),
                                 ("llama3_70b_dpo_qlora", 2, "")]},
    "llama3_70b_dpo_qlora_on_gpu_plan": Command(
        "DRY_RUN=1 NGPU=2 CONFIG_FILE=train_configs/llama3_70b_dpo_qlora.toml ./run_train.sh "
        "--dry_run.device_memory_gib 24 --training.enable_cpu_offload false", exit_codes=(2,)),
    "sparsegpt_estimate": Command(".venv/bin/python scripts/prune.py --flavor 8B --hf_assets_path assets/tokenizer "
                                  "--estimate_only --method sparsegpt --nsamples 128 --seq_len 2048 "
                                  "--device_memory_gib 24"),
    "wanda_estimate": Command(".venv/bin/python scripts/prune.py --flavor 8B --hf_assets_path assets/tokenizer "
                              "--estimate_only --method wanda --nsamples 128 --seq_len 2048 --device_memory_gib 24"),
    "float8_30": Command("./run_train.sh --model.converters quantize.linear.float8 --training.steps 30 "
                         "--job.dump_folder outputs/float8_30", slow=True),
    "fp32_30": Command("./run_train.sh --training.steps 30 --job.dump_folder outputs/fp32_30", slow=True),
    # The GSM8K section's 100-step run and lm_eval on it (the Evaluation section quotes the same run).
    "gsm8k_100": Command(" && ".join([
        ".venv/bin/python scripts/make_synthetic_gsm8k.py --output data/synthetic_gsm8k/train.jsonl --num_problems "
        "2000 --seed 0",
        ".venv/bin/python scripts/make_synthetic_gsm8k.py --output data/synthetic_gsm8k/test.jsonl --num_problems 200 "
        "--seed 1",
        f"rm -rf {GSM8K_RUN}",  # a finished run in the folder would not train again
        "CONFIG_FILE=train_configs/lora_synthetic_gsm8k_cpu.toml ./run_train.sh --training.steps 100 "
        f"--checkpoint.interval 100 --job.dump_folder {GSM8K_RUN}",
        f".venv/bin/python scripts/lm_eval.py --model_args pretrained={GSM8K_RUN}/checkpoint/step-100-hf,max_length=96 "
        "--tasks gsm8k_synthetic --num_fewshot 0 --gen_kwargs max_gen_toks=24 --limit 100 --batch_size 50",
        f".venv/bin/python scripts/lm_eval.py --model_args pretrained={GSM8K_RUN}/checkpoint/step-100-hf "
        "--tasks shakespeare_choice,shakespeare_rolling,shakespeare_continue --batch_size 16 --output_path "
        "outputs/lm_eval",
        "echo CHECKPOINT",
        f".venv/bin/python scripts/lm_eval.py --model_args checkpoint={GSM8K_RUN}/checkpoint/step-100,"
        f"config={GSM8K_CONFIG} --tasks shakespeare_choice,shakespeare_rolling,shakespeare_continue --batch_size 16",
        "echo TWO",
        ".venv/bin/torchrun --standalone --nproc_per_node 2 scripts/lm_eval.py --model_args "
        f"checkpoint={GSM8K_RUN}/checkpoint/step-100,config={GSM8K_CONFIG} --tasks "
        "shakespeare_choice,shakespeare_rolling --batch_size 16"]), slow=True),
    # Distillation and recovery: the 600-step debug_tied model of the Pruning section, then the benchmark script.
    "distill_recovery": Command(" && ".join([
        "rm -rf outputs/debug_tied outputs/distill_bench",
        "./run_train.sh --model.flavor debugmodel_tied --training.steps 600 --metrics.log_freq 100 --validation.freq "
        "200 --job.dump_folder outputs/debug_tied --checkpoint.enable --checkpoint.interval 600 "
        "--checkpoint.last_save_in_hf",
        ".venv/bin/python benchmarks/distill_recovery.py --hf_assets_path outputs/debug_tied/checkpoint/step-600-hf "
        "--eval_data titan_lite/data/corpus/shakespeare/validation/midsummer_nights_dream.txt --out "
        "outputs/distill_bench"]), slow=True),
    # The chat section's CPU example: 400 steps with validation, then eval_answers on the held-out conversations.
    "chat_example": Command(" && ".join([
        ".venv/bin/python scripts/make_synthetic_chat.py --output data/synthetic_chat/train.jsonl --num_conversations "
        "3000 --seed 0 --tokenizer_output data/synthetic_chat/tokenizer",
        "rm -rf outputs/chat_lora_cpu",  # a finished run in the folder would not train again
        "CONFIG_FILE=train_configs/chat_lora_cpu.toml ./run_train.sh",
        ".venv/bin/python scripts/eval_answers.py --checkpoint outputs/chat_lora_cpu/checkpoint/step-400 --config "
        "train_configs/chat_lora_cpu.toml --max_new_tokens 24"]), slow=True),
    # The chat section's show_data listing (reads the whole packed stream for its efficiency line: about 40 s).
    "chat_show_data": Command(" && ".join([
        ".venv/bin/python scripts/make_synthetic_chat.py --output data/synthetic_chat/train.jsonl --num_conversations "
        "3000 --seed 0 --tokenizer_output data/synthetic_chat/tokenizer",
        ".venv/bin/python scripts/show_data.py --config train_configs/chat_lora_cpu.toml --count 1 --jsonl "
        "outputs/chat_samples.jsonl"]), slow=True),
    # The pruning guide's REAP example, at the thread count it documents (its figures depend on it).
    "reap_example": Command(" && ".join([
        "export OMP_NUM_THREADS=1",
        # finished runs do not train again; folders an older titan_lite wrote are not replaced
        "rm -rf outputs/debug_moe outputs/reap_recovery outputs/reap_recovery_plain outputs/debug_moe_reap50 "
        "outputs/debug_moe_freq50",
        "CONFIG_FILE=train_configs/debug_moe_cpu.toml ./run_train.sh",
        *(".venv/bin/python scripts/prune.py --hf_assets_path outputs/debug_moe/checkpoint/step-200-hf --output_dir "
          f"outputs/debug_moe_{name}50 --method reap --expert_ratio 0.5{score} --nsamples 32 --seq_len 128 "
          "--batch_size 4" for name, score in (("reap", ""), ("freq", " --expert_score frequency"))),
        "CONFIG_FILE=train_configs/reap_recovery_cpu.toml ./run_train.sh",
        "CONFIG_FILE=train_configs/reap_recovery_cpu.toml ./run_train.sh --distill.enable=false --job.dump_folder "
        "outputs/reap_recovery_plain",
        "for model in " + " ".join(REAP_MODELS.values()) + "; do .venv/bin/python scripts/eval_ppl.py "
        "--hf_assets_path outputs/$model --seq_len 128 --data "
        "titan_lite/data/corpus/shakespeare/validation/midsummer_nights_dream.txt || exit 1; done"]), slow=True),
    # The preference section's CPU example: the pairs, then 100 steps of LoRA DPO with validation every 20.
    "dpo_example": Command(" && ".join([
        ".venv/bin/python scripts/make_synthetic_chat.py --output data/synthetic_chat/train.jsonl --num_conversations "
        "3000 --seed 0 --tokenizer_output data/synthetic_chat/tokenizer",
        ".venv/bin/python scripts/make_synthetic_preferences.py --chat data/synthetic_chat/train.jsonl --output "
        "data/synthetic_prefs/train.jsonl --seed 0",
        "rm -rf outputs/dpo_lora_cpu",  # a finished run in the folder would not train again
        "CONFIG_FILE=train_configs/dpo_lora_cpu.toml ./run_train.sh"]), slow=True),
    # RL with verifiable rewards: the 24 GB GPU plan, and the CPU example (300 SFT steps, GRPO's evaluation of
    # that start, then 60 GRPO steps).
    "grpo_1.7b_plan": Command("DRY_RUN=1 NGPU=1 CONFIG_FILE=train_configs/qwen3_1.7b_grpo_gsm8k.toml ./run_train.sh "
                              "--dry_run.device_memory_gib 24", exit_codes=DRY),
    "grpo_example": Command(" && ".join([
        ".venv/bin/python scripts/make_synthetic_gsm8k.py --output data/synthetic_gsm8k/train.jsonl --num_problems "
        "2000 --seed 0",
        # finished runs would not train again
        "rm -rf outputs/gsm8k_sft_300 outputs/grpo_synthetic_gsm8k_cpu_start outputs/grpo_synthetic_gsm8k_cpu",
        "OMP_NUM_THREADS=1 CONFIG_FILE=train_configs/lora_synthetic_gsm8k_cpu.toml ./run_train.sh --training.steps "
        "300 --validation.max_new_tokens 20 --job.dump_folder outputs/gsm8k_sft_300",
        "OMP_NUM_THREADS=1 CONFIG_FILE=train_configs/grpo_synthetic_gsm8k_cpu.toml ./run_train.sh --training.steps 1 "
        "--validation.freq 1 --optimizer.lr 1e-12 --job.dump_folder outputs/grpo_synthetic_gsm8k_cpu_start",
        "OMP_NUM_THREADS=1 CONFIG_FILE=train_configs/grpo_synthetic_gsm8k_cpu.toml ./run_train.sh"]), slow=True),
}


def table_row(task: str, filter_: str, metric: str) -> str:
    """An lm_eval results-table row's value and stderr (`task` blank on a task's later rows)."""
    return (rf"^\|{task}\s*\|[^|\n]*\|{filter_}\s*\|[^|\n]*\|{metric}\s*\|[^|\n]*\|\s*{NUMBER}\|±\s*\|\s*"
            rf"({NUMBER[1:-1]}|N/A)\|$")


TABLE_ROWS = [("gsm8k_synthetic", "flexible-extract", "exact_match"), ("", "strict-match", "exact_match"),
              ("shakespeare_choice", "none", "acc"), ("", "none", "acc_norm"),
              ("shakespeare_continue", "none", "exact_match"), ("shakespeare_rolling", "none", "bits_per_byte"),
              ("", "none", "byte_perplexity")]


FIGURES = [
    # float8 training: DRY_RUN of the float8 config, and llama3_8b.toml's buffers beside it
    Figure("float8 plan: buffers, overlap, peak", "float8_plan",
           rf"^  buffers +{NUMBER} GiB.*\n  overlap +{NUMBER} GiB.*\n  peak +{NUMBER} GiB$",
           rf"^  buffers +{NUMBER} GiB  FSDP: 525,340,672.*\n  overlap +{NUMBER} GiB.*\n  peak +{NUMBER} GiB\n```"),
    Figure("float8 plan: activations", "float8_plan", rf"^  activations +{NUMBER} GiB  AC selective op",
           rf"^  activations +{NUMBER} GiB  AC selective op; \.\.\. float8 casts"),
    Figure("float8 plan: buffers, the prose", "float8_plan", rf"^  buffers +{NUMBER} GiB",
           rf"^\({NUMBER} GiB of buffers against"),
    Figure("float8 plan against llama3_8b.toml: buffers", "8b_plan", rf"^  buffers +{NUMBER} GiB",
           rf"GiB of buffers against {NUMBER} GiB for `llama3_8b.toml`"),
    # expert parallelism: the 30B-A3B plan with EP 8, and the MoE plans against their CPU twins
    Figure("EP plan: the experts line", "ep_30b_plan",
           rf"^experts: 48 MoE layers, 16 of 128 on each rank \(ep 8\), sharded over efsdp 1; each rank sends {NUMBER} "
           rf"routed rows per layer and microbatch; its experts compute {NUMBER} when balanced and are planned at the "
           rf"worst case, {NUMBER} ",
           rf"^experts: 48 MoE layers, 16 of 128 on each rank \(ep 8\), sharded over efsdp 1; each rank sends {NUMBER} "
           rf"routed rows per layer and microbatch; its experts compute {NUMBER} when balanced and are planned at the "
           rf"worst case, {NUMBER} "),
    Figure("EP plan: local parameters, activations, peak", "ep_30b_plan",
           rf"^  local parameters: {NUMBER}\n(?:.*\n)*?  activations +{NUMBER} GiB .*MoE: {NUMBER} routed rows .*EP "
           rf"all-to-all {NUMBER} rows out and up to {NUMBER} in, {NUMBER} GiB .*\n(?:.*\n)*?  peak +{NUMBER} GiB",
           rf"^  local parameters: {NUMBER}\n  activations +{NUMBER} GiB .*MoE: {NUMBER} routed rows .*EP all-to-all "
           rf"{NUMBER} rows out and up to {NUMBER} in, {NUMBER} GiB .*\n  peak +{NUMBER} GiB"),
    *(Figure(f"30B-A3B LoRA plan {name}", command, rf"^  {row} +{NUMBER} GiB", readme)
      for name, command, row, readme in [
        ("without EP: peak", "lora_30b_ep1_plan", "peak", rf"plans {NUMBER} GiB per GPU without\s+EP"),
        ("without EP: buffers", "lora_30b_ep1_plan", "buffers", rf"\(buffers [\d.]+ GiB instead of {NUMBER}\)"),
        ("without EP: activations", "lora_30b_ep1_plan", "activations",
         rf"raise the activations \([\d.]+ GiB instead of {NUMBER}\)"),
        ("with EP 8: buffers", "lora_30b_ep8_plan", "buffers", rf"\(buffers {NUMBER} GiB instead of"),
        ("with EP 8: activations", "lora_30b_ep8_plan", "activations",
         rf"raise the activations \({NUMBER} GiB instead of"),
        ("with EP 8: peak", "lora_30b_ep8_plan", "peak", rf"for a peak of {NUMBER} GiB:")]),
    Figure("MoE memory plan on the CPU twin: EP 2", "moe_memory_plan",
           rf"^debugmodel_moe ep2 +estimate +{NUMBER} MiB  measured +{NUMBER} MiB  estimate / measured {NUMBER}",
           rf"EP 2\s+estimate {NUMBER} MiB, measured {NUMBER} MiB on the busier rank \(estimate / measured {NUMBER}\)"),
    Figure("MoE memory plan on the CPU twin: one process", "moe_memory_plan",
           rf"^debugmodel_moe full +estimate +{NUMBER} MiB  measured +{NUMBER} MiB  estimate / measured {NUMBER}",
           rf"one process\s+estimate {NUMBER} MiB, measured {NUMBER} MiB \({NUMBER}\)"),
    # QLoRA plans
    Figure("QLoRA 8B plan: NF4 storage", "qlora_8b_plan",
           rf"^lora: NF4 base \(QLoRA\): 224 frozen block linears, [\d,]+ parameters in {NUMBER} GiB .* instead of "
           rf"{NUMBER} GiB in bfloat16",
           rf"^lora: NF4 base \(QLoRA\): 224 frozen block linears, [\d,]+ parameters in {NUMBER} GiB .* instead of "
           rf"{NUMBER} GiB in bfloat16"),
    Figure("QLoRA 8B plan: parameters, activations, peak", "qlora_8b_plan",
           rf"^  parameters +{NUMBER} GiB +{NUMBER} local x {NUMBER} bytes each\n(?:.*\n)*?  activations +{NUMBER} "
           rf"GiB .*\n(?:.*\n)*?  peak +{NUMBER} GiB",
           rf"^  parameters +{NUMBER} GiB +{NUMBER} local x {NUMBER} bytes each\n  activations +{NUMBER} GiB .*\n"
           rf"  peak +{NUMBER} GiB"),
    Figure("QLoRA 8B plan: the last line", "qlora_8b_plan",
           rf"^dry run OK: 1 rank; largest peak {NUMBER} GiB on rank 0, head-room {NUMBER} GiB",
           rf"^  peak +[\d.]+ GiB\ndry run OK: 1 rank; largest peak {NUMBER} GiB on rank 0, head-room {NUMBER} GiB"),
    Figure("QLoRA 8B plan: the prose", "qlora_8b_plan", rf"^  peak +{NUMBER} GiB",
           rf"fits\n24 GiB at {NUMBER} GiB"),
    Figure("QLoRA 70B plan: parameters, buffers", "qlora_70b_plan",
           rf"^  parameters +{NUMBER} GiB +{NUMBER} local x {NUMBER} bytes each \(offloaded to CPU\)\n(?:.*\n)*?  "
           rf"buffers +{NUMBER} GiB .*dequantization of one weight \({NUMBER} elements\)",
           rf"^  parameters +{NUMBER} GiB +{NUMBER} local x {NUMBER} bytes each \(offloaded to CPU\)\n  buffers +"
           rf"{NUMBER} GiB  FSDP: \.\.\. NF4 dequantization of one weight \({NUMBER} elements\)"),
    Figure("QLoRA 70B plan: the last line", "qlora_70b_plan",
           rf"^dry run OK: 2 ranks; largest peak {NUMBER} GiB on rank 0, head-room {NUMBER} GiB",
           rf"NF4 dequantization of one weight .*\ndry run OK: 2 ranks; largest peak {NUMBER} GiB on rank 0, head-room "
           rf"{NUMBER} GiB"),  # the DPO 70B plan's line, in docs/preference.md, is its own figure
    Figure("QLoRA 70B plan: the prose", "qlora_70b_plan", rf"^  peak +{NUMBER} GiB", rf"offload of the sharded "
           rf"parameters and optimizer state\) peaks at {NUMBER} GiB"),
    # LoRA 8B plan
    Figure("LoRA 8B plan: peak", "lora_8b_plan", rf"^  peak +{NUMBER} GiB",
           rf"adapter state: {NUMBER} GiB estimated peak per GPU for either 8B config"),
    # chat fine-tuning: the 8B chat config with LoRA and with QLoRA
    Figure("chat 8B LoRA plan", "chat_8b_plan",
           rf"^  parameters +{NUMBER} GiB +{NUMBER} local x bfloat16/float32\n(?:.*\n)*?  activations +{NUMBER} GiB .*"
           rf"block-causal \(sdpa\) {NUMBER} GiB of mask and RoPE rows per microbatch\n(?:.*\n)*?dry run OK: 1 rank; "
           rf"largest peak {NUMBER} GiB on rank 0, head-room {NUMBER} GiB",
           rf"^```\n  parameters +{NUMBER} GiB +{NUMBER} local x bfloat16/float32\n  activations +{NUMBER} GiB .*"
           rf"block-causal \(sdpa\) {NUMBER} GiB of mask and RoPE rows per microbatch\ndry run OK: 1 rank; "
           rf"largest peak {NUMBER} GiB on rank 0, head-room {NUMBER} GiB"),  # the DPO 8B plan's lines follow a name
    Figure("chat 8B QLoRA plan", "chat_8b_qlora_plan",
           rf"^  parameters +{NUMBER} GiB +{NUMBER} local x {NUMBER} bytes each\n(?:.*\n)*?dry run OK: 1 rank; "
           rf"largest peak {NUMBER} GiB on rank 0, head-room {NUMBER} GiB",
           rf"^\.\.\.\n  parameters +{NUMBER} GiB +{NUMBER} local x {NUMBER} bytes each\ndry run OK: 1 rank; "
           rf"largest peak {NUMBER} GiB on rank 0, head-room {NUMBER} GiB"),
    # model families: the shipped configs' peaks
    *(Figure(f"{name} plan: peak", f"{name}_plan", rf"^dry run OK: \d+ ranks?; largest peak {NUMBER} GiB",
             rf"`{re.escape(name)}\.toml`(?: on `NGPU=8`)? {NUMBER} GiB of")
      for name in ("qwen3_8b_lora", "qwen3_8b_qlora", "mistral_7b_lora", "qwen2.5_7b_wanda")),
    Figure("qwen3_8b_lora_128k plan: YaRN, activations, peak", "qwen3_8b_lora_128k_plan",
           rf"^rope: yarn x{NUMBER} over the original {NUMBER} positions, attention factor {NUMBER};(?:.*\n)*?"
           rf"  activations +{NUMBER} GiB  AC full; microbatch 1 x seq 131072 / cp 8(?:.*\n)*?dry run OK: 8 ranks; "
           rf"largest peak {NUMBER} GiB on rank 0, head-room {NUMBER} GiB",
           rf"^rope: yarn x{NUMBER} over the original {NUMBER} positions, attention factor {NUMBER};(?:.*\n)*?"
           rf"  activations +{NUMBER} GiB  AC full; microbatch 1 x seq 131072 / cp 8(?:.*\n)*?dry run OK: 8 ranks; "
           rf"largest peak {NUMBER} GiB on rank 0, head-room {NUMBER} GiB"),
    Figure("qwen2.5_7b_wanda plan: the pruning pass", "qwen2.5_7b_wanda_plan",
           rf"^  peak +[\d.]+ GiB\n(?:.*\n)*?  peak +{NUMBER} GiB\n  verdict", rf"the pruning pass {NUMBER} GiB\)"),
    # distillation: the Minitron config with its teacher
    Figure("Minitron plan", "llama3_8b_minitron_plan",
           rf"^  parameters +{NUMBER} GiB +{NUMBER} local x float32; teacher {NUMBER} local x bfloat16 \(frozen\)\n"
           rf"(?:.*\n)*?  activations +{NUMBER} GiB .*\n(?:.*\n)*?  peak +{NUMBER} GiB",
           rf"^  parameters +{NUMBER} GiB +{NUMBER} local x float32; teacher {NUMBER} local x bfloat16 \(frozen\)\n"
           rf"  activations +{NUMBER} GiB .*\n  peak +{NUMBER} GiB"),
    # pruning estimates
    # RL with verifiable rewards: the 24 GB GPU plan
    Figure("GRPO 1.7B plan", "grpo_1.7b_plan",
           rf"^(grpo rollouts: .*)\n(?:.*\n)*?  peak +{NUMBER} GiB\n  verdict: fits: peak {NUMBER} GiB of 24.00 GiB, "
           rf"head-room {NUMBER} GiB\n(?:.*\n)*?  kv cache +{NUMBER} GiB  (.*)\n(?:.*\n)*?  peak +{NUMBER} GiB",
           rf"^(grpo rollouts: .*)\n  peak +{NUMBER} GiB\n  verdict: fits: peak {NUMBER} GiB of 24.00 GiB, head-room "
           rf"{NUMBER} GiB\neach step's rollout \(generation with the KV cache\), per device:\n  kv cache +{NUMBER} "
           rf"GiB  (.*)\n(?:  staging .*\n)?  peak +{NUMBER} GiB"),
    Figure("GRPO 1.7B plan: the prose", "grpo_1.7b_plan",
           rf"^  peak +{NUMBER} GiB\n  verdict: fits(?:.*\n)*?each step's rollout(?:.*\n)*?  peak +{NUMBER} GiB",
           rf"The training step peaks at {NUMBER} GiB and the rollout at {NUMBER} GiB of 24"),
    # preference tuning's plans
    Figure("DPO 8B LoRA plan", "llama3_8b_dpo_lora_plan",
           rf"^  parameters +{NUMBER} GiB  ([\d,]+) local x bfloat16/float32(?:.*\n)*?  activations +{NUMBER} GiB  AC "
           rf"full(?:.*\n)*?^dry run OK: 1 rank; largest peak {NUMBER} GiB on rank 0, head-room {NUMBER} GiB",
           rf"^llama3_8b_dpo_lora.toml:\n  parameters +{NUMBER} GiB  ([\d,]+) local x bfloat16/float32\n  "
           rf"activations +{NUMBER} GiB  AC full.*\ndry run OK: 1 rank; largest peak {NUMBER} GiB on rank 0, "
           rf"head-room {NUMBER} GiB"),
    Figure("DPO 8B QLoRA plan", "llama3_8b_dpo_qlora_plan",
           rf"^  parameters +{NUMBER} GiB  ([\d,]+) local x {NUMBER} bytes each(?:.*\n)*?^dry run OK: 1 rank; "
           rf"largest peak {NUMBER} GiB on rank 0, head-room {NUMBER} GiB",
           rf"^llama3_8b_dpo_qlora.toml:\n  parameters +{NUMBER} GiB  ([\d,]+) local x {NUMBER} bytes each\ndry run "
           rf"OK: 1 rank; largest peak {NUMBER} GiB on rank 0, head-room {NUMBER} GiB"),
    Figure("DPO 70B QLoRA plan", "llama3_70b_dpo_qlora_plan",
           rf"^  parameters +{NUMBER} GiB  ([\d,]+) local x {NUMBER} bytes each \(offloaded to CPU\)(?:.*\n)*?^dry "
           rf"run OK: 2 ranks; largest peak {NUMBER} GiB on rank 0, head-room {NUMBER} GiB",
           rf"^llama3_70b_dpo_qlora.toml:\n  parameters +{NUMBER} GiB  ([\d,]+) local x {NUMBER} bytes each "
           rf"\(offloaded to CPU\)\ndry run OK: 2 ranks; largest peak {NUMBER} GiB on rank 0, head-room {NUMBER} GiB"),
    Figure("DPO 70B QLoRA plan without the offload", "llama3_70b_dpo_qlora_on_gpu_plan",
           rf"^  parameters +{NUMBER} GiB(?:.*\n)*?^  peak +{NUMBER} GiB",
           rf"holds an NF4 shard of {NUMBER} GiB per GPU and peaks\nat {NUMBER} GiB"),
    Figure("SparseGPT 8B estimate", "sparsegpt_estimate",
           rf"^  weights +{NUMBER} GiB.*\n(?:.*\n)  calibration cache +{NUMBER} GiB.*\n  statistics +{NUMBER} GiB.*\n"
           rf"  working +{NUMBER} GiB.*\n  peak +{NUMBER} GiB\n  verdict: fits: peak {NUMBER} GiB of 24.00 GiB, "
           rf"head-room {NUMBER} GiB\nestimate: peak {NUMBER} GiB",
           rf"^  weights +{NUMBER} GiB.*\n(?:.*\n)  calibration cache +{NUMBER} GiB.*\n  statistics +{NUMBER} GiB.*\n"
           rf"  working +{NUMBER} GiB.*\n  peak +{NUMBER} GiB\n  verdict: fits: peak {NUMBER} GiB of 24.00 GiB, "
           rf"head-room {NUMBER} GiB\nestimate: peak {NUMBER} GiB"),
    Figure("Wanda 8B estimate", "wanda_estimate", rf"^estimate: peak {NUMBER} GiB",
           rf"^Wanda at 50% \(or 2:4\) plans {NUMBER} GiB"),
    # distillation against plain recovery (slow; the throughputs move with the machine's load and are not checked)
    *(Figure(f"distill recovery: {row}", "distill_recovery", rf"^\| {re.escape(row)} \| {NUMBER} \|",
             rf"^\| {re.escape(row)} \| {NUMBER} \|")
      for row in ("dense (the teacher)", "width-pruned, 50% of heads and channels", "plain training, 100 steps",
                  "distillation, 100 steps")),
    Figure("distill recovery: the result line", "distill_recovery",
           rf"^result: after 100 steps each, distillation {NUMBER} < plain {NUMBER} \(pruned {NUMBER}, dense "
           rf"{NUMBER}\)",
           rf"^`result: after 100 steps each, distillation {NUMBER} < plain {NUMBER} \(pruned {NUMBER}, dense "
           rf"{NUMBER}\)"),
    # the chat example (slow)
    *(Figure(f"chat example: validation at step {step}", "chat_example",
             rf"validate step: {step} +loss: +{NUMBER} +token_accuracy: {NUMBER} +answer_accuracy: {NUMBER}",
             rf"^validate step: {step} +loss: +{NUMBER} +token_accuracy: {NUMBER} +answer_accuracy: {NUMBER}")
      for step in (100, 200, 300, 400)),
    Figure("chat example: eval_answers", "chat_example", r"answer accuracy: (\d+)/(\d+) = ([\d.]+)",
           r"measured the same held-out problems again: `answer accuracy: (\d+)/(\d+) = ([\d.]+)`"),
    # the REAP example (slow): the pruned model's line, and each model's perplexity
    Figure("REAP example: the pruned model", "reap_example",
           rf"^pruned model written to outputs/debug_moe_reap50: 8 -> 4 experts in each of 6 MoE layers \(reap\); "
           rf"{NUMBER} -> {NUMBER} parameters \({NUMBER}%\), {NUMBER} active",
           rf"^pruned model written to outputs/debug_moe_reap50: 8 -> 4 experts in each of 6 MoE layers \(reap\); "
           rf"{NUMBER} -> {NUMBER} parameters \({NUMBER}%\), {NUMBER} active"),
    *(Figure(f"REAP example: {row}", "reap_example",
             rf"^evaluating outputs/{re.escape(folder)} on (?:.*\n)*?perplexity: {NUMBER}$",
             rf"^\| {re.escape(row)} \| {NUMBER} \|$") for row, folder in REAP_MODELS.items()),
    # the preference example (slow)
    Figure("DPO example: the first step", "dpo_example", rf"step: +1/100 +loss: +{NUMBER} ",
           rf"^step: +1/100 +loss: +{NUMBER} "),
    *(Figure(f"DPO example: validation at step {step}", "dpo_example",
             rf"validate step: {step} +loss: +{NUMBER} +rewards/chosen: {NUMBER} +rewards/rejected: {NUMBER} +"
             rf"rewards/margins: {NUMBER} +rewards/accuracies: {NUMBER}",
             rf"^validate step: {step} +loss: +{NUMBER} +rewards/chosen: {NUMBER} +rewards/rejected: {NUMBER} +"
             rf"rewards/margins: {NUMBER} +rewards/accuracies: {NUMBER}")
      for step in (20, 40, 60, 100)),
    Figure("DPO example: the prose's accuracies", "dpo_example",
           rf"validate step: 20 .*rewards/accuracies: {NUMBER} .*\n(?:.*\n)*?.*validate step: 40 .*rewards/accuracies: "
           rf"{NUMBER}", rf"accuracy rises from {NUMBER} at step 20 \(chance\) to {NUMBER} at step 40"),
    Figure("DPO example: the prose's margins", "dpo_example",
           rf"validate step: 20 .*rewards/margins: {NUMBER} (?:.*\n)*?.*validate step: 100 .*rewards/margins: "
           rf"{NUMBER} ",
           rf"and the margins from {NUMBER} to {NUMBER} at step\s+100"),
    # the GRPO example (slow): the SFT run's last evaluation (the start), then GRPO's every 20 steps
    Figure("GRPO example: the SFT model's answer accuracy", "grpo_example",
           r"answer accuracy at step 300 \(last evaluation\): (\d+)/100",
           r"^answer accuracy at step 300 \(last evaluation\): (\d+)/100$"),
    Figure("GRPO example: GRPO's own evaluation of the start", "grpo_example",
           rf"validate step: +1 +reward: {NUMBER} +rewards/answer_match/mean: {NUMBER} +answer_accuracy: {NUMBER}",
           rf"^validate step: +1 +reward: {NUMBER} +rewards/answer_match/mean: {NUMBER} +answer_accuracy: {NUMBER}"),
    *(Figure(f"GRPO example: validation at step {step}", "grpo_example",
             rf"validate step: {step} +reward: {NUMBER} +rewards/answer_match/mean: {NUMBER} +answer_accuracy: "
             rf"{NUMBER} +completions/mean_length: {NUMBER}",
             rf"^validate step: {step} +reward: {NUMBER} +rewards/answer_match/mean: {NUMBER} +answer_accuracy: "
             rf"{NUMBER} +completions/mean_length: {NUMBER}")
      for step in GRPO_EXAMPLE_STEPS),
    Figure("GRPO example: the rise, in README", "grpo_example",
           rf"validate step: 300 .*answer_accuracy: {NUMBER}(?:.*\n)*?.*validate step: 60 +reward: .*answer_accuracy: "
           rf"{NUMBER}", rf"held-out greedy answer accuracy from {NUMBER} to {NUMBER} in 60 steps"),
    Figure("show_data: the first sample", "chat_show_data",
           r"^--- sample 1: (\d+) tokens, (\d+) documents, (\d+) trained",
           r"^--- sample 1: (\d+) tokens, (\d+) documents, (\d+) trained"),
    Figure("show_data: packing efficiency", "chat_show_data",
           rf"^packing efficiency over {NUMBER} samples \({NUMBER} tokens\): {NUMBER} trained \({NUMBER}%\), "
           rf"{NUMBER} not padding \({NUMBER}%\)",
           rf"^packing efficiency over {NUMBER} samples \({NUMBER} tokens\): {NUMBER} trained \({NUMBER}%\), "
           rf"{NUMBER} not padding \({NUMBER}%\)"),
    # float8 against fp32, 30 steps (slow)
    Figure("float8 30 steps: losses", "float8_30", rf"step: +5/30 +loss: +{NUMBER}(?:.*\n)*?.*step: +30/30 +loss: "
           rf"+{NUMBER}", rf"--training.steps 30 --job.dump_folder outputs/float8_30 +# step 5 loss {NUMBER}, step 30 "
           rf"{NUMBER}"),
    Figure("fp32 30 steps: losses", "fp32_30", rf"step: +5/30 +loss: +{NUMBER}(?:.*\n)*?.*step: +30/30 +loss: "
           rf"+{NUMBER}", rf"--training.steps 30 --job.dump_folder outputs/fp32_30 +# step 5 {NUMBER}, step 30 "
           rf"{NUMBER}"),
    # the GSM8K run and lm_eval (slow)
    Figure("GSM8K run: answer accuracy at step 100", "gsm8k_100",
           r"answer accuracy at step 100 \(first evaluation\): (\d+)/100",
           r"^The run's own evaluation at step 100: `answer accuracy at step 100 \(first evaluation\): (\d+)/100`"),
    Figure("GSM8K run: token accuracy", "gsm8k_100", rf"validate step: 100 .*token_accuracy: {NUMBER}",
           rf"\(token accuracy\s+{NUMBER}, eval loss"),
    Figure("GSM8K run: eval loss", "gsm8k_100", rf"validate step: 100 +loss: +{NUMBER}",
           rf"\(token accuracy\s+[\d.]+, eval loss {NUMBER}\)"),
    *(Figure(f"lm_eval table: {task or 'its'} {filter_} {metric}", "gsm8k_100", table_row(task, filter_, metric),
             table_row(task, filter_, metric)) for task, filter_, metric in TABLE_ROWS),
    Figure("shakespeare tasks: word perplexity, one process and the checkpoint", "gsm8k_100",
           rf"word_perplexity\|↓  \|\s*{NUMBER}\|(?:.*\n)*?CHECKPOINT\n(?:.*\n)*?.*word_perplexity\|↓  \|\s*{NUMBER}\|",
           rf"^\| *\| *\|none  \| *0\|word_perplexity\|↓  \|{NUMBER}\|(?:.*\n)*?table \(word_perplexity {NUMBER}, "
           rf"the rest identical to four decimals\)"),
    Figure("shakespeare tasks: two processes", "gsm8k_100",
           rf"TWO\n(?:.*\n)*?.*\|acc +\|↑  \|\s*{NUMBER}\|(?:.*\n)*?.*acc_norm +\|↑  \|\s*{NUMBER}\|(?:.*\n)*?.*"
           rf"bits_per_byte +\|↓  \|\s*{NUMBER}\|(?:.*\n)*?.*byte_perplexity\|↓  \|\s*{NUMBER}\|(?:.*\n)*?.*"
           rf"word_perplexity\|↓  \|\s*{NUMBER}\|",
           rf"printed the same figures for its two tasks \(acc {NUMBER}, acc_norm {NUMBER},\nbits_per_byte {NUMBER}, "
           rf"byte_perplexity {NUMBER}, word_perplexity {NUMBER}\)"),
]


# ------------------------------------------------------------------------------------------ checking


def documents() -> dict[str, str]:
    """The text of README.md and of every guide in docs/, by path from the checkout: where figures are quoted."""
    paths = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return {str(path.relative_to(REPO)): path.read_text() for path in paths}


@dataclass
class Found:
    figure: Figure
    readme: list[str] | None  # None: the quoted pattern does not match exactly once across the documents
    printed: list[str] | None  # None: the command's output does not hold it
    spans: list[tuple[int, int]]
    document: str | None = None  # the file that quotes it

    @property
    def same(self) -> bool:
        return self.readme is not None and self.readme == self.printed


def readme_values(figure: Figure, texts: dict[str, str]) -> tuple[list[str] | None, list[tuple[int, int]], str | None]:
    """The quoted values, their spans and the document that holds them, where the pattern matches exactly once in
    all the documents together."""
    matches = [(name, match) for name, text in texts.items() for match in re.finditer(figure.readme, text, flags=re.M)]
    if len(matches) != 1:
        return None, [], None
    name, match = matches[0]
    return list(match.groups()), [match.span(i) for i in range(1, len(match.groups()) + 1)], name


def printed_values(figure: Figure, output: str) -> list[str] | None:
    match = re.search(figure.printed, output, flags=re.M)
    return list(match.groups()) if match else None


def compare(figures: list[Figure], outputs: dict[str, str], texts: dict[str, str]) -> list[Found]:
    found = []
    for figure in figures:
        readme, spans, document = readme_values(figure, texts)
        found.append(Found(figure, readme, printed_values(figure, outputs[figure.command]), spans, document))
    return found


def rewrite(texts: dict[str, str], found: list[Found]) -> dict[str, str]:
    """The documents that change, each with every figure its command printed put in place of the quoted one."""
    changed = {}
    for name, text in texts.items():
        edits = sorted(((span, value) for f in found if f.document == name and f.printed is not None
                        for span, value in zip(f.spans, f.printed, strict=True)), reverse=True)
        for (start, end), value in edits:
            text = text[:start] + value + text[end:]
        if text != texts[name]:
            changed[name] = text
    return changed


# A plan as the documents give it: run_train.sh execs `python -m titan_lite.train` for it with these variables set.
DRY_RUN_LINE = re.compile(r"DRY_RUN=1 NGPU=(\d+) CONFIG_FILE=(\S+) \./run_train\.sh(.*)")


def run_command(name: str, command: Command) -> str:
    """The command's output (stdout and stderr), run with bash from the checkout as a user runs it; a DRY_RUN plan
    in this process (see run_plan)."""
    start = time.monotonic()
    plan = DRY_RUN_LINE.fullmatch(command.line)
    if plan is not None:
        code, out, err = run_plan(int(plan.group(1)), plan.group(2), shlex.split(plan.group(3)))
        output = out + err  # as a subprocess's output is kept: stdout, then stderr
    else:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")}
        result = subprocess.run(["bash", "-c", command.line], cwd=REPO, env=env, capture_output=True, text=True)
        code, output = result.returncode, result.stdout + result.stderr
    if code not in command.exit_codes:
        tail = " | ".join(output.strip().splitlines()[-3:])
        raise RuntimeError(f"command {name} exited {code}: {command.line}\n  ... {tail}")
    print(f"ran {name} in {time.monotonic() - start:.1f}s", flush=True)
    LOGS.mkdir(parents=True, exist_ok=True)
    (LOGS / f"{name}.log").write_text(output)
    return output


def run_plan(ngpu: int, config: str, args: list[str], nnodes: int = 1) -> tuple[int, str, str]:
    """What `DRY_RUN=1 NGPU=ngpu NNODES=nnodes CONFIG_FILE=config ./run_train.sh args` exits with and prints on
    stdout and stderr, from titan_lite.train.main in this process (the module run_train.sh execs for a plan): the same
    lines without a fresh Python and torch per plan, which the suite's figure check would otherwise start twenty
    times. It sets the process's environment, working folder and standard streams while it runs: call it from one
    thread, alone. (tests/test_dry_run.py plans through it too.)"""
    from titan_lite.train import main as train_main

    settings = {"DRY_RUN": "1", "NGPU": str(ngpu), "NNODES": str(nnodes)}
    log = logging.getLogger("titan_lite")
    saved_env = {k: os.environ.get(k) for k in settings}
    saved_log, cwd, out, err = (list(log.handlers), log.level, log.propagate), os.getcwd(), io.StringIO(), io.StringIO()
    os.environ.update(settings)
    os.chdir(REPO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = train_main(["--job.config_file", config, *args])
    finally:
        os.chdir(cwd)
        for key, value in saved_env.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        log.handlers[:], log.propagate = saved_log[0], saved_log[2]
        log.setLevel(saved_log[1])
    return code, out.getvalue(), err.getvalue()


def saved_output(name: str) -> str:
    log = LOGS / f"{name}.log"
    if not log.is_file():
        raise RuntimeError(f"no saved output of {name} ({log}): run the command first (without --from_logs)")
    return log.read_text()


def describe(f: Found) -> str:
    if f.readme is None:
        return f"MISSING {f.figure.name}: its pattern does not match README.md and docs/*.md exactly once"
    if f.printed is None:
        return f"NOT PRINTED {f.figure.name}: command {f.figure.command} printed no such figure"
    if f.same:
        return f"ok {f.figure.name}: {', '.join(f.readme)}"
    return f"DIFFERS {f.figure.name}: {f.document} {', '.join(f.readme)}; printed {', '.join(f.printed)}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(__doc__)
    parser.add_argument("--check", action="store_true", help="compare only (exit 1 on a difference); without it the "
                                                             "quoted figures are rewritten")
    parser.add_argument("--slow", action="store_true", help="also the slow commands (training examples, lm_eval)")
    parser.add_argument("--only", help="comma list of command names (COMMANDS keys) to run")
    parser.add_argument("--jobs", type=int, default=2, help="commands run at once")
    parser.add_argument("--from_logs", action="store_true", help="read each command's output saved by an earlier "
                                                                  "run (outputs/readme_figures) instead of running it")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    chosen = {name for name, c in COMMANDS.items() if (opts.slow or not c.slow)
              and (not opts.only or name in opts.only.split(","))}
    figures = [f for f in FIGURES if f.command in chosen]
    start = time.monotonic()
    try:
        if opts.from_logs:
            outputs = {name: saved_output(name) for name in chosen}
        else:
            plans = [n for n in sorted(chosen) if DRY_RUN_LINE.fullmatch(COMMANDS[n].line)]
            outputs = {name: run_command(name, COMMANDS[name]) for name in plans}  # in this process, one at a time
            rest = sorted(chosen - set(plans))
            with ThreadPoolExecutor(max(1, opts.jobs)) as pool:
                outputs |= dict(zip(rest, pool.map(lambda n: run_command(n, COMMANDS[n]), rest), strict=True))
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    texts = documents()
    found = compare(figures, outputs, texts)
    for f in found:
        print(describe(f), flush=True)
    wrong = [f for f in found if not f.same]
    elapsed = f"{len(found)} figures from {len(chosen)} commands in {time.monotonic() - start:.0f}s"
    if not wrong:
        print(f"result: README.md and docs/*.md quote what their commands print: {elapsed}", flush=True)
        return 0
    if opts.check or any(f.readme is None or f.printed is None for f in wrong):
        rerun = f".venv/bin/python -m benchmarks.figures{' --slow' if opts.slow else ''}"
        names = "; ".join(f.figure.name for f in wrong)
        print(f"result: {len(wrong)} of {elapsed} differ from what README.md and docs/*.md quote ({names}); "
              f"rewrite them with: {rerun}", flush=True)
        return 1
    changed = rewrite(texts, found)
    for name, text in changed.items():
        (REPO / name).write_text(text)
    print(f"result: {', '.join(changed)} rewritten: {len(wrong)} of {elapsed} now as printed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
