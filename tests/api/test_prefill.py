"""Long prompts: prefill split over several forward passes gives the same result as one."""

from helpers import Server

FILLER = " ".join(f"Item {i} is a plain box." for i in range(40))
PROMPT = ("Remember this: the secret animal is a giraffe. " + FILLER +
          "\nQuestion: what is the secret animal? Answer:")


def run(batch_tokens):
    with Server("--parallel", "1", "--batch-tokens", str(batch_tokens)) as s:
        m0 = s.metrics()
        r = s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                       "logprobs": 1})
        assert r.status == 200, r.text
        m1 = s.metrics()
        passes = m1["moeserve_forward_passes_total"] - m0["moeserve_forward_passes_total"]
        sampled = (m1["moeserve_generated_tokens_total"]
                   - m0["moeserve_generated_tokens_total"])
        return r.json(), passes, sampled


def test_chunked_prefill_matches_single_pass():
    one, passes_one, sampled = run(1024)
    n_prompt = one["usage"]["prompt_tokens"]
    assert 300 < n_prompt < 1024
    chunked, passes_chunked, sampled_chunked = run(96)
    assert chunked["usage"]["prompt_tokens"] == n_prompt
    assert sampled == sampled_chunked >= one["usage"]["completion_tokens"]
    # one pass for the whole prompt vs ceil(n/96); then one per further sampled token
    assert passes_one == sampled
    assert passes_chunked == -(-n_prompt // 96) + sampled - 1
    assert chunked["choices"][0]["text"] == one["choices"][0]["text"]
    # Same numbers up to kernel rounding (a wrong position or a lost chunk is far off).
    a = one["choices"][0]["logprobs"]["token_logprobs"]
    b = chunked["choices"][0]["logprobs"]["token_logprobs"]
    assert len(a) == len(b)
    assert all(abs(x - y) < 1e-2 for x, y in zip(a, b)), (a, b)
