#!/usr/bin/env bash
# Device session, stage 2 of 2: reassemble the GGUF, make the transformers reference
# fixture, then benchmark moeserve (release binaries in .dev/bin) against llama-bench on
# the same CPU, GGUF and thread counts. Results go to $OUT.
set -euo pipefail
export PYTHONUNBUFFERED=1
w=/root/w
mkdir -p $w/model
cat $w/part1 .dev/part2 > $w/model/SmolLM2-135M-Instruct.Q4_1.gguf
sha256sum $w/model/SmolLM2-135M-Instruct.Q4_1.gguf
[ -n "${SKIP_FIXTURE:-}" ] || { python3 -m pip install -q --no-index --no-deps --target /tmp/site .dev/whl/*.whl && export PYTHONPATH=/tmp/site; }
[ -n "${SKIP_FIXTURE:-}" ] || python3 tests/fixtures/smollm2/make_logits.py $w/model SmolLM2-135M-Instruct.Q4_1.gguf $OUT/smollm2_logits.npz 2>&1 | grep -v Warning | tail -5
cat > $w/plugins.toml <<TOML
plugin_dir = "$PWD/.dev/bin"
[[plugin]]
library = "moe_backend_cpu"
[[plugin]]
library = "moe_quant_ggml"
[[plugin]]
library = "moe_policy_basic"
TOML
# Kernel time breakdown of our decode, one thread (the backend reports <kernel>.ns).
MOE_CPU_THREADS=1 RUST_LOG=warn .dev/bin/moeserve --config $w/plugins.toml bench --model $w/model/SmolLM2-135M-Instruct.Q4_1.gguf \
  --prompt-tokens 8 --gen-tokens 128 --repetitions 1 --json > $OUT/profile_t1.json
[ -n "${PROFILE_ONLY:-}" ] && exit 0
for i in $(seq 1 120); do [ -f $w/build.rc ] && break; sleep 2; done
cat $w/build.rc; tail -3 $w/build.log
python3 scripts/bench/cpu_vs_llamacpp.py --moeserve .dev/bin/moeserve --config $w/plugins.toml \
  --llama-bench $w/llama.cpp/build/bin/llama-bench --model $w/model/SmolLM2-135M-Instruct.Q4_1.gguf \
  --threads ${THREADS:-2,4,8} --out $OUT/cpu_bench.json | tee $OUT/cpu_bench.md
