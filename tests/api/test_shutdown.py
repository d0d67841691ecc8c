"""SIGTERM lets in-flight requests finish, then the process exits 0."""

import json
import signal
import threading
import time

import pytest

from helpers import LONG_PROMPT, Server, chat_body, raw_request, sse_events


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_sigterm_drains_in_flight_request(stream):
    srv = Server("--parallel", "2")
    srv.start()
    try:
        result = {}
        opts = {"include_usage": True} if stream else None

        def call():
            try:
                result["resp"] = raw_request(srv.port, "POST", "/v1/chat/completions",
                                             chat_body(LONG_PROMPT, temperature=0,
                                                       max_tokens=40, stream=stream,
                                                       stream_options=opts), timeout=120)
            except Exception as e:  # reported below
                result["error"] = e

        t = threading.Thread(target=call)
        t.start()
        # wait until generation has started, so the request is really in flight
        deadline = time.monotonic() + 30
        while srv.metrics()["moeserve_generated_tokens_total"] < 2:
            assert time.monotonic() < deadline, "generation did not start"
            time.sleep(0.05)
        srv.proc.send_signal(signal.SIGTERM)
        t.join(120)
        assert not t.is_alive()
        assert "error" not in result, result.get("error")
        r = result["resp"]
        assert r.status == 200, r.text
        if stream:
            events = sse_events(r.text)
            assert events[-1] == "[DONE]"
            body = json.loads(events[-2])
            fin = json.loads(events[-3])["choices"][0]
        else:
            body = r.json()
            fin = body["choices"][0]
        assert body["usage"]["completion_tokens"] == 40
        assert fin["finish_reason"] == "length"
        assert srv.proc.wait(30) == 0, srv.log()
        assert "shutting down" in srv.log()
    finally:
        srv.close()


def test_sigterm_when_idle_exits_zero():
    srv = Server("--parallel", "1")
    srv.start()
    try:
        # a kept-alive idle connection from a client must not hold the shutdown up
        c = srv.client()
        c.models.list()
        t0 = time.monotonic()
        assert srv.terminate(timeout=20) == 0, srv.log()
        assert time.monotonic() - t0 < 10
    finally:
        srv.close()
