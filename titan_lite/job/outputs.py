"""The scripts' output folders and files: a folder a script replaces or fills must be new, empty, or one titan_lite
wrote (its marker file, or a report of the script's own); anything else is one line and stays as it is. Light (no
torch), for every script."""

import json
import sys
from pathlib import Path

from titan_lite.errors import ConfigError, quote_path

OUTPUT_MARKER = "titan_lite_output.json"  # written into every folder a script writes


def written_by_titan_lite(folder: Path, reports: tuple[str, ...] = ()) -> bool:
    """The folder holds titan_lite's marker, or one of `reports` (what the script wrote before it left markers)."""
    return any((folder / name).exists() for name in (OUTPUT_MARKER, *reports))


def check_replaceable(flag: str, out: str | Path, reports: tuple[str, ...] = ()) -> None:
    """An output folder may be written (replaced, or filled) only when it does not exist, is empty, or titan_lite
    wrote it: a typo such as `--output_dir outputs` must never delete or mix into a user's other folders."""
    path = Path(out)
    if not path.exists():
        return
    if not path.is_dir():
        raise ConfigError(f"{flag} {quote_path(out)} is a file, not a folder")
    held = sorted(p.name for p in path.iterdir())
    if not held or written_by_titan_lite(path, reports):
        return
    shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
    raise ConfigError(f"{flag} {quote_path(out)} is not empty ({shown}) and was not written by titan_lite (no "
                      f"{OUTPUT_MARKER}): name a new or empty folder; nothing there was changed")


def mark_written(folder: str | Path, **about: object) -> None:
    """Leave titan_lite's marker in a folder a script wrote (what wrote it, and how), so a later run may replace it."""
    record = {"written_by": f"titan_lite {Path(sys.argv[0]).name}".strip(), **about}
    (Path(folder) / OUTPUT_MARKER).write_text(json.dumps(record, indent=1, default=str) + "\n")


def check_output_file(flag: str, out: str | Path) -> None:
    """A file a script writes (JSON lines, say): not a folder, and its folder can be created."""
    path = Path(out)
    if path.is_dir():
        raise ConfigError(f"{flag} {quote_path(out)} is a folder; name a file to write")
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ConfigError(f"{flag} {quote_path(out)} cannot be written: '{parent}' is a file, not a folder")
