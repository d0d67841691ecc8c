"""--cors-origin: browser pages from the listed origins may call the API; without the
flag no CORS headers are sent (browsers then keep other sites' pages out)."""

import subprocess

import pytest

from helpers import BIN, CONFIG, MODEL, Server, chat_body

ORIGIN = "http://localhost:3000"
KEY = "secret"


@pytest.fixture(scope="module")
def cors_server():
    # (the origin as a user may type it: browsers send it in lower case)
    with Server("--parallel", "1", "--api-key", KEY, "--cors-origin",
                ORIGIN.replace("localhost", "LocalHost"),
                env={"RUST_LOG": "warn,moeserve::http=info"}) as s:
        yield s


def preflight(server, origin):
    return server.request("OPTIONS", "/v1/chat/completions", headers={
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    })


def header(resp, name):
    return {k.lower(): v for k, v in resp.headers.items()}.get(name.lower())


def test_preflight_is_answered_without_the_key(cors_server):
    r = preflight(cors_server, ORIGIN)
    assert r.status == 200, (r.status, r.text)
    assert "OPTIONS /v1/chat/completions 200" in cors_server.log()
    assert header(r, "access-control-allow-origin") == ORIGIN
    assert "POST" in header(r, "access-control-allow-methods")
    allowed = header(r, "access-control-allow-headers").lower()
    assert "authorization" in allowed and "content-type" in allowed


def test_allowed_origin_gets_the_header_on_answers_and_errors(cors_server):
    ok = cors_server.post("/v1/chat/completions", chat_body(max_tokens=1),
                          headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert ok.status == 200, ok.text
    assert header(ok, "access-control-allow-origin") == ORIGIN
    # (a page must be able to read the 401 to tell its user the key is wrong)
    denied = cors_server.post("/v1/chat/completions", chat_body(max_tokens=1),
                              headers={"Origin": ORIGIN})
    assert denied.status == 401
    assert header(denied, "access-control-allow-origin") == ORIGIN


def test_other_origin_gets_no_allow_header(cors_server):
    r = preflight(cors_server, "http://evil.example")
    assert header(r, "access-control-allow-origin") is None
    got = cors_server.post("/v1/chat/completions", chat_body(max_tokens=1),
                           headers={"Origin": "http://evil.example",
                                    "Authorization": f"Bearer {KEY}"})
    assert header(got, "access-control-allow-origin") is None


def test_without_the_flag_no_cors_headers(server):
    r = server.request("GET", "/v1/models", headers={"Origin": ORIGIN})
    assert r.status == 200
    assert header(r, "access-control-allow-origin") is None


def test_any_origin():
    with Server("--parallel", "1", "--cors-origin", "*") as s:
        r = s.request("GET", "/health", headers={"Origin": "http://anything.example"})
        assert header(r, "access-control-allow-origin") == "*"


@pytest.mark.parametrize("bad", ["localhost:3000", "http://host/path", "ftp://x", "http://"])
def test_bad_origin_is_refused_at_start(bad):
    p = subprocess.run([str(BIN), "--config", str(CONFIG), "serve", "--model", str(MODEL), "--port", "0",
                        "--cors-origin", bad], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "--cors-origin" in p.stderr and "Traceback" not in p.stderr and "panicked" not in p.stderr
