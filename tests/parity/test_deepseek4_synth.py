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
