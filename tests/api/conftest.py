import os

import pytest

from helpers import SHORT_PROMPT, Server

# Loopback traffic must never go through a proxy from the environment.
for _var in ("NO_PROXY", "no_proxy"):
    os.environ[_var] = ",".join(filter(None, [os.environ.get(_var), "127.0.0.1", "localhost"]))


@pytest.fixture(scope="session")
def server():
    """The shared server: 4 slots, default limits. Tests that need other flags start
    their own short-lived `Server`."""
    s = Server("--parallel", "4")
    s.start()
    yield s
    s.close()


@pytest.fixture(scope="session")
def client(server):
    return server.client()


@pytest.fixture(scope="session")
def greedy_hello(server, client):
    """The greedy (temperature 0) answer to SHORT_PROMPT, computed once."""
    r = client.chat.completions.create(
        model=server.model_id,
        messages=[{"role": "user", "content": SHORT_PROMPT}],
        temperature=0,
        max_tokens=40,
    )
    return r
