"""The job config schema: one dataclass per TOML section, every field documented where it is declared.

Section and key names follow torchtitan v0.2.2. A key with a fixed set of values is typed `Literal[...]`:
the loader, `validate` and `--help` take the allowed values from the type. Keys of torchtitan features that
titan_lite does not implement are declared with `unsupported=...`: they load while they keep their inert
default and are refused with one line when switched on.

Settings that take effect only behind a switch (config/gates.py) are declared here too: a section's boolean `enable`
switches every other key of it; a boolean `enable_<name>` the keys that name it in `needs` (or contain <name>); a
section's `converter` or `read_when`, the whole section. A setting changed while its switch is off is refused with
one line, or warned about where the section is `inert` (torchtitan's sections, which its TOMLs carry while off).
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

PipelineSchedule = Literal["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"]
AUTO = "auto"  # `needs`: the switch the key's name and section imply (see config/gates.py)


@dataclass(frozen=True)
class When:
    """`needs` as a condition on the value of another key, e.g. a preference loss that reads the setting."""

    key: str  # of the same section, or dotted
    holds: Callable[[Any], bool]  # of that key's value
    text: str  # the condition, for the one line: "is 'simpo'"
    fix: str  # what makes it hold: "--preference.loss simpo"


def opt(default: Any, help: str, *, unsupported: str | None = None,
        needs: "str | tuple[str, ...] | When | None" = AUTO, refused: dict[str, str] | None = None) -> Any:
    """A config field: its default, its documentation, whether it is inert (a Literal type lists its values), and
    what it takes effect behind (`needs`: a boolean key of its section or a dotted one, or several of which any one
    will do, or a condition on another key's value (When); None: read whatever the section's switches say).
    `refused`: values the field's type does not list, each with the one line that says why it is not supported."""
    meta = {"help": help, "unsupported": unsupported, "needs": needs, "refused": refused or {}}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ReadWhen:
    """A condition on other keys under which a section is read at all, e.g. [instruct] for an instruct dataset."""

    text: str  # the condition, for the one line: "'training.dataset' or 'validation.dataset' is 'instruct'"
    holds: Callable[[Any], bool]  # of the JobConfig
    fix: str  # what makes it hold: "set --training.dataset instruct"


def section(cls: type, help: str, *, converter: str | None = None, inert: bool = False,
            read_when: ReadWhen | None = None) -> Any:
    """A nested section (a sub-table such as [training.dataloader]). `converter`: the model converter that reads it;
    `read_when`: a condition on other keys. A setting changed from its default while the section's switch (the
    converter, `read_when`, its `enable` key) is off has no effect and is refused with one line (`inert`: a warning
    instead, for torchtitan's sections, whose published TOMLs set such keys while the switch is off)."""
    return field(default_factory=cls, metadata={"help": help, "unsupported": None, "converter": converter,
                                                "inert": inert, "read_when": read_when})


@dataclass
class Job:
    config_file: str | None = opt(None, "Path of the TOML file this job was loaded from.")
    dump_folder: str = opt("./outputs", "Folder for every output of the run: TensorBoard, traces, checkpoints.")
    description: str = opt("default job", "Free text describing the job, printed at start.")
    print_config: bool = opt(False, "Print the resolved config (TOML + overrides) at start.")
    save_config_file: str | None = opt(
        "config.toml", "Write the resolved config as TOML to this file under dump_folder (rank 0; '' = do not).")
    log_file: str = opt(
        "train.log", "Write the console log (rank 0's lines, no colours) to this file under dump_folder too, line by "
        "line and appending on resume ('' = do not).")
    custom_config_module: str = opt(
        "", "torchtitan's custom config extension module.",
        unsupported="custom config modules are not supported; every key lives in titan_lite's schema")


@dataclass
class Profiling:
    enable_profiling: bool = opt(False, "Record torch.profiler Chrome traces.")
    save_traces_folder: str = opt("profile_trace", "Trace folder, relative to dump_folder.", needs="enable_profiling")
    profile_freq: int = opt(10, "Record one profiled window every this many steps.", needs="enable_profiling")
    profiler_active: int = opt(1, "Steps recorded in each profiled window.", needs="enable_profiling")
    profiler_warmup: int = opt(3, "Warm-up steps before each profiled window.", needs="enable_profiling")
    enable_memory_snapshot: bool = opt(
        False, "Dump CUDA allocator memory snapshots (CUDA only; ignored with a warning elsewhere).")
    save_memory_snapshot_folder: str = opt("memory_snapshot", "Memory snapshot folder, relative to dump_folder.")


@dataclass
class Metrics:
    log_freq: int = opt(10, "Log metrics every this many steps (step 1 is always logged).")
    enable_tensorboard: bool = opt(False, "Write the logged scalars to TensorBoard event files.")
    disable_color_printing: bool = opt(
        False, "Print metrics without ANSI colours (they are only ever printed when the output is a terminal).")
    save_tb_folder: str = opt("tb", "TensorBoard folder, relative to dump_folder.", needs="enable_tensorboard")
    save_for_all_ranks: bool = opt(
        False, "Write TensorBoard files and W&B runs for every rank (each in its own rank_N folder), not just rank 0.",
        needs=("enable_tensorboard", "enable_wandb"))
    enable_wandb: bool = opt(
        False, "Log the same scalars to a Weights & Biases run (with TensorBoard when both are on), from rank 0 or "
        "every rank (save_for_all_ranks), the resolved config as the run's config; the run folder is the TensorBoard "
        "folder's wandb/. WANDB_PROJECT (default titan_lite), WANDB_TEAM, WANDB_RUN_NAME, WANDB_RUN_ID, "
        "WANDB_RUN_GROUP, WANDB_RUN_TAGS (a,b), WANDB_RUN_NOTES, WANDB_RUN_JOB_TYPE; a resumed run continues its W&B "
        "run. Needs the wandb extra (pip install -e '.[wandb]'); WANDB_MODE=offline logs without an account.")


@dataclass
class RoPE:
    """[model.rope]: torchtitan's RoPE config names (scaling, rope_factor, beta_fast, beta_slow, original_seq_len,
    truncate, low/high_freq_factor, theta). Every key unset (None) keeps the flavor's or config.json's value."""

    scaling: Literal["none", "llama", "llama3", "yarn", "linear"] | None = opt(
        None, "Long-context RoPE scaling, as transformers computes it: yarn (Qwen2.5/Qwen3 past 32K), llama "
        "(= llama3, Llama 3.1's), linear (positions / rope_factor), none (plain RoPE); None = the flavor's or "
        "config.json's. dynamic is refused: its frequencies follow the longest sequence seen, so no fixed rotation "
        "exists to train.",
        refused={"dynamic": "dynamic NTK frequencies follow the longest sequence seen so far (transformers recomputes "
                            "them whenever a longer one arrives), so a trained model has no fixed rotation per "
                            "position; use 'yarn' or 'linear'"})
    rope_factor: float | None = opt(
        None, "The scaling factor (transformers' factor; torchtitan's llama scaling_factor): the new context is about "
        "factor x original_seq_len. Needed when scaling names a type the model does not already have.")
    original_seq_len: int | None = opt(
        None, "The context length the model was pre-trained with (transformers' original_max_position_embeddings; "
        "Qwen2.5/Qwen3: 32768). yarn needs it; llama's default is 8192.")
    beta_fast: float | None = opt(
        None, "yarn: pairs turning more than this many times over original_seq_len keep their frequency (32).")
    beta_slow: float | None = opt(
        None, "yarn: pairs turning fewer times than this are fully interpolated (divided by rope_factor) (1).")
    truncate: bool | None = opt(None, "yarn: round the ramp's ends outwards to whole pairs (true, as transformers).")
    attention_factor: float | None = opt(
        None, "yarn: what cos and sin are multiplied by; None = 0.1 ln(rope_factor) + 1 (1.1386 for 4).")
    low_freq_factor: float | None = opt(None, "llama: the low-frequency band's factor (1).")
    high_freq_factor: float | None = opt(None, "llama: the high-frequency band's factor (4).")
    theta: float | None = opt(None, "RoPE base (rope_theta); None = the flavor's or config.json's.")


@dataclass
class Model:
    name: Literal["llama3", "llama2", "llama", "qwen3", "qwen2", "mistral", "gemma3"] = opt(
        "llama3", "Model family. qwen3, qwen2, mistral or gemma3 must name a flavor of that family (torchtitan's "
        "qwen3 '8B' is titan_lite's 'qwen3_8B'; its '8B' is Llama 3.1 8B).")
    flavor: str = opt(
        "debugmodel", "Model size preset: debugmodel, debugmodel_gqa, debugmodel_tied, tiny, smollm2_135M, 1B, 3B, "
        "8B, 8B_sheared, 70B, 405B, llama2_7B; qwen3_0.6B, qwen3_1.7B, qwen3_4B, qwen3_8B, qwen3_14B, qwen3_32B; "
        "qwen2.5_0.5B, qwen2.5_7B, qwen2.5_72B; mistral_7B (v0.3), mistral_7B_v0.1; gemma3_1B, gemma3_4B, gemma3_12B, "
        "gemma3_27B (text); debugmodel_flex_attn, 8B_flex "
        "(torchtitan's FlexAttention flavors); or 'hf': the shape of hf_assets_path/config.json. A preset next to a "
        "config.json is checked against it.")
    hf_assets_path: str | None = opt(
        "./assets/tokenizer", "Folder with tokenizer files (tokenizer.model or tokenizer.json) and, optionally, HF "
        "config.json and weights.")
    tokenizer_path: str | None = opt(
        None, "Deprecated torchtitan key: a tokenizer file or folder; overrides hf_assets_path for the tokenizer.")
    converters: list[str] = opt(
        [], "Model transforms applied on the meta model before parallelism, in order (e.g. lora,prune).")
    print_after_conversion: bool = opt(False, "Print the model after the transforms ran.")
    attn_type: Literal["sdpa", "flex", "varlen"] | None = opt(
        None, "Attention kernel (torchtitan's names); None = the flavor's (sdpa; flex for the *_flex flavors). flex: "
        "FlexAttention with a compiled block mask on CUDA, SDPA with a boolean-derived mask elsewhere.")
    attn_mask_type: Literal["causal", "block_causal"] | None = opt(
        None, "causal, or block_causal: packed documents attend only within themselves, RoPE positions restart at "
        "each document and no label crosses a document boundary; None = the flavor's.")
    rope: RoPE = section(RoPE, "RoPE and its long-context scaling ([model.rope]); unset keys keep the model's.")
    router_aux_loss_coef: float | None = opt(
        None, "MoE models: weight of transformers' load-balancing loss (per sequence and MoE layer, averaged) in the "
        "objective; 0 turns it off; None = the flavor's or config.json's (Qwen3-MoE 0.001, Mixtral 0.02).")
    load_balance_coeff: float | None = opt(
        None, "DeepSeek-V3's routers: how far each expert's correction bias moves toward balance per step (the "
        "aux-loss-free rule, torchtitan's key); 0 freezes the biases; None = the flavor's (0.001).")


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam"] = opt("AdamW", "Optimizer.")
    lr: float = opt(8e-4, "Peak learning rate.")
    beta1: float = opt(0.9, "Adam beta1.")
    beta2: float = opt(0.95, "Adam beta2.")
    eps: float = opt(1e-8, "Adam epsilon.")
    weight_decay: float = opt(0.1, "Decoupled weight decay.")
    implementation: Literal["fused", "foreach", "for-loop"] = opt(
        "fused", "Kernel: fused, foreach or for-loop; fused falls back to foreach where the device has no "
        "fused kernel.")
    early_step_in_backward: bool = opt(False, "Step the optimizer inside backward.",
                                       unsupported="early_step_in_backward is not implemented")


@dataclass
class LRScheduler:
    name: Literal["wsd", "greedy"] = opt(
        "wsd", "Schedule: wsd (linear warmup, optional stable phase, decay) or greedy (warmup, then adapt the LR to "
        "the loss).")
    warmup_steps: int = opt(200, "Steps of linear warmup from near zero to the peak LR.")
    warmup_ratio: float | None = opt(
        None, "Warmup as a fraction of the schedule's length (total_steps, else training.steps), rounded to whole "
        "steps; replaces warmup_steps when set (e.g. 0.1 for 10%).")
    total_steps: int | None = opt(None, "Length of the schedule; defaults to training.steps.")
    decay_ratio: float | None = opt(
        None, "Fraction of steps spent decaying; None decays straight after warmup (no stable phase).")
    decay_type: Literal["linear", "sqrt", "cosine"] = opt("linear", "Shape of the decay.")
    min_lr_factor: float = opt(0.0, "LR at the end of decay, as a fraction of the peak LR.")
    greedy_factor: float = opt(
        1.1, "greedy: multiply the LR by this after `greedy_patience` improving steps, divide by it after as many "
        "worsening ones.")
    greedy_patience: int = opt(10, "greedy: steps of consistent improvement or worsening before the LR changes.")
    greedy_smoothing: float = opt(0.9, "greedy: exponential smoothing of the loss (0 = raw loss).")
    greedy_min_lr_factor: float = opt(0.01, "greedy: lower bound of the LR, as a fraction of the peak LR.")
    greedy_max_lr_factor: float = opt(10.0, "greedy: upper bound of the LR, as a fraction of the peak LR.")
    greedy_cooldown: int = opt(0, "greedy: steps to wait after an LR change before counting again.")


@dataclass
class DataLoader:
    num_workers: int = opt(0, "DataLoader workers: processes (on raw text whose tokenizer releases the GIL: "
                               "threads sharing the tokenizing in one worker process).")
    persistent_workers: bool = opt(False, "Keep workers alive between epochs.")
    pin_memory: bool = opt(False, "Pin host memory for faster host-to-device copies.")
    prefetch_factor: int | None = opt(None, "Batches prefetched per worker (needs num_workers > 0).")


@dataclass
class Training:
    dataset: str = opt(
        "shakespeare", "Dataset: shakespeare, shakespeare_validation (bundled), c4, c4_test, c4_validation, text, "
        "jsonl (read training.dataset_path); instruct: prompt/response examples from training.dataset_path (a "
        ".jsonl, .json or .parquet file; see [instruct]), loss on response tokens only; preference: chosen/rejected "
        "pairs from training.dataset_path, trained with [preference]'s loss; prompts: prompts (and the fields their "
        "rewards read) from training.dataset_path, answered by the policy itself and trained with [grpo] (online RL "
        "with verifiable rewards).")
    dataset_path: str | None = opt(
        None, "Local file or folder of .txt, .jsonl, .json.gz shards (one JSON object per line with a 'text' field) "
        "or .parquet shards (a 'text' column; needs pyarrow).")
    local_batch_size: int = opt(8, "Sequences per micro-batch on each data-parallel rank.")
    global_batch_size: int = opt(
        -1, "Sequences per optimizer step over all ranks; -1 = local_batch_size x data-parallel degree "
        "(no accumulation).")
    seq_len: int = opt(2048, "Tokens per sequence.")
    max_norm: float = opt(1.0, "Clip the global gradient norm to this (0 or less disables clipping).")
    steps: int = opt(10000, "Optimizer steps to train.")
    shuffle: bool | None = opt(
        None, "Read the training data in a seeded order drawn anew each epoch (from debug.seed and the epoch): windows "
        "of token files, instruction examples and preference pairs (packing keeps examples whole). None = on where "
        "the data can be counted (token files from scripts/tokenize_data.py, instruct, preference), off for raw-text "
        "pre-training, which streams in order (true is refused there: tokenize it once). A resume, also on another "
        "data-parallel degree, continues the same order.")
    epochs: float | None = opt(
        None, "Passes over the training data, instead of steps: the run trains ceil(epochs x samples per epoch / "
        "global batch) steps (printed at the start; it replaces training.steps, so the LR schedule, warmup_ratio "
        "and validation follow it). Counting the samples reads and tokenizes the training data once.")
    enable_cpu_offload: bool = opt(False, "FSDP2 CPU offload of parameters, gradients and optimizer state.")
    dtype: Literal["float32", "bfloat16"] = opt("float32", "Parameter dtype outside FSDP mixed precision.")
    mixed_precision_param: Literal["auto", "float32", "bfloat16", "float16"] = opt(
        "auto", "Compute dtype: FSDP2 parameter dtype, or the autocast dtype without FSDP; auto = bfloat16 on "
        "accelerators, float32 on CPU (bf16 matmuls are very slow on most CPUs).")
    mixed_precision_reduce: Literal["float32", "bfloat16"] = opt("float32", "FSDP2 gradient reduction dtype.")
    gc_freq: int = opt(50, "Run Python's garbage collector every this many steps (automatic gc is disabled).")
    gc_debug: bool = opt(False, "Collect garbage every step to find reference cycles.")
    on_nonfinite: Literal["stop", "skip"] = opt(
        "stop", "A NaN or infinite loss or gradient norm (checked on every step, before the optimizer step): stop "
        "with one line naming the step (exit 3; the step is not applied and no checkpoint holds it), or skip the "
        "step (no update, a warning; the LR schedule and the data still advance).")
    dataloader: DataLoader = section(DataLoader, "DataLoader options.")


@dataclass
class DataMixture:
    enable: bool = opt(
        False, "Train on a mixture of data domains instead of training.dataset: every sample of a global batch is "
        "drawn from one domain with probability = its weight (a seeded draw per sample, the same on every rank).")
    dataset_paths: list[str] = opt(
        [], "One local file or folder per domain (.txt/.jsonl/.json.gz/.parquet, as training.dataset_path).")
    domains: list[str] = opt([], "Domain names for logs and TensorBoard; [] = each path's file or folder name.")
    weights: list[float] = opt([], "Initial mixture weights, one per domain (>= 0, normalised to sum 1); [] = uniform.")
    reference_losses: list[float] = opt(
        [], "Target loss per domain (Sheared-LLaMA dynamic batch loading); [] = the weights stay fixed (per-domain "
        "losses are still logged).")
    update_freq: int = opt(
        50, "Steps between weight updates: w <- (1 - smoothing) x softmax(log w + eta x (loss - reference)) + "
        "smoothing / domains, from each domain's mean token loss over the training batches of those steps; a domain "
        "with no tokens in that window keeps its weight.")
    eta: float = opt(1.0, "Step size of the update (Sheared-LLaMA: 1).")
    smoothing: float = opt(1e-4, "Share of the weight spread uniformly after each update (Sheared-LLaMA: 1e-4).")
    clip_excess_loss: bool = opt(
        False, "Use max(loss - reference, 0), as the Sheared-LLaMA paper; false = the signed difference, as its "
        "released code.")
    seed: int | None = opt(None, "Seed of the domain draws; None = debug.seed (0 if unset).")


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = opt(1, "Replicas of the model (DDP/HSDP replicate dimension).")
    data_parallel_shard_degree: int = opt(
        -1, "FSDP shard degree; -1 = whatever the other degrees leave of the world size.")
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = opt(
        "default", "Free unsharded parameters after forward: default (yes, except with PP), always, never.")
    tensor_parallel_degree: int = opt(1, "Tensor parallel degree (with sequence parallel).")
    disable_loss_parallel: bool = opt(False, "Gather logits before the loss instead of computing it sharded over TP.")
    enable_async_tensor_parallel: bool = opt(
        False, "Async TP.", unsupported="async tensor parallel needs CUDA symmetric memory and is not implemented")
    pipeline_parallel_degree: int = opt(1, "Pipeline stages over ranks.")
    module_fqns_per_model_part: list[str] | None = opt(
        None, "Explicit module names per pipeline stage.",
        unsupported="module_fqns_per_model_part is not implemented; use pipeline_parallel_layers_per_stage")
    pipeline_parallel_first_stage_less_layers: int = opt(
        1, "Layers fewer on the first stage (it also holds the embeddings).")
    pipeline_parallel_last_stage_less_layers: int = opt(
        1, "Layers fewer on the last stage (it also holds the output head).")
    pipeline_parallel_layers_per_stage: int | None = opt(
        None, "Transformer layers per virtual stage; None = split evenly.")
    pipeline_parallel_schedule: PipelineSchedule = opt("1F1B", "Pipeline schedule.")
    pipeline_parallel_schedule_csv: str | None = opt(
        None, "Custom schedule CSV.", unsupported="CSV pipeline schedules are not implemented")
    pipeline_parallel_microbatch_size: int = opt(1, "Sequences per pipeline micro-batch.")
    pipeline_parallel_expert_parallel_overlap: bool = opt(
        False, "DualPipeV's overlap of expert all-to-all with compute; titan_lite has no DualPipeV schedule (refused "
        "with expert_parallel_degree > 1).")
    context_parallel_degree: int = opt(1, "Context parallel degree (sequence split for attention).")
    context_parallel_load_balancer: Literal["headtail", "none"] | None = opt(
        "headtail", "Causal load balancing: headtail (2 x CP chunks), or none (None also means none).")
    context_parallel_rotate_method: Literal["allgather", "alltoall"] = opt(
        "allgather", "How K/V reach other ranks; titan_lite all-gathers.")
    expert_parallel_degree: int = opt(
        1, "MoE models: split each MoE layer's experts over this many ranks, carved from dp_shard x cp x tp "
        "(torchtitan's rule); tokens reach their experts by all-to-all; the experts are FSDP-sharded over the "
        "remaining data ranks (efsdp = dp_shard x cp x tp / ep). 1 = off.")
    expert_tensor_parallel_degree: int = opt(
        1, "Tensor parallel degree of the experts; 1: experts stay whole on their EP rank, and under TP the EP ranks "
           "include the TP ranks (torchtitan's default).",
        unsupported="expert tensor parallelism is not implemented: each expert stays whole on its EP rank (with TP, "
                    "expert_parallel_degree spans the TP ranks instead)")
    expert_parallel_comm_backend: Literal["standard", "deepep", "hybridep"] = opt(
        "standard", "Expert-parallel all-to-all: standard (torch.distributed); deepep and hybridep (CUDA kernels) are "
        "not part of titan_lite (refused with expert_parallel_degree > 1).")


@dataclass
class Checkpoint:
    enable: bool = opt(False, "Save distributed checkpoints and resume from the newest complete one.")
    enable_ft_dataloader_checkpoints: bool = opt(
        False, "torchft dataloader checkpoints.", unsupported="fault tolerance (torchft) is not part of titan_lite")
    folder: str = opt("checkpoint", "Checkpoint folder, relative to dump_folder.")
    interval: int = opt(500, "Save every this many steps (and at the last step).")
    initial_load_path: str | None = opt(
        None, "Checkpoint (DCP folder, or HF folder with initial_load_in_hf) to start from when no checkpoint of this "
        "run exists.", needs=None)
    initial_load_model_only: bool = opt(True, "Load only model weights from initial_load_path.", needs=None)
    initial_load_in_hf: bool = opt(
        False, "initial_load_path (default hf_assets_path) is a Hugging Face safetensors folder.", needs=None)
    initial_load_in_hf_quantized: bool = opt(
        False, "Quantized HF weights.", unsupported="quantized HF checkpoints are not supported", needs=None)
    last_save_model_only: bool = opt(
        False, "The final save holds model weights only (in export_dtype). torchtitan's default is true; titan_lite's "
        "final save keeps the full training state by default so a finished run can be extended (more steps "
        "continue from the last one). With true, an extended run continues from the newest full checkpoint.")
    last_save_in_hf: bool = opt(
        False, "At the end of training, also export a Hugging Face folder (step-N-hf; a LoRA run's PEFT adapter too).")
    export_dtype: Literal["float32", "bfloat16", "float16"] = opt("float32", "Dtype of model-only and HF exports.")
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = opt(
        "disabled", "disabled, or async (save in a background thread).")
    keep_latest_k: int = opt(10, "Keep only the newest k complete checkpoints (0 keeps all).")
    load_step: int = opt(-1, "Resume from this step instead of the newest (-1 = newest).")
    exclude_from_loading: list[str] = opt(
        [], "State keys not loaded on resume (model, optimizer, lr_scheduler, dataloader, train_state, rng).")
    enable_first_step_checkpoint: bool = opt(False, "Also save right after step 1.")
    create_seed_checkpoint: bool = opt(False, "Initialise the model on one process, save it as step 0 and exit.")
    load_only: bool = opt(False, "Load checkpoints but never save.")


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective", "memory_budget"] = opt(
        "selective", "Activation checkpointing: none, full or selective (memory_budget is refused).")
    selective_ac_option: str = opt(
        "2", "selective: 'op' for per-op SAC, or an integer N to checkpoint every N-th layer.")
    per_op_sac_force_recompute_mm_shapes_by_fqns: list[str] = opt(
        ["moe.router.gate"], "op SAC: always recompute the mm of the Linear layers whose name in a block ends with "
        "one of these (matched by weight shape: any mm of that shape is recomputed). The default matches nothing in "
        "Llama.")
    early_stop: bool = opt(False, "Stop recomputation early (non-reentrant checkpoint).")
    memory_budget: float = opt(0.5, "Compiler memory budget.", unsupported=None)
    visualize_memory_budget_pareto: bool = opt(
        False, "Plot the memory budget Pareto front.", unsupported="memory_budget AC is not implemented")
    preserve_rng_state: bool = opt(False, "Restore RNG state when recomputing (needed with dropout; Llama has none).")
    determinism_check: Literal["default", "none"] = opt("default", "torch.utils.checkpoint determinism check.")
    debug: bool = opt(False, "torch.utils.checkpoint debug mode.")


@dataclass
class Compile:
    enable: bool = opt(False, "torch.compile each transformer block (and the loss).")
    components: list[str] = opt(["model", "loss"], "What to compile: model, loss.")
    backend: str = opt("inductor", "torch.compile backend.")


@dataclass
class Comm:
    init_timeout_seconds: int = opt(
        300, "Collective timeout (every process group) until the first step ends; a rank that waits longer stops "
        "with one line naming itself and what it was doing (exit 4).")
    train_timeout_seconds: int = opt(100, "Collective timeout after the first step (see init_timeout_seconds).")
    trace_buf_size: int = opt(20000, "NCCL flight recorder: collectives kept per rank, dumped on a timeout "
                                     "(0 disables; inert on gloo).")
    save_traces_folder: str = opt("comm_traces", "NCCL flight-recorder dump folder, relative to dump_folder.")
    save_traces_file_prefix: str = opt("rank_", "NCCL flight-recorder dump file prefix (the rank is appended).")
    mode: Literal["default", "fake_backend", "local_tensor"] = opt(
        "default", "default, or fake_backend (plan in one process; what DRY_RUN=1 uses).")


@dataclass
class Validation:
    enable: bool = opt(False, "Compute the loss on a held-out split every `freq` steps.")
    dataset: str = opt("shakespeare_validation", "Validation dataset (same names as training.dataset).")
    dataset_path: str | None = opt(None, "Local validation data (see training.dataset_path).")
    local_batch_size: int = opt(8, "Validation sequences per rank per batch.")
    seq_len: int = opt(2048, "Validation sequence length.")
    freq: int = opt(10, "Validate every this many steps.")
    steps: int = opt(-1, "Validation batches per run; -1 = one full pass of the split.")
    answer_problems: int = opt(
        0, "dataset = instruct: also measure answer accuracy on this many held-out problems (the first of the "
        "validation split) by greedy generation, comparing the final number ('#### N', 'The answer is: N') with the "
        "reference's; 0 = off. One process or FSDP/HSDP only.")
    max_new_tokens: int = opt(64, "Answer accuracy: tokens generated per problem at most.")
    sample_outputs: int = opt(3, "Answer accuracy: completions printed at the first and the last evaluation.")
    dataloader: DataLoader = section(DataLoader, "Validation DataLoader options.")


@dataclass
class Instruct:
    prompt_field: str = opt("question", "Field (JSON key or parquet column) of the prompt: question for GSM8K, "
                                        "query for MetaMathQA.")
    response_field: str = opt("answer", "Field of the response: answer for GSM8K, response for MetaMathQA.")
    template: str = opt("Question: {prompt}\nAnswer: ", "Text before the response; {prompt} is replaced by the "
                                                        "prompt field. The response follows, then the eos token.")
    packing: bool = opt(False, "Pack examples back to back into windows of seq_len tokens (no padding); false = "
                               "one example per sequence (cut at seq_len), padded to the longest in the batch.")
    validation_fraction: float = opt(
        0.05, "With validation.dataset = instruct and no validation.dataset_path: this fraction of the training "
        "file's examples (evenly spread, the same every run) is held out for validation and never trained on.")
    messages_field: str = opt("messages", "Field of an OpenAI-format conversation: a list of {role, content} turns, "
                                          "roles system/user/assistant. A row with it is a conversation.")
    conversations_field: str = opt("conversations", "Field of a ShareGPT conversation: a list of {from, value} turns, "
                                                    "from human/gpt/system.")
    chat_template: str = opt(
        "", "How conversations become text: '' = none (prompt/response rows use `template`; a conversation is "
        "refused); 'tokenizer' = the tokenizer folder's chat_template.jinja or tokenizer_config.json chat_template; or "
        "the path of a Jinja2 template file. With a chat template a prompt/response row is one user and one assistant "
        "turn.")
    train_on: Literal["assistant", "last_assistant", "all"] = opt(
        "assistant", "What carries the loss: every assistant turn (its content and the end-of-turn token after it), "
        "the last assistant turn only, or every token of the conversation.")


@dataclass
class Debug:
    seed: int | None = opt(None, "Seed for all RNGs; None = a fixed default of 0 for the model init.")
    deterministic: bool = opt(False, "Use deterministic algorithms (slower).")
    deterministic_warn_only: bool = opt(False, "Warn instead of failing on nondeterministic ops.")
    moe_force_load_balance: bool = opt(False, "MoE only; inert for Llama.")


@dataclass
class DryRun:
    device_memory_gib: float | None = opt(
        None, "Memory per device for the DRY_RUN verdict; default the visible GPU's, else 80.")
    device_type: Literal["cuda", "cpu"] = opt(
        "cuda", "The device the plan is for: cuda (bf16 under 'auto') or cpu (titan_lite's CPU step: float32 under "
                "'auto').")


@dataclass
class MemoryEstimation:
    enable: bool = opt(
        False, "torchtitan's memory estimation.", unsupported="use DRY_RUN=1, which plans the job and estimates memory")
    disable_fake_mode: bool = opt(False, "torchtitan's memory estimation without fake tensors.")


@dataclass
class FaultTolerance:
    enable: bool = opt(
        False, "torchft fault tolerance.", unsupported="fault tolerance (torchft) is not part of titan_lite")
    process_group: str = opt("gloo", "torchft process group.")
    process_group_timeout_ms: int = opt(10000, "torchft timeout.")
    replica_id: int = opt(0, "torchft replica id.")
    group_size: int = opt(0, "torchft group size.")
    min_replica_size: int = opt(1, "torchft minimum replicas.")
    semi_sync_method: str | None = opt(
        None, "torchft semi-sync method.", unsupported="fault tolerance (torchft) is not part of titan_lite")


@dataclass
class Lora:
    rank: int = opt(8, "Adapter rank r (A is [r, in], B is [out, r]).")
    alpha: float = opt(16.0, "Adapter alpha: the update is scaled by alpha / rank, or alpha / sqrt(rank) with "
                             "use_rslora.")
    dropout: float = opt(0.0, "Dropout on the adapter's input while training (0 = none).")
    use_rslora: bool = opt(False, "rsLoRA: scale by alpha / sqrt(rank) instead of alpha / rank.")
    init: str = opt("default", "Adapter initialisation: default (Kaiming-uniform A, zero B), gaussian (A normal "
                               "with std 1/rank, zero B), pissa (exact SVD of the loaded weight; the residual becomes "
                               "the frozen base), pissa_niter_N (a seeded randomized SVD with N subspace iterations).")
    use_dora: bool = opt(False, "DoRA: a trained per-output magnitude times the normalised adapted weight.")
    target_modules: list[str] = opt(["all-linear"], "Projections that get adapters: titan_lite names (wq, wk, wv, "
                                                    "wo, w1, w2, w3), Hugging Face names (q_proj, k_proj, v_proj, "
                                                    "o_proj, gate_proj, up_proj, down_proj), or all-linear (all "
                                                    "seven).")
    rank_pattern: list[str] = opt([], "Per-module ranks as 'regex=rank' (first match wins); a regex matches the end "
                                      "of a module's titan_lite or Hugging Face name, as in PEFT (e.g. "
                                      "'down_proj=16', 'layers\\.0\\..*=64').")
    alpha_pattern: list[str] = opt([], "Per-module alphas as 'regex=alpha', matched like rank_pattern.")
    train_modules: list[str] = opt([], "Modules trained in full beside the adapters (PEFT's modules_to_save), by "
                                       "titan_lite or HF name: e.g. output (lm_head), norm, attention_norm, a "
                                       "projection without an adapter.")
    base_dtype: Literal["float32", "bfloat16", "float16", "nf4", "mxfp4"] = opt(
        "float32", "dtype of the frozen weights (adapters, train_modules and their optimizer state stay float32); "
                   "'nf4' (QLoRA) stores every frozen block linear as torchao's 4-bit NormalFloat, quantized once "
                   "after the initial weights are loaded, on each rank's own shard; 'mxfp4' (gpt-oss) keeps the "
                   "experts in the release's MXFP4 blocks and scales as the folder holds them (quantized to that "
                   "format from an unquantized folder), dequantized one expert at a time in the matmul.")
    save_adapter_only: bool = opt(True, "Checkpoints hold the adapters and train_modules (plus optimizer, schedule, "
                                        "data position, RNG); on resume the frozen base is loaded again from the "
                                        "initial weights (and PiSSA's SVD recomputed, which is deterministic).")
    adapter_path: str | None = opt(None, "A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to "
                                         "start the adapters from instead of initialising them; rank, alpha, targets "
                                         "and options must match this section.")
    refactor_freq: int = opt(0, "Every this many steps re-factor each adapter's product B A through its SVD into a "
                                "balanced pair with the same product and restart its optimizer state (0 = never).")
    max_spectral_norm: float | None = opt(None, "With refactor_freq: cap the largest singular value of each scaled "
                                                "update (scale x B A) at this value when re-factoring.")
    keep_sparsity: Literal["auto", "on", "off"] = opt(
        "auto", "Sparse recovery: mask each adapter's update by its frozen base's zeros, W + (scale B A) * (W != 0), "
                "in training, merge and export, so a pruned base stays exactly as sparse (N:M included). auto: on when "
                "'prune' precedes 'lora' in model.converters; on: also for a base pruned elsewhere (pruned initial "
                "weights: their zeros are the masks); off: plain dense updates.")
    export_merged: bool = opt(
        True, "What checkpoint.last_save_in_hf writes at the end besides the PEFT adapter (step-N-adapter, and "
              "step-N-base-hf when the base was not loaded from a Hugging Face folder): the merged model step-N-hf "
              "(W + scale B A; a full-size model); false: the adapter (and that base) only.",
        needs="checkpoint.last_save_in_hf")


@dataclass
class Experimental:
    custom_import: str = opt("", "Module imported at start, before the transforms are built: e.g. one that registers "
                                 "your own transform with titan_lite.transforms.register_transform.")
    custom_args_module: str = opt("", "Deprecated torchtitan key.", unsupported="custom args modules are not supported")


@dataclass
class Float8Linear:
    enable_fsdp_float8_all_gather: bool = opt(
        False, "Under FSDP/HSDP, cast weights to float8 before the all-gather (half the bytes of bf16); tensorwise "
               "recipe only.")
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(
        False, "With the float8 all-gather: compute every weight's float8 scale in one all-reduce after each "
               "optimizer step instead of one per weight in the forward.")
    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] | None = opt(
        None, "torchao float8 recipe: tensorwise (one scale per tensor; the default when unset), rowwise (one per "
              "row, more accurate), rowwise_with_gw_hp (rowwise, weight gradient in high precision).")
    filter_fqns: list[str] = opt(
        ["output"], "Linears left in high precision: any whose name contains one of these strings. The default "
                    "leaves out the output head, as torchtitan does; a list you set replaces it.")
    emulate: bool = opt(
        False, "Emulate float8 (float8 casts, high-precision matmul): for CUDA GPUs below compute capability 8.9. "
               "On CPU the converter always emulates (the real float8 matmul is a slow reference kernel there).")


@dataclass
class MXLinear:
    mxfp8_dim1_cast_kernel_choice: str = opt("triton", "MX kernel (inert: MX is not implemented).")
    recipe_name: str = opt("mxfp8_cublas", "MX recipe (inert).")
    filter_fqns: list[str] = opt(["output"], "Modules left in high precision (inert).")


@dataclass
class QuantizeLinear:
    float8: Float8Linear = section(
        Float8Linear, "float8 training of linears (active when model.converters lists quantize.linear.float8).",
        converter="quantize.linear.float8", inert=True)
    mx: MXLinear = section(MXLinear, "torchtitan MX linear options (active only via model.converters).")


@dataclass
class GroupedMMFloat8:
    fqns: list[str] = opt([], "MoE float8 modules (inert).")


@dataclass
class GroupedMMMX:
    recipe_name: str = opt("mxfp8", "MoE MX recipe (inert).")
    fqns: list[str] = opt([], "MoE MX modules (inert).")


@dataclass
class QuantizeGroupedMM:
    float8: GroupedMMFloat8 = section(GroupedMMFloat8, "MoE float8 options (inert).")
    mx: GroupedMMMX = section(GroupedMMMX, "MoE MX options (inert).")


@dataclass
class Quantize:
    linear: QuantizeLinear = section(QuantizeLinear, "Quantized linear options.")
    grouped_mm: QuantizeGroupedMM = section(QuantizeGroupedMM, "Quantized grouped-mm options.")


@dataclass
class Pruning:
    method: Literal["wanda", "magnitude", "sparsegpt"] = opt(
        "wanda", "One-shot method of the 'prune' transform: wanda (|W| x input-channel norm, compared per output "
        "row), magnitude (|W|, one threshold per layer; needs no data), sparsegpt (Hessian-based, updates the kept "
        "weights).")
    sparsity: float = opt(0.5, "Fraction of each pruned linear's weights set to zero; an N:M pattern needs exactly "
                               "N/M.")
    pattern: Literal["unstructured", "2:4", "4:8"] = opt(
        "unstructured", "unstructured, or N:M semi-structured: '2:4' / '4:8' zero N of every M consecutive input "
        "weights of a row.")
    skip: list[str] = opt([], "Linear layers left dense: glob patterns over module names, e.g. 'layers.0.*' or "
                              "'*.feed_forward.w2'. Embeddings, norms and the output layer are never pruned.")
    dataset: str = opt("shakespeare", "Calibration dataset (names as training.dataset).")
    dataset_path: str | None = opt(None, "Local calibration data: a .txt/.jsonl/.json.gz/.parquet file or a folder "
                                         "of them.")
    nsamples: int = opt(128, "Calibration sequences: the first nsamples windows of seq_len tokens, split over "
                             "data-parallel ranks.")
    seq_len: int = opt(2048, "Tokens per calibration sequence.")
    batch_size: int = opt(1, "Calibration sequences per forward: the chunk that bounds the working activations.")
    blocksize: int = opt(128, "SparseGPT: columns per lazy-update block (and per unstructured mask selection).")
    percdamp: float = opt(0.01, "SparseGPT: dampening added to the Hessian diagonal, as a fraction of its mean.")
    hold_masks: bool = opt(True, "Keep a mask buffer per pruned linear (1 byte per weight, sharded and checkpointed "
                                 "like it) so that training keeps the pruned weights at zero; scripts/prune.py, which "
                                 "only exports, turns it off.")
    mask_gradients: bool = opt(True, "While training: zero the gradients of pruned weights (clipping and AdamW see "
                                     "the sparse model), besides re-applying the masks after every optimizer step.")
    layer_ratios: Literal["uniform", "owl"] = opt(
        "uniform", "Each layer's sparsity: uniform (every layer at 'sparsity'), or owl (outlier-weighted, OWL: a layer "
        "with more outlier Wanda scores is pruned less; the layers average 'sparsity'). Unstructured only.")
    owl_lambda: float = opt(0.08, "OWL: the layers' sparsities span 2 x owl_lambda around 'sparsity'.")
    owl_m: float = opt(5.0, "OWL: a Wanda score counts as an outlier above owl_m x its layer's mean score.")


@dataclass
class Sheared:
    target_layers: int | None = opt(None, "Target architecture: transformer blocks kept (overrides layer_sparsity).")
    target_heads: int | None = opt(None, "Target query heads per layer (overrides head_sparsity): a multiple of the "
                                         "KV heads kept; per_group_query keeps every KV head, kv_group needs "
                                         "target_heads = target_kv_heads x query heads per KV head.")
    target_kv_heads: int | None = opt(None, "Target KV heads per layer: kv_group mode only (per_group_query keeps "
                                            "them all).")
    target_dim: int | None = opt(None, "Target model (hidden) dimension (overrides hidden_sparsity).")
    target_intermediate: int | None = opt(None, "Target SwiGLU intermediate size (overrides intermediate_sparsity).")
    layer_sparsity: float = opt(0.0, "Fraction of blocks removed when target_layers is not given (0 = not pruned).")
    head_sparsity: float = opt(0.0, "Fraction of query heads removed when target_heads is not given; rounded to "
                                    "whole query heads per KV group (per_group_query) or whole KV groups (kv_group).")
    hidden_sparsity: float = opt(0.0, "Fraction of the model dimension removed when target_dim is not given.")
    intermediate_sparsity: float = opt(0.0, "Fraction of the intermediate size removed when target_intermediate is "
                                            "not given.")
    head_mode: Literal["per_group_query", "kv_group"] = opt(
        "per_group_query", "GQA-aware head gates: per_group_query (one gate per query slot of a KV group, shared by "
        "every group: each KV head keeps the same query heads, all KV heads stay) or kv_group (one gate per KV head, "
        "removing it with its query heads; shrinks the KV cache).")
    warmup_steps: int = opt(0, "Steps over which the target sparsity ramps linearly from 0 to the target (Sheared "
                               "uses 20% of the pruning steps; too short a ramp fails to converge).")
    mask_lr: float = opt(1.0, "Learning rate of the gate logits (log_alpha); no weight decay.")
    lambda_lr: float = opt(1.0, "Learning rate of the Lagrange multipliers, applied as gradient ascent (the "
                                "optimizer group gets -lambda_lr); no weight decay.")
    target_tp_degree: int = opt(1, "Tensor-parallel degree the pruned model must support: it must divide the target "
                                   "query heads, KV heads and intermediate size (checked before launch).")
    materialize_at_end: bool = opt(True, "At the end of the run write the pruned dense model (deterministic gates "
                                         "with the exact target counts, soft values folded in) as the HF folder "
                                         "'step-N-pruned-hf' in the checkpoint folder; with "
                                         "checkpoint.last_save_in_hf the run's 'step-N-hf' export is that model.")


@dataclass
class Distill:
    enable: bool = opt(False, "Train on a frozen teacher's logits (knowledge distillation): loss = alpha x T^2 x "
                              "KL + (1 - alpha) x cross entropy over the trained tokens.")
    teacher_path: str = opt("", "The teacher: a Hugging Face folder (config.json, safetensors, tokenizer), a DCP step "
                                "folder of a titan_lite run (its shape from teacher_config), or 'base': the student's "
                                "own frozen base with the adapters switched off (LoRA/QLoRA; no second copy).")
    teacher_flavor: str = opt("", "The teacher's flavor (default: the shape of teacher_path/config.json, or "
                                  "teacher_config's model.flavor); names one when the folder is not there yet "
                                  "(DRY_RUN).")
    teacher_config: str = opt("", "For a DCP teacher: the TOML of the run that wrote it (default: the config.toml "
                                  "that run saved two folders above the step folder).")
    alpha: float = opt(1.0, "Weight of the KL term; 1 - alpha weighs the cross entropy (1.0: logits only, Minitron's "
                            "choice).")
    temperature: float = opt(1.0, "Softmax temperature T of both logits in the KL term (the term is scaled by T^2).")
    kind: Literal["forward", "reverse"] = opt(
        "forward", "forward: KL(teacher || student), mass-covering; reverse: KL(student || teacher), mode-seeking.")


REFERENCE_FREE = ("simpo", "orpo")  # preference losses that compare the policy with itself, without a reference
WITH_REFERENCE = When("loss", lambda loss: loss not in REFERENCE_FREE, "is one that compares with a reference "
                      "(sigmoid, hinge or ipo)", "--preference.loss sigmoid")


@dataclass
class Preference:
    loss: Literal["sigmoid", "ipo", "hinge", "simpo", "orpo"] = opt(
        "sigmoid", "Preference loss over pairs, with h = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log "
        "ref(rejected)) from answer log-probabilities summed over the answer's tokens: sigmoid (DPO): -log "
        "sigmoid(beta h); hinge: max(0, 1 - beta h); ipo: (h' - 1 / (2 beta))^2 with h' from per-token averages; "
        "simpo (reference-free): -log sigmoid(beta (avg log pi(chosen) - avg log pi(rejected)) - simpo_gamma); orpo "
        "(reference-free): NLL of the chosen answer per token - beta log sigmoid(log odds(chosen) - log "
        "odds(rejected)), odds of the per-token averaged probability.")
    beta: float = opt(0.1, "beta: how far the policy may move from the reference (DPO, hinge, IPO's 1 / (2 beta) "
                           "target), SimPO's reward scale, ORPO's weight of the odds-ratio term (its lambda).")
    label_smoothing: float = opt(
        0.0, "sigmoid and simpo: the probability eps that a pair's labels are flipped, in [0, 0.5): cDPO's loss "
        "-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h); with robust, robust DPO's unbiased loss.")
    robust: bool = opt(False, "sigmoid with label_smoothing eps: robust DPO, (-(1 - eps) log sigmoid(beta h) + eps "
                              "log sigmoid(-beta h)) / (1 - 2 eps), as TRL's 'robust'.",
                       needs=When("label_smoothing", lambda eps: eps > 0, "is above 0 (the share of flipped labels "
                                  "it corrects for)", "--preference.label_smoothing 0.1"))
    simpo_gamma: float = opt(0.5, "simpo: the target reward margin gamma.",
                             needs=When("loss", lambda loss: loss == "simpo", "is 'simpo'", "--preference.loss simpo"))
    sft_weight: float = opt(
        0.0, "Weight of an NLL term on the chosen answers (RPO with sigmoid): their mean token NLL over the global "
        "batch, as TRL's 'sft' loss; 0 = none. orpo has its own NLL term (weight 1).")
    reference: str = opt(
        "base", "The reference model of sigmoid, hinge and ipo: 'base' = the policy itself with its adapters switched "
        "off (LoRA, QLoRA, DoRA, PiSSA with its initial adapters added back: no second copy of the model); or a "
        "Hugging Face folder or a DCP step folder of a titan_lite run, loaded frozen and sharded by the policy's mesh. "
        "Reference-free losses (simpo, orpo) load none.", needs=WITH_REFERENCE)
    reference_flavor: str = opt("", "The reference's flavor (default: the shape of reference/config.json, or "
                                    "reference_config's model.flavor); names one when the folder is not there yet "
                                    "(DRY_RUN).", needs=WITH_REFERENCE)
    reference_config: str = opt("", "For a DCP reference: the TOML of the run that wrote it (default: the "
                                    "config.toml that run saved two folders above the step folder).",
                                needs=WITH_REFERENCE)
    precompute_reference: bool = opt(
        False, "Compute the reference's log-probabilities of every pair (training and held-out) in one pass before "
        "training, keep them in a table checkpointed with the run (a resumed run loads them, never recomputes) and "
        "free the reference: training then holds and runs no reference.")
    packing: bool = opt(
        True, "Pack whole pairs into windows of seq_len tokens (each answer a block-causal document with its own "
        "copy of the prompt); false = one pair per sequence, padded to the longest of the batch.")
    prompt_field: str = opt("prompt", "Field (JSON key or parquet column) of the prompt: a string, or a list of "
                                      "messages ending with a user turn.")
    chosen_field: str = opt("chosen", "Field of the preferred answer: a string, or a list of assistant messages (or "
                                      "the whole conversation, prompt included: UltraFeedback's rows).")
    rejected_field: str = opt("rejected", "Field of the other answer, in the chosen field's form.")
    chat_template: str = opt(
        "", "How conversational rows become text: '' = none (conversational rows are refused); 'tokenizer' = the "
        "tokenizer folder's template; or the path of a Jinja2 template file (as instruct.chat_template). The prompt "
        "is rendered with the generation prompt; an answer is what the whole conversation adds to it, trained up to "
        "its end-of-turn token.")
    truncation_mode: Literal["keep_end", "keep_start", "drop"] = opt(
        "keep_end", "A pair longer than a window (its two documents, prompt twice, over seq_len + 1 tokens): "
        "keep_end cuts the prompt from the left (keep_start: from the right) down to max_prompt_length, then the "
        "answers from their end (the longer first), as TRL's truncation_mode; drop leaves the pair out. Both are "
        "counted in the log.")
    max_prompt_length: int = opt(
        0, "Tokens a prompt keeps at least when a pair is cut (it is cut only as far as the answers need); 0 = a "
        "quarter of seq_len.")
    validation_fraction: float = opt(
        0.05, "With validation.dataset = preference and no validation.dataset_path: this fraction of the training "
        "file's pairs (evenly spread, the same every run) is held out for validation and never trained on.")


@dataclass
class Grpo:
    """[grpo]: online RL with verifiable rewards on training.dataset = "prompts" (TRL GRPOConfig's key names)."""

    num_generations: int = opt(
        8, "G: completions sampled per prompt, compared within their group (at least 2). training.global_batch_size "
        "(and local_batch_size) count completions, as TRL's batch sizes do: a step answers global_batch_size / G "
        "prompts, and G must divide it.")
    max_completion_length: int = opt(
        512, "Tokens a completion may have at most (its end token included); a prompt plus this must fit "
        "training.seq_len.")
    temperature: float = opt(1.0, "Sampling temperature (> 0); the log-probabilities of training and of the KL term "
                                  "are of the same tempered distribution, as TRL's.")
    top_p: float = opt(1.0, "Sample among the most likely tokens holding this much probability (1 = all).")
    top_k: int = opt(0, "Sample among the k most likely tokens (0 = all).")
    logprobs: Literal["full", "sampled"] = opt(
        "full", "The policy's distribution whose log-probabilities the rollout records and training computes: full = "
        "softmax(logits / temperature) over the whole vocabulary (TRL's default); sampled = the one the tokens are "
        "drawn from, truncated by top_k / top_p and renormalised (the importance ratio is exactly on-policy; needs "
        "top_p < 1 or top_k). The KL term's reference keeps its full tempered distribution.")
    generation_batch_size: int = opt(
        0, "Completions a rank decodes together (their KV cache is held at once): the decode engine's slots, each "
        "taking the next pending completion when its own ends; 0 = all of its completions of the step "
        "(local_batch_size x gradient accumulation).")
    gather_once: Literal["auto", "always", "never"] = opt(
        "auto", "Under FSDP: all-gather every layer's weights once per rollout and keep them gathered while it decodes "
        "(always), or layer by layer in every decode step as training does (never); auto gathers once where the "
        "unsharded weights fit beside the rollout's KV cache in every rank's free memory. The log says which.")
    fold_adapters: bool = opt(
        True, "Fold the adapters (LoRA, DoRA) into their base weights for each rollout and restore the base bit for "
        "bit after it, so decoding runs the base's matmuls only; done where it is exact (float32 weights and compute), "
        "the log says where not (QLoRA's NF4 base, bfloat16).")
    stop_check_interval: int = opt(
        8, "Decode steps between the rollout's reads of which completions have ended (the only host syncs while "
        "decoding); a slot that ended meanwhile idles until the read, which changes no result.")
    compile_generation: bool = opt(
        False, "torch.compile the rollout's decode step whole (static shapes, the cache preallocated; CUDA graphs "
        "with mode reduce-overhead on CUDA). One process only: sharded layouts decode eagerly.")
    loss_type: Literal["dapo", "grpo", "dr_grpo"] = opt(
        "dapo", "How token losses become the loss (TRL's): dapo sums them over the step's completions and divides by "
        "their count of completion tokens; grpo averages each completion's tokens, then the completions; dr_grpo "
        "divides the sum by completions x max_completion_length.")
    epsilon: float = opt(0.2, "Clipping of the importance ratio: [1 - epsilon, 1 + epsilon_high].")
    epsilon_high: float | None = opt(None, "The upper clipping bound (DAPO's clip-higher); None = epsilon.")
    beta: float = opt(0.0, "Weight of the KL term (k3 estimator, per token) towards the reference; 0 loads no "
                           "reference, as TRL.")
    use_bias_correction_kl: bool = opt(
        True, "Multiply each token's KL by its importance ratio (TRL's default since DeepSeek-V3.2: the unbiased "
        "reverse-KL gradient; with num_iterations 1 the ratio is 1 but its gradient is not 0).")
    reference: str = opt(
        "base", "The KL reference (with beta > 0): 'base' = the policy with its adapters switched off (no second "
        "copy), or a Hugging Face folder or a DCP step folder, loaded frozen and sharded like the policy (as "
        "preference.reference).")
    reference_flavor: str = opt("", "The reference's flavor (default: from its config.json or reference_config); "
                                    "names one when the folder is not there yet (DRY_RUN).")
    reference_config: str = opt("", "For a DCP reference: the TOML of the run that wrote it.")
    scale_rewards: Literal["group", "batch", "none"] = opt(
        "group", "Advantage = reward - its group's mean, divided by the group's std (group), the whole step's "
        "(batch), or not at all (none; Dr. GRPO).")
    num_iterations: int = opt(
        1, "Optimizer steps on each batch of rollouts (TRL's mu): the importance ratio compares the policy with the "
        "log-probabilities recorded when sampling.")
    reward_funcs: list[str] = opt(
        ["answer_match"], "Reward functions, summed with reward_weights: answer_match (1 when the completion's final "
        "number equals the row's answer_field's, eval's extraction), format (1 when the completion matches "
        "format_pattern), length_penalty (DAPO's soft overlong punishment over the last length_penalty_buffer "
        "tokens), or 'module.path:function' with TRL's signature: f(prompts, completions, completion_ids, **fields) "
        "-> one float (or None) per completion, the row's other fields passed as lists.")
    reward_weights: list[float] = opt([], "One weight per reward function; [] = all 1.")
    format_pattern: str = opt("", "The format reward's regular expression, matched from the completion's start "
                                  "(re.match with DOTALL and MULTILINE).")
    length_penalty_buffer: int = opt(
        0, "length_penalty: completions longer than max_completion_length minus this get a penalty growing "
        "linearly to -1 at max_completion_length (TRL's soft_punish_cache).")
    prompt_field: str = opt("prompt", "Field of the prompt: a string, or a list of messages (rendered with the chat "
                                      "template and its generation prompt).")
    answer_field: str = opt("answer", "Field holding the reference answer answer_match compares with.")
    template: str = opt("{prompt}", "Text of a string prompt without a chat template; {prompt} is replaced by it.")
    chat_template: str = opt(
        "", "'' = none (string prompts use `template`); 'tokenizer' = the tokenizer folder's template; or a Jinja2 "
        "template file: the prompt is one user turn (or its messages), rendered with the generation prompt; "
        "completions stop at its end-of-turn token.")
    packing: bool = opt(
        True, "Pack each microbatch's prompt + completion sequences whole into windows of seq_len tokens "
        "(block-causal documents); false = one per sequence, padded to the longest of the microbatch.")
    validation_fraction: float = opt(
        0.05, "With validation.dataset = prompts and no validation.dataset_path: this fraction of the training file's "
        "prompts (evenly spread) is held out; validation answers them greedily and reports the mean reward and "
        "answer_match's accuracy.")


def reads_dataset(name: str) -> Callable[[Any], bool]:
    """Whether a run reads a dataset's section: its training data, or its validation data (validation on), is
    `name` ([instruct], [preference])."""
    return lambda cfg: cfg.training.dataset == name or (cfg.validation.enable and cfg.validation.dataset == name)


# What a setting made while its section's switch is off gets (config/gates.py): a warning on the sections that are
# `inert`, which are torchtitan's whose published TOMLs set keys while the switch is off ([checkpoint] interval,
# last_save_model_only and export_dtype with enable = false; [validation] dataset, freq and steps; [profiling]
# profile_freq; [compile] components) and which only save, observe or speed up a run; a refusal everywhere else,
# sections added later included: there a setting made while off means a run that trains something other than what
# its config says ([distill]'s teacher, [data_mixture]'s domains, [instruct]'s chat template, a converter's section).
@dataclass
class JobConfig:
    job: Job = section(Job, "The job: where outputs go.")
    profiling: Profiling = section(Profiling, "torch.profiler traces and memory snapshots.", inert=True)
    metrics: Metrics = section(Metrics, "Console and TensorBoard metrics.", inert=True)
    model: Model = section(Model, "Which Llama, its assets and its transforms.")
    optimizer: Optimizer = section(Optimizer, "The optimizer.")
    lr_scheduler: LRScheduler = section(LRScheduler, "The learning-rate schedule.")
    training: Training = section(Training, "Data, batch and step counts, precision.")
    parallelism: Parallelism = section(Parallelism, "Parallel degrees and their options.")
    checkpoint: Checkpoint = section(Checkpoint, "Distributed checkpoints and HF import/export.", inert=True)
    activation_checkpoint: ActivationCheckpoint = section(ActivationCheckpoint, "Activation checkpointing.")
    compile: Compile = section(Compile, "torch.compile.", inert=True)
    comm: Comm = section(Comm, "Communication timeouts and tracing.")
    validation: Validation = section(Validation, "Held-out loss during training.", inert=True)
    data_mixture: DataMixture = section(DataMixture, "Several data domains with mixture weights, optionally "
                                                     "updated from per-domain losses (dynamic batch loading).")
    instruct: Instruct = section(Instruct, "Instruction data (training.dataset / validation.dataset = "
                                           "\"instruct\"): fields, prompt template, packing, held-out split.",
                                 read_when=ReadWhen(
                                     "'training.dataset' or 'validation.dataset' is 'instruct'",
                                     reads_dataset("instruct"),
                                     "set --training.dataset instruct (or --validation.dataset instruct)"))
    debug: Debug = section(Debug, "Seeds and determinism.")
    dry_run: DryRun = section(DryRun, "DRY_RUN=1 planning options.")
    pruning: Pruning = section(Pruning, "One-shot pruning at the start of a run (the 'prune' transform in "
                                        "model.converters).", converter="prune")
    sheared: Sheared = section(Sheared, "Sheared-LLaMA targeted structured pruning: hard-concrete gates trained with "
                                        "a Lagrangian towards a target architecture (model.converters = "
                                        "[\"sheared\"]).", converter="sheared")
    distill: Distill = section(Distill, "Knowledge distillation from a frozen teacher (its logits train the student).")
    preference: Preference = section(Preference, "Preference tuning on chosen/rejected pairs (training.dataset = "
                                                 "\"preference\"): DPO and its reference-free cousins.",
                                     read_when=ReadWhen(
                                         "'training.dataset' or 'validation.dataset' is 'preference'",
                                         reads_dataset("preference"), "set --training.dataset preference"))
    grpo: Grpo = section(Grpo, "Online RL with verifiable rewards (training.dataset = \"prompts\"): GRPO, DAPO and "
                                   "Dr. GRPO with rollouts from the policy itself.",
                         read_when=ReadWhen("'training.dataset' or 'validation.dataset' is 'prompts'",
                                            reads_dataset("prompts"), "set --training.dataset prompts"))
    memory_estimation: MemoryEstimation = section(MemoryEstimation, "torchtitan memory estimation (see DRY_RUN).",
                                                  inert=True)
    fault_tolerance: FaultTolerance = section(FaultTolerance, "torchft (not supported).", inert=True)
    lora: Lora = section(Lora, "LoRA adapters (active with model.converters = [\"lora\"]).", converter="lora")
    experimental: Experimental = section(Experimental, "torchtitan experimental hooks (not supported).")
    quantize: Quantize = section(Quantize, "torchtitan quantization converters (not supported).")
