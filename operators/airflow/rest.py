"""JSON over HTTP to an Airflow api-server's REST API, for the clients trainguard has of it (the
``Standalone`` wrapper the tests, the demo and the benchmarks drive, and the tasks' run notes).

With the SQLite metadata database of ``airflow standalone`` a request that meets another process's write
lock may answer 500 ("database is locked"); nothing was written then. ``call`` tries such a request again
for up to ``retry_s`` seconds. Only requests that are safe to repeat should ask for it: reads, PATCHes,
and creations that name what they create (a DAG run with its own run id: a repeat answers 409).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

# how long a client that asks for retries keeps trying an api-server that answers 5xx (SQLite's writers
# hold their lock for well under a second each; a minute covers a queue of them on a loaded host)
RETRY_S = 60.0


def call(url: str, body: Any = None, *, method: str = "GET", token: str = "", timeout: float = 30,
         retry_s: float = 0.0) -> Any:
    """``method`` ``url`` with ``body`` as JSON; the answer's JSON (None when empty). HTTPError for an
    error status: 4xx at once, 5xx (and a connection refused or reset) after ``retry_s`` of tries."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    deadline = time.monotonic() + retry_s
    pause = 0.25
    while True:
        req = urllib.request.Request(url, data=data, headers=headers, method=method)  # noqa: S310
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310  (an Airflow api-server)
                text = r.read().decode()
            return json.loads(text) if text.strip() else None
        except urllib.error.HTTPError as exc:
            if exc.code < 500 or time.monotonic() + pause > deadline:
                raise
        except (urllib.error.URLError, ConnectionResetError) as exc:
            reason = getattr(exc, "reason", exc)
            if not isinstance(reason, (ConnectionRefusedError, ConnectionResetError)) or \
                    time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(2.0, pause * 2)
