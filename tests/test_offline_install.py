"""The offline install as docs/setup.md gives it: scripts/wheelhouse.sh fills a folder on a machine with an index, and
`TITAN_LITE_WHEELS=DIR scripts/setup_env.sh` installs from it with the index switched off, keeping the machine's own
torch (a GPU image's python3 is a virtual environment holding a CUDA torch)."""

import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
PYTHON = f"{sys.version_info[0]}.{sys.version_info[1]}"
# The interpreter this test's own venv was made from: the image's python is a venv of it, like the GPU image's
# python3 (/opt/torch/.venv/bin/python3), through which setup_env.sh must see.
BASE_PYTHON = Path(sys.base_prefix) / "bin" / f"python{PYTHON}"
RUNTIME = {"torchdata", "tomli", "tensorboard", "sentencepiece", "tiktoken", "safetensors", "torchao"}


def link_distribution_closure(name: str, folder: Path) -> None:
    """Symlinks to the installed files of `name` and everything it requires, in `folder`: a site folder holding
    this test's torch, as a GPU image's environment holds its own (copying torch would cost a minute)."""
    folder.mkdir()
    todo, seen = [name], set()
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        key = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
        if key in seen:
            continue
        seen.add(key)
        todo += [r.name for r in map(Requirement, dist.requires or [])
                 if r.marker is None or r.marker.evaluate({"extra": ""})]
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            source = Path(dist.locate_file(top))
            if source.exists() and not top.endswith(".pth") and not (folder / top).exists():
                (folder / top).symlink_to(source)


def offline_environment(**extra: str) -> dict[str, str]:
    """This environment with the index switched off: no index, no extra index, no find-links or pip config that
    could bring another copy of a wheel in (only the wheelhouse), and no PYTHONPATH to this checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    # PIP_NO_COMPILE: no .pyc files written at install (time only; what is installed, and from where, is the same)
    return env | {"PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull, "PIP_NO_COMPILE": "1"} | extra


def run(argv: list, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow  # downloads the runtime wheels (~45 MiB, 15 s) and installs them into a fresh venv (30 s)
def test_a_runtime_wheelhouse_installs_with_the_index_switched_off(tmp_path):
    wheels = tmp_path / "wheels"
    # here the index is reachable; the folder named as docs/setup.md does, relative to where the command runs
    built = run([REPO / "scripts" / "wheelhouse.sh", "wheels/", "--python", PYTHON], cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    last = built.stdout.strip().splitlines()[-1]
    assert last.startswith("wheelhouse ready: ") and last.endswith(
        f"install there with: TITAN_LITE_WHEELS={wheels} scripts/setup_env.sh"), built.stdout
    packages = json.loads((wheels / "titan_lite_wheelhouse.json").read_text())["packages"]
    assert RUNTIME <= set(packages) and "torch" not in packages, packages
    assert not list(wheels.glob("torch-*.whl"))

    # The machine's own python: a virtual environment holding torch (and nothing else titan_lite needs).
    image = tmp_path / "image"
    assert run([BASE_PYTHON, "-m", "venv", "--without-pip", image]).returncode == 0
    link_distribution_closure("torch", tmp_path / "image_torch")
    site = next((image / "lib").glob("python3*/site-packages"))
    (site / "image_torch.pth").write_text(f"import site; site.addsitedir({str(tmp_path / 'image_torch')!r})\n")

    venv = tmp_path / "venv"
    env = offline_environment(PYTHON_BIN=str(image / "bin" / "python"), TITAN_LITE_VENV=str(venv),
                              TITAN_LITE_WHEELS=str(wheels))
    refused = run([REPO / "scripts" / "setup_env.sh", "test"], env)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        f"error: the wheelhouse {wheels} was built without the 'test' extra (extras: none); rebuild it with "
        f"scripts/wheelhouse.sh {wheels} --python {PYTHON} --extras test"), refused.stderr

    installed = run([REPO / "scripts" / "setup_env.sh"], env)
    assert installed.returncode == 0, installed.stderr
    assert installed.stdout.strip() == str(venv / "bin" / "python")
    names = ["titan_lite", "torch", *sorted(RUNTIME)]
    where = run([venv / "bin" / "python", "-c", f"import {', '.join(names)}; "
                 f"print('\\n'.join(m.__file__ for m in ({', '.join(names)})))"], env, cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    files = dict(zip(names, where.stdout.split(), strict=True))
    assert files["titan_lite"] == str(REPO / "titan_lite" / "__init__.py")  # the editable install of the checkout
    assert files["torch"].startswith(str(tmp_path / "image_torch"))  # the machine's own torch, kept
    for name in RUNTIME:  # from the wheelhouse, into the new venv
        assert files[name].startswith(str(venv)), (name, files[name])


def test_the_readmes_relative_wheelhouse_path_is_read_from_where_the_command_runs(tmp_path):
    """`TITAN_LITE_WHEELS=wheels/ scripts/setup_env.sh`, as docs/setup.md writes it: the folder is found from the
    current directory (setup_env.sh's checks run elsewhere), here to refuse one built for another Python in one line."""
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "titan_lite_wheelhouse.json").write_text(json.dumps({"python": "2.7", "extras": []}))
    env = offline_environment(PYTHON_BIN=str(BASE_PYTHON), TITAN_LITE_VENV=str(tmp_path / "venv"),
                              TITAN_LITE_WHEELS="wheels/")
    refused = run([REPO / "scripts" / "setup_env.sh"], env, cwd=tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == (
        f"error: the wheelhouse {tmp_path / 'wheels'} holds wheels for Python 2.7, but {tmp_path / 'venv'}/bin/python "
        f"is {PYTHON}; rebuild it with scripts/wheelhouse.sh {tmp_path / 'wheels'} --python {PYTHON}")


def load_wheelhouse():
    spec = importlib.util.spec_from_file_location("wheelhouse", REPO / "scripts" / "wheelhouse.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wheelhouse_resolves_for_the_targets_tags_and_markers():
    """The two causes of the air-gapped failures: pip matched one manylinux tag exactly (packages tagged for an older
    glibc were missed, or an old release taken), and the wheels were a hand-kept list rather than pyproject.toml's
    closure evaluated for the target's Python."""
    wheelhouse = load_wheelhouse()
    tags = wheelhouse.platforms("manylinux_2_28_x86_64")
    assert tags[:2] == ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64"] and "manylinux_2_17_x86_64" in tags
    assert {"manylinux2014_x86_64", "manylinux1_x86_64"} <= set(tags)
    env = wheelhouse.target_environment("3.12", "manylinux_2_28_x86_64")
    assert env["python_version"] == "3.12" and env["platform_machine"] == "x86_64" and env["sys_platform"] == "linux"
    resolved = {"peft": ("0.13", ["torch>=1.13", "tqdm", "colorama; python_version < '3.9'",
                                  "setuptools; python_version >= '3.12'"]),
                "torch": ("2.11.0", ["sympy"]), "tqdm": ("4.0", [])}
    found, missing = wheelhouse.needed(["peft>=0.13"], resolved, env, skip={"torch"})
    assert found == {"peft": "0.13", "tqdm": "4.0"}  # torch is the target's own: neither collected nor followed
    assert [str(r) for r in missing] == ['setuptools; python_version >= "3.12"']  # asked for again, unconditionally
    roots = wheelhouse.requirements(["test"])
    assert {"transformers>=4.45", "tensorboard>=2.15", "setuptools>=64"} <= set(roots)  # test extra, runtime, backend
