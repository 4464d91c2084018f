"""Layers point one way: each package imports only from lower layers (or itself); imports sit at module top."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "titan_lite"

# Bottom to top. A module may import from its own unit and from units of lower layers, never from a unit of its
# own layer or above. docs/architecture.md draws the same picture.
LAYERS = [
    ["titan_lite.errors"],
    ["titan_lite.folders"],
    ["titan_lite.config", "titan_lite.launcher"],
    ["titan_lite.distributed", "titan_lite.dtensor", "titan_lite.loss", "titan_lite.faults"],
    ["titan_lite.models", "titan_lite.data", "titan_lite.optim", "titan_lite.metrics"],
    ["titan_lite.parallel"],
    ["titan_lite.generate"],
    ["titan_lite.rl"],
    ["titan_lite.checkpoint"],
    ["titan_lite.transforms"],
    ["titan_lite.job"],
    ["titan_lite.objective"],
    ["titan_lite.eval", "titan_lite.dry_run"],
    ["titan_lite.train"],
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    """titan_lite.parallel.fsdp -> titan_lite.parallel; titan_lite.dry_run -> titan_lite.dry_run."""
    parts = module.split(".")
    return ".".join(parts[:2])


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) of every titan_lite import in the source, wherever it sits; relative imports (which the
    package does not use) come back as '.' so that they fail the check."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "." if node.level else node.module or ""))
    return [(line, name) for line, name in found if name.startswith("titan_lite") or name == "."]


def layering_violations(source: str, module: str) -> list[str]:
    """'module:line imports X (layer a) from layer b' for every import that points sideways or up."""
    own = unit_of(module)
    bad = []
    for line, name in imported_modules(source):
        target = unit_of(name)
        if target == own or name == "titan_lite":
            continue
        if name == ".":
            bad.append(f"{module}:{line} uses a relative import; write the absolute titan_lite module")
        elif target not in LAYER_OF:
            bad.append(f"{module}:{line} imports {name}, which has no layer in LAYERS")
        elif LAYER_OF[target] >= LAYER_OF[own]:
            bad.append(f"{module}:{line} imports {name} (layer {LAYER_OF[target]}) from layer {LAYER_OF[own]}")
    return bad


def unexplained_local_imports(source: str, module: str) -> list[str]:
    """Imports inside functions without a comment (on the line or just above) saying why they are not at the top."""
    lines = source.splitlines()
    bad = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                here, above = lines[node.lineno - 1], lines[node.lineno - 2] if node.lineno > 1 else ""
                if "#" not in here and not above.strip().startswith("#"):
                    bad.append(f"{module}:{node.lineno}: {here.strip()}")
    return bad


def package_modules() -> list[tuple[str, str]]:
    return [(module_name(p), p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))]


def test_every_unit_has_a_layer():
    units = {unit_of(name) for name, _ in package_modules() if name != "titan_lite"}
    assert units <= set(LAYER_OF), sorted(units - set(LAYER_OF))


def test_layers_import_downward_only():
    bad = [v for name, source in package_modules() for v in layering_violations(source, name)]
    assert bad == [], "\n".join(bad)


def test_imports_sit_at_module_top_unless_a_comment_says_why():
    bad = [v for name, source in package_modules() for v in unexplained_local_imports(source, name)]
    assert bad == [], "\n".join(bad)


@pytest.mark.parametrize("module, source, expected", [
    ("titan_lite.parallel.fsdp", "from titan_lite.train import Trainer\n",
     ["titan_lite.parallel.fsdp:1 imports titan_lite.train (layer 13) from layer 5"]),
    ("titan_lite.models.decoder", "import titan_lite.data.tokenizer\n",
     ["titan_lite.models.decoder:1 imports titan_lite.data.tokenizer (layer 4) from layer 4"]),
    ("titan_lite.checkpoint.hf", "def f():\n    from titan_lite.job.plan import JobPlan  # cycle\n",
     ["titan_lite.checkpoint.hf:2 imports titan_lite.job.plan (layer 10) from layer 8"]),
    ("titan_lite.job.plan", "from titan_lite.models.decoder import Llama\nfrom titan_lite.job import assembly\n", []),
])
def test_the_check_catches_a_bad_import(module, source, expected):
    assert layering_violations(source, module) == expected


def test_the_check_catches_an_unexplained_local_import():
    source = "def f():\n    import json\n\ndef g():\n    # optional dependency\n    import pyarrow\n"
    assert unexplained_local_imports(source, "titan_lite.x") == ["titan_lite.x:2: import json"]


# Modules that talk to transforms only through the contract of titan_lite/transforms/base.py (issue #24).
TRANSFORM_AGNOSTIC = ["dry_run.py", "job", "train.py", "parallel", "checkpoint/manager.py", "checkpoint/resume.py"]
# (DeepSeek-V3's q_lora_rank and kv_lora_rank are the model's own low-rank widths, not the LoRA transform.)
NAMES_A_TRANSFORM = re.compile(r'Sheared|[Pp]runing|"prune"|(?<!q_)(?<!kv_)lora|nf4|float8|'
                               r'from titan_lite\.transforms\.')


def code_lines(source: str) -> list[tuple[int, str]]:
    """(line number, text) of the lines holding code: comments and docstrings left out."""
    docstrings = {n for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Expr)
                  and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                  for n in range(node.lineno, node.end_lineno + 1)}
    return [(i, line.split("#", 1)[0]) for i, line in enumerate(source.splitlines(), 1) if i not in docstrings]


def test_no_module_outside_transforms_names_a_transform():
    paths = [p for entry in TRANSFORM_AGNOSTIC for p in
             ((PACKAGE / entry).rglob("*.py") if (PACKAGE / entry).is_dir() else [PACKAGE / entry])]
    found = [f"{p.relative_to(PACKAGE)}:{i}: {line.strip()}" for p in paths
             for i, line in code_lines(p.read_text()) if NAMES_A_TRANSFORM.search(line)]
    assert found == [], "\n".join(found)
