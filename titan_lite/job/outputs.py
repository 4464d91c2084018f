"""The scripts' output folders and files. A folder is written through `output_folder` (checked first with
`check_replaceable`): it must be new, empty, or one titan_lite wrote, and titan_lite replaces only the files it wrote
there (the names its marker lists); a folder holding anything else is one line naming it and stays as it is. An
output file is checked by `check_output_file` and written by `write_output_file`, which never replaces a different
file unless told to. Light (no torch), for every script.

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

OUTPUT_MARKER = "titan_lite_output.json"  # written into every folder a script writes: what wrote it, and its files
FILES = "files"  # the marker's list of the names titan_lite wrote into the folder
# How a script's --help describes a folder it writes.
FOLDER_HELP = ("a new or empty folder, or one titan_lite wrote, whose files it replaces (a folder that holds anything "
               "else is refused, naming it)")


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def written_files(folder: str | Path) -> set[str] | None:
    """The names titan_lite's marker in `folder` says it wrote there; None without a marker that lists them."""
    marker = Path(folder) / OUTPUT_MARKER
    try:
        record = json.loads(marker.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    files = record.get(FILES) if isinstance(record, dict) else None
    return set(files) if isinstance(files, list) else None


def check_replaceable(flag: str, out: str | Path) -> None:
    """An output folder may be written only when it does not exist, is empty, or holds nothing but what titan_lite
    wrote there: a typo such as `--output_dir outputs` must never delete or mix into a user's folder, and a file the
    user added to an output (their own evaluation, say) is never lost. One ConfigError line naming what is in the way;
    nothing is changed."""
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
                          f"(no {OUTPUT_MARKER}): name a new or empty folder; nothing there was changed")
    recorded = written_files(path)
    if recorded is None:
        raise ConfigError(f"{flag} {quote_path(out)} was written by an older titan_lite, whose {OUTPUT_MARKER} does "
                          "not list the files it wrote, so a file you added there cannot be told apart: remove the "
                          "folder yourself or name another one; nothing there was changed")
    others = [name for name in held if name not in recorded and name != OUTPUT_MARKER]
    if others:
        them = "it" if len(others) == 1 else "them"
        raise ConfigError(f"{flag} {quote_path(out)} holds {_shown(others)}, which titan_lite did not write (it "
                          f"replaces only the files its {OUTPUT_MARKER} lists): move {them} out of the folder or name "
                          "another folder; nothing there was changed")


def mark_written(folder: str | Path, files: Iterable[str] | None = None, **about: object) -> None:
    """Leave titan_lite's marker in a folder a script wrote: what wrote it, the names it wrote (`files`; default:
    everything the folder holds now) and `about`, so a later run may replace those and only those."""
    folder = Path(folder)
    names = sorted(set(files) if files is not None else {p.name for p in folder.iterdir()} - {OUTPUT_MARKER})
    record = {"written_by": f"titan_lite {Path(sys.argv[0]).name}".strip(), **about, FILES: names}
    (folder / OUTPUT_MARKER).write_text(json.dumps(record, indent=1, default=str) + "\n")


def partial_folder(out: str | Path) -> Path:
    """The folder an output is written into before it replaces `out` (the same name on every rank)."""
    out = Path(out)
    return out.with_name(f".{out.name}.partial")


@contextmanager
def output_folder(flag: str, out: str | Path, owner: bool = True, **about: object) -> Iterator[Path]:
    """The one way a script writes a folder. Yields a fresh partial folder to write the whole output into; on success
    it gets titan_lite's marker (listing its files, with `about`) and replaces `out`, which check_replaceable must
    still allow (what titan_lite wrote there is removed only after the rename); on any failure the partial folder is
    removed and `out` is untouched. `owner` is the one process (rank 0) that creates, renames and removes."""
    out, tmp = Path(out), partial_folder(out)
    if owner:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    try:
        yield tmp
        if owner:
            swap_in(flag, tmp, out, **about)
    finally:
        if owner:
            shutil.rmtree(tmp, ignore_errors=True)


def swap_in(flag: str, partial: Path, out: str | Path, **about: object) -> None:
    """A whole output written into `partial` becomes `out`: checked again (a file added to `out` while the output was
    being written stays too), marked as titan_lite's (listing its files, with `about`), then renamed; what titan_lite
    wrote at `out` before is removed only after the rename."""
    out = Path(out)
    check_replaceable(flag, out)
    mark_written(partial, **about)
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    partial.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def check_output_file(flag: str, out: str | Path) -> None:
    """A file a script writes (JSON lines, say): not a folder, and its folder can be created."""
    path = Path(out)
    if path.is_dir():
        raise ConfigError(f"{flag} {quote_path(out)} is a folder; name a file to write")
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ConfigError(f"{flag} {quote_path(out)} cannot be written: '{parent}' is a file, not a folder")


def check_not_input(flag: str, out: str | Path, inputs: dict[str, str | Path | None]) -> None:
    """An output file is none of the inputs (writing it would destroy what the command reads)."""
    target = Path(out).resolve()
    for name, path in inputs.items():
        if path is not None and Path(path).resolve() == target:
            raise ConfigError(f"{flag} {quote_path(out)} is also {name}: writing it would overwrite the input; name "
                              "another file")


def write_output_file(flag: str, out: str | Path, text: str, overwrite: bool) -> bool:
    """Write `text` to `out` (its folder created): an existing file that holds something else is replaced only with
    `overwrite` (one ConfigError line otherwise, the file untouched). False when the file already held exactly
    `text` (nothing written: rerunning a seeded generator is harmless)."""
    path = Path(out)
    if path.is_file():
        if path.read_bytes() == text.encode():
            return False
        if not overwrite:
            raise ConfigError(f"{flag} {quote_path(out)} exists and holds something else than this command writes: "
                              "pass --overwrite to replace it, or name another file; it was left as it is")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(text)
    tmp.replace(path)
    return True
