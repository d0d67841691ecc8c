"""Bad requests get OpenAI-style JSON errors, and the server keeps serving."""

import socket
import time

import openai
import pytest

from helpers import HOST, SHORT_PROMPT, assert_openai_error, chat_body


def still_serving(server):
    assert server.get_json("/health")[0] == 200
    r = server.post("/v1/chat/completions", chat_body(SHORT_PROMPT, temperature=0, max_tokens=2))
    assert r.status == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 2


def test_malformed_json_is_400(server):
    r = server.post("/v1/chat/completions", '{"messages": [', headers={
        "Content-Type": "application/json"})
    assert_openai_error(r, 400)
    r = server.post("/v1/completions", b"\xff\xfe not json", headers={
        "Content-Type": "application/json"})
    assert_openai_error(r, 400)


def test_missing_messages_is_400(server):
    assert_openai_error(server.post("/v1/chat/completions", {"max_tokens": 2}), 400)
    assert_openai_error(server.post("/v1/chat/completions", {"messages": []}), 400,
                        param="messages")
    assert_openai_error(server.post("/v1/completions", {"max_tokens": 2}), 400)


@pytest.mark.parametrize("field,value", [
    ("temperature", 5), ("temperature", -0.5), ("top_p", 1.5), ("top_p", 0),
    ("presence_penalty", 3), ("frequency_penalty", -3), ("top_logprobs", 21), ("n", 2),
    ("min_p", 2), ("top_k", -1),
])
def test_out_of_range_parameter_is_400_naming_it(server, field, value):
    body = chat_body(SHORT_PROMPT, max_tokens=1, **{field: value})
    if field == "top_logprobs":
        body["logprobs"] = True
    err = assert_openai_error(server.post("/v1/chat/completions", body), 400, param=field)
    assert err["type"] == "invalid_request_error"


def test_temperature_5_via_openai_client(server, client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=server.model_id,
                                       messages=[{"role": "user", "content": "hi"}],
                                       temperature=5, max_tokens=1)
    assert ei.value.status_code == 400
    assert ei.value.body["param"] == "temperature"
    assert "temperature" in ei.value.body["message"]


def test_wrong_types_and_unknown_role_are_400(server):
    assert_openai_error(server.post("/v1/chat/completions",
                                    chat_body(max_tokens="ten")), 400)
    assert_openai_error(server.post("/v1/chat/completions",
                                    {"messages": [{"role": "wizard", "content": "hi"}]}),
                        400, param="messages")
    assert_openai_error(server.post("/v1/chat/completions", {"messages": "hello"}), 400)
    assert_openai_error(server.post("/v1/chat/completions", chat_body(
        stop=["a", "b", "c", "d", "e"], max_tokens=1)), 400, param="stop")


def test_unknown_model_is_404(server, client):
    r = server.post("/v1/chat/completions", chat_body(model="gpt-9-imaginary", max_tokens=1))
    assert_openai_error(r, 404, param="model", code="model_not_found")
    r = server.post("/v1/completions", {"model": "gpt-9-imaginary", "prompt": "hi"})
    assert_openai_error(r, 404, param="model", code="model_not_found")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9-imaginary",
                                       messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=1)


def test_unknown_route_is_404_json(server):
    assert_openai_error(server.request("GET", "/v1/nothing-here"), 404)


def test_wrong_method_is_405_json(server):
    assert_openai_error(server.request("GET", "/v1/chat/completions"), 405)


def _send_raw(port: int, data: bytes, read: bool = True, timeout: float = 5.0) -> bytes:
    """Sends raw bytes on a fresh TCP connection; returns what comes back until EOF."""
    with socket.create_connection((HOST, port), timeout=timeout) as s:
        s.sendall(data)
        if not read:
            return b""
        out = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
        except (socket.timeout, ConnectionResetError):
            pass
        return out


def test_garbage_bytes_do_not_crash(server):
    _send_raw(server.port, b"\x00\xff\x13\x37 garbage \r\n\r\n" * 50)
    _send_raw(server.port, b"GARBAGE / HTTP/9.9\r\n\r\n")
    _send_raw(server.port, bytes(range(256)) * 16)
    # a request head cut short, then the client goes away
    _send_raw(server.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n", read=False)
    still_serving(server)


def test_invalid_content_length_does_not_crash(server):
    before = server.metrics()["moeserve_requests_total"]
    body = b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
    for cl in (b"abc", b"-5", b"99999999999999999999999", b"12, 13"):
        resp = _send_raw(server.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: " + cl +
                         b"\r\n\r\n" + body)
        assert resp == b"" or resp.startswith(b"HTTP/1.1 4"), (cl, resp[:200])
    # Content-Length larger than what is sent, then the client goes away
    _send_raw(server.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
              b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n" + body,
              read=False)
    # Content-Length smaller than the body: the JSON is cut, so 400, never a generation
    resp = _send_raw(server.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Connection: close\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 10\r\n\r\n" + body)
    assert resp.startswith(b"HTTP/1.1 400"), resp[:200]
    time.sleep(0.2)
    assert server.metrics()["moeserve_requests_total"] == before, "a broken request ran"
    still_serving(server)
