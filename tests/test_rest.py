"""The REST client's retries against a real HTTP server on the loopback that answers as a busy
api-server does (500 while its database is locked), then normally."""

from __future__ import annotations

import json
import threading
import urllib.error
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from operators.airflow import rest


class _Busy(BaseHTTPRequestHandler):
    """Answers 500 to the first ``busy`` requests, then 200 with what it was sent; records each request."""

    busy = 0
    seen: ClassVar[list[tuple[str, str, str]]] = []

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else ""
        type(self).seen.append((self.command, self.path, self.headers.get("Authorization", "")))
        if len(type(self).seen) <= type(self).busy:
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"Internal Server Error")
            return
        out = json.dumps({"method": self.command, "body": json.loads(body) if body else None}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = do_PATCH = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, type[_Busy]]]:
    handler = type("Handler", (_Busy,), {"busy": 0, "seen": []})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", handler
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join()


def test_a_repeatable_request_is_tried_again_while_the_server_answers_500(server):
    url, handler = server
    handler.busy = 2
    doc = rest.call(f"{url}/api/v2/x", {"note": "n"}, method="PATCH", token="t", retry_s=10)
    assert doc == {"method": "PATCH", "body": {"note": "n"}}
    assert handler.seen == [("PATCH", "/api/v2/x", "Bearer t")] * 3


def test_without_retry_or_past_the_retry_time_the_500_is_raised(server):
    url, handler = server
    handler.busy = 100
    with pytest.raises(urllib.error.HTTPError) as exc:
        rest.call(f"{url}/api/v2/x", {}, method="POST")
    assert exc.value.code == 500 and len(handler.seen) == 1
    with pytest.raises(urllib.error.HTTPError):
        rest.call(f"{url}/api/v2/x", method="GET", retry_s=0.6)
    assert 2 <= len(handler.seen) - 1 <= 4  # 0.25 s, then 0.5 s apart: tried again, then given up

