#!/usr/bin/env python3
"""CPU benchmark: moeserve vs llama.cpp's llama-bench on the same GGUF and thread count.

Both measure pp (one batched pass over N prompt tokens) and tg (N tokens decoded one at a
time), mean of R repetitions after a warm-up. tg is taken twice, at the same context for
both: from an empty context (llama-bench's tg; ours after a 1-token prompt) and after the
pp prompt (ours as `moeserve bench` runs it; llama-bench with `-d PP`), since decode
slows as the context grows. Prints a markdown table of tok/s and the ratio
ours/llama.cpp, and writes all numbers as JSON.

Usage: cpu_vs_llamacpp.py --moeserve BIN --config plugins.toml --llama-bench BIN
                          --model M.gguf [--threads 2,4,8] [--pp 512] [--tg 128] [--reps 3]
                          [--out results.json]
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time


def bench_ours(a, threads, pp):
    env = dict(os.environ, MOE_CPU_THREADS=str(threads), RUST_LOG="warn")
    cmd = [a.moeserve, "--config", a.config, "bench", "--model", a.model, "--prompt-tokens",
           str(pp), "--gen-tokens", str(a.tg), "--repetitions", str(a.reps), "--json"]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_ours(a, threads):
    full, empty = bench_ours(a, threads, a.pp), bench_ours(a, threads, 1)
    return {"pp": full["pp_tok_s"], "tg_after_pp": full["tg_tok_s"], "tg": empty["tg_tok_s"],
            "raw": [full, empty]}


def bench_llama(a, threads, pp, tg, depth):
    cmd = [a.llama_bench, "-m", a.model, "-p", str(pp), "-n", str(tg), "-d", str(depth),
           "-t", str(threads), "-r", str(a.reps), "-ngl", "0", "-o", "json"]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def run_llama(a, threads):
    rows = bench_llama(a, threads, a.pp, a.tg, 0) + bench_llama(a, threads, 0, a.tg, a.pp)
    res = {"raw": rows}
    for r in rows:
        if r.get("n_prompt", 0) > 0:
            res["pp"] = r["avg_ts"]
        else:
            res["tg_after_pp" if r.get("n_depth", 0) > 0 else "tg"] = r["avg_ts"]
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moeserve", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", default="2,4,8")
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="cpu_bench.json")
    a = ap.parse_args()
    results = []
    for t in [int(x) for x in a.threads.split(",")]:
        ours, peer = run_ours(a, t), run_llama(a, t)
        results.append({"threads": t, "ours": ours, "llama.cpp": peer})
        print(f"threads={t}: ours pp={ours['pp']:.1f} tg={ours['tg']:.1f} "
              f"tg@pp={ours['tg_after_pp']:.1f} | llama.cpp pp={peer['pp']:.1f} "
              f"tg={peer['tg']:.1f} tg@pp={peer['tg_after_pp']:.1f}", file=sys.stderr)
    print(f"\n| threads | test | moeserve tok/s | llama.cpp tok/s | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        for k, name in (("pp", f"pp{a.pp}"), ("tg", f"tg{a.tg}"),
                        ("tg_after_pp", f"tg{a.tg} after pp{a.pp}")):
            o, p = r["ours"][k], r["llama.cpp"][k]
            print(f"| {r['threads']} | {name} | {o:.1f} | {p:.1f} | {o / p:.2f} |")
    meta = {"date": time.strftime("%Y-%m-%d"), "cpu": platform.processor() or platform.machine(),
            "model": os.path.basename(a.model), "pp": a.pp, "tg": a.tg, "reps": a.reps}
    try:
        meta["cpu"] = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
