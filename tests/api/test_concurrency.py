"""Several clients at once (continuous batching) and clients that go away mid-request."""

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import HOST, LONG_PROMPT, SHORT_PROMPT, Server, chat_body

# Distinct prompts: an answer crossed between slots, or changed by batching, shows up as
# a difference from the same request served alone.
PROMPTS = [
    "What is 2+2?",
    "Name three colors.",
    "Count from 1 to 20.",
    "What is the capital of France?",
    "List some fruits.",
    "Describe a cat.",
]
MAX_TOKENS = 16


def wait_idle(server, timeout=10.0):
    """Until no generation runs (the counter of generated tokens stands still)."""
    deadline = time.monotonic() + timeout
    last = server.metrics()["moeserve_generated_tokens_total"]
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = server.metrics()["moeserve_generated_tokens_total"]
        if now == last:
            return
        last = now
    raise RuntimeError("the server did not go idle")


def test_concurrent_clients_are_batched(server, client):
    wait_idle(server)

    def one(prompt):
        return client.chat.completions.create(
            model=server.model_id, messages=[{"role": "user", "content": prompt}],
            temperature=0, max_tokens=MAX_TOKENS)

    # Each prompt alone first: greedy decoding makes these the expected answers (every
    # position's numbers are computed the same way whatever else shares the pass).
    alone = [one(p).choices[0].message.content for p in PROMPTS]
    wait_idle(server)
    before = server.metrics()
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        results = list(ex.map(one, PROMPTS))
    elapsed = time.monotonic() - t0
    after = server.metrics()

    for prompt, want, r in zip(PROMPTS, alone, results):
        text = r.choices[0].message.content
        assert text.strip(), prompt
        assert text == want, (prompt, want, text)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert 1 <= r.usage.completion_tokens <= MAX_TOKENS

    d = {k: after[k] - before[k] for k in after if k.endswith("_total")}
    assert d["moeserve_requests_total"] == len(PROMPTS)
    assert d["moeserve_prompt_tokens_total"] == sum(r.usage.prompt_tokens for r in results)
    # generated tokens also count a final end-of-generation token per request
    completion = sum(r.usage.completion_tokens for r in results)
    assert completion <= d["moeserve_generated_tokens_total"] <= completion + len(PROMPTS)
    # One request at a time, every sampled token needs its own forward pass (the prompt
    # pass yields the first one). Fewer passes than tokens means sequences shared passes.
    assert d["moeserve_forward_passes_total"] < d["moeserve_generated_tokens_total"], d
    print(f"\n{len(PROMPTS)} clients: {elapsed:.1f} s, "
          f"{d['moeserve_generated_tokens_total']:.0f} tokens in "
          f"{d['moeserve_forward_passes_total']:.0f} forward passes")


def test_requests_queue_when_slots_are_full():
    """With one slot, three clients at once: two wait, all three are answered."""
    with Server("--parallel", "1") as srv:
        c = srv.client()
        seen_waiting = 0
        with ThreadPoolExecutor(3) as ex:
            futs = [ex.submit(c.chat.completions.create, model=srv.model_id,
                              messages=[{"role": "user", "content": p}], temperature=0,
                              max_tokens=MAX_TOKENS)
                    for p in PROMPTS[:3]]
            while not all(f.done() for f in futs):
                seen_waiting = max(seen_waiting,
                                   srv.metrics()["moeserve_requests_waiting"])
                time.sleep(0.03)
            results = [f.result() for f in futs]
        # Queued requests get the same answers as when served one after another.
        for prompt, r in zip(PROMPTS, results):
            again = c.chat.completions.create(
                model=srv.model_id, messages=[{"role": "user", "content": prompt}],
                temperature=0, max_tokens=MAX_TOKENS)
            assert r.choices[0].message.content == again.choices[0].message.content, prompt
        assert seen_waiting >= 1
        m = srv.metrics()
        assert m["moeserve_requests_total"] == 6


def _open_stream(port, body):
    data = json.dumps(body).encode()
    s = socket.create_connection((HOST, port), timeout=30)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
              % (HOST.encode(), len(data)) + data)
    return s


def _read_content_chunks(s, n):
    """Reads the SSE stream until n chunks with non-empty content arrived."""
    buf = b""
    seen = 0
    while seen < n:
        chunk = s.recv(4096)
        assert chunk, f"stream ended early: {buf[-500:]!r}"
        buf += chunk
        seen = buf.count(b'"content":"') - buf.count(b'"content":""')
    assert buf.startswith(b"HTTP/1.1 200"), buf[:200]
    return buf


def _close(s):
    try:
        s.shutdown(socket.SHUT_RDWR)
    finally:
        s.close()


def _assert_generation_stops(server, before_tokens):
    """Within ~2 s: nothing running, and the generated-token counter stands still."""
    deadline = time.monotonic() + 2.5
    m = server.metrics()
    while m["moeserve_requests_running"] != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
        m = server.metrics()
    assert m["moeserve_requests_running"] == 0, m
    g1 = m["moeserve_generated_tokens_total"]
    time.sleep(0.8)
    g2 = server.metrics()["moeserve_generated_tokens_total"]
    assert g2 == g1, "tokens are still being generated for a client that went away"
    # it stopped early, far short of the 2000 tokens asked for
    assert g2 - before_tokens < 200


def test_stream_client_disconnect_stops_generation(server):
    wait_idle(server)
    before = server.metrics()["moeserve_generated_tokens_total"]
    s = _open_stream(server.port, chat_body(LONG_PROMPT, temperature=0, max_tokens=2000,
                                            stream=True))
    try:
        _read_content_chunks(s, 2)
        assert server.metrics()["moeserve_requests_running"] == 1
    finally:
        _close(s)
    _assert_generation_stops(server, before)


def test_non_stream_client_disconnect_stops_generation(server):
    wait_idle(server)
    before = server.metrics()["moeserve_generated_tokens_total"]
    s = _open_stream(server.port, chat_body(LONG_PROMPT, temperature=0, max_tokens=2000))
    try:
        deadline = time.monotonic() + 30
        while server.metrics()["moeserve_generated_tokens_total"] < before + 3:
            assert time.monotonic() < deadline, "generation did not start"
            time.sleep(0.1)
    finally:
        _close(s)
    _assert_generation_stops(server, before)


def test_requests_running_is_zero_after_completion(server, client):
    r = client.chat.completions.create(
        model=server.model_id, messages=[{"role": "user", "content": SHORT_PROMPT}],
        temperature=0, max_tokens=3)
    if r.usage.completion_tokens < 1:
        raise RuntimeError("precondition: the request should have generated")
    time.sleep(1.0)
    m = server.metrics()
    assert m["moeserve_requests_running"] == 0, m
    assert m["moeserve_requests_waiting"] == 0, m
