"""The scripts' output files: checked by `check_output_file` (and `check_not_input`) and written by
`write_output_file`, which never replaces a different file unless told to. Output folders follow titan_lite.folders.
Light (no torch), for every script."""

from pathlib import Path

from titan_lite.errors import ConfigError, quote_path
from titan_lite.folders import partial_folder


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


def needs_writing(flag: str, out: str | Path, text: str, overwrite: bool) -> bool:
    """Whether `out` must be written to hold `text`: False when it already holds exactly that; an existing file that
    holds something else may be replaced only with `overwrite` (one ConfigError line otherwise, nothing changed)."""
    path = Path(out)
    if not path.is_file():
        return True
    if path.read_bytes() == text.encode():
        return False
    if not overwrite:
        raise ConfigError(f"{flag} {quote_path(out)} exists and holds something else than this command writes: "
                          "pass --overwrite to replace it, or name another file; it was left as it is")
    return True


def write_output_file(flag: str, out: str | Path, text: str, overwrite: bool) -> bool:
    """Write `text` to `out` (its folder created): an existing file that holds something else is replaced only with
    `overwrite` (one ConfigError line otherwise, the file untouched). False when the file already held exactly
    `text` (nothing written: rerunning a seeded generator is harmless)."""
    path = Path(out)
    if not needs_writing(flag, out, text, overwrite):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_folder(path)  # the same name as a folder's, so one glob finds both
    tmp.write_text(text)
    tmp.replace(path)
    return True
