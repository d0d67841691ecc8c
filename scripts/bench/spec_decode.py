#!/usr/bin/env python3
"""Speculative decoding benchmark: the same server binary with drafting on
(`--draft-max N`) and off (`--draft-max 0`), measured in the same run.

Each server gets the upstream decode harness's request (serving.md: POST chat
completions, a prompt asking to repeat BETA seeded with eight BETAs, max_tokens 512,
temperature 0, not streamed; 1 warm-up + 3 measured runs; here with
`"cache_prompt": false` so no run hits the prefix cache) and a prompt whose answer does
not repeat itself, where drafts mostly miss. Per prompt it prints decode tok/s (the
server's own usage.timings.decode_tokens_per_sec, mean of the measured runs), the draft
acceptance, and the ratio drafting / plain; it checks that both servers wrote the same
text (sha256) and fails otherwise. Writes all numbers as JSON.

Usage: spec_decode.py [--moeserve target/release/moeserve] [--config plugins.toml]
                      [--model .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf]
                      [--draft-max 3] [--max-tokens 512] [--out results.json]
                      [--mtp MTP.gguf]   (deepseek4: the drafting server drafts with it)
"""
import argparse
import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
PROMPTS = {
    "repeat BETA (upstream harness)": "Repeat the word BETA as many times as you can, separated "
    "by spaces. Start: BETA BETA BETA BETA BETA BETA BETA BETA",
    "free text": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def serve(a, draft):
    port = free_port()
    log = open(os.path.join(a.work, f"serve-draft{draft}.log"), "w")
    mtp = ["--mtp", a.mtp] if a.mtp and draft else []
    p = subprocess.Popen([a.moeserve, "--config", a.config, "serve", "--model", a.model,
                          "--port", str(port), "--parallel", "1", "--draft-max", str(draft),
                          *mtp],
                         stdout=log, stderr=subprocess.STDOUT,
                         env=dict(os.environ, RUST_LOG="warn"))
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return p, port
        except OSError:
            if p.poll() is not None:
                sys.exit(f"the server (draft {draft}) exited; see {log.name}")
            time.sleep(0.2)
    p.kill()
    sys.exit("the server did not become ready")


def measure(port, prompt, a):
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": a.max_tokens,
            "temperature": 0, "stream": False, "cache_prompt": False}
    post(port, body)  # warm-up
    runs = []
    for _ in range(a.reps):
        r = post(port, body)
        u = r["usage"]
        if u["timings"]["cache_hit"]:
            sys.exit("a measured run hit the prefix cache")
        text = r["choices"][0]["message"]["content"]
        runs.append({"completion_tokens": u["completion_tokens"],
                     "decode_ms": u["timings"]["decode_ms"],
                     "decode_tokens_per_sec": u["timings"]["decode_tokens_per_sec"],
                     "accept_rate": u["accept_rate"], "spec_decode_ran": u["spec_decode_ran"],
                     "finish_reason": r["choices"][0]["finish_reason"],
                     "sha256": hashlib.sha256(text.encode()).hexdigest()})
    if len({r["sha256"] for r in runs}) != 1:
        sys.exit("the measured runs' texts differ")
    return runs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moeserve", default=os.path.join(ROOT, "target", "release", "moeserve"))
    ap.add_argument("--config", default=os.path.join(ROOT, "plugins.toml"))
    ap.add_argument("--model", default=os.path.join(
        ROOT, ".cache", "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--draft-max", type=int, default=3)
    ap.add_argument("--mtp", default=None,
                    help="deepseek4: an MTP drafter GGUF for the drafting server")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--work", default=os.environ.get("TMPDIR", "/tmp"))
    a = ap.parse_args()
    results = {}
    for draft in (a.draft_max, 0):
        p, port = serve(a, draft)
        try:
            results[draft] = {name: measure(port, text, a) for name, text in PROMPTS.items()}
        finally:
            p.terminate()
            p.wait(60)
    mean = lambda runs, k: sum(r[k] for r in runs) / len(runs)
    rows, ok = [], True
    for name in PROMPTS:
        on, off = results[a.draft_max][name], results[0][name]
        same = on[0]["sha256"] == off[0]["sha256"]
        ok &= same
        t_on, t_off = mean(on, "decode_tokens_per_sec"), mean(off, "decode_tokens_per_sec")
        rows.append((name, on[0]["completion_tokens"], t_off, t_on, mean(on, "accept_rate"),
                     t_on / t_off if t_off else 0.0, same))
    print(f"moeserve speculative decoding (prompt lookup, --draft-max {a.draft_max}) vs plain; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{os.path.basename(a.model)}")
    print("| prompt | tokens | plain tok/s | drafting tok/s | accept rate | drafting / plain | same text |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.3f} | {r[5]:.2f} | "
              f"{'yes' if r[6] else 'NO'} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "model": os.path.basename(a.model), "draft_max": a.draft_max,
                       "mtp": a.mtp and os.path.basename(a.mtp),
                       "max_tokens": a.max_tokens, "runs": {str(k): v for k, v in results.items()},
                       "table": rows}, f, indent=1)
    if not ok:
        sys.exit("drafting changed the text")


if __name__ == "__main__":
    main()
