"""How the MLflow client reaches its store: bounded HTTP timeouts and retries, a connect check, the heartbeat tag.

An HTTP store that is down must cost seconds, not minutes: MLflow's defaults (7 retries, exponential backoff, 120 s
timeout) stalled a 20-step run for ~4 minutes before the one warning.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Any

# A TCP connect with this timeout runs before the first request; the request settings apply where the user has
# not set them in the environment (MLflow reads them at every request).
CONNECT_TIMEOUT_S = 3.0
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
HEARTBEAT_TAG = "dflash.heartbeat"  # UTC time of the run's last log call: a stale RUNNING run shows here


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def heartbeat_tags() -> list[Any]:
    from mlflow.entities import RunTag
    return [RunTag(HEARTBEAT_TAG, utc_now())]


def http_preflight(uri: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """For http(s) stores: bounded request timeouts/retries (unless set in the environment), and a TCP connect
    within `timeout` seconds, raising ConnectionError naming the host when nothing answers."""
    from urllib.parse import urlsplit
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return
    for k, v in HTTP_DEFAULTS.items():
        os.environ.setdefault(k, v)
    host, port = parts.hostname or "localhost", parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        raise ConnectionError(f"nothing answers at {host}:{port} within {timeout:g} s ({e})") from e
