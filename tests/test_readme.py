"""The documentation's commands stay true (README.md and every guide in docs/): every run_train.sh line parses
against the config schema, and every script line runs with the environment's Python as written (`.venv/bin/python
scripts/...`, no activated venv) and parses with that script's own parser; no line runs a bare python or pip; each
module run (`-m benchmarks.x`) names a module of the checkout and parses with its parser; each training example writes
its own output folder."""

import importlib
import importlib.util
import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from titan_lite.config import parse_args, validate
from titan_lite.errors import ConfigError, pip_install

REPO = Path(__file__).resolve().parents[1]


def documentation() -> str:
    """README.md and the guides in docs/, one after the other: where the commands a user copies are."""
    paths = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert len(paths) >= 15, "README.md and its guides in docs/"
    return "\n".join(path.read_text() for path in paths)


def readme_train_commands() -> list[tuple[dict[str, str], list[str]]]:
    """(environment assignments, override arguments) of each `./run_train.sh` command in the documentation's code
    blocks."""
    text = documentation()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#")[0].strip().rstrip("&").strip()
            if "./run_train.sh" not in line or line.startswith("$"):
                continue
            words = shlex.split(line)
            at = words.index("./run_train.sh")
            env = dict(w.split("=", 1) for w in words[:at] if "=" in w)
            commands.append((env, words[at + 1:]))
    return commands


def readme_script_commands() -> list[tuple[str, list[str]]]:
    """(script name, arguments) of each line of the documentation's code blocks that runs a script, with the
    interpreter it names checked: `.venv/bin/python scripts/x.py` or `.venv/bin/torchrun ... scripts/x.py`."""
    text = documentation()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if not re.search(r"scripts/\w+\.py", line):  # the shell scripts (setup, tests, wheels) take no options
                continue
            words = shlex.split(line)
            at = next(i for i, w in enumerate(words) if w.startswith("scripts/") and w.endswith(".py"))
            assert words[0] in (".venv/bin/python", ".venv/bin/torchrun"), f"a documented script runs bare: {line}"
            commands.append((Path(words[at]).stem, words[at + 1:]))
    return commands


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"readme_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_script_commands_parse_with_their_scripts():
    commands = readme_script_commands()
    assert len(commands) >= 15 and {name for name, _ in commands} >= {"merge_lora", "generate", "eval_answers",
                                                                         "prune", "eval_ppl", "make_synthetic_gsm8k"}
    for name, args in commands:
        assert (REPO / "scripts" / f"{name}.py").is_file(), name
        try:
            load_script(name).parse_args(args)
        except SystemExit as exc:
            raise AssertionError(f"documentation: scripts/{name}.py {' '.join(args)} does not parse") from exc


def test_readme_has_the_two_setup_commands():
    text = (REPO / "README.md").read_text()
    assert "./run_train.sh            # trains" in text and "./scripts/run_tests.sh" in text
    assert "./scripts/run_tests.sh" in (REPO / ".ci" / "run").read_text()


@pytest.mark.parametrize("env, args", readme_train_commands())
def test_readme_command_parses(env, args):
    config = env.get("CONFIG_FILE", "train_configs/debug_model.toml")
    assert (REPO / config).is_file(), config
    try:
        cfg = parse_args(["--job.config_file", str(REPO / config), *args])
    except ConfigError as exc:
        raise AssertionError(f"documented command {env} {args}: {exc}") from None
    # Paths to the user's own data (e.g. /data/c4/en) are not here; everything else must validate.
    cfg.training.dataset_path = cfg.validation.dataset_path = None
    cfg.checkpoint.initial_load_path = None
    cfg.pruning.dataset_path = None
    validate(cfg)


def test_readme_lists_at_least_the_workflows():
    commands = readme_train_commands()
    assert len(commands) >= 6
    assert any(env.get("DRY_RUN") == "1" for env, _ in commands)
    assert any(env.get("NNODES") == "2" for env, _ in commands)


# ------------------------------------------------------------------------------------------ as written

# a command word with an argument after it: `python -m ...`, `pip install ...` (a bare `python` in prose is a name)
BARE = re.compile(r"^(?:\$ )?(?:[A-Z_]+=\S* )*(python3?|pip3?|torchrun) +\S")


def readme_command_lines() -> list[str]:
    """Every line of the documentation's code blocks (continuations joined) and every inline code span: where a
    command the reader copies can be."""
    text = documentation()
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    lines = [line.strip() for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return lines + [span.strip() for span in re.findall(r"`([^`\n]+)`", prose)]


def test_no_readme_line_runs_a_bare_python_or_pip():
    """A bare `python`/`pip` is whatever the shell finds first, not the checkout's .venv: every command names it."""
    bare = [line for line in readme_command_lines() if BARE.match(line)]
    assert not bare, f"the documentation runs a bare python or pip (use .venv/bin/python, .venv/bin/pip): {bare}"
    assert BARE.match("pip install -e .[eval]") and BARE.match("OMP_NUM_THREADS=2 python -m benchmarks.run")
    assert not BARE.match(".venv/bin/pip install -e '.[eval]'")


def test_install_hints_name_the_environments_pip(monkeypatch, tmp_path):
    """Error lines that say what to install name the pip of the Python that is running."""
    checkout = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(checkout)
    monkeypatch.setattr(sys, "prefix", str(checkout / ".venv"))
    assert pip_install(extra="eval") == ".venv/bin/pip install -e '.[eval]'"
    assert pip_install("huggingface_hub") == ".venv/bin/pip install huggingface_hub"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "prefix", "/opt/other")
    monkeypatch.setattr(sys, "executable", "/opt/other/bin/python3")
    assert pip_install(extra="eval") == f"/opt/other/bin/python3 -m pip install -e '{checkout}[eval]'"


def readme_module_commands() -> list[tuple[str, list[str]]]:
    """(module, arguments) of each `.venv/bin/python -m <module> ...` in the documentation."""
    found = []
    for line in readme_command_lines():
        line = line.split("  #")[0].strip()
        words = shlex.split(line) if line.startswith(".venv/bin/python -m ") else []
        if words:
            found.append((words[2], words[3:]))
    return found


def test_readme_module_runs_name_modules_of_the_checkout_and_parse():
    """`.venv/bin/python -m benchmarks.run ...` runs from the checkout (its folder is on the path for -m): each module
    is there, and its arguments parse with its own parser."""
    commands = readme_module_commands()
    modules = {m for m, _ in commands}
    assert {"benchmarks.run", "benchmarks.memory_plan", "benchmarks.gpu", "titan_lite.train"} <= modules, modules
    for module, args in commands:
        assert importlib.util.find_spec(module) is not None, module
        if module == "titan_lite.train":
            assert args == ["--help"] or parse_args(args)
            continue
        code = importlib.import_module(module)
        parser = getattr(code, "parse", None) or getattr(code, "parse_args", None)
        if parser is not None:
            parser(args)


def test_each_training_example_writes_its_own_folder():
    """Two documented examples that train into one folder would mix their logs, and the second would resume (or
    refuse) the first's checkpoints: each has its own job.dump_folder (the two-node example is one run on two nodes;
    an example the README repeats from its guide is the same example)."""
    owners: dict[str, str] = {}
    seen = set()
    for env, args in readme_train_commands():
        if env.get("DRY_RUN") == "1" or env.get("NODE_RANK") == "1" or (key := repr((env, args))) in seen:
            continue
        seen.add(key)
        config = env.get("CONFIG_FILE", "train_configs/debug_model.toml")
        cfg = parse_args(["--job.config_file", str(REPO / config), *args])
        folder = os.path.normpath(cfg.job.dump_folder)
        command = f"{config} {' '.join(args)}"
        assert folder not in owners, f"documented examples share {folder}: '{owners[folder]}' and '{command}'"
        owners[folder] = command
    assert len(owners) >= 15 and "outputs/debug" in owners


def test_the_preference_row_the_guide_quotes_is_the_one_its_commands_write(tmp_path, capsys):
    """docs/preference.md shows a row of its CPU example: the commands given there (the first conversations of the
    seeded generators are the same whatever their count) write exactly that row."""
    text = (REPO / "docs" / "preference.md").read_text()
    quoted = re.search(r"the second row of the CPU example below: `(\{.*?\})`", text, flags=re.S).group(1)
    chat, pairs = tmp_path / "chat.jsonl", tmp_path / "pairs.jsonl"
    assert load_script("make_synthetic_chat").main(["--output", str(chat), "--num_conversations", "2",
                                                    "--seed", "0"]) == 0
    assert load_script("make_synthetic_preferences").main(["--chat", str(chat), "--output", str(pairs),
                                                           "--seed", "0"]) == 0
    capsys.readouterr()
    assert json.loads(quoted.replace("\n  ", " ")) == json.loads(pairs.read_text().splitlines()[1])


def test_the_front_door_fine_tunes_a_downloaded_model():
    """README.md shows the path from a Hugging Face repo to a trained, exported adapter: the download, a LoRA run
    that starts from the folder it downloads into, and where the Wanda example's model and C4 shard come from."""
    text = (REPO / "README.md").read_text()
    scripts = [(name, args) for name, args in readme_script_commands() if name == "download_hf_assets"]
    assert ("download_hf_assets", ["meta-llama/Llama-3.2-1B", "--include", "weights"]) in scripts
    runs = [args for _, args in readme_train_commands() if "--checkpoint.initial_load_in_hf" in args]
    front = next(args for args in runs if args[args.index("--model.hf_assets_path") + 1] == "assets/hf/Llama-3.2-1B")
    cfg = parse_args(["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), *front])
    assert cfg.model.converters == ["lora"] and cfg.checkpoint.last_save_in_hf and cfg.checkpoint.enable
    assert text.index("## Fine-tune a Hugging Face model") < text.index("## What works")
    assert "hf download allenai/c4 en/c4-train.00000-of-01024.json.gz --repo-type dataset --local-dir /data/c4" in text


def test_run_tests_runs_only_the_paths_it_is_given():
    import subprocess

    env = dict(os.environ, TITAN_LITE_TEST_WORKERS="1")
    out = subprocess.run([str(REPO / "scripts" / "run_tests.sh"), "tests/test_docs_links.py", "--collect-only"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    collected = [line for line in out.stdout.splitlines() if "::" in line]
    assert out.returncode == 0 and collected, out.stdout + out.stderr
    assert all(line.startswith("tests/test_docs_links.py::") for line in collected), collected[:5]
