"""Collect, on a machine with a package index, every wheel that `scripts/setup_env.sh` installs (the runtime
dependencies, the extras you name, the build backend of the editable install, with all their dependencies) for
another machine's Python and platform, into one folder. Carry the folder over and install there with no index:
`TITAN_LITE_WHEELS=DIR scripts/setup_env.sh [test]`. Run it as scripts/wheelhouse.sh (this file is its body).

    scripts/wheelhouse.sh wheels/ --python 3.12 --extras test       # the GPU image: Python 3.12, its own torch 2.11
    scripts/wheelhouse.sh wheels/ --python 3.11 --with_torch        # a machine without torch (torch included)

The requirements are read from pyproject.toml. torch is not collected by default: the target keeps its own build
(a CUDA torch), and every other package is resolved against `--torch_version`, the version the target has;
`--with_torch` collects torch as well (on Linux x86_64 with its CUDA libraries: several GB). Environment markers are
evaluated for the target's Python and platform (pip evaluates them for the Python that runs it), so a dependency
only the target's Python needs is collected too. A manylinux platform accepts every older manylinux tag (pip
would match the named one exactly, and pick an older release, or none, for wheels tagged otherwise). The folder
gets titan_lite_wheelhouse.json, which setup_env.sh reads to check the Python and the extras before installing.
"""

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# The checkout's titan_lite (its command-line parser only: nothing here imports torch).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lite.job.cli import ScriptParser

try:  # packaging, or the copy pip vendors (every machine with pip has one)
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pragma: no cover - depends on the machine
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        from pip._vendor import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
MANIFEST = "titan_lite_wheelhouse.json"
GPU_IMAGE_TORCH = "2.11.0"  # the device machines' image: torch 2.11 with CUDA 13, Python 3.12
MANYLINUX = re.compile(r"manylinux_(\d+)_(\d+)_(\w+)")
LEGACY_MANYLINUX = {"manylinux2014": (2, 17), "manylinux2010": (2, 12), "manylinux1": (2, 5)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(__doc__, prog="scripts/wheelhouse.sh")
    parser.add_argument("dir", help="the folder to fill (created if needed; wheels already there are kept)")
    parser.add_argument("--python", default="3.12", help="the target machine's Python, major.minor")
    parser.add_argument("--platform", default="manylinux_2_28_x86_64",
                        help="the target's wheel platform: manylinux_2_N_x86_64 or _aarch64 (N: its glibc, "
                             "`ldd --version`), macosx_14_0_arm64, win_amd64, ...")
    parser.add_argument("--extras", help="comma list of pyproject.toml extras to collect too: test, "
                                                     "eval, parquet")
    parser.add_argument("--torch_version", default=GPU_IMAGE_TORCH,
                        help="the torch the target has: the other packages are resolved against it")
    parser.add_argument("--with_torch", action="store_true",
                        help="collect torch too (torch==--torch_version from the index, with its dependencies)")
    opts = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", opts.python):
        parser.error(f"--python '{opts.python}' is not a version such as 3.12")
    return opts


# ------------------------------------------------------------------------------------------ requirements


def requirements(extras: list[str]) -> list[str]:
    """pyproject.toml's runtime dependencies, the named extras, and the build backend (the editable install
    builds titan_lite with it, from the same folder)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    optional = project["project"].get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"error: --extras {','.join(unknown)}: pyproject.toml has no such extra (it has: "
                         f"{', '.join(optional)})")
    return [*project["project"]["dependencies"], *(r for e in extras for r in optional[e]),
            *project["build-system"]["requires"], "wheel"]


def platforms(platform: str) -> list[str]:
    """The platform and every older manylinux tag a machine with that glibc accepts."""
    match = MANYLINUX.fullmatch(platform)
    if not match:
        return [platform]
    major, minor, arch = int(match[1]), int(match[2]), match[3]
    tags = [f"manylinux_{major}_{m}_{arch}" for m in range(minor, 4, -1)]
    return tags + [f"{name}_{arch}" for name, glibc in LEGACY_MANYLINUX.items() if glibc <= (major, minor)]


def target_environment(python: str, platform: str) -> dict[str, str]:
    """The environment markers of the target machine."""
    linux = re.fullmatch(r"(?:(?:many|musl)linux(?:_\d+_\d+|2014|2010|1)?|linux)_(\w+)", platform)
    arch = linux[1] if linux else ""
    system = "Linux" if arch else "Darwin" if platform.startswith("macosx") else "Windows"
    if system == "Darwin":
        arch = "arm64" if platform.endswith("arm64") else "x86_64"
    elif system == "Windows":
        arch = "AMD64" if platform.endswith("amd64") else "ARM64"
    return {"python_version": python, "python_full_version": f"{python}.0", "implementation_name": "cpython",
            "implementation_version": f"{python}.0", "platform_python_implementation": "CPython",
            "os_name": "nt" if system == "Windows" else "posix", "platform_system": system,
            "sys_platform": {"Linux": "linux", "Darwin": "darwin", "Windows": "win32"}[system],
            "platform_machine": arch, "platform_release": "", "platform_version": ""}


def applies(requirement: Requirement, env: dict[str, str], extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**env, "extra": extra}) for extra in extras | {""})


# ------------------------------------------------------------------------------------------ pip


def pip_target(opts: argparse.Namespace) -> list[str]:
    abi = f"cp{opts.python.replace('.', '')}"
    flags = ["--only-binary=:all:", "--python-version", opts.python, "--implementation", "cp", "--abi", abi,
             "--abi", "abi3", "--abi", "none"]
    for tag in [*platforms(opts.platform), "any"]:
        flags += ["--platform", tag]
    return flags


def pip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pip", *args]
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if check and result.returncode != 0:
        raise SystemExit(f"error: pip {args[0]} failed: {pip_errors(result.stderr)}")
    return result


def pip_errors(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("ERROR")]
    return " ".join(errors or stderr.strip().splitlines()[-3:])


def build_pure_wheel(requirement: str, folder: Path) -> None:
    """A package published as source only (lm-eval's sqlitedict, say) built into a wheel here: accepted when it is
    pure Python (py3-none-any), which installs on any target; anything else must be built on the target."""
    before = set(folder.glob("*.whl"))
    print(f"[wheelhouse] {requirement} has no wheel on the index: building one from its source", flush=True)
    pip("wheel", "--no-deps", "--disable-pip-version-check", "-q", "-w", str(folder), requirement)
    for wheel in set(folder.glob("*.whl")) - before:
        if not wheel.name.endswith("-py3-none-any.whl") and not wheel.name.endswith("-py2.py3-none-any.whl"):
            raise SystemExit(f"error: {requirement} has no wheel for the target on the index and builds into "
                             f"{wheel.name}, which is not pure Python: build its wheel on the target machine")


def stub_torch(folder: Path, version: str) -> str:
    """A metadata-only torch wheel standing for the target's own torch, so that resolving the packages that
    depend on torch neither downloads nor backtracks through torch's own (GB-sized) wheels."""
    name = f"torch-{version}+wheelhouse.stub"
    dist_info = f"torch-{version}+wheelhouse.stub.dist-info"
    with zipfile.ZipFile(folder / f"{name}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}"
                                                "+wheelhouse.stub\n")
        wheel.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nGenerator: wheelhouse\nRoot-Is-Purelib: true\n"
                                             "Tag: py3-none-any\n")
        wheel.writestr(f"{dist_info}/RECORD", "")
    return f"torch=={version}+wheelhouse.stub"


def resolve(opts: argparse.Namespace, roots: list[str], work: Path) -> dict[str, tuple[str, list[str]]]:
    """pip's resolution of `roots` for the target: name -> (version, Requires-Dist)."""
    report = work / "report.json"
    extra = ["--find-links", str(work / "built")]
    if not opts.with_torch:
        (work / "constraints.txt").write_text(stub_torch(work, opts.torch_version) + "\n")
        extra += ["--find-links", str(work), "--constraint", str(work / "constraints.txt")]
    for _ in range(10):  # each round builds one more source-only package
        result = pip("install", "--dry-run", "--ignore-installed", "--disable-pip-version-check", "-q", "--target",
                     str(work / "never"), "--report", str(report), *pip_target(opts), *extra, *roots, check=False)
        source_only = re.search(r"No matching distribution found for (\S+)", result.stderr)
        if result.returncode == 0 or source_only is None:
            break
        build_pure_wheel(source_only[1], work / "built")
    if result.returncode != 0:
        raise SystemExit(f"error: pip could not resolve the requirements for the target: {pip_errors(result.stderr)}")
    return {canonicalize_name(item["metadata"]["name"]): (item["metadata"]["version"],
                                                         item["metadata"].get("requires_dist") or [])
            for item in json.loads(report.read_text())["install"]}


def needed(roots: list[str], resolved: dict, env: dict[str, str], skip: set[str]) -> tuple[dict[str, str], list]:
    """(name -> version of every package the target needs, requirements the resolution lacks): a walk from the
    roots with the target's markers; `skip` (torch) is neither collected nor followed."""
    found: dict[str, str] = {}
    missing, seen = [], set()
    stack = [(Requirement(r), set()) for r in roots]
    while stack:
        requirement, parent_extras = stack.pop()
        name = canonicalize_name(requirement.name)
        if not applies(requirement, env, parent_extras) or name in skip:
            continue
        if name not in resolved:
            missing.append(requirement)
            continue
        key = (name, frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        version, requires = resolved[name]
        found[name] = version
        stack += [(Requirement(r), set(requirement.extras)) for r in requires]
    return found, missing


def collect(opts: argparse.Namespace) -> str:
    extras = [e for e in (opts.extras or "").split(",") if e]
    roots = requirements(extras)
    if opts.with_torch:
        roots.append(f"torch=={opts.torch_version}")
    env = target_environment(opts.python, opts.platform)
    skip = set() if opts.with_torch else {"torch"}
    print(f"[wheelhouse] resolving {len(roots)} requirements of pyproject.toml (extras: {', '.join(extras) or 'none'})"
          f" for Python {opts.python} on {opts.platform}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "built").mkdir()
        for _ in range(3):  # each round adds what only the target's markers ask for
            resolved = resolve(opts, roots, Path(tmp))
            pins, missing = needed(roots, resolved, env, skip)
            if not missing:
                break
            for requirement in missing:  # the markers held for the target: ask pip for it unconditionally
                requirement.marker = None
                roots.append(str(requirement))
        else:
            raise SystemExit(f"error: could not resolve {', '.join(map(str, missing))} for the target")
        out = Path(opts.dir)
        out.mkdir(parents=True, exist_ok=True)
        print(f"[wheelhouse] downloading {len(pins)} wheels into {out}", flush=True)
        pip("download", "--no-deps", "--disable-pip-version-check", "-q", "-d", str(out), *pip_target(opts),
            "--find-links", str(Path(tmp) / "built"), *(f"{name}=={version}" for name, version in sorted(pins.items())))
    torch = f"torch {opts.torch_version} included" if opts.with_torch else \
        f"torch not included: the target's own, resolved against {opts.torch_version}"
    (out / MANIFEST).write_text(json.dumps({"python": opts.python, "platform": opts.platform, "extras": extras,
                                            "torch": torch, "packages": dict(sorted(pins.items()))}, indent=1) + "\n")
    wheels = list(out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    extra_arg = " test" if "test" in extras else ""  # setup_env.sh's one extra (eval: see docs/setup.md)
    return (f"wheelhouse ready: {len(wheels)} wheels ({size:,.0f} MiB) in {out.resolve()} for Python {opts.python} "
            f"on {opts.platform}, extras: {', '.join(extras) or 'none'}; {torch}; install there with: "
            f"TITAN_LITE_WHEELS={out.resolve()} scripts/setup_env.sh{extra_arg}")


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if importlib.util.find_spec("pip") is None:
        print(f"error: {sys.executable} has no pip to download with (set PYTHON_BIN to a python that has)",
              file=sys.stderr)
        return 2
    try:
        print(collect(opts), flush=True)
    except SystemExit as exc:
        print(exc, file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted (Ctrl-C); the folder may hold part of the wheels", file=sys.stderr, flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
