"""A Weights & Biases run of the training job: torchtitan's WANDB_* variables, the resolved config, one run id kept
across resumes."""

import dataclasses
import os
import secrets
from pathlib import Path

from titan_lite.config import JobConfig
from titan_lite.errors import ConfigError, pip_install

RUN_ID_FILE = "wandb_run_id"
DEFAULT_PROJECT = "titan_lite"
WANDB_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")  # what wandb.Settings accepts


def check_wandb_installed(cfg: JobConfig) -> None:
    """metrics.enable_wandb needs the optional wandb package and a WANDB_MODE it knows: one line each."""
    if not cfg.metrics.enable_wandb:
        return
    mode = os.environ.get("WANDB_MODE")
    if mode is not None and mode not in WANDB_MODES:
        raise ConfigError(f"'metrics.enable_wandb': WANDB_MODE={mode!r} is not a W&B mode; expected online (the "
                          f"default), offline (no account needed) or disabled (also {', '.join(WANDB_MODES[3:])})")
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError(f"'metrics.enable_wandb' needs the wandb package, which is not installed: "
                          f"{pip_install(extra='wandb')}") from None


def _run_id(folder: Path, resuming: bool) -> str:
    """The run id: WANDB_RUN_ID, else the one this run folder's earlier attempt used when the run resumes from its
    checkpoint, else a new one (written down for the next resume)."""
    if os.environ.get("WANDB_RUN_ID"):
        return os.environ["WANDB_RUN_ID"]
    stored = folder / RUN_ID_FILE
    if resuming and stored.is_file() and stored.read_text().strip():
        return stored.read_text().strip()
    run_id = secrets.token_hex(6)  # W&B takes any id of letters, digits, - and _
    folder.mkdir(parents=True, exist_ok=True)
    stored.write_text(run_id + "\n")
    return run_id


def _init_options(folder: Path, resuming: bool) -> dict:
    """wandb.init's keywords from torchtitan's environment variables."""
    env = os.environ.get
    tags = [tag.strip() for tag in env("WANDB_RUN_TAGS", "").split(",") if tag.strip()]
    options = dict(project=env("WANDB_PROJECT") or DEFAULT_PROJECT, entity=env("WANDB_TEAM") or None,
                   name=env("WANDB_RUN_NAME") or None, notes=env("WANDB_RUN_NOTES") or None, tags=tags or None,
                   group=env("WANDB_RUN_GROUP") or None, job_type=env("WANDB_RUN_JOB_TYPE") or None, dir=str(folder))
    rewind = {key: env(var) for key, var in (("resume_from", "WANDB_RESUME_FROM"), ("fork_from", "WANDB_FORK_FROM"))
              if env(var)}
    if rewind:  # W&B's own rewind or fork of an earlier run names that run itself
        return {**options, **rewind}
    return {**options, "id": _run_id(folder, resuming), "resume": "allow"}


class WandbWriter:
    """Scalars of each logged step to one W&B run (WANDB_MODE=offline writes it under the folder only)."""

    def __init__(self, cfg: JobConfig, folder: str, resuming: bool):
        check_wandb_installed(cfg)
        import wandb  # the optional extra: imported only when W&B logging is on

        folder_path = Path(folder)
        folder_path.mkdir(parents=True, exist_ok=True)
        options = _init_options(folder_path, resuming)
        try:
            self.run = wandb.init(config=dataclasses.asdict(cfg), **options)
        except Exception as exc:  # noqa: BLE001 - wandb raises its own types (login, network, usage): all one line
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"'metrics.enable_wandb': wandb.init failed: {first} (log in with `wandb login` or "
                              "WANDB_API_KEY, or set WANDB_MODE=offline)") from None

    @property
    def run_id(self) -> str:
        return self.run.id

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()
