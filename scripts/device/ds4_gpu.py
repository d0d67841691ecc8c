#!/usr/bin/env python3
"""DeepSeek-V4 on the CUDA backend vs the CPU backend and the transformers oracle, on the
committed tiny fixtures (run on the device machine by scripts/device/ds4_gpu.sh; carry
.dev/ds4 with the stripped moeserve + cpu/cuda/ggml/policy plugins built here).

For each fixture and weight type: `moeserve convert`, then `moeserve logits` with the
cuda backend (batched prefill and token-by-token decode) and the cpu backend (f32
activations), and `moeserve generate` (greedy) on the GPU. Prints a table, writes JSON.
On the GPU the whole forward runs as backend ops with activations and caches resident
(host/engine/src/deepseek4/gpu.rs; decode steps replayed as CUDA graphs); the column
"dev vs host glue" compares it with the same GPU run whose per-token glue is on the host
(MOE_DS4_HOST_GLUE=1): same weight kernels, so only the glue's summation order differs.
Prefill runs Q8_0 / ROCmFP4 products of 16+ columns on the q8_1 MMQ tiles (8-bit
activations, as llama.cpp does); "exact" columns rerun prefill with
MOE_GPU_EXACT_PREFILL=1 (f32 activations: the CPU's sums up to order); "split vs dec"
reruns decode with MOE_GPU_ATT_SPLIT=1 (the long-context attention: each token's keys
split over blocks, then merged by a second launch) and "1-launch vs dec" with
MOE_GPU_ATT_DEC=1 too (the same splits merged in the same launch, ds4_attention_dec),
against the fixtures' own decode (a block a head); summation order only. "draft vs dec":
`logits --mode draft` (passes of a token and up to 7 drafts, some made up, which the slot
drops by restoring its ring rows: speculative decoding's passes) against decode."""
import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests/fixtures/deepseek4"
BIN = ROOT / ".dev/ds4"
OUT = Path(os.environ.get("OUT", "/tmp/ds4gpu"))
W = Path(os.environ.get("W", "/tmp/ds4gpu-work"))
RUNS = [("tiny_mixed", "f32"), ("tiny_release_ratios", "f32"), ("tiny_odd", "f32"),
        ("tiny_defaults", "f32"), ("tiny_wide_index", "f32"), ("tiny_trained", "f32"),
        ("tiny_release", "f32"),
        ("tiny_trained", "f16"), ("tiny_trained", "q8_0"), ("tiny_mixed", "bf16"),
        ("tiny_trained", "rocmfp4"), ("tiny_trained", "rocmfpx-mix"), ("tiny_mixed", "rocmfpx-mix")]
# "rocmfpx-mix": routed experts ROCmFP2 affine (107), attention + shared experts ROCmFP4
# (100), like the published Strix-Lean files; made with `moeserve quantize` from f32.
# "rocmfp4": only the ROCmFP4 part (the dense kernel, f32 activations like the CPU run).
MIX = [(r"_exps\.weight$", "107-affine"),
       (r"(attn_q_a|attn_q_b|attn_kv|attn_output_a|attn_output_b|_shexp)\.weight$", "Q4_0_ROCMFP4")]
MIXES = {"rocmfpx-mix": MIX, "rocmfp4": MIX[1:]}


def config(backend):
    p = W / f"plugins-{backend}.toml"
    p.write_text(f'plugin_dir = "{BIN}"\n'
                 f'[[plugin]]\nlibrary = "moe_backend_{backend}"\n'
                 + ('[plugin.settings]\nactivation = "f32"\n' if backend == "cpu" else "")
                 + '[[plugin]]\nlibrary = "moe_quant_ggml"\n[[plugin]]\nlibrary = "moe_policy_basic"\n'
                 + '[[plugin]]\nlibrary = "moe_quant_rocmfpx"\n[plugin.settings]\nfp2 = "affine"\n'
                 f'[devices]\nbackend = "{backend}"\n')
    return p


def moeserve(cfg, *args, env=None):
    r = subprocess.run([str(BIN / "moeserve"), "--config", str(cfg), *map(str, args)],
                       capture_output=True, text=True, env=dict(os.environ, RUST_LOG="warn", **(env or {})))
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip())
    return r.stdout


def rel(a, b):
    return float((np.abs(a - b).max(1) / np.abs(b).max()).max())


def main():
    W.mkdir(parents=True, exist_ok=True)
    OUT.mkdir(parents=True, exist_ok=True)
    cpu, gpu = config("cpu"), config("cuda")
    rows = []
    print(f"{'fixture':20} {'type':5} {'gpu vs cpu':>10} {'gpu vs oracle':>13} {'pre vs dec':>10} "
          f"{'dev vs host glue':>16} {'exact vs cpu':>12} {'exact vs dec':>12} {'split vs dec':>12} "
          f"{'1-launch vs dec':>15} {'draft vs dec':>12} {'top-1':>6} "
          f"{'greedy':>7} {'gpu s':>6}")
    only = os.environ.get("ONLY")  # e.g. ONLY=tiny_mixed.f32: the runs named so
    for name, ty in RUNS:
        if only and f"{name}.{ty}" not in only.split(","):
            continue
        ref = np.load(FIX / f"{name}.npz")
        toks = ",".join(map(str, ref["tokens"]))
        model = W / f"{name}.{ty}.gguf"
        if ty in MIXES:
            src = W / f"{name}.f32.gguf"
            moeserve(cpu, "convert", FIX / name, "--out", src, "--type", "f32")
            for i, (pattern, target) in enumerate(MIXES[ty]):
                dst = model if i == len(MIXES[ty]) - 1 else W / f"{name}.mix{i}.gguf"
                moeserve(cpu, "quantize", "--model", src, "--out", dst, "--tensors", pattern, "--type", target)
                src = dst
        else:
            moeserve(cpu, "convert", FIX / name, "--out", model, "--type", ty)
        got = {}
        t0 = time.time()
        for backend, cfg in (("cuda", gpu), ("cpu", cpu)):
            for mode in ("prefill", "decode", "draft") if backend == "cuda" else ("prefill",):
                out = W / f"{name}.{ty}.{backend}.{mode}.npy"
                moeserve(cfg, "logits", "--model", model, "--tokens", toks, "--out", out, "--mode", mode)
                got[(backend, mode)] = np.load(out)
            if backend == "cuda":
                secs = time.time() - t0
                # Decode with the long-context attention (keys split over blocks, merged by a
                # second launch or in the same one), which the fixtures' short contexts would
                # not pick.
                for key, env, mode in (("hostglue", {"MOE_DS4_HOST_GLUE": "1"}, "prefill"),
                                       ("exact", {"MOE_GPU_EXACT_PREFILL": "1"}, "prefill"),
                                       ("split", {"MOE_GPU_ATT_SPLIT": "1"}, "decode"),
                                       ("dec1", {"MOE_GPU_ATT_SPLIT": "1", "MOE_GPU_ATT_DEC": "1"},
                                        "decode")):
                    out = W / f"{name}.{ty}.cuda.{key}.npy"
                    moeserve(cfg, "logits", "--model", model, "--tokens", toks, "--out", out, "--mode", mode,
                             env=env)
                    got[("cuda", key)] = np.load(out)
        n = int(ref["prompt_len"])
        g = moeserve(gpu, "generate", "--model", model, "--prompt-tokens", ",".join(map(str, ref["tokens"][:n])),
                     "--max-tokens", len(ref["greedy"]), "--ids").strip()
        greedy_same = [int(x) for x in g.split(",")] == ref["greedy"].tolist()
        gp, gd, cp = got[("cuda", "prefill")], got[("cuda", "decode")], got[("cpu", "prefill")]
        ge = got[("cuda", "exact")]
        row = dict(fixture=name, type=ty, gpu_vs_cpu=rel(gp, cp), gpu_vs_oracle=rel(gp, ref["logits"]),
                   gpu_prefill_vs_decode=rel(gp, gd), device_vs_host_glue=rel(gp, got[("cuda", "hostglue")]),
                   exact_prefill_vs_cpu=rel(ge, cp), exact_prefill_vs_decode=rel(ge, gd),
                   split_decode_vs_decode=rel(got[("cuda", "split")], gd),
                   one_launch_decode_vs_decode=rel(got[("cuda", "dec1")], gd),
                   draft_vs_decode=rel(got[("cuda", "draft")], gd),
                   top1_vs_cpu=float((gp.argmax(1) == cp.argmax(1)).mean()),
                   greedy_equals_oracle=greedy_same, gpu_seconds=secs)
        rows.append(row)
        print(f"{name:20} {ty:5} {row['gpu_vs_cpu']:10.3g} {row['gpu_vs_oracle']:13.3g} "
              f"{row['gpu_prefill_vs_decode']:10.3g} {row['device_vs_host_glue']:16.3g} {row['exact_prefill_vs_cpu']:12.3g} "
              f"{row['exact_prefill_vs_decode']:12.3g} {row['split_decode_vs_decode']:12.3g} "
              f"{row['one_launch_decode_vs_decode']:15.3g} {row['draft_vs_decode']:12.3g} "
              f"{row['top1_vs_cpu']:6.3f} {str(greedy_same):>7} {secs:6.1f}",
              flush=True)
    (OUT / "ds4_gpu.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
