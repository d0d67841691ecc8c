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
text (sha256) and fails otherwise, and fails as the upstream harness does on partial
output, a cache hit, a drafting server that did not draft or zero throughput; records
whether every word is BETA. Writes all numbers as JSON.

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


def all_beta(text):
    """Whether every word of the answer is BETA (punctuation around a word ignored)."""
    words = [w.strip(".,;:!?\"'()") for w in text.split()]
    return bool(words) and all(w == "BETA" for w in words)


def measure(port, prompt, a, drafting):
    """The warm-up and measured runs of one prompt; exits (status 1) as the upstream
    harness fails a run: partial output, a prefix-cache hit, no speculative decoding on
    the drafting server, zero throughput, or texts that differ between runs."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": a.max_tokens,
            "temperature": 0, "stream": False, "cache_prompt": False}
    post(port, body)  # warm-up
    runs = []
    for _ in range(a.reps):
        r = post(port, body)
        u, choice = r["usage"], r["choices"][0]
        text = choice["message"]["content"] or ""
        run = {"completion_tokens": u["completion_tokens"],
               "decode_ms": u["timings"]["decode_ms"],
               "decode_tokens_per_sec": u["timings"]["decode_tokens_per_sec"],
               "accept_rate": u["accept_rate"], "spec_decode_ran": u["spec_decode_ran"],
               "cache_hit": u["timings"]["cache_hit"],
               "cached_prefix_tokens": u["timings"]["cached_prefix_tokens"],
               "finish_reason": choice["finish_reason"],
               "sha256": hashlib.sha256(text.encode()).hexdigest(), "all_beta": all_beta(text)}
        runs.append(run)
        if run["finish_reason"] not in ("stop", "length") or not text or not run["completion_tokens"]:
            sys.exit(f"partial output: {run}")
        if run["cache_hit"] or run["cached_prefix_tokens"]:
            sys.exit(f"a measured run hit the prefix cache: {run}")
        if drafting and not run["spec_decode_ran"]:
            sys.exit(f"the drafting server did not draft: {run}")
        if not run["decode_tokens_per_sec"] > 0:
            sys.exit(f"zero throughput: {run}")
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
            results[draft] = {name: measure(port, text, a, draft > 0)
                              for name, text in PROMPTS.items()}
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
                     t_on / t_off if t_off else 0.0, same, on[0]["all_beta"]))
    print(f"moeserve speculative decoding (prompt lookup, --draft-max {a.draft_max}) vs plain; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"{os.path.basename(a.model)}")
    print("| prompt | tokens | plain tok/s | drafting tok/s | accept rate | drafting / plain | "
          "same text | all BETA |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.3f} | {r[5]:.2f} | "
              f"{'yes' if r[6] else 'NO'} | {'yes' if r[7] else 'no'} |")
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
