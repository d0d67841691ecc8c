"""Streamed (SSE) chat and text completions."""

import json

import openai
import pytest

from helpers import SHORT_PROMPT, assert_openai_error, chat_body, sse_events


def test_stream_with_usage_via_openai_client(server, client, greedy_hello):
    stream = client.chat.completions.create(
        model=server.model_id, messages=[{"role": "user", "content": SHORT_PROMPT}],
        temperature=0, max_tokens=40, stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert len(chunks) >= 4
    ids = {c.id for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)

    first = chunks[0]
    assert first.choices[0].delta.role == "assistant"

    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
    last = chunks[-1]
    assert last.choices == []

    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finish) == 1 and finish[0] is chunks[-2]
    assert finish[0].choices[0].finish_reason == greedy_hello.choices[0].finish_reason

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy_hello.choices[0].message.content

    u = last.usage
    assert u.completion_tokens == greedy_hello.usage.completion_tokens
    assert u.prompt_tokens == greedy_hello.usage.prompt_tokens
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert "timings" in u.model_extra and "spec_decode_ran" in u.model_extra
    # llama-server clients read `timings` on the last chunk: the finish chunk and the
    # usage chunk after it carry it
    assert finish[0].model_extra["timings"]["predicted_n"] == u.completion_tokens
    assert last.model_extra["timings"] == finish[0].model_extra["timings"]


def test_stream_raw_sse_ends_with_done(server, greedy_hello):
    r = server.post("/v1/chat/completions", chat_body(
        SHORT_PROMPT, temperature=0, max_tokens=40, stream=True,
        stream_options={"include_usage": True}))
    assert r.status == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert events.count("[DONE]") == 1
    assert r.text.rstrip().endswith("data: [DONE]")
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    # as OpenAI: the other chunks carry "usage": null
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    fin = chunks[-2]["choices"][0]
    assert fin["delta"] == {} and fin["finish_reason"] in ("stop", "length")
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == greedy_hello.choices[0].message.content


def test_stream_without_include_usage_has_no_usage_chunk(server):
    r = server.post("/v1/chat/completions", chat_body(
        SHORT_PROMPT, temperature=0, max_tokens=3, stream=True))
    assert r.status == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["choices"] for c in chunks)
    assert all("usage" not in c or c["usage"] is None for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stream_with_stop_matches_non_stream(server, client, greedy_hello):
    text = greedy_hello.choices[0].message.content
    words = [w for w in text.split() if len(w) >= 3 and w.isalpha()]
    stop = " " + words[-1]
    expect = text[: text.find(stop)]
    stream = client.chat.completions.create(
        model=server.model_id, messages=[{"role": "user", "content": SHORT_PROMPT}],
        temperature=0, max_tokens=40, stream=True, stop=[stop],
    )
    chunks = list(stream)
    got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert got == expect
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_text_completion_stream(server, client):
    prompt = "The capital of France is"
    whole = client.completions.create(model=server.model_id, prompt=prompt, max_tokens=6,
                                      temperature=0)
    chunks = list(client.completions.create(
        model=server.model_id, prompt=prompt, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stream_options_without_stream_is_400(server, client):
    r = server.post("/v1/chat/completions", chat_body(
        SHORT_PROMPT, max_tokens=2, stream_options={"include_usage": True}))
    assert_openai_error(r, 400, param="stream_options")
    r = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stream": False,
                                        "stream_options": {"include_usage": True}})
    assert_openai_error(r, 400, param="stream_options")
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(
            model=server.model_id, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
            stream_options={"include_usage": True})
    assert ei.value.status_code == 400
    assert ei.value.body["param"] == "stream_options"


@pytest.mark.parametrize("prompt,max_tokens", [
    ("Écris une phrase en français sur Paris.", 20),   # accented letters
    ("Write a smiley emoji.", 9),             # 4-byte characters over several tokens
    ("Translate to Japanese: good morning", 12),
])
def test_stream_non_ascii_equals_non_stream(server, prompt, max_tokens):
    body = chat_body(prompt, temperature=0, max_tokens=max_tokens)
    whole = server.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    assert whole and any(ord(ch) > 127 for ch in whole), whole
    r = server.post("/v1/chat/completions", dict(body, stream=True))
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    deltas = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
    assert "".join(deltas) == whole
    # every delta is valid text on its own (no split characters)
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in whole


def test_stop_string_at_the_start_gives_empty_content(server, greedy_hello):
    text = greedy_hello.choices[0].message.content
    first = text.split()[0]
    r = server.post("/v1/chat/completions", chat_body(
        SHORT_PROMPT, temperature=0, max_tokens=40, stop=[first], stream=True))
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == ""
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
