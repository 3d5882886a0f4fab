"""The REST API client (httpx, tenacity): its retries against a real HTTP server on the loopback that
answers as a busy api-server does (500 while its database is locked), then normally; its token."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import httpx
import pytest

from trainguard.operators.hooks.airflow_api import AirflowApi, ApiError


class _Busy(BaseHTTPRequestHandler):
    """Answers 500 to the first ``busy`` requests, then 200 with what it was sent; records each request."""

    busy = 0
    seen: ClassVar[list[tuple[str, str, str]]] = []

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else ""
        type(self).seen.append((self.command, self.path, self.headers.get("Authorization", "")))
        if self.headers.get("Authorization") == "Bearer expired":
            self.send_response(401)
            self.end_headers()
            return
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

    def do_POST(self) -> None:
        if self.path == "/auth/token":
            length = int(self.headers.get("Content-Length") or 0)
            creds = json.loads(self.rfile.read(length).decode())
            type(self).seen.append((self.command, self.path, creds["username"]))
            out = json.dumps({"access_token": f"jwt-of-{creds['username']}"}).encode()
            self.send_response(200 if creds["password"] == "pw" else 401)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
            return
        self._answer()

    do_GET = do_PATCH = _answer

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
    handler.busy = 3  # the token's request, then two PATCHes answered 500
    with AirflowApi(url, username="notes", password="pw", retry_s=10) as api:
        doc = api.request("PATCH", "/api/v2/x", {"note": "n"})
        assert doc == {"method": "PATCH", "body": {"note": "n"}}
        # one token (its own request), then the PATCH three times with it
        assert handler.seen == [("POST", "/auth/token", "notes")] + [("PATCH", "/api/v2/x", "Bearer jwt-of-notes")] * 3
        api.request("GET", "/api/v2/y")
        assert handler.seen[-1] == ("GET", "/api/v2/y", "Bearer jwt-of-notes")  # the token is kept


def test_without_retry_or_past_the_retry_time_the_500_is_raised_and_a_4xx_at_once(server):
    url, handler = server
    handler.busy = 100
    api = AirflowApi(url, retry_s=0.6)
    with pytest.raises(ApiError) as exc:
        api.request("POST", "/api/v2/x", {}, auth=False)  # not repeatable: once
    assert exc.value.status == 500 and len(handler.seen) == 1
    with pytest.raises(ApiError):
        api.request("GET", "/api/v2/x", auth=False)
    assert 2 <= len(handler.seen) - 1 <= 5  # 0.25 s, then 0.5 s apart: tried again, then given up
    refused = AirflowApi(url, username="notes", password="wrong", retry_s=10)
    before = len(handler.seen)
    with pytest.raises(ApiError, match="HTTP 401"):
        refused.request("GET", "/api/v2/x")
    assert len(handler.seen) == before + 1  # the token's request, never repeated


def test_a_server_that_is_not_there_yet_is_waited_for_then_refused():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = AirflowApi(f"http://127.0.0.1:{port}", retry_s=0.5)
    with pytest.raises(httpx.ConnectError):
        api.request("GET", "/api/v2/monitor/health", auth=False)


def test_an_expired_token_is_fetched_again_once(server):
    """A client kept for long (the guardian's trigger keeps one) outlives its token: the request is sent
    again once with a new one."""
    url, handler = server
    api = AirflowApi(url, username="notes", password="pw", retry_s=0)
    api._token = "expired"
    assert api.request("PATCH", "/api/v2/x", {"note": "n"}) == {"method": "PATCH", "body": {"note": "n"}}
    assert [h[2] for h in handler.seen] == ["Bearer expired", "notes", "Bearer jwt-of-notes"]


def test_an_answer_slower_than_the_timeout_is_asked_for_again_and_a_repeated_run_creation_is_one_run():
    """A busy api-server (a request of its own waits for a database lock) answers after the client gave up on it:
    the repeatable request is sent again; a DAG run named by the client that landed the first time answers 409 the
    second, which says it exists. One run, one id."""
    release = threading.Event()
    created: list[str] = []

    class Slow(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode())
            if self.path == "/auth/token":
                out, code = json.dumps({"access_token": "t"}).encode(), 200
            elif body["dag_run_id"] in created:
                out, code = b'{"detail": "exists"}', 409
            else:
                created.append(body["dag_run_id"])
                release.wait(10)  # lands, and answers after the client's timeout
                out, code = b"{}", 200
            try:
                self.send_response(code)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
            except OSError:
                pass  # the client gave up on this answer

        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        with AirflowApi(f"http://127.0.0.1:{srv.server_address[1]}", timeout_s=0.5, retry_s=10,
                        connect_retry_s=0.2) as api:
            run_id = api.trigger_run("tg_job_launch", {"spec": {}})
        assert created == [run_id]
        with AirflowApi(f"http://127.0.0.1:{srv.server_address[1]}", timeout_s=0.5, retry_s=0) as api, \
                pytest.raises(httpx.ReadTimeout):
            api.trigger_run("tg_job_launch", {"spec": {}})  # without retries the slow answer is the caller's error
    finally:
        release.set()
        srv.shutdown()
        srv.server_close()
        thread.join()


def test_an_address_nothing_listens_on_is_given_up_on_after_the_connect_retry_not_the_busy_one():
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = AirflowApi(f"http://127.0.0.1:{port}", retry_s=60, connect_retry_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(httpx.ConnectError):
        api.request("GET", "/api/v2/monitor/health", auth=False)
    assert time.monotonic() - t0 < 10  # the busy server's minute would still be waiting
