"""Long prompts: prefill split over several forward passes gives the same result as one."""

from helpers import Server

FILLER = " ".join(f"Item {i} is a plain box." for i in range(40))
PROMPT = ("Remember this: the secret animal is a giraffe. " + FILLER +
          "\nQuestion: what is the secret animal? Answer:")


def run(batch_tokens):
    with Server("--parallel", "1", "--batch-tokens", str(batch_tokens)) as s:
        before = s.metrics()["moeserve_forward_passes_total"]
        r = s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                       "logprobs": 1})
        assert r.status == 200, r.text
        passes = s.metrics()["moeserve_forward_passes_total"] - before
        return r.json(), passes


def test_chunked_prefill_matches_single_pass():
    # More than 8 rows per pass in both runs: the same matmul path (see the CPU backend).
    one, passes_one = run(1024)
    n_prompt = one["usage"]["prompt_tokens"]
    assert 300 < n_prompt < 1024
    assert n_prompt % 96 == 0 or n_prompt % 96 > 8, "the last chunk would take the q8 path"
    chunked, passes_chunked = run(96)
    assert chunked["usage"]["prompt_tokens"] == n_prompt
    n_gen = one["usage"]["completion_tokens"]
    # one pass for the whole prompt vs ceil(n/96); then one per further token
    assert passes_one == n_gen
    assert passes_chunked == -(-n_prompt // 96) + n_gen - 1
    assert chunked["choices"][0]["text"] == one["choices"][0]["text"]
    assert chunked["choices"][0]["logprobs"]["token_logprobs"] == \
        one["choices"][0]["logprobs"]["token_logprobs"]
