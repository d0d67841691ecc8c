"""Output-length fields, server limits, context length and body size."""

import pytest

from helpers import LONG_PROMPT, Server, assert_openai_error, chat_body


def completion_tokens(srv, **fields):
    r = srv.post("/v1/chat/completions", chat_body(LONG_PROMPT, temperature=0, **fields))
    assert r.status == 200, r.text
    b = r.json()
    return b["usage"]["completion_tokens"], b["choices"][0]["finish_reason"]


@pytest.mark.parametrize(
    "fields,expect",
    [
        ({"max_tokens": 2, "max_output_tokens": 5, "max_completion_tokens": 7}, 2),
        ({"max_output_tokens": 3, "max_completion_tokens": 7}, 3),
        ({"max_tokens": 4, "max_completion_tokens": 7}, 4),
        ({"max_completion_tokens": 5}, 5),
        ({"max_output_tokens": 6}, 6),
    ],
    ids=["max_tokens-wins", "max_output-over-max_completion", "max_tokens-over-max_completion",
         "max_completion-alone", "max_output-alone"],
)
def test_output_length_precedence(server, fields, expect):
    n, reason = completion_tokens(server, **fields)
    assert (n, reason) == (expect, "length")


def test_openai_client_max_completion_tokens(server, client):
    r = client.chat.completions.create(
        model=server.model_id, messages=[{"role": "user", "content": LONG_PROMPT}],
        temperature=0, max_completion_tokens=3)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


@pytest.fixture(scope="module")
def small_server():
    """Small context, small default output, small body limit."""
    with Server("--parallel", "2", "--ctx-size", "64", "--default-max-tokens", "5",
                "--max-body-bytes", "4096") as s:
        yield s


@pytest.mark.parametrize("fields", [{}, {"max_tokens": 0}, {"max_tokens": -1},
                                    {"max_completion_tokens": -1},
                                    {"max_tokens": None}],
                         ids=["missing", "zero", "minus-one", "max_completion-minus-one", "null"])
def test_missing_zero_negative_means_server_default(small_server, fields):
    n, reason = completion_tokens(small_server, **fields)
    assert n <= 5
    assert (n, reason) == (5, "length")


def test_prompt_longer_than_context_is_400(small_server):
    long = "apple banana cherry " * 40
    r = small_server.post("/v1/chat/completions", chat_body(long, max_tokens=2))
    assert_openai_error(r, 400, code="context_length_exceeded")
    r = small_server.post("/v1/completions", {"prompt": long, "max_tokens": 2})
    assert_openai_error(r, 400, code="context_length_exceeded")
    # and the server keeps serving
    n, _ = completion_tokens(small_server, max_tokens=2)
    assert n == 2


def test_context_boundary(small_server):
    one = small_server.post("/tokenize", {"content": "one"}).json()["tokens"][0]
    r = small_server.post("/v1/completions", {"prompt": [one] * 63, "max_tokens": 10})
    assert r.status == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 1
    r = small_server.post("/v1/completions", {"prompt": [one] * 64, "max_tokens": 10})
    assert_openai_error(r, 400, code="context_length_exceeded")


def test_completions_context_error_names_prompt(small_server):
    r = small_server.post("/v1/completions", {"prompt": "apple banana cherry " * 40})
    assert_openai_error(r, 400, code="context_length_exceeded", param="prompt")


def test_generation_never_runs_past_the_context(small_server):
    # 60 prompt tokens in a 64-token context: at most 4 more can be generated.
    ids = [small_server.post("/tokenize", {"content": "one"}).json()["tokens"][0]] * 60
    r = small_server.post("/v1/completions", {"prompt": ids, "max_tokens": 50,
                                              "temperature": 0})
    assert r.status == 200, r.text
    u = r.json()["usage"]
    assert u["prompt_tokens"] == 60
    assert u["prompt_tokens"] + u["completion_tokens"] <= 64
    assert r.json()["choices"][0]["finish_reason"] == "length" or u["completion_tokens"] < 4


def test_body_over_limit_is_413(small_server):
    body = chat_body("x" * 6000, max_tokens=1)
    r = small_server.post("/v1/chat/completions", body)
    assert_openai_error(r, 413)
    # just under the limit is fine (it is not a size problem)
    r = small_server.post("/v1/chat/completions",
                          chat_body("hi", max_tokens=1, user="u" * 3500))
    assert r.status == 200, r.text
    assert small_server.get_json("/health")[0] == 200


def test_max_tokens_above_limit_is_clamped():
    with Server("--parallel", "1", "--max-tokens-limit", "4") as s:
        for fields in ({"max_tokens": 50}, {"max_completion_tokens": 1000}, {}):
            n, reason = completion_tokens(s, **fields)
            assert (n, reason) == (4, "length"), fields
        # below the limit it is honoured
        assert completion_tokens(s, max_tokens=2) == (2, "length")


def test_serve_settings_from_the_environment():
    """Every serve flag has a MOESERVE_<FLAG> variable; a flag given wins over it."""
    env = {"MOESERVE_DEFAULT_MAX_TOKENS": "3", "MOESERVE_MAX_TOKENS_LIMIT": "5"}
    with Server(env=env) as s:
        assert completion_tokens(s) == (3, "length")
        assert completion_tokens(s, max_tokens=9) == (5, "length")
    with Server("--default-max-tokens", "4", env=env) as s:
        assert completion_tokens(s) == (4, "length")
