#!/usr/bin/env python3
"""What the vendor's libraries get from this GPU, as a yardstick for `bench --limits`.

`moeserve bench --limits` reports prefill as a fraction of *our own* ROCmFP2 product's
rate (a [4096 x 16384] x 512 MATMUL) and decode against our own copy kernel's bandwidth.
This prints, from PyTorch (cuBLAS and the CUDA runtime's copy) on the same machine:
  - bf16 GEMM TFLOP/s at that shape (x^T W over 512 columns) and at 8192^3;
  - device-to-device copy GB/s (a 4 GiB buffer; the bytes read and written both
    counted, as our stream bandwidth, an add of two 1 GiB vectors, counts all three).
Run on the device machine: python3 scripts/device/vendor_peak.py [--json FILE]
"""
import json
import sys
import time

import torch


def timed(fn, reps):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def gemm_tflops(m, n, k, reps=50):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    s = timed(lambda: torch.matmul(a, b), reps)
    return 2.0 * m * n * k / s / 1e12


def copy_gbs(nbytes=4 << 30, reps=20):
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    s = timed(lambda: dst.copy_(src), reps)
    return 2.0 * nbytes / s / 1e9


def main():
    if not torch.cuda.is_available():
        sys.exit("vendor_peak: no CUDA device visible to PyTorch")
    out = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        # (rows of W = 16384 outputs, 512 token columns, k = 4096: bench's matrix_rate shape)
        "bf16_gemm_tflops_bench_shape": gemm_tflops(16384, 512, 4096),
        "bf16_gemm_tflops_8192_cubed": gemm_tflops(8192, 8192, 8192, reps=20),
        "d2d_copy_gb_s": copy_gbs(),
    }
    print("| measure | value |")
    print("| --- | --- |")
    print(f"| GPU | {out['gpu']} (torch {out['torch']}) |")
    print(f"| cuBLAS bf16 GEMM, 16384 x 512 x 4096 | {out['bf16_gemm_tflops_bench_shape']:.1f} TFLOP/s |")
    print(f"| cuBLAS bf16 GEMM, 8192^3 | {out['bf16_gemm_tflops_8192_cubed']:.1f} TFLOP/s |")
    print(f"| device-to-device copy (read + write) | {out['d2d_copy_gb_s']:.0f} GB/s |")
    if len(sys.argv) == 3 and sys.argv[1] == "--json":
        with open(sys.argv[2], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
