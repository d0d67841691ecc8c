"""Shared helpers for the end-to-end API tests: starting a real `moeserve` on loopback,
raw HTTP requests (stdlib only, so nothing between us and the server rewrites anything),
SSE parsing and Prometheus metrics parsing."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("MOESERVE_BIN", ROOT / "target" / "debug" / "moeserve"))
MODEL = Path(
    os.environ.get(
        "MOESERVE_TEST_MODEL", ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
)
CONFIG = ROOT / "plugins.toml"
HOST = "127.0.0.1"
READY_TIMEOUT_S = 120.0

# A prompt the small model answers with a long list: it will not stop on its own within a
# few dozen tokens, so `finish_reason` is "length" for small limits.
LONG_PROMPT = "Count from 1 to 100, separated by commas."
SHORT_PROMPT = "Say hello."


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    """One `moeserve serve` process on 127.0.0.1 and a free port."""

    def __init__(self, *extra_args: str, env: dict | None = None, model: Path | None = None):
        self.model = Path(model) if model else MODEL
        self.extra_args = [str(a) for a in extra_args]
        self.env_extra = env or {}
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.log_path = ""
        self.model_id = ""

    # -- lifecycle -------------------------------------------------------------------
    def start(self, timeout: float = READY_TIMEOUT_S) -> "Server":
        if not BIN.is_file():
            raise RuntimeError(f"{BIN} is missing: run `cargo build --workspace` first")
        if not self.model.is_file():
            raise RuntimeError(f"{self.model} is missing: run scripts/fetch-model.sh first")
        last_err = None
        for _attempt in range(3):  # the free port may be taken between probe and bind
            self.port = free_port()
            env = dict(os.environ)
            # only the tests' flags and `env` decide (serve reads MOESERVE_<FLAG> too)
            for k in [k for k in env if k.startswith("MOESERVE_")]:
                env.pop(k)
            env.setdefault("RUST_LOG", "warn")
            env.update(self.env_extra)
            fd, self.log_path = tempfile.mkstemp(prefix=f"moeserve-{self.port}-", suffix=".log")
            cmd = [
                str(BIN), "--config", str(CONFIG), "serve", "--model", str(self.model),
                "--host", HOST, "--port", str(self.port), *self.extra_args,
            ]
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, env=env
            )
            os.close(fd)
            try:
                self._wait_ready(timeout)
                self.model_id = self.get_json("/v1/models", auth=True)[1]["data"][0]["id"]
                return self
            except _PortTaken as e:
                last_err = e
                Path(self.log_path).unlink(missing_ok=True)
                continue
            except BaseException:
                self.close()  # the log is already in the exception's message
                raise
        raise RuntimeError(f"could not start the server: {last_err}")

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                log = self.log()
                if "cannot listen" in log:
                    raise _PortTaken(log)
                raise RuntimeError(f"server exited with {rc} while starting:\n{log}")
            try:
                status, _ = self.get_json("/health", timeout=2)
                if status == 200:
                    return
                assert status == 503, f"/health answered {status} while loading"
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait; SIGKILL if it does not exit. Returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def close(self) -> None:
        """Stops the server (SIGTERM, then SIGKILL if needed) and removes its log file
        (set MOESERVE_KEEP_LOGS=1 to keep it)."""
        try:
            self.terminate()
        finally:
            self.kill()
            if self.log_path and not os.environ.get("MOESERVE_KEEP_LOGS"):
                Path(self.log_path).unlink(missing_ok=True)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- clients ---------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def client(self, api_key: str = "sk-no-key-needed", **kw) -> openai.OpenAI:
        kw.setdefault("timeout", 120.0)
        kw.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, **kw)

    def request(self, method: str, path: str, body=None, headers: dict | None = None,
                timeout: float = 120.0, auth: bool = False) -> "Resp":
        return raw_request(self.port, method, path, body, headers, timeout,
                           api_key=self._key() if auth else None)

    def post(self, path: str, body, **kw) -> "Resp":
        return self.request("POST", path, body, **kw)

    def get_json(self, path: str, timeout: float = 30.0, auth: bool = False):
        r = self.request("GET", path, timeout=timeout, auth=auth)
        return r.status, r.json()

    def metrics(self) -> dict[str, float]:
        r = self.request("GET", "/metrics")
        assert r.status == 200, r.body
        return parse_metrics(r.text)

    def _key(self) -> str | None:
        args = self.extra_args
        return args[args.index("--api-key") + 1] if "--api-key" in args else None


class _PortTaken(Exception):
    pass


@dataclass
class Resp:
    status: int
    headers: dict
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self):
        return json.loads(self.body)


def raw_request(port: int, method: str, path: str, body=None, headers: dict | None = None,
                timeout: float = 120.0, api_key: str | None = None) -> Resp:
    """One HTTP/1.1 request over a fresh connection; `body` may be bytes, str or JSON."""
    h = {} if headers is None else dict(headers)
    if body is not None and not isinstance(body, (bytes, str)):
        body = json.dumps(body)
        h.setdefault("Content-Type", "application/json")
    if isinstance(body, str):
        body = body.encode()
    if api_key:
        h.setdefault("Authorization", f"Bearer {api_key}")
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=h)
        r = conn.getresponse()
        data = r.read()
        return Resp(r.status, {k.lower(): v for k, v in r.getheaders()}, data)
    finally:
        conn.close()


def sse_events(raw: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order (comments/keep-alives skipped)."""
    out = []
    for block in raw.replace("\r\n", "\n").split("\n\n"):
        data = [ln[5:].lstrip(" ") for ln in block.split("\n") if ln.startswith("data:")]
        if data:
            out.append("\n".join(data))
    return out


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, value = line.rsplit(" ", 1)
        out[name] = float(value)
    return out


def assert_openai_error(resp: Resp, status: int, param: str | None = "<any>",
                        code: str | None = "<any>") -> dict:
    """Checks an OpenAI-style error body: {"error": {"message", "type", "param", "code"}}."""
    assert resp.status == status, (resp.status, resp.text)
    assert resp.headers.get("content-type", "").startswith("application/json"), resp.headers
    body = resp.json()
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"], body
    assert isinstance(err["type"], str) and err["type"], body
    assert "param" in err and "code" in err, body
    if param != "<any>":
        assert err["param"] == param, body
    if code != "<any>":
        assert err["code"] == code, body
    return err


def chat_body(content: str = SHORT_PROMPT, **kw) -> dict:
    body = {"messages": [{"role": "user", "content": content}]}
    body.update(kw)
    return body
