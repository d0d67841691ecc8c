#!/usr/bin/env bash
# Sets up and runs every test: Python packages the parity tests compare against, the
# default model (for the tests that use a real GGUF), then the workspace's tests.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -r tests/requirements.txt
scripts/fetch-model.sh >/dev/null
# Plugins are cdylibs the tests load from target/debug: build them first.
cargo build --workspace --quiet
cargo test --workspace -- --test-threads=2
python3 -m pytest -q tests/parity
# End-to-end API tests: start the real server (target/debug/moeserve) on loopback.
python3 -m pytest -q tests/api
