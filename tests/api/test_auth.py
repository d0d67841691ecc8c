"""--api-key: generation and model routes need `Authorization: Bearer KEY`."""

import openai
import pytest

from helpers import SHORT_PROMPT, Server, assert_openai_error, chat_body

KEY = "secret"


@pytest.fixture(scope="module")
def keyed_server():
    with Server("--parallel", "1", "--api-key", KEY) as s:
        yield s


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": KEY},                 # no "Bearer " scheme
    {"Authorization": f"Basic {KEY}"},
    {"Authorization": f"Bearer {KEY}x"},
], ids=["none", "wrong", "no-scheme", "basic", "longer"])
def test_missing_or_wrong_key_is_401(keyed_server, headers):
    for method, path, body in [
        ("POST", "/v1/chat/completions", chat_body(max_tokens=1)),
        ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        ("GET", "/v1/models", None),
        ("POST", "/tokenize", {"content": "hi"}),
        ("POST", "/detokenize", {"tokens": [1]}),
    ]:
        r = keyed_server.request(method, path, body, headers=headers)
        err = assert_openai_error(r, 401)
        assert err["code"] == "invalid_api_key", (path, err)


def test_key_is_checked_before_the_body(keyed_server):
    r = keyed_server.request("POST", "/v1/chat/completions", "{not json",
                             headers={"Content-Type": "application/json"})
    assert_openai_error(r, 401)


def test_right_key_works_with_openai_client(keyed_server):
    c = keyed_server.client(api_key=KEY)
    r = c.chat.completions.create(model=keyed_server.model_id,
                                  messages=[{"role": "user", "content": SHORT_PROMPT}],
                                  temperature=0, max_tokens=3)
    assert r.choices[0].message.content
    assert [m.id for m in c.models.list()] == [keyed_server.model_id]


def test_wrong_key_raises_authentication_error(keyed_server):
    c = keyed_server.client(api_key="not-the-key")
    with pytest.raises(openai.AuthenticationError) as ei:
        c.chat.completions.create(model=keyed_server.model_id,
                                  messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert ei.value.status_code == 401


def test_health_and_metrics_need_no_key(keyed_server):
    assert keyed_server.get_json("/health") == (200, {"status": "ok"})
    assert keyed_server.request("GET", "/metrics").status == 200


@pytest.mark.parametrize("scheme", ["bearer", "BEARER"])
def test_the_scheme_is_case_insensitive(keyed_server, scheme):
    r = keyed_server.request("GET", "/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
    assert r.status == 200, r.text
