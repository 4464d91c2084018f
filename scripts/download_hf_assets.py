"""Download a Hugging Face repo's config and tokenizer (optionally its safetensors weights) into assets/hf/<name>.

    .venv/bin/python scripts/download_hf_assets.py meta-llama/Llama-3.2-1B                    # config + tokenizer
    .venv/bin/python scripts/download_hf_assets.py meta-llama/Llama-3.2-1B --include weights  # ... + safetensors
    .venv/bin/python scripts/download_hf_assets.py HuggingFaceTB/SmolLM2-135M --all --exclude 'onnx/*'

Needs `.venv/bin/pip install huggingface_hub`. Gated repos (Meta's Llama) need an account with access: run
`.venv/bin/hf auth login` or set HF_TOKEN. The folder must be new, empty, or a download of the same repo (to add files
or resume): files are never mixed into another folder.
"""

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

# The checkout's titan_lite, whichever python runs the script (e.g. `.venv/bin/python scripts/...`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lite.errors import ConfigError, pip_install
from titan_lite.folders import OUTPUT_MARKER, check_replaceable, mark_written, written_files
from titan_lite.job.cli import ScriptParser

# Named groups accepted by --include besides glob patterns.
FILE_GROUPS = {
    "config": ["config.json", "generation_config.json"],
    "tokenizer": ["tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json"],
    "weights": ["*.safetensors", "model.safetensors.index.json"],
}
DEFAULT_GROUPS = ("config", "tokenizer")
LOGIN_HINT = "run `.venv/bin/hf auth login` or set HF_TOKEN"


class DownloadError(Exception):
    """A failure explained in one line for the user."""


@dataclass
class Plan:
    repo_id: str
    local_dir: Path
    allow_patterns: list[str] | None  # None: every file
    ignore_patterns: list[str] | None
    revision: str | None
    token: str | None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(__doc__)
    parser.add_argument("repo_id", help="e.g. meta-llama/Llama-3.2-1B")
    parser.add_argument("--local_dir", help="destination (default: assets/hf/<repo name>)")
    parser.add_argument("--all", action="store_true", help="every file of the repo")
    parser.add_argument("--include", action="append", default=[], metavar="PATTERN",
                        help=f"also fetch files matching a glob or a group ({', '.join(FILE_GROUPS)}); repeatable")
    parser.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                        help="skip files matching a glob; repeatable")
    parser.add_argument("--revision", help="branch, tag or commit")
    parser.add_argument("--token", help="a Hugging Face token (default: HF_TOKEN or the cached login)")
    return parser.parse_args(argv)


def expand_patterns(names: list[str]) -> list[str]:
    """Group names replaced by their globs, duplicates dropped, order kept."""
    patterns = []
    for name in names:
        for pattern in FILE_GROUPS.get(name, [name]):
            if pattern not in patterns:
                patterns.append(pattern)
    return patterns


def build_plan(opts: argparse.Namespace) -> Plan:
    repo_id = opts.repo_id.strip().strip("/")
    if not repo_id or repo_id.count("/") > 1 or " " in repo_id:
        raise DownloadError(f"'{opts.repo_id}' is not a repo id; expected 'owner/name' such as meta-llama/Llama-3.2-1B")
    local_dir = Path(opts.local_dir) if opts.local_dir else Path("assets/hf") / repo_id.split("/")[-1]
    allow = None if opts.all else expand_patterns([*DEFAULT_GROUPS, *opts.include])
    ignore = expand_patterns(opts.exclude) or None
    return Plan(repo_id, local_dir, allow, ignore, opts.revision, opts.token)


def import_hub():
    try:
        import huggingface_hub
    except ImportError:
        raise DownloadError(f"huggingface_hub is not installed: {pip_install('huggingface_hub')}") from None
    return huggingface_hub


def _hub_error(name: str) -> type:
    """An exception class of huggingface_hub by name, wherever this version keeps it (a stand-in never raised
    when this version lacks it)."""
    for module in ("huggingface_hub.errors", "huggingface_hub.utils"):
        try:
            return getattr(__import__(module, fromlist=[name]), name)
        except (ImportError, AttributeError):
            continue
    return type(name, (Exception,), {})


def explain(exc: Exception, repo_id: str) -> str:
    """One line saying what went wrong and what to do."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, _hub_error("GatedRepoError")):
        return f"{repo_id} is gated: request access on its Hugging Face page, then {LOGIN_HINT}"
    if isinstance(exc, _hub_error("RepositoryNotFoundError")):
        return f"{repo_id} was not found or is private: check the id; if it is private, {LOGIN_HINT}"
    if isinstance(exc, _hub_error("RevisionNotFoundError")):
        return f"{repo_id} has no such revision"
    if isinstance(exc, (_hub_error("OfflineModeIsEnabled"), _hub_error("LocalEntryNotFoundError"))):
        return (f"cannot reach the Hugging Face Hub (offline: HF_HUB_OFFLINE set or no network) and {repo_id} "
                "is not in the local cache")
    if status in (401, 403):
        return f"not authorised to download {repo_id} (HTTP {status}): {LOGIN_HINT}"
    if isinstance(exc, (OSError, _hub_error("HfHubHTTPError"))) or "connect" in type(exc).__name__.lower():
        return f"download of {repo_id} failed (network?): {' '.join(str(exc).split())[:200]}"
    raise exc


def check_local_dir(plan: Plan) -> None:
    """The folder is new or empty, or holds a download of this repo (ours, or huggingface_hub's unfinished one):
    another repo's files, or a folder of the user's, are never downloaded into."""
    marker = plan.local_dir / OUTPUT_MARKER
    if marker.is_file():
        repo = json.loads(marker.read_text()).get("repo_id")
        if repo is not None and repo != plan.repo_id:
            raise DownloadError(f"--local_dir '{plan.local_dir}' holds a download of {repo}, not {plan.repo_id}: "
                                "name another folder")
        return
    if (plan.local_dir / ".cache" / "huggingface").is_dir():
        return  # a download huggingface_hub began there: it resumes
    try:
        check_replaceable("--local_dir", plan.local_dir)
    except ConfigError as exc:
        raise DownloadError(str(exc)) from None


def download(plan: Plan) -> Path:
    hub = import_hub()
    try:
        path = hub.snapshot_download(plan.repo_id, local_dir=str(plan.local_dir), allow_patterns=plan.allow_patterns,
                                     ignore_patterns=plan.ignore_patterns, revision=plan.revision, token=plan.token)
    except Exception as exc:  # noqa: BLE001 - turned into one line by explain() or re-raised
        raise DownloadError(explain(exc, plan.repo_id)) from None
    return Path(path)


def entries(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name != OUTPUT_MARKER] if folder.is_dir() else []


def main(argv: list[str] | None = None) -> int:
    try:
        plan = build_plan(parse_args(argv))
        check_local_dir(plan)
        before = set(entries(plan.local_dir))
        recorded = written_files(plan.local_dir) or set()
        path = download(plan)
        # the marker lists what the downloads brought, never a file that was there before them and not theirs
        mark_written(path, recorded | (set(entries(path)) - before), repo_id=plan.repo_id, revision=plan.revision)
    except DownloadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    files = sorted(p.name for p in path.iterdir() if p.is_file() and p.name != OUTPUT_MARKER)
    print(f"downloaded {plan.repo_id} to {path}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
