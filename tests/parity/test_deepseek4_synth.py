"""`moeserve synth` at V4-Flash's real width (hidden 4096, 64 heads x 512, q_lora 1024,
8 output groups, indexer 64 x 128, expert FFN 2048) with few layers / experts / tokens:
the file carries the real type mix (ROCmFP2 affine experts, ROCmFP4 attention, Q8_0
embeddings and compressors), loads through the plugins' validation, and the forward at that
width gives finite, unit-scale logits with batched prefill equal to token-by-token decode.
(A structural check: there is no oracle for random weights of these types.)"""
import subprocess

import numpy as np

from moeserve_cli import BIN_DIR, config, moeserve


def test_synth_flash_width_loads_and_runs(tmp_path):
    cfg = tmp_path / "rocmfpx.toml"
    cfg.write_text(config(tmp_path, "q8").read_text()
                   + '[[plugin]]\nlibrary = "moe_quant_rocmfpx"\n')
    model = tmp_path / "synth.gguf"
    moeserve(cfg, "synth", "--out", model, "--layers", 4, "--experts", 4, "--vocab", 512)
    # (PyPI gguf cannot read ROCmFPx type ids, so ask our own `dequant`.)
    for name, ty, shape in [("blk.3.ffn_gate_exps.weight", "Q2_0_ROCMFP2", "[4, 2048, 4096]"),
                            ("blk.0.attn_q_b.weight", "Q4_0_ROCMFP4", "[32768, 1024]"),
                            ("blk.3.indexer.attn_q_b.weight", "Q8_0", "[8192, 1024]"),
                            ("token_embd.weight", "Q8_0", "[512, 4096]")]:
        r = subprocess.run([str(BIN_DIR / "moeserve"), "--config", str(cfg), "dequant", "--model", str(model),
                            "--tensor", name, "--out", str(tmp_path / "t.npy")], capture_output=True, text=True)
        assert r.returncode == 0 and f"({ty}, shape {shape})" in r.stderr, r.stderr
    toks = "1,5,9,200,7,3,11,12,13,14"
    out = {}
    for mode in ("prefill", "decode"):
        p = tmp_path / f"{mode}.npy"
        moeserve(cfg, "logits", "--model", model, "--tokens", toks, "--out", p, "--mode", mode)
        out[mode] = np.load(p)
    a = out["prefill"]
    assert a.shape == (10, 512) and np.isfinite(a).all()
    assert 0.1 < a.std(axis=1).mean() < 10
    assert np.abs(a - out["decode"]).max() <= 1e-5 * np.abs(a).max()


def test_synth_q8_0_mix_is_plain_ggml_and_tokenizes(tmp_path):
    """`--mix q8_0`: every matrix Q8_0 (PyPI gguf reads the whole file, which it cannot
    with ROCmFPx types), the rest f32 / I32, with a byte-level BPE vocabulary of the
    requested size that our tokenizer accepts (text in, tokens out)."""
    import gguf

    cfg = config(tmp_path, "q8")
    model = tmp_path / "synth.gguf"
    moeserve(cfg, "synth", "--out", model, "--layers", 4, "--experts", 4, "--vocab", 300, "--mix", "q8_0")
    r = gguf.GGUFReader(model)
    types = {t.tensor_type.name for t in r.tensors}
    assert types == {"Q8_0", "F32", "I32"}, types
    assert all(t.tensor_type.name == "Q8_0" for t in r.tensors if t.name.endswith("_exps.weight"))
    tokens = r.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == 300 and "rocmfpx.fp2_mode" not in r.fields
    out = moeserve(cfg, "generate", "--model", model, "--prompt", "hi there", "--raw", "--max-tokens", 2)
    assert out.strip()
    bad = subprocess.run([str(BIN_DIR / "moeserve"), "--config", str(cfg), "synth", "--out", str(tmp_path / "x.gguf"),
                          "--layers", "4", "--vocab", "100"], capture_output=True, text=True)
    assert bad.returncode != 0 and "too small" in bad.stderr and not (tmp_path / "x.gguf").exists()


def test_bench_depths_and_layers(tmp_path):
    """`bench --depths` moves the slot to each depth without running it (the CPU backend
    runs the glue ops, so it can) and reports what a decoded token reads there: the same
    weights at every depth, more cache rows the deeper, and with `--layers` (repeated
    layers) more weights in proportion to the extra layers' sizes."""
    import json

    cfg = config(tmp_path, "q8")
    model = tmp_path / "synth.gguf"
    moeserve(cfg, "synth", "--out", model, "--layers", 6, "--experts", 4, "--vocab", 300, "--mix", "q8_0")

    def bench(*extra):
        out = moeserve(cfg, "bench", "--model", model, "--prompt-tokens", 4, "--gen-tokens", 2,
                       "--repetitions", 1, "--json", *extra)
        return json.loads(out)

    b = bench("--depths", "0,600")
    d0, d1 = b["depths"]
    assert (d0["depth"], d1["depth"]) == (0, 600)
    assert d0["weight_bytes_per_token"] == d1["weight_bytes_per_token"] > 0
    assert d1["cache_bytes_per_token"] > d0["cache_bytes_per_token"] > 0
    assert d0["tg_tok_s"] > 0 and d1["tg_tok_s"] > 0 and d0["tg_fraction_of_limit"] is None
    deeper = bench("--layers", 8)["depths"][0]
    # Layers 6 and 7 repeat layers 4 and 5: two more layers' weights per token.
    assert deeper["weight_bytes_per_token"] > d0["weight_bytes_per_token"]


def test_synth_mtp_file_drafts_for_its_model(tmp_path):
    """`synth --mtp` writes the drafter of the model `synth` writes with the same seed and
    sizes (the same embedding and head bytes): it loads next to the in-memory model (the
    full-width path the device benchmark takes), its chain after a batched prefill equals
    the one after token-by-token steps; a drafter of another seed loads with a warning,
    and one of another vocabulary is refused."""
    cfg = tmp_path / "rocmfpx.toml"
    cfg.write_text(config(tmp_path, "q8").read_text()
                   + '[[plugin]]\nlibrary = "moe_quant_rocmfpx"\n')
    mtp, other = tmp_path / "mtp.gguf", tmp_path / "other.gguf"
    sizes = ("--layers", 4, "--experts", 4, "--vocab", 300)
    moeserve(cfg, "synth", "--mtp", "--out", mtp, *sizes)
    moeserve(cfg, "synth", "--mtp", "--out", other, "--seed", 2, *sizes)
    wrong = tmp_path / "wrong.gguf"
    moeserve(cfg, "synth", "--mtp", "--out", wrong, "--layers", 4, "--experts", 4, "--vocab", 400)
    toks = "1,5,9,200,7,3"
    model = ("--synth", 4, "--synth-experts", 4, "--synth-vocab", 300)
    out = {}
    for mode in ("mtp", "mtp-prefill"):
        p = tmp_path / f"{mode}.npy"
        moeserve(cfg, "logits", *model, "--mtp", mtp, "--tokens", toks, "--out", p, "--mode", mode)
        out[mode] = np.load(p)
    a = out["mtp"]
    assert a.shape == (6 + 3, 300) and np.isfinite(a).all()
    assert 0.1 < a.std(axis=1).mean() < 10
    assert np.abs(out["mtp-prefill"] - a[5:]).max() <= 1e-5 * np.abs(a).max()
    def run(mtp_file):
        return subprocess.run([str(BIN_DIR / "moeserve"), "--config", str(cfg), "logits",
                               *map(str, model), "--mtp", str(mtp_file), "--tokens", toks,
                               "--out", str(tmp_path / "x.npy"), "--mode", "mtp"],
                              capture_output=True, text=True)

    r = run(other)
    assert r.returncode == 0 and "differs from the model's" in r.stderr, r.stderr
    r = run(wrong)
    assert r.returncode != 0 and "drafts for another model" in r.stderr, r.stderr
