"""A slot's cache serves the next prompt that starts with what it holds: the prefilled
tokens drop, `usage.timings` says how many were cached, and the answer is the same,
logprobs included, as a full prefill (`"cache_prompt": false`)."""

import uuid

from helpers import chat_body


def cached(r):
    t = r.json()["usage"]["timings"]
    assert t["cache_hit"] == (t["cached_prefix_tokens"] > 0), t
    assert t["prefilled_tokens"] == t["effective_prompt_tokens"] - t["cached_prefix_tokens"], t
    return t["cached_prefix_tokens"]


def answer(r):
    ch = r.json()["choices"][0]
    return ch.get("text", ch.get("message", {}).get("content")), ch["logprobs"]


def test_repeated_prompt_prefills_only_its_last_token(server):
    # (a prompt no other test sends, so the first request cannot hit)
    body = {"prompt": f"Note {uuid.uuid4().hex}: list the planets of the solar system.",
            "max_tokens": 8, "temperature": 0, "logprobs": 2}
    first = server.post("/v1/completions", body)
    assert first.status == 200, first.text
    n = first.json()["usage"]["prompt_tokens"]
    assert cached(first) == 0
    before = server.metrics()["moeserve_prompt_tokens_cached_total"]
    again = server.post("/v1/completions", body)
    assert cached(again) == n - 1
    assert server.metrics()["moeserve_prompt_tokens_cached_total"] - before == n - 1
    full = server.post("/v1/completions", {**body, "cache_prompt": False})
    assert cached(full) == 0
    assert answer(again) == answer(first) == answer(full)


def test_next_chat_turn_prefills_only_the_new_turn(server):
    turn1 = [{"role": "user", "content": f"My name is {uuid.uuid4().hex[:8]}. Say hi."}]
    r1 = server.post("/v1/chat/completions", {"messages": turn1, "temperature": 0,
                                              "max_tokens": 12})
    assert r1.status == 200, r1.text
    p1 = r1.json()["usage"]["prompt_tokens"]
    reply = r1.json()["choices"][0]["message"]["content"]
    turn2 = turn1 + [{"role": "assistant", "content": reply},
                     {"role": "user", "content": "What is my name?"}]
    body = {"messages": turn2, "temperature": 0, "max_tokens": 12, "logprobs": True}
    r2 = server.post("/v1/chat/completions", body)
    # at least the whole first prompt comes from the cache (the reply's tokens too
    # where its text tokenizes back to what was generated)
    assert cached(r2) >= p1, (cached(r2), p1)
    full = server.post("/v1/chat/completions", {**body, "cache_prompt": False})
    assert cached(full) == 0
    assert answer(r2) == answer(full)


def test_different_prompt_keeps_only_the_shared_start(server):
    stem = f"Topic {uuid.uuid4().hex}. "
    a = server.post("/v1/completions", {"prompt": stem + "Tell me about cats.",
                                        "max_tokens": 2, "temperature": 0})
    assert a.status == 200, a.text
    stem_tokens = len(server.post("/tokenize", {"content": stem.rstrip()}).json()["tokens"])
    b = server.post("/v1/completions", {"prompt": stem + "Tell me about dogs.",
                                        "max_tokens": 2, "temperature": 0})
    n = b.json()["usage"]["prompt_tokens"]
    assert stem_tokens - 1 <= cached(b) < n - 1, (cached(b), stem_tokens, n)
