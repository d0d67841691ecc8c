"""Running the `moeserve` binary from the parity tests: a plugins.toml for the CPU
backend with a given activation mode, and a call that fails with moeserve's stderr."""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN_DIR = Path(os.environ.get("MOESERVE_BIN_DIR", ROOT / "target/debug"))


def config(tmp_path, activation):
    p = tmp_path / f"plugins-{activation}.toml"
    p.write_text(
        f'plugin_dir = "{BIN_DIR}"\n'
        f'[[plugin]]\nlibrary = "moe_backend_cpu"\n[plugin.settings]\nactivation = "{activation}"\n'
        '[[plugin]]\nlibrary = "moe_quant_ggml"\n[[plugin]]\nlibrary = "moe_policy_basic"\n'
    )
    return p


def moeserve(cfg, *args, env=None):
    env = dict(os.environ, RUST_LOG="warn", **(env or {}))
    out = subprocess.run([str(BIN_DIR / "moeserve"), "--config", str(cfg), *map(str, args)],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout
