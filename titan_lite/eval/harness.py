"""titan_lite's model inside EleutherAI's lm-evaluation-harness: `TitanLM` (an lm_eval TemplateLM answering the
three request types on titan_lite's own model and tokenizer) and `evaluate` (lm_eval's own run: tasks, few-shot,
metrics, results table, JSON). The one module that imports lm_eval; only scripts/lm_eval.py imports it, after
checking that lm_eval is installed (the optional `eval` extra)."""

import contextlib
import difflib
import logging
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path

import lm_eval
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.config.evaluate_config import EvaluatorConfig
from lm_eval.loggers import EvaluationTracker
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.tasks import TaskManager
from lm_eval.tasks._yaml_loader import load_yaml
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, make_table
from tqdm import tqdm

from titan_lite.data.chat import TOKENIZER_TEMPLATE, ChatTemplate, TemplateFailure, load_chat_template
from titan_lite.errors import ConfigError
from titan_lite.eval.harness_model import LoadedModel
from titan_lite.generate import GenerationConfig, generate

logger = logging.getLogger("titan_lite")
DEFAULT_MAX_GEN_TOKS = 256  # lm_eval's HF backend's
_SAMPLING_KEYS = {"do_sample", "temperature", "top_k", "seed"}


def folder_chat_template(folder: Path) -> ChatTemplate | None:
    """The chat template of a tokenizer folder (chat_template.jinja, else tokenizer_config.json's chat_template),
    rendered by the code training renders conversations with (titan_lite.data.chat); None when it has none."""
    try:
        return load_chat_template(TOKENIZER_TEMPLATE, folder)
    except ConfigError as exc:
        if "no chat_template" in str(exc):
            return None
        raise


class TitanLM(TemplateLM):
    """loglikelihood, loglikelihood_rolling and generate_until on a titan_lite model, batched and sorted by length
    as lm_eval's HF backend does (so they give its numbers): contexts left-truncated to `max_length`, scores in
    float32, generation greedy or sampled with the KV cache until a stop string, eos or max_gen_toks. Under
    torchrun each process holds the whole model and lm_eval deals it a share of the requests; results meet on
    rank 0 through the collectives below."""

    def __init__(self, loaded: LoadedModel, device: torch.device, batch_size: int | str = 1, seed: int = 0,
                 chat_template: ChatTemplate | None = None, name: str = "titan_lite", max_batch_size: int = 64):
        super().__init__()
        self.model, self.tok = loaded.model, loaded.tokenizer
        self.max_length = loaded.max_length
        # an integer, or lm_eval's "auto" / "auto:N": the largest batch up to max_batch_size whose forward fits,
        # detected on the longest requests (and again at N points as they get shorter), as its HF backend does
        self.batch_size = batch_size
        self.batch_schedule = int(batch_size.partition(":")[2] or 1) if isinstance(batch_size, str) else 0
        self.max_batch_size = max_batch_size
        self.batch_sizes: dict[int, int] = {}  # lm_eval records these in the results
        self.seed = seed
        self.template = chat_template
        self._name = name.replace("/", "__")
        self._device = device
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._world_size = dist.get_world_size() if dist.is_initialized() else 1
        self._generations = 0

    # ------------------------------------------------------------------ tokens

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id if self.tok.bos_id >= 0 else self.tok.eos_id

    @property
    def tokenizer_name(self) -> str:
        return self._name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        """The text's ids with the BOS in front (unless asked not to, or the text already starts with it);
        special-token strings in the text are special tokens (as in transformers)."""
        bos = add_special_tokens
        if bos is None:
            bos = not (self.tok.bos_id >= 0 and string.startswith(self.tok.decode([self.tok.bos_id])))
        ids = self.tok.encode(string, bos=bos, eos=False, allow_special=True)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids: list[int]) -> str:
        """The text of the ids without special tokens (as the HF backend decodes, skip_special_tokens)."""
        specials = self.tok.special_ids | {self.tok.bos_id, self.tok.eos_id, self.tok.pad_id}
        return self.tok.decode([i for i in ids if i not in specials])

    # ------------------------------------------------------------------ scoring

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """(sum of log p(continuation), whether it is the greedy continuation) per (context, continuation) pair,
        longest first, in batches of right-padded sequences; one-token continuations of a shared context share
        one forward (lm_eval's Collator groups them)."""
        reorder = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])), group_by="contexts",
                           group_fn=lambda r: r[-2] + r[-1][:-1])
        results = []
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="loglikelihood requests")
        auto = self.batch_schedule > 0 and not override_bs and len(requests) > 0
        batches = reorder.get_batched(n=0, batch_fn=self._batch_scheduler) if auto else \
            reorder.get_batched(n=override_bs or self.batch_size)
        for chunk in batches:
            inputs = [(ctx + cont)[-(self.max_length + 1):][:-1] for _, ctx, cont in chunk]
            logits = self._forward(inputs)
            for (key, ctx, cont), row, length in zip(chunk, logits, map(len, inputs), strict=True):
                scores = F.log_softmax(row[length - len(cont):length].float(), dim=-1)[None]  # [1, cont, vocab]
                greedy = scores.argmax(dim=-1)
                for request_key, cont_ids, cont_scores in reorder.get_cache(req_str=key, cxt_toks=ctx,
                                                                            cont_toks=cont, logits=scores):
                    target = torch.tensor(cont_ids, device=cont_scores.device)[None]
                    picked = cont_scores[:, -target.shape[1]:].gather(2, target[..., None]).squeeze(-1)
                    answer = (float(picked.sum()), bool((greedy[:, -target.shape[1]:] == target).all()))
                    results.append(answer)
                    if request_key is not None:
                        self.cache_hook.add_partial("loglikelihood", request_key, answer)
                    bar.update(1)
        bar.close()
        return reorder.get_original(results)

    def _batch_scheduler(self, pos: int, ordered: list) -> int:
        """The batch size at position `pos` of the requests sorted longest first: detected once per 1 / N of them."""
        sched = pos // max(1, len(ordered) // self.batch_schedule)
        if sched not in self.batch_sizes:
            previous = self.batch_sizes.get(sched - 1)
            _, context, continuation = ordered[pos]
            length = len((context + continuation)[-(self.max_length + 1):][:-1])
            self.batch_sizes[sched] = previous if previous == self.max_batch_size else self.detect_batch_size(length)
        return self.batch_sizes[sched]

    @torch.no_grad()
    def detect_batch_size(self, length: int) -> int:
        """The largest batch, from max_batch_size down by halves, whose forward over `length` tokens runs without
        running out of device memory; the smallest over the processes."""
        size = self.max_batch_size
        while size > 1:
            try:
                self._forward([[self.prefix_token_id] * length] * size)
                break
            except torch.OutOfMemoryError:
                size //= 2
                if self._device.type == "cuda":
                    torch.cuda.empty_cache()
        if self.world_size > 1:
            found = torch.tensor(size, device=self._device)
            dist.all_reduce(found, op=dist.ReduceOp.MIN)
            size = int(found)
        if self.rank == 0:
            logger.info(f"lm_eval: batch size {size} (--batch_size {self.batch_size}, {length} tokens, at most "
                        f"--max_batch_size {self.max_batch_size})")
        return size

    def _forward(self, inputs: list[list[int]]) -> torch.Tensor:
        """Logits [batch, longest, vocab] of right-padded sequences (padding comes after: causal attention keeps it
        out of every real position)."""
        longest = max(map(len, inputs))
        tokens = torch.zeros(len(inputs), longest, dtype=torch.long)
        for i, ids in enumerate(inputs):
            tokens[i, :len(ids)] = torch.tensor(ids)
        return self.model(tokens.to(self._device))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over disjoint windows of max_length tokens, the text encoded as the HF
        backend does (with its BOS) and the prefix token (BOS) predicting the first."""
        windows, owners = [], []
        for index, (text,) in enumerate(req.args for req in requests):
            for context, target in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, target))
                owners.append(index)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for index, (score, _) in zip(owners, scores, strict=True):
            totals[index] += score
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------ generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Batches of contexts (longest first, one generation setting per batch) continued with the KV cache."""
        reorder = Collator([req.args for req in requests], sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
                           group_by="gen_kwargs", group_fn=lambda r: r[1])
        results = []
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="generate_until requests")
        if self.batch_schedule and "generate" not in self.batch_sizes:  # generation fills the whole context
            self.batch_sizes["generate"] = self.detect_batch_size(self.max_length)
        for chunk in reorder.get_batched(n=self.batch_sizes["generate"] if self.batch_schedule else self.batch_size):
            contexts, settings = zip(*chunk, strict=True)
            for context, text in zip(contexts, self._generate(list(contexts), settings[0]), strict=True):
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, settings[0]), text)
                bar.update(1)
        bar.close()
        return reorder.get_original(results)

    def _generate(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
        kwargs = normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok.decode([self.eot_token_id]))
        max_gen_toks = kwargs.pop("max_gen_toks")
        if max_gen_toks >= self.max_length:
            raise ConfigError(f"max_gen_toks {max_gen_toks} leaves no room for a context in the model's "
                              f"{self.max_length} tokens")
        ignored = sorted(set(kwargs) - _SAMPLING_KEYS)
        if ignored:
            logger.warning(f"lm_eval: generation settings {ignored} are not supported by titan_lite and ignored")
        sample = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature") or 1.0) > 0
        self._generations += 1
        cfg = GenerationConfig(max_new_tokens=max_gen_toks,
                               temperature=float(kwargs.get("temperature") or 1.0) if sample else 0.0,
                               top_k=int(kwargs["top_k"]) if sample and kwargs.get("top_k") else None,
                               stop_ids=(self.eot_token_id,), pad_id=0,
                               seed=int(kwargs.get("seed", self.seed)) + self._generations * 7919 + self.rank)
        prompts = [self.tok_encode(c, left_truncate_len=self.max_length - max_gen_toks) for c in contexts]
        lookback = max(len(self.tok_encode(s, add_special_tokens=False)) for s in until) + 2
        stops = [s for s in until if s]

        def has_stop(ids: list[int]) -> bool:
            tail = self.tok_decode(ids[-lookback:])
            return any(s in tail for s in stops)
        outputs = generate(self.model, prompts, cfg, self._device, stop_when=has_stop)
        return [postprocess_generated_text(self.tok_decode(ids), stop=until, think_end_token=None) for ids in outputs]

    # ------------------------------------------------------------------ chat template

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.template.source if self.template and chat_template not in (False, None) else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.template is None:
            raise ConfigError("--apply_chat_template: the tokenizer has no chat_template")
        try:
            return self.template.render(chat_history, add_generation_prompt)
        except TemplateFailure as failure:
            raise ConfigError(f"--apply_chat_template: the chat template ({self.template.origin}) fails on a "
                              f"request: {failure}") from None

    # ------------------------------------------------------------------ several processes

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor.reshape(-1)) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.reshape(-1).contiguous())
        return torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


# ---------------------------------------------------------------------------------------------- the run


def parse_gen_kwargs(values: list[str] | None) -> dict:
    """--gen_kwargs as lm_eval reads it: a JSON object, or key=value items (several arguments or commas)."""
    from lm_eval._cli.utils import key_val_to_dict, try_parse_json  # lm_eval's own parser of this option

    merged: dict = {}
    for value in values or []:
        try:
            parsed = try_parse_json(value)
            merged.update(parsed if isinstance(parsed, dict) else key_val_to_dict(value))
        except ValueError as exc:
            raise ConfigError(f"--gen_kwargs: {exc}") from None
    return merged


def evaluator_config(opts: Namespace, model_args: dict) -> tuple[EvaluatorConfig, object]:
    """lm_eval's own checks and task resolution of the options (tasks from --include_path and the bundled folder)."""
    fields = {"tasks": opts.tasks, "include_path": opts.include_path, "num_fewshot": opts.num_fewshot,
              "batch_size": opts.batch_size, "limit": opts.limit, "output_path": opts.output_path,
              "log_samples": opts.log_samples, "gen_kwargs": parse_gen_kwargs(opts.gen_kwargs),
              "apply_chat_template": opts.apply_chat_template, "seed": opts.seed, "model": "titan_lite",
              "model_args": model_args}
    managers: list[TaskManager] = []
    include_defaults = not set(opts.tasks.split(",")) <= local_task_names(opts.include_path or [])
    try:
        cfg = EvaluatorConfig.from_cli(Namespace(**fields))
        with kept(managers, include_defaults):
            return cfg, cfg.process_tasks(cfg.metadata)
    except ValueError as exc:
        line = str(exc).splitlines()[0]
        if line.startswith("Tasks not found: ") and managers:
            line += closest_tasks(line.removeprefix("Tasks not found: ").split(", "), managers[-1])
        raise ConfigError(f"lm_eval: {line}") from None


def task_yamls(folders: list[str]) -> Iterator[tuple[Path, dict]]:
    """(file, config) of each task YAML in `folders`, in file order, unresolved."""
    for yaml_file in sorted(p for folder in folders for p in Path(folder).glob("*.yaml")):
        yield yaml_file, load_yaml(yaml_file, resolve_func=False)


def local_task_names(folders: list[str]) -> set[str]:
    """The task, group and tag names the YAMLs of `folders` define."""
    names: set[str] = set()
    for _, config in task_yamls(folders):
        for key in ("task", "group", "tag"):
            value = config.get(key)
            names.update([value] if isinstance(value, str) else value if isinstance(value, list) else [])
    return names


@contextlib.contextmanager
def kept(managers: list, include_defaults: bool = True) -> Iterator[None]:
    """Keep the TaskManager that EvaluatorConfig.process_tasks builds: its names are where the closest ones to a
    missing task come from. Without include_defaults (every task asked for is in the include folders) it indexes
    only those folders: lm_eval's own ~15k tasks take 10 to 25 s to index on a CPU."""
    init = TaskManager.__init__

    def remember(self, *args, **kwargs):
        kwargs.setdefault("include_defaults", include_defaults)
        init(self, *args, **kwargs)
        managers.append(self)
    TaskManager.__init__ = remember
    try:
        yield
    finally:
        TaskManager.__init__ = init


def closest_tasks(missing: list[str], manager: "TaskManager") -> str:
    """' (closest names: ...)' with the closest task, group and tag names to each missing one (lm_eval names none)."""
    known = manager.all_tasks
    hints = [f"{name}: {', '.join(close)}" for name in missing
             if (close := difflib.get_close_matches(name, known, n=3, cutoff=0.6))]
    return f" (closest names: {'; '.join(hints)})" if hints else " (no task, group or tag has a close name)"


def check_local_data(tasks: list[str], folders: list[str], makers: dict[str, str]) -> None:
    """Each of `tasks` defined by a YAML in `folders` that reads local data files (dataset_kwargs.data_files) finds
    them: missing ones are one line naming the files and the commands that make them (`makers`: file -> command);
    lm_eval's own error comes later and names neither."""
    for yaml_file, config in task_yamls(folders):
        if config.get("task") not in tasks:
            continue
        files = (config.get("dataset_kwargs") or {}).get("data_files") or {}
        missing = [path for path in (files.values() if isinstance(files, dict) else [files]) if not Path(path).exists()]
        if missing:
            how = "; ".join(dict.fromkeys(makers.get(path, f"see {yaml_file}") for path in missing))
            raise ConfigError(f"task {config['task']} reads {' and '.join(missing)} (relative to the current directory "
                              f"{Path.cwd()}), which {'does' if len(missing) == 1 else 'do'} not exist; make "
                              f"{'it' if len(missing) == 1 else 'them'} with: {how}")


def evaluate(lm: TitanLM, cfg: EvaluatorConfig, task_manager, model_args: dict) -> dict | None:
    """lm_eval's simple_evaluate on `lm` (options from `evaluator_config`), as `lm_eval run` calls it; rank 0
    prints the tables and (with --output_path) writes the results JSON and the samples. Returns the results on
    rank 0, None elsewhere."""
    tracker = EvaluationTracker(output_path=cfg.output_path)
    seeds = cfg.seed or [None] * 4
    results = lm_eval.simple_evaluate(
        model=lm, tasks=cfg.tasks, num_fewshot=cfg.num_fewshot, batch_size=cfg.batch_size, limit=cfg.limit,
        log_samples=cfg.log_samples, evaluation_tracker=tracker, apply_chat_template=cfg.apply_chat_template,
        fewshot_as_multiturn=cfg.fewshot_as_multiturn, gen_kwargs=cfg.gen_kwargs or None, task_manager=task_manager,
        random_seed=seeds[0], numpy_random_seed=seeds[1], torch_random_seed=seeds[2], fewshot_random_seed=seeds[3],
        metadata=cfg.metadata)
    if results is None:
        return None
    name_results(results, tracker, model_args, lm.chat_template(cfg.apply_chat_template), cfg.fewshot_as_multiturn)
    samples = results.pop("samples", None)
    if cfg.output_path:
        tracker.save_results_aggregated(results=results, samples=samples if cfg.log_samples else None)
        if cfg.log_samples:
            for task in results["configs"]:
                tracker.save_results_samples(task_name=task, samples=samples[task])
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    return results


def name_results(results: dict, tracker: EvaluationTracker, model_args: dict, template: str | None,
                 multiturn: bool) -> None:
    """The model in the results as `lm_eval --model X --model_args ...` would record it (simple_evaluate only sees an
    LM object): model "titan_lite", its arguments, and the output sub-folder named after what was evaluated."""
    results["config"]["model"] = "titan_lite"
    results["config"]["model_args"] = model_args
    name = model_args.get("adapter") or model_args.get("pretrained") or model_args.get("checkpoint")
    tracker.general_config_tracker.log_experiment_args(
        model_source="titan_lite", model_args={"pretrained": name}, system_instruction=None, chat_template=template,
        fewshot_as_multiturn=multiturn)


def results_file(output_path: str | None) -> str | None:
    """The results JSON the last run wrote under --output_path (lm_eval names it by model and time; a path ending in
    .json gets the time appended to its stem)."""
    if not output_path:
        return None
    path = Path(output_path)
    candidates = path.parent.glob(f"{path.stem}_*.json") if path.suffix == ".json" else path.rglob("results_*.json")
    found = sorted(candidates, key=lambda p: p.stat().st_mtime)
    return str(found[-1]) if found else None
