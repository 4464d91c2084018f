"""CheckpointManager: saving and resuming distributed checkpoints (placeholder until DCP support lands)."""

from titan_lite.config.manager import ConfigError


class CheckpointManager:
    def __init__(self, cfg, trainer):
        if cfg.checkpoint.enable:
            raise ConfigError("'checkpoint.enable' = true: checkpointing is not implemented yet")

    def load(self) -> None:
        pass

    def save(self, step: int, last: bool = False) -> None:
        pass

    def finish(self) -> None:
        pass
