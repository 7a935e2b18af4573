"""The logging interface every logger implements (`Logger`) and the run tracking's config (`TrackingConfig`).
`dflash.tracking.loggers` re-exports both; `dflash.tracking.mlflow_logger` and the loggers there build on them.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass
class TrackingConfig:
    tracking_uri: str = "sqlite:///mlflow.db"
    experiment: str = "dflash"
    run_name: str = ""  # empty -> the run folder's name (`<loss>-<noise>-<buffer>-s<seed>-<time>`)
    log_every: int = 10  # steps between metric reads/logs
    console: bool = True
    system_metrics: bool = True  # MLflow's own system-metrics logging (the run's System metrics tab)
    system_metrics_interval_s: float = 10.0  # seconds between samples of that monitor
    enabled: bool = True  # False -> only the jsonl file


# --------------------------------------------------------------------------- loggers


class Logger(ABC):
    """Logging interface. Only ``log`` is required; everything else defaults to a no-op."""

    @abstractmethod
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self, status: str = "FINISHED") -> None:  # noqa: B027 - optional hook
        pass

    def log_params(self, params: Mapping[str, Any]) -> None:  # noqa: B027
        pass

    def set_tags(self, tags: Mapping[str, Any]) -> None:  # noqa: B027
        pass

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:  # noqa: B027
        pass

    def log_text(self, text: str, name: str) -> None:  # noqa: B027
        pass

    def log_dict(self, d: Mapping[str, Any], name: str) -> None:  # noqa: B027
        pass

    def log_figure(self, fig: Any, name: str) -> None:  # noqa: B027
        pass

    @property
    def run_id(self) -> str | None:
        return None

    def __enter__(self) -> "Logger":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close("FINISHED")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.close("KILLED")
        else:
            self.close("FAILED")
