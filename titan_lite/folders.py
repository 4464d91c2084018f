"""Every folder titan_lite writes (a script's output, the trainer's Hugging Face and adapter exports, a token folder,
a re-masked model) is written whole into its partial folder `.NAME.partial` beside it and renamed into place, and
may replace only a folder that is new, empty, or one titan_lite wrote (the names its marker lists): a folder holding
anything else is one ConfigError line naming it and stays as it is. Light (no torch), at the bottom of the layers.

    check_replaceable("--output_dir", out)           # before any long work: one ConfigError line, nothing changed
    with output_folder("--output_dir", out) as tmp:  # write the whole output into tmp; it replaces `out` at the end
        (tmp / "data.bin").write_bytes(...)
"""

import json
import shutil
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from titan_lite.errors import ConfigError, quote_path

OUTPUT_MARKER = "titan_lite_output.json"  # written into every folder titan_lite writes: what wrote it, and its files
FILES = "files"  # the marker's list of the names titan_lite wrote into the folder
ANOTHER = "name another folder"  # the way out a refusal names, unless the writer's caller knows a better one
# How a script's --help describes a folder it writes.
FOLDER_HELP = ("a new or empty folder, or one titan_lite wrote, whose files it replaces (a folder that holds anything "
               "else is refused, naming it)")


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _new_or(instead: str) -> str:
    return "name a new or empty folder" if instead == ANOTHER else instead


def written_files(folder: str | Path) -> set[str] | None:
    """The names titan_lite's marker in `folder` says it wrote there; None without a marker that lists them."""
    marker = Path(folder) / OUTPUT_MARKER
    try:
        record = json.loads(marker.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    files = record.get(FILES) if isinstance(record, dict) else None
    return set(files) if isinstance(files, list) else None


def check_replaceable(flag: str, out: str | Path, instead: str = ANOTHER) -> None:
    """An output folder may be written only when it does not exist, is empty, or holds nothing but what titan_lite
    wrote there: a typo such as `--output_dir outputs` must never delete or mix into a user's folder, and a file the
    user added to an output (their own evaluation, say) is never lost. One ConfigError line naming what is in the way
    (and `instead`, the other way out); nothing is changed."""
    path = Path(out)
    if not path.exists():
        return
    if not path.is_dir():
        raise ConfigError(f"{flag} {quote_path(out)} is a file, not a folder")
    held = sorted(p.name for p in path.iterdir())
    if not held:
        return
    if OUTPUT_MARKER not in held:
        raise ConfigError(f"{flag} {quote_path(out)} is not empty ({_shown(held)}) and was not written by titan_lite "
                          f"(no {OUTPUT_MARKER}): {_new_or(instead)}; nothing there was changed")
    recorded = written_files(path)
    if recorded is None:
        raise ConfigError(f"{flag} {quote_path(out)} was written by an older titan_lite, whose {OUTPUT_MARKER} does "
                          "not list the files it wrote, so a file you added there cannot be told apart: remove the "
                          f"folder yourself or {instead}; nothing there was changed")
    others = [name for name in held if name not in recorded and name != OUTPUT_MARKER]
    if others:
        them = "it" if len(others) == 1 else "them"
        raise ConfigError(f"{flag} {quote_path(out)} holds {_shown(others)}, which titan_lite did not write (it "
                          f"replaces only the files its {OUTPUT_MARKER} lists): move {them} out of the folder or "
                          f"{instead}; nothing there was changed")


def mark_written(folder: str | Path, files: Iterable[str] | None = None, **about: object) -> None:
    """Leave titan_lite's marker in a folder a script wrote: what wrote it, the names it wrote (`files`; default:
    everything the folder holds now) and `about`, so a later run may replace those and only those."""
    folder = Path(folder)
    names = sorted(set(files) if files is not None else {p.name for p in folder.iterdir()} - {OUTPUT_MARKER})
    record = {"written_by": f"titan_lite {Path(sys.argv[0]).name}".strip(), **about, FILES: names}
    (folder / OUTPUT_MARKER).write_text(json.dumps(record, indent=1, default=str) + "\n")


def partial_folder(out: str | Path) -> Path:
    """The one name an output (a folder, or a script's file) is written under before it replaces `out`: hidden beside
    it, the same on every rank and in every run (a token folder's is also where an interrupted run resumes)."""
    out = Path(out)
    return out.with_name(f".{out.name}.partial")


def _old_folder(out: Path) -> Path:
    return out.with_name(f".{out.name}.old")


@contextmanager
def output_folder(flag: str, out: str | Path, owner: bool = True, instead: str = ANOTHER,
                  **about: object) -> Iterator[Path]:
    """The one way titan_lite writes a folder. `out` is checked (check_replaceable), then a fresh partial folder is
    yielded to write the whole output into; on success it gets titan_lite's marker (listing its files, with `about`)
    and replaces `out`, which check_replaceable must still allow (what titan_lite wrote there is removed only after
    the rename); on any failure the partial folder is removed and `out` is untouched. `owner` is the one process
    (rank 0) that checks, creates, renames and removes."""
    out, tmp = Path(out), partial_folder(out)
    if owner:
        check_replaceable(flag, out, instead)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    try:
        yield tmp
        if owner:
            swap_in(flag, tmp, out, instead, **about)
    finally:
        if owner:
            shutil.rmtree(tmp, ignore_errors=True)


def swap_in(flag: str, partial: Path, out: str | Path, instead: str = ANOTHER, **about: object) -> None:
    """A whole output written into `partial` becomes `out`: checked again (a file added to `out` while the output was
    being written stays too), marked as titan_lite's (listing its files, with `about`), then renamed; what titan_lite
    wrote at `out` before is removed only after the rename."""
    out = Path(out)
    check_replaceable(flag, out, instead)
    mark_written(partial, **about)
    old = _old_folder(out)
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    partial.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def first_missing(path: str | Path) -> Path | None:
    """The outermost folder of `path` that does not exist yet (what creating `path` would create); None if it
    exists."""
    path = Path(path).absolute()
    missing = [p for p in (path, *path.parents) if not p.exists()]
    return missing[-1] if missing else None


def remove_if_only(folder: str | Path, names: Iterable[str]) -> bool:
    """Remove `folder` (one that a refused run created) when it holds nothing but the files `names` (paths relative
    to it: what that run wrote) and empty folders; a folder holding anything else stays as it is. True if removed."""
    folder = Path(folder)
    if not folder.is_dir():
        return False
    allowed = {Path(name) for name in names}
    if any(p.relative_to(folder) not in allowed for p in folder.rglob("*") if not p.is_dir()):
        return False
    shutil.rmtree(folder)
    return True
