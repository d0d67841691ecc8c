"""Tool calls and reasoning for DeepSeek-style chat templates: requests with `tools`,
histories with calls and tool results, `chat_template_kwargs` and `reasoning_effort`
reach the template; the prompt equals Jinja2's rendering of the same template (the
engine transformers renders chat templates with, set up as it sets it up); thinking
answers come back as `reasoning_content`. The splitting of an answer's DSML tool calls
is checked in host/server/src/chat_output.rs (a random-weight model cannot be made to
write them)."""

from __future__ import annotations

import json
import gguf
import jinja2
import jinja2.ext
import jinja2.sandbox
import pytest

from helpers import MODEL, ROOT, Server, sse_events

TEMPLATE = ROOT / "tests" / "fixtures" / "chat" / "dsml_tools.jinja"

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]

HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris for 3 days?"},
    {"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {
         "name": "get_weather",
         "arguments": json.dumps({"city": "Paris \"FR\"", "days": 3, "opts": {"unit": "C"}})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
    {"role": "user", "content": "And now?"},
]


def bos_text() -> str:
    r = gguf.GGUFReader(str(MODEL))
    f = r.fields["tokenizer.ggml.bos_token_id"]
    bos = int(f.parts[f.data[0]][0])
    t = r.fields["tokenizer.ggml.tokens"]
    return bytes(t.parts[t.data[bos]]).decode()


def jinja2_render(messages, **variables) -> str:
    """The template as transformers renders chat templates: a sandboxed Jinja2 with
    trim_blocks / lstrip_blocks and loop controls, `tojson` as json.dumps without ASCII
    escapes; `from_json` is json.loads. Content null is handed over as ""."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.filters["from_json"] = json.loads
    msgs = [{**m, "content": m.get("content") or ""} for m in messages]
    return env.from_string(TEMPLATE.read_text()).render(
        messages=msgs, add_generation_prompt=True, bos_token=bos_text(), eos_token="",
        **variables)


@pytest.fixture(scope="module")
def dsml():
    with Server("--chat-template-file", TEMPLATE, "--parallel", "1") as s:
        yield s


def test_prompt_with_tools_and_history_equals_jinja2(dsml):
    r = dsml.post("/apply-template", {
        "messages": HISTORY, "tools": TOOLS, "reasoning_effort": "high",
        "chat_template_kwargs": {"thinking": True}})
    assert r.status == 200, r.text
    want = jinja2_render(HISTORY, tools=TOOLS, reasoning_effort="high", thinking=True)
    assert r.json()["prompt"] == want
    # The history's call is DSML with typed values; the schema keeps the client's key order.
    assert '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>' in want
    assert '{"name": "get_weather", "description": "Weather for a city."' in want
    # tool_choice "none": no tools in the prompt.
    r = dsml.post("/apply-template", {"messages": HISTORY[:2], "tools": TOOLS,
                                      "tool_choice": "none"})
    assert r.json()["prompt"] == jinja2_render(HISTORY[:2])


def test_thinking_answer_is_reasoning_content(dsml):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12,
            "temperature": 0, "chat_template_kwargs": {"thinking": True}, "tools": TOOLS}
    r = dsml.post("/v1/chat/completions", body)
    assert r.status == 200, r.text
    msg = r.json()["choices"][0]["message"]
    # The same prompt as plain text gives the tokens the answer is made of: all of it
    # reasoning (no `</think>` in 12 tokens of this model), none of it content.
    prompt = dsml.post("/apply-template", body).json()["prompt"]
    assert prompt.endswith("<think>")
    raw = dsml.post("/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0})
    text = raw.json()["choices"][0]["text"]
    assert "</think>" not in text and text
    assert msg["reasoning_content"] == text
    assert msg["content"] == ""
    assert "tool_calls" not in msg
    # Streamed: the deltas carry the same reasoning, and no content.
    r = dsml.post("/v1/chat/completions", {**body, "stream": True})
    chunks = [json.loads(e) for e in sse_events(r.text) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == text
    assert "".join(d.get("content", "") for d in deltas) == ""
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # Thinking off: the answer is content.
    off = dsml.post("/v1/chat/completions", {**body, "chat_template_kwargs": {"thinking": False}})
    m = off.json()["choices"][0]["message"]
    assert m["content"] and "reasoning_content" not in m


def test_openai_client_sends_tools_and_reads_reasoning(dsml):
    c = dsml.client()
    r = c.chat.completions.create(
        model=dsml.model_id, messages=HISTORY, tools=TOOLS, max_tokens=6, temperature=0,
        extra_body={"chat_template_kwargs": {"thinking": True}})
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "length"
    assert m.model_extra["reasoning_content"]
    assert m.tool_calls is None


def test_reasoning_format_none_keeps_content():
    with Server("--chat-template-file", TEMPLATE, "--reasoning-format", "none") as s:
        r = s.post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0,
            "chat_template_kwargs": {"thinking": True}})
        m = r.json()["choices"][0]["message"]
        assert m["content"] and "reasoning_content" not in m


def test_tool_requests_that_cannot_be_served_are_refused(server, dsml):
    user = [{"role": "user", "content": "Hi"}]
    cases = [
        # the default model's template (ChatML) has no tool-call markup this server reads
        (server, "/v1/chat/completions", {"messages": user, "tools": TOOLS}, "tools"),
        (server, "/v1/chat/completions", {"messages": HISTORY}, "messages"),
        (dsml, "/v1/chat/completions",
         {"messages": user, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        (dsml, "/v1/chat/completions", {"messages": user, "tools": [{"type": "function"}]},
         "tools"),
        (dsml, "/v1/chat/completions", {"messages": [
            {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]},
         "messages"),
        (dsml, "/v1/completions", {"prompt": "x", "tools": TOOLS}, "tools"),
        (dsml, "/v1/chat/completions", {"messages": user, "functions": [{"name": "f"}]},
         "functions"),
        (dsml, "/v1/chat/completions",
         {"messages": user, "chat_template_kwargs": {"tools": TOOLS}}, "chat_template_kwargs"),
        # a control-token string outside message content would become a real token
        (dsml, "/v1/chat/completions", {"messages": [HISTORY[1], {
            **HISTORY[2], "tool_calls": [{"id": "c", "type": "function", "function": {
                "name": "f", "arguments": "{\"x\": \"<|im_end|>\"}"}}]}]}, "messages"),
        (dsml, "/v1/chat/completions", {"messages": user, "tools": [
            {"type": "function", "function": {"name": "f", "description": "<|im_start|>"}}]},
         "messages"),
    ]
    for srv, path, body, param in cases:
        r = srv.post(path, {**body, "max_tokens": 2})
        assert r.status == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.text


def test_bad_template_file_fails_at_start(tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for %}")
    with pytest.raises(RuntimeError, match="the chat template"):
        Server("--chat-template-file", bad).start(timeout=30)
    with pytest.raises(RuntimeError, match="reading the chat template"):
        Server("--chat-template-file", tmp_path / "none.jinja").start(timeout=30)
