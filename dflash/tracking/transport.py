"""How the MLflow client reaches its store: bounded HTTP timeouts and retries, a connect check, the heartbeat tag,
and a fresh sqlite store created once.

An HTTP store that is down must cost seconds, not minutes: MLflow's defaults (7 retries, exponential backoff, 120 s
timeout) stalled a 20-step run for ~4 minutes before the one warning. A server that accepts connections and never
answers cost 3 × 10 s read timeouts, so the check also waits (boundedly) for a first response.

A fresh sqlite file is migrated by the first client that opens it (alembic, ~30 revisions); two processes doing it
at once corrupt the schema ("table _alembic_tmp_… already exists", "Online migration expected to match one row")
and neither tracks. `prepare_store` builds it once, whole, under an exclusive `flock` on `<db>.lock`
(dflash/tracking/store.py).
"""
from __future__ import annotations

import os
import socket
import time
from typing import Any

# A TCP connect with this timeout runs before the first request; the request settings apply where the user has
# not set them in the environment (MLflow reads them at every request).
CONNECT_TIMEOUT_S = 3.0
# Connect plus the first response of a small request: a server that never answers is disabled within this.
FIRST_RESPONSE_S = 5.0
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
HEARTBEAT_TAG = "dflash.heartbeat"  # UTC time of the run's last log call: a stale RUNNING run shows here


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def heartbeat_tags() -> list[Any]:
    from mlflow.entities import RunTag
    return [RunTag(HEARTBEAT_TAG, utc_now())]


# A small read every MLflow server answers (404 for a store without that experiment still counts): a server whose
# /health answers while its tracking API hangs (its database or workers stuck) is found here, not after 3 × 10 s
# of retried requests and a chain of tracebacks.
API_PROBE = "/api/2.0/mlflow/experiments/get-by-name?experiment_name=Default"


def http_preflight(uri: str, timeout: float = CONNECT_TIMEOUT_S, total: float = FIRST_RESPONSE_S) -> None:
    """For http(s) stores: bounded request timeouts/retries (unless set in the environment), then two requests,
    `GET /health` and a small read of the tracking API (`API_PROBE`), each connected within `timeout` seconds and
    answered within `total` seconds of its start (any status counts as an answer); ConnectionError naming the host
    otherwise."""
    from urllib.parse import urlsplit
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return
    for k, v in HTTP_DEFAULTS.items():
        os.environ.setdefault(k, v)
    _first_response(parts, "/health", "", timeout, total)
    _first_response(parts, parts.path.rstrip("/") + API_PROBE,
                    " to its tracking API while GET /health answers (a server half up: its database or workers hung)",
                    timeout, total)


def _first_response(parts, path: str, what: str, timeout: float, total: float) -> None:
    """`GET path` on the server of `parts` (a urlsplit URI): ConnectionError unless it connects within `timeout` s
    and answers within `total` s; `what` says which request did not answer."""
    import http.client
    import ssl
    host, port = parts.hostname or "localhost", parts.port or (443 if parts.scheme == "https" else 80)
    if parts.scheme == "https":  # the probe asks only "does it answer": TLS is verified by MLflow's own requests
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, port, timeout=timeout, context=ssl._create_unverified_context())
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    t0 = time.monotonic()
    try:
        try:
            conn.connect()
        except OSError as e:
            raise ConnectionError(f"nothing answers at {host}:{port} within {timeout:g} s ({e})") from e
        wait = max(total - (time.monotonic() - t0), 0.5)
        conn.sock.settimeout(wait)
        try:
            conn.request("GET", path, headers={"Connection": "close"})
            conn.getresponse().close()
        except (socket.timeout, TimeoutError) as e:
            raise ConnectionError(f"{host}:{port} accepts connections but sends no response{what} within "
                                  f"{wait:.1f} s (a hung or wrong server)") from e
        except (OSError, http.client.HTTPException) as e:
            raise ConnectionError(f"{host}:{port} accepts connections but does not answer HTTP{what} "
                                  f"({type(e).__name__}: {e})") from e
    finally:
        conn.close()


def prepare_store(uri: str, lock_timeout: float | None = None) -> None:
    """Before the first MLflow client call on `uri`: the HTTP preflight for a server; for a sqlite file, its
    schema made whole or checked once, under an exclusive lock (`dflash.tracking.store.prepare_sqlite`), so
    processes starting together on a fresh store do not migrate it at the same time and a stop mid-creation
    leaves no half-made store. Other stores: nothing."""
    http_preflight(uri)
    from dflash.tracking.run_info import sqlite_db_path
    from dflash.tracking.store import STORE_LOCK_TIMEOUT_S, prepare_sqlite
    db = sqlite_db_path(uri)
    if db is not None:
        prepare_sqlite(uri, db, STORE_LOCK_TIMEOUT_S if lock_timeout is None else lock_timeout)
