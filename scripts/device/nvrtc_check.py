#!/usr/bin/env python3
"""Compile the GPU kernels the way the CUDA backend does (NVRTC, the same translation
unit and options), on a machine without a GPU, then report ptxas's registers / spills
of the kernels matching a pattern. NVRTC and ptxas come from NVIDIA's PyPI wheels
(nvidia-cuda-nvrtc-cu12, and nvidia-cuda-nvcc-cu12 as scripts/device/cuda_local.sh
unpacks it into .dev/cuda), fetched once into .dev/cuda (git-ignored).

  python3 scripts/device/nvrtc_check.py [--arch sm_90] [-D NAME=VALUE ...] [--cubin F] [PATTERN]

Exit status 1 if NVRTC rejects the source. The device machine's NVRTC (CUDA 13) stays
the reference: this catches front-end errors and register growth before a device call.
"""
import argparse
import ctypes
import glob
import os
import re
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
CUDA = os.path.join(ROOT, ".dev", "cuda")
NVRTC_WHEEL = "nvidia-cuda-nvrtc-cu12==12.9.86"


def nvrtc_lib(skip_offline):
    libs = glob.glob(os.path.join(CUDA, "nvrtc", "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.*"))
    if not libs:
        os.makedirs(os.path.join(CUDA, "whl"), exist_ok=True)
        print(f"nvrtc_check: fetching {NVRTC_WHEEL} into .dev/cuda...", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
               "-d", os.path.join(CUDA, "whl"), NVRTC_WHEEL]
        # (three tries: a registry hiccup is not a finding about the kernels)
        if not any(subprocess.run(cmd).returncode == 0 for _ in range(3)):
            if skip_offline:
                print(f"nvrtc_check: SKIPPED: could not fetch {NVRTC_WHEEL} from PyPI")
                sys.exit(0)
            sys.exit(f"nvrtc_check: could not fetch {NVRTC_WHEEL} from PyPI")
        for w in glob.glob(os.path.join(CUDA, "whl", "nvidia_cuda_nvrtc_cu12-*.whl")):
            zipfile.ZipFile(w).extractall(os.path.join(CUDA, "nvrtc"))
        libs = glob.glob(os.path.join(CUDA, "nvrtc", "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.*"))
    return ctypes.CDLL(sorted(libs)[0])


def source():
    """kernels::source(COMMON_CUH, [ROCMFPX_CU, DS4_CU]) (backends/gpu-common/src/kernels.rs)."""
    gpu = os.path.join(ROOT, "kernels", "gpu")
    common = open(os.path.join(gpu, "common.cuh")).read().replace("#pragma once", "")
    inc = '#include "common.cuh"'
    units = [open(os.path.join(gpu, f)).read() for f in ("rocmfpx.cu", "ds4.cu")]
    return "".join(u.replace(inc, common if i == 0 else "") + "\n" for i, u in enumerate(units))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("-D", action="append", default=[], help="extra define (an A/B option)")
    ap.add_argument("--skip-offline", action="store_true",
                    help="exit 0 with a SKIPPED line when PyPI cannot be reached (CI)")
    ap.add_argument("--cubin", help="also keep ptxas's cubin here (for cuobjdump -sass)")
    ap.add_argument("pattern", nargs="?", default=".")
    a = ap.parse_args()
    lib = nvrtc_lib(a.skip_offline)
    prog = ctypes.c_void_p()
    src = source().encode()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"rocmfpx.cu", 0, None, None) != 0:
        sys.exit("nvrtcCreateProgram failed")
    # As Module::load's compile(): the backend's options (the PTX target here, for ptxas).
    opts = [f"--gpu-architecture=compute_{a.arch[3:]}", "--std=c++17", "-default-device"]
    opts += [f"-D{d}" for d in a.D]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    text = log.value.decode(errors="replace").strip()
    if text:
        print(text)
    if rc != 0:
        print(f"nvrtc_check: NVRTC rejected the kernels (options {' '.join(opts)})")
        sys.exit(1)
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    ptxas = os.path.join(CUDA, "root", "bin", "ptxas")
    if not os.path.exists(ptxas):
        print("nvrtc_check: NVRTC compiled the kernels; no ptxas (run scripts/device/cuda_local.sh once)")
        return
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        open(p, "wb").write(ptx.value)
        cubin = a.cubin or os.path.join(d, "k.cubin")
        out = subprocess.run([ptxas, f"-arch={a.arch}", "-v", p, "-o", cubin],
                             capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stderr)
        sys.exit("nvrtc_check: ptxas failed")
    name, pat = None, re.compile(a.pattern)
    for line in out.stderr.splitlines():
        # (a kernel's, or a called function's: its mangled name)
        m = re.search(r"Compiling entry function '([^']+)'|Function properties for (\S+)", line)
        if m:
            name = m.group(1) or m.group(2)
            continue
        if name and pat.search(name) and re.search(r"spill|Used", line):
            info = re.sub(r"^ptxas info\s*:\s*", "", line.strip())
            print(f"{name}: {info}")
    print(f"nvrtc_check: NVRTC compiled the kernels ({' '.join(opts)})")


if __name__ == "__main__":
    main()
