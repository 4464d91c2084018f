"""The README's commands stay true: every run_train.sh line in it parses against the config schema, and every
script line runs with the environment's Python as written (`.venv/bin/python scripts/...`, no activated venv) and
parses with that script's own parser."""

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from titan_lite.config import parse_args, validate
from titan_lite.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def readme_train_commands() -> list[tuple[dict[str, str], list[str]]]:
    """(environment assignments, override arguments) of each `./run_train.sh` command in the README's code blocks."""
    text = (REPO / "README.md").read_text()
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
    """(script name, arguments) of each line of the README's code blocks that runs a script, with the interpreter
    it names checked: `.venv/bin/python scripts/x.py` or `.venv/bin/torchrun ... scripts/x.py`."""
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if not re.search(r"scripts/\w+\.py", line):  # the shell scripts (setup, tests, wheels) take no options
                continue
            words = shlex.split(line)
            at = next(i for i, w in enumerate(words) if w.startswith("scripts/") and w.endswith(".py"))
            assert words[0] in (".venv/bin/python", ".venv/bin/torchrun"), f"README runs a script bare: {line}"
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
            raise AssertionError(f"README: scripts/{name}.py {' '.join(args)} does not parse") from exc


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
        raise AssertionError(f"README command {env} {args}: {exc}") from None
    # Paths to the user's own data (e.g. /data/c4/en) are not here; everything else must validate.
    cfg.training.dataset_path = None
    cfg.checkpoint.initial_load_path = None
    cfg.pruning.dataset_path = None
    validate(cfg)


def test_readme_lists_at_least_the_workflows():
    commands = readme_train_commands()
    assert len(commands) >= 6
    assert any(env.get("DRY_RUN") == "1" for env, _ in commands)
    assert any(env.get("NNODES") == "2" for env, _ in commands)
