"""scripts/lm_eval.py against lm_eval itself (the oracle), offline, on the bundled local tasks of the three request
types: the same HF folder through `lm_eval`'s HF backend and through titan_lite's model gives the same metrics,
per-request log-likelihoods within 1e-4 (or one float32 step of a large rolling sum) and identical greedy
generations; two processes (torchrun, gloo) give the one-process results; a LoRA run's DCP checkpoint, evaluated
unmerged, equals its merged HF export evaluated by lm_eval's HF backend; bad input is one line."""

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from benchmarks.lm_eval_speed import write_test_hf_folder  # noqa: E402
from tests.integration.harness import BASE_TOML, run_train  # noqa: E402
from tests.warm_python import python_command  # noqa: E402
from titan_lite.errors import pip_install  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = ["shakespeare_choice", "shakespeare_rolling", "shakespeare_continue"]
# Stop strings that cut most of the tiny model's continuations early (exercises `until` on both sides).
GEN_KWARGS = '{"until": ["th", "SCENE", "\\n"], "max_gen_toks": 12}'
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
os.environ.update(OFFLINE)


def load_script():
    spec = importlib.util.spec_from_file_location("lm_eval_script", ROOT / "scripts" / "lm_eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_samples(model_args: str, limit: int | None = None) -> tuple[dict, dict]:
    """(results, samples by task) of lm_eval's own HF backend, in this process."""
    results = lm_eval.simple_evaluate(
        model="hf", model_args=f"{model_args},dtype=float32", tasks=TASKS, batch_size=4, limit=limit,
        device="cuda" if torch.cuda.is_available() else "cpu",  # where scripts/lm_eval.py runs
        log_samples=True, gen_kwargs=json.loads(GEN_KWARGS),
        task_manager=lm_eval.tasks.TaskManager(include_path=str(ROOT / "assets" / "lm_eval_tasks"),
                                               include_defaults=False))
    return results["results"], results["samples"]


def written(output: Path) -> tuple[dict, dict]:
    """(results, samples by task) that scripts/lm_eval.py wrote under --output_path."""
    results = json.loads(next(output.rglob("results_*.json")).read_text())["results"]
    samples = {task: [json.loads(line) for line in next(output.rglob(f"samples_{task}_*.jsonl")).read_text()
                      .splitlines()] for task in TASKS}
    return results, samples


def script_args(model_args: str, output: Path, limit: int | None = None) -> list[str]:
    return ["--model_args", model_args, "--tasks", ",".join(TASKS), "--batch_size", "4", "--output_path", str(output),
            "--log_samples", "--gen_kwargs", GEN_KWARGS, *(["--limit", str(limit)] if limit else [])]


def close(a: float, b: float) -> bool:
    """Within 1e-4, or two float32 steps of the value (a rolling sum of -1000 resolves to 1.2e-4 in float32)."""
    return abs(a - b) <= max(1e-4, 2 * float(np.spacing(np.float32(abs(a)))))


def assert_same_answers(got: dict, want: dict) -> None:
    for task in TASKS:
        mine = {s["doc_id"]: s["resps"] for s in got[task]}
        theirs = {s["doc_id"]: s["resps"] for s in want[task]}
        assert mine.keys() == theirs.keys(), task
        for doc, resps in theirs.items():
            for m, t in zip(mine[doc], resps, strict=True):
                if task == "shakespeare_continue":
                    assert m == t, (task, doc, m, t)
                elif task == "shakespeare_choice":  # (loglikelihood, is_greedy)
                    assert close(float(m[0][0]), float(t[0][0])) and str(m[0][1]) == str(t[0][1]), (task, doc, m, t)
                else:
                    assert close(float(m[0]), float(t[0])), (task, doc, m, t)
    cut = [s for s in want["shakespeare_continue"] if len(s["resps"][0][0]) < 20]
    assert cut and any(s["resps"][0][0] for s in want["shakespeare_continue"])  # stop strings cut, text survives


def assert_same_metrics(got: dict, want: dict) -> None:
    for task in TASKS:
        for metric, value in want[task].items():
            if isinstance(value, float):
                assert got[task][metric] == pytest.approx(value, rel=1e-5, abs=1e-9), (task, metric)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    return write_test_hf_folder(tmp_path_factory.mktemp("lm_eval") / "hf")


@pytest.fixture(scope="module")
def one_process(hf_folder, tmp_path_factory) -> tuple[dict, dict, str]:
    output = tmp_path_factory.mktemp("one")
    code = load_script().main(script_args(f"pretrained={hf_folder},dtype=float32", output))
    assert code == 0
    return written(output)


@pytest.mark.slow  # with its fixture, the script's run: about 30 s on the shared 2 cores
def test_local_tasks_equal_lm_eval_hf_backend(hf_folder, one_process, capsys):
    results, samples = one_process
    want_results, want_samples = reference_samples(f"pretrained={hf_folder}")
    assert_same_answers(samples, want_samples)
    assert_same_metrics(results, want_results)
    assert results["shakespeare_choice"]["acc,none"] == want_results["shakespeare_choice"]["acc,none"]


@pytest.mark.slow
def test_two_processes_equal_one(hf_folder, one_process, tmp_path):
    """torchrun with 2 CPU processes (gloo): each scores its share of the requests; rank 0 writes the results."""
    output = tmp_path / "two"
    env = {**os.environ, **OFFLINE, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([*python_command(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(ROOT / "scripts" / "lm_eval.py"),
                           *script_args(f"pretrained={hf_folder},dtype=float32", output)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("evaluated shakespeare_choice") and "on 2 process(es)" in last, last
    results, samples = written(output)
    assert_same_answers(samples, one_process[1])
    assert_same_metrics(results, one_process[0])


@pytest.mark.slow  # the script and lm_eval's HF backend on 3 documents per task
@pytest.mark.parametrize("flavor", ["tiny_mistral"])
def test_family_folder_equals_lm_eval_hf_backend(flavor, tmp_path):
    """A Mistral with a sliding window (8) shorter than the requests: titan_lite's forward and KV-cache generation
    window as transformers' MistralForCausalLM does (loglikelihoods, rolling sums and greedy continuations)."""
    folder = write_test_hf_folder(tmp_path / "hf", flavor=flavor)
    assert json.loads((folder / "config.json").read_text())["sliding_window"] == 8
    output = tmp_path / "out"
    assert load_script().main(script_args(f"pretrained={folder},dtype=float32", output, limit=3)) == 0
    results, samples = written(output)
    want_results, want_samples = reference_samples(f"pretrained={folder}", limit=3)
    assert_same_answers(samples, want_samples)
    assert_same_metrics(results, want_results)


LORA_TOML = """
[lora]
rank = 4
alpha = 8.0
use_dora = true
target_modules = ["wq", "wv", "w2"]

[checkpoint]
enable = true
interval = 3
last_save_in_hf = true
initial_load_in_hf = true
"""


@pytest.mark.slow
def test_lora_checkpoint_unmerged_equals_its_merged_export(hf_folder, tmp_path):
    """A LoRA run (DoRA, 3 steps) from the HF folder: its adapter-only DCP checkpoint, evaluated with the run's TOML
    (adapters unmerged), and its PEFT adapter on the base folder, against the merged HF export the run wrote,
    evaluated by lm_eval's HF backend."""
    toml = tmp_path / "lora.toml"
    toml.write_text(BASE_TOML.read_text().replace('hf_assets_path = "./assets/tokenizer"',
                                                  f'hf_assets_path = "{hf_folder}"\nconverters = ["lora"]')
                    .replace("seq_len = 64", "seq_len = 32").replace("local_batch_size = 8", "local_batch_size = 4")
                    .replace("steps = 5", "steps = 3") + LORA_TOML
                    + f'initial_load_path = "{hf_folder}"\nfolder = "checkpoint"\n')
    run = run_train([], tmp_path / "run", config=toml)
    assert run.returncode == 0, run.output[-3000:]
    step, merged = tmp_path / "run" / "checkpoint" / "step-3", tmp_path / "run" / "checkpoint" / "step-3-hf"
    assert step.is_dir() and merged.is_dir()
    output = tmp_path / "out"
    code = load_script().main(script_args(f"checkpoint={step},config={toml},dtype=float32", output, limit=8))
    assert code == 0
    results, samples = written(output)
    want_results, want_samples = reference_samples(f"pretrained={merged}", limit=8)
    assert_same_answers(samples, want_samples)
    assert_same_metrics(results, want_results)
    adapted = tmp_path / "adapted"  # the run's PEFT adapter on the base folder: the same model again
    assert load_script().main(script_args(f"pretrained={hf_folder},adapter={step}-adapter,dtype=float32", adapted,
                                          limit=8)) == 0
    assert_same_answers(written(adapted)[1], want_samples)
    base, trained = load_file(str(hf_folder / "model.safetensors")), load_file(str(merged / "model.safetensors"))
    assert not torch.equal(base["model.layers.0.self_attn.q_proj.weight"],
                           trained["model.layers.0.self_attn.q_proj.weight"])  # the adapters changed the model


# ------------------------------------------------------------------------------------------ one-line errors


@pytest.mark.parametrize("model_args, message", [
    (["pretrained=/nonexistent/model"], "error: --model_args pretrained=/nonexistent/model: no such folder"),
    (["pretrained=.,revision=main"], "error: --model_args: unknown key 'revision' (expected pretrained, checkpoint, "
                                     "config, adapter, dtype, max_length)"),
    (["checkpoint=."], "error: --model_args checkpoint= needs config=, the TOML of the run that saved it"),
    (["pretrained=.", "dtype=fp8"], "error: --model_args dtype=fp8: expected one of auto, float32, bfloat16"),
])
def test_bad_model_args_are_one_line(model_args, message, capsys):
    code = load_script().main(["--model_args", *model_args, "--tasks", "shakespeare_choice"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == message


def test_without_lm_eval_the_script_says_how_to_install_it(hf_folder, capsys, monkeypatch):
    script = load_script()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    assert script.main(["--model_args", f"pretrained={hf_folder}", "--tasks", "shakespeare_choice"]) == 2
    assert capsys.readouterr().err.strip() == "error: scripts/lm_eval.py needs EleutherAI's lm-evaluation-harness, " \
                                              f"the optional eval extra: {pip_install(extra='eval')}"


def test_help_names_the_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        load_script().main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    for option in ("--model_args", "--tasks", "--include_path", "--num_fewshot", "--batch_size", "--limit",
                   "--output_path", "--log_samples", "--gen_kwargs", "--apply_chat_template", "--seed"):
        assert option in out


def test_chat_template_renders_and_its_absence_is_one_line(hf_folder, tmp_path, capsys):
    from titan_lite.eval.harness import folder_chat_template

    assert folder_chat_template(hf_folder) is None
    code = load_script().main(["--model_args", f"pretrained={hf_folder}", "--tasks", "shakespeare_choice",
                               "--apply_chat_template"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (f"error: --apply_chat_template: {hf_folder / 'tokenizer_config.json'} "
                                               f"has no chat_template (evaluate without it, or add one)")
    config = json.loads((hf_folder / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
        "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")}))
    template = folder_chat_template(tmp_path)
    text = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


# ------------------------------------------------------------------------------------------ the script's edges


@pytest.mark.slow  # a third run of the script (8 documents a task) beside the one_process fixture's
def test_batch_size_auto_finds_a_size_and_gives_the_same_answers(hf_folder, one_process, tmp_path, capsys):
    """--batch_size auto:N as lm_eval's CLI takes it: the largest batch up to --max_batch_size that runs, found on
    the longest requests and again at N points; the answers are those of a fixed batch size."""
    output = tmp_path / "auto"
    argv = script_args(f"pretrained={hf_folder},dtype=float32", output, limit=8)
    argv[argv.index("--batch_size") + 1] = "auto:2"
    assert load_script().main([*argv, "--max_batch_size", "8"]) == 0
    captured = capsys.readouterr()
    assert "lm_eval: batch size 8 (--batch_size auto:2, " in captured.out + captured.err
    mine, theirs = written(output)[1], one_process[1]
    assert_same_answers(mine, {task: [s for s in theirs[task] if s["doc_id"] < 8] for task in TASKS})


@pytest.mark.parametrize("value, message", [("0", "'0': expected a positive integer, auto or auto:N (N >= 1)"),
                                            ("auto:x", "'auto:x': expected a positive integer, auto or auto:N")])
def test_batch_size_takes_a_number_auto_or_auto_n(value, message, capsys):
    script = load_script()
    assert script.parse_args(["--model_args", "pretrained=.", "--tasks", "t", "--batch_size", "auto:3"]).batch_size \
        == "auto:3"
    with pytest.raises(SystemExit):
        script.parse_args(["--model_args", "pretrained=.", "--tasks", "t", "--batch_size", value])
    assert message in capsys.readouterr().err


@pytest.mark.slow  # lm_eval indexes every task it knows first: 10 to 20 s
def test_an_unknown_task_gets_the_closest_names(hf_folder, capsys):
    code = load_script().main(["--model_args", f"pretrained={hf_folder}", "--tasks", "shakespeare_choise"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        "error: lm_eval: Tasks not found: shakespeare_choise (closest names: shakespeare_choise: shakespeare_choice, "
        "shakespeare_continue, shakespeare)")


def test_a_bundled_task_without_its_data_names_the_file_and_the_command(hf_folder, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no data/synthetic_gsm8k here
    code = load_script().main(["--model_args", f"pretrained={hf_folder}", "--tasks", "gsm8k_synthetic"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        "error: task gsm8k_synthetic reads data/synthetic_gsm8k/train.jsonl and data/synthetic_gsm8k/test.jsonl "
        f"(relative to the current directory {tmp_path}), which do not exist; make them with: .venv/bin/python "
        "scripts/make_synthetic_gsm8k.py --output data/synthetic_gsm8k/train.jsonl --num_problems 2000 --seed 0; "
        ".venv/bin/python scripts/make_synthetic_gsm8k.py --output data/synthetic_gsm8k/test.jsonl --num_problems 200 "
        "--seed 1")


def test_bundled_tasks_alone_index_only_their_folders():
    """Every task asked for is bundled (or in --include_path): lm_eval's own ~15k tasks are not indexed (10-25 s);
    one that is not bundled indexes them all, as lm_eval does."""
    from argparse import Namespace

    from titan_lite.eval.harness import evaluator_config, local_task_names

    bundled = [str(load_script().BUNDLED_TASKS)]
    assert local_task_names(bundled) == {"gsm8k_synthetic", "shakespeare", "shakespeare_choice",
                                         "shakespeare_continue", "shakespeare_rolling"}
    opts = Namespace(tasks="shakespeare_choice,shakespeare", include_path=bundled, num_fewshot=None, batch_size=1,
                     limit=None, output_path=None, log_samples=False, gen_kwargs=None, apply_chat_template=False,
                     seed=[0, 1234, 1234, 1234])
    _, manager = evaluator_config(opts, {"pretrained": "."})
    assert sorted(manager.all_tasks) == sorted(local_task_names(bundled))
