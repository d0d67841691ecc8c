// Dense decode mat-vec (one activation column) on the device: matvec_dense_rows and its
// (rows per block, units in flight) variants against matvec_dense, each checked against
// a double-precision host dot
// and timed on the DeepSeek-V4-Flash shapes, next to a pure streaming read of the same
// bytes (the ceiling), launched one by one and replayed from a CUDA graph. Built and run by
// scripts/device/dense_matvec_bench.sh (nvcc, --default-stream per-thread for the capture).
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <vector>
#include <random>
#include <algorithm>
#include "../../kernels/gpu/rocmfpx.cu"
#include "bench_check.cuh"

// ---- candidate (measured slower, 2026-11-30 14:07: docs/notes/dense-matvec-h200.md) ----
// Staged decode mat-vec: the same sums as dense_rows, but the block first copies its R
// rows' bytes (up to STAGE_COLS columns of each at a time) into shared memory with
// 16-byte loads, all issued at once, then decodes from there. dense_rows' narrow loads
// (2-4 bytes, the blocks being 34 / 18 bytes) leave too few bytes in flight per SM to
// cover the memory latency. Needs k % 1024 == 0, rows and w 16-byte aligned, x 16-byte
// aligned. `stage`: DENSE_STAGE_BYTES(R) of shared memory, 16-byte aligned (the kernel's,
// so that one buffer serves every instance). grid = ceil(m / R), block = 128.
#define DENSE_STAGE_COLS(TY) ((TY) == DT_Q8_0 ? 4096 : 8192)
#define DENSE_STAGE_BYTES(R) ((R) * 4608)
template <int TY, int R>
__device__ void dense_staged(const unsigned char* __restrict__ w, long long row_bytes, int k, int m,
                          const float* __restrict__ x, float* __restrict__ out,
                          unsigned char* stage) {
    constexpr int BB = TY == DT_Q8_0 ? 34 : 18;
    constexpr int SPAN_MAX = DENSE_STAGE_COLS(TY) / 32 * BB;  // bytes of a row per stage
    constexpr int WMAX = (R * SPAN_MAX / 16 + 127) / 128;     // 16-byte words per thread
    static_assert(R * SPAN_MAX <= DENSE_STAGE_BYTES(R), "stage size");
    __shared__ float lut[16];
    __shared__ float sc[256];
    __shared__ float red[4][R];
    const int t = threadIdx.x;
    if (TY == DT_ROCMFP4) fp4_tables(lut, sc);
    const int r0 = blockIdx.x * R;
    const int cols = k < DENSE_STAGE_COLS(TY) ? k : DENSE_STAGE_COLS(TY);
    const int span = cols / 32 * BB, sw = span >> 4, words = R * sw;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    for (int c0 = 0; c0 < k; c0 += cols) {
        gpu_u4 v[WMAX];
#pragma unroll
        for (int j = 0; j < WMAX; ++j) {
            const int i = t + 128 * j;
            if (i < words) {
                const int r = i / sw;
                // Rows past the end repeat the last row (computed, never stored).
                const long long row = r0 + r < m ? r0 + r : m - 1;
                v[j] = *(const gpu_u4*)(w + row * row_bytes + (long long)(c0 / 32) * BB +
                                        16 * (i - r * sw));
            }
        }
        if (c0 > 0) __syncthreads();  // the previous stage is read
#pragma unroll
        for (int j = 0; j < WMAX; ++j) {
            const int i = t + 128 * j;
            if (i < words) *(gpu_u4*)(stage + 16 * i) = v[j];
        }
        __syncthreads();
        for (int u = t; u < cols / 8; u += 128) {
            const int b = u >> 2, q = u & 3;
            const float* xb = x + c0 + b * 32;
            const gpu_f4 a = *(const gpu_f4*)(xb + (TY == DT_Q8_0 ? 8 * q : 4 * q));
            const gpu_f4 c = *(const gpu_f4*)(xb + (TY == DT_Q8_0 ? 8 * q + 4 : 16 + 4 * q));
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const unsigned char* blk = stage + r * span + b * BB;
                if (TY == DT_Q8_0)
                    acc[r] = dense_unit_dot<TY>(gpu_load_u16(blk), gpu_load_u32_a2(blk + 2 + 8 * q),
                                                gpu_load_u32_a2(blk + 6 + 8 * q), a, c, lut, sc, acc[r]);
                else
                    acc[r] = dense_unit_dot<TY>(gpu_load_u32_a2(blk + 4 * q), gpu_load_u16(blk + 16),
                                                0u, a, c, lut, sc, acc[r]);
            }
        }
    }
    rows_block_store<R>(acc, red, r0, m, out);
}


// ---- the committed dense_rows at other (rows, units in flight) -------------------------
template <int TY, int R, int U>
__global__ void __launch_bounds__(128) rows_variant(const unsigned char* __restrict__ w, long long row_bytes,
                                                    int k, int m, const float* __restrict__ x,
                                                    float* __restrict__ out) {
    dense_rows<TY, R, U>(w, row_bytes, k, m, x, out, blockIdx.x);
}

template <int TY, int R>
__global__ void __launch_bounds__(128) staged_variant(const unsigned char* __restrict__ w, long long row_bytes,
                                                      int k, int m, const float* __restrict__ x,
                                                      float* __restrict__ out) {
    __shared__ __attribute__((aligned(16))) unsigned char stage[DENSE_STAGE_BYTES(R)];
    dense_staged<TY, R>(w, row_bytes, k, m, x, out, stage);
}

template <int R>
__global__ void __launch_bounds__(128) fp4_q8_variant(const unsigned char* __restrict__ w, long long row_bytes,
                                                      int k, int m, const q8_1_block* __restrict__ act,
                                                      float* __restrict__ out) {
    dense_rows_q8<DT_ROCMFP4, R>(w, row_bytes, k, m, act, out, blockIdx.x);
}

// ---- candidate (not measured yet): Q8_0 without int-to-float conversions --------------
// The committed Q8_0 rows loop spends 32 I2F (a quarter-rate conversion) on 32 weights a
// thread (SASS, 20:01 UTC: 198 instructions, docs/notes/dense-matvec-h200.md round 8).
// Here each code byte is sign-extended by a byte permute and becomes a float through the
// 1.5 * 2^23 bias (small_int_float: an integer add and a float subtract, full rate);
// the sums are the committed kernel's, in the same order (so the same bits).
template <int R>
__global__ void __launch_bounds__(128) q8_magic_variant(const unsigned char* __restrict__ w, long long row_bytes,
                                                        int k, int m, const float* __restrict__ x,
                                                        float* __restrict__ out) {
    __shared__ rows_smem<R> sm;
    const int t = threadIdx.x, r0 = blockIdx.x * R;
    const unsigned char* rows[R];
    float acc[R];
    rows_block_begin<DT_Q8_0, R>(sm, w, row_bytes, r0, m, rows, acc);
    const int units = (k >> 5) * 4;
    // Byte i of a word, sign-extended to 32 bits: permute selector (8|i)(8|i)(8|i)i.
    auto sx = [](unsigned int v, unsigned int i) {
        return small_int_float((int)gpu_perm(v, 0u, ((8u | i) * 0x1110u) | i));
    };
    for (int u = t; u < units; u += 128) {
        const int b = u >> 2, q = u & 3;
        const float* xb = x + b * 32;
        const gpu_f4 a = *(const gpu_f4*)(xb + 8 * q), c = *(const gpu_f4*)(xb + 8 * q + 4);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const unsigned char* blk = rows[r] + b * 34;
            const unsigned int wa = gpu_load_u16(blk), wb = gpu_load_u32_a2(blk + 2 + 8 * q),
                               wc = gpu_load_u32_a2(blk + 6 + 8 * q);
            float s = gpu_mul(sx(wb, 0), a.x);
            s = fmaf(sx(wb, 1), a.y, s);
            s = fmaf(sx(wb, 2), a.z, s);
            s = fmaf(sx(wb, 3), a.w, s);
            s = fmaf(sx(wc, 0), c.x, s);
            s = fmaf(sx(wc, 1), c.y, s);
            s = fmaf(sx(wc, 2), c.z, s);
            s = fmaf(sx(wc, 3), c.w, s);
            acc[r] = fmaf(half_scale(wa), s, acc[r]);
        }
    }
    rows_block_store<R>(acc, sm.red, r0, m, out);
}

// ---- ceiling: read the same bytes with 16-byte loads ----------------------------------
__global__ void __launch_bounds__(256) stream_read(const gpu_f4* __restrict__ p, long long n,
                                                  float* __restrict__ out) {
    float s = 0.0f;
    for (long long i = (long long)blockIdx.x * 256 + threadIdx.x; i < n; i += (long long)gridDim.x * 256) {
        const gpu_f4 v = p[i];
        s += v.x + v.y + v.z + v.w;
    }
    if (s == 12345.678f) out[0] = s;  // keeps the loads
}

// ---- host -------------------------------------------------------------------------
static float h2f_host(unsigned short h) {
    const unsigned int s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, mm = h & 0x3ff;
    unsigned int bits;
    if (e == 0) {
        float v = mm * 5.9604644775390625e-8f;
        return s ? -v : v;
    }
    bits = s | ((e + 112) << 23) | (mm << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static float ue4m3_host(unsigned int b) {
    if (b >= 0x7f) return 0.0f;
    const unsigned int e = (b >> 3) & 15, mm = b & 7;
    if (e == 0) return mm * 0.0009765625f;
    return ldexpf(1.0f + mm / 8.0f, (int)e - 8);
}
static double host_value(const unsigned char* row, int ty, int i) {
    if (ty == DT_Q8_0) {
        const unsigned char* b = row + (i / 32) * 34;
        unsigned short h;
        memcpy(&h, b, 2);
        return (double)h2f_host(h) * (signed char)b[2 + i % 32];
    }
    const unsigned char* b = row + (i / 32) * 18;
    const int j = i % 32, q = (b[j % 16] >> (j >= 16 ? 4 : 0)) & 15, mm = q & 7;
    const double mag = mm <= 4 ? mm : 2 * mm - 4;
    return (q & 8 ? -mag : mag) * ue4m3_host(b[16 + (j >= 16)]);
}

struct Shape {
    const char* what;
    int ty, k, m;
};

// ---- candidates (not measured yet): products that compute their input -----------------
// A decode step runs the shared expert's SwiGLU, the routed experts' SwiGLU and wq_b's
// RMS norm as launches of their own (~2-3.5 us each, ncu 20:16 UTC) right before the
// product that reads their output. The runs kernel quantises its input itself, so it can
// compute it there (fp4_src_swiglu / fp4_src_norm in rocmfpx.cu); the routed experts'
// quantisation can take the SwiGLU the same way. Each pair below: the two launches as a
// step runs them now, against one. The SwiGLU pairs compute the same values (max diff 0
// expected); the norm's sum of squares is taken in another order than the stand-in
// norm_kernel's (and ds4_norm_rope's), so that row differs in the last bits.
template <int R, typename SRC>
__global__ void __launch_bounds__(FP4_RUNS_MAX_THREADS, 1)
    runs_src_variant(const unsigned char* __restrict__ w, long long row_bytes, int k, int m, SRC src,
                     float* __restrict__ out) {
    __shared__ fp4_q8_smem sm;
    fp4_runs_q8<R>(w, row_bytes, k, m, src, out, true, nullptr, 0, sm);
}
__global__ void swiglu_kernel(const float* g, const float* u, float* out, int n, float lim) {
    const int i = blockIdx.x * 256 + threadIdx.x;
    if (i < n) out[i] = gpu_swiglu(g[i], u[i], lim);
}
// RMS norm times w of one k-vector on one 256-thread block (ds4_norm_rope's norm = 2).
__global__ void __launch_bounds__(256) norm_kernel(const float* x, const float* w, float eps, int k, float* out) {
    __shared__ float part[8];
    float s = 0.0f;
    for (int i = threadIdx.x; i < k; i += 256) s += x[i] * x[i];
    s = gpu_warp_sum(s);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    __syncthreads();
    float t = 0.0f;
    for (int i = 0; i < 8; ++i) t += part[i];
    const float r = 1.0f / sqrtf(t / (float)k + eps);
    for (int i = threadIdx.x; i < k; i += 256) out[i] = w[i] * (x[i] * r);
}
// quantize_q8_1 of swiglu(g, u): one warp per 32 values.
__global__ void quantize_swiglu_kernel(const float* g, const float* u, float lim, q8_1_block* out,
                                       long long n_blocks) {
    const int lane = threadIdx.x & 31;
    const long long b = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (b >= n_blocks) return;
    const float v = gpu_swiglu(g[b * 32 + lane], u[b * 32 + lane], lim);
    const float d = gpu_warp_max(fabsf(v)) / 127.0f;
    const int q = (int)roundf(v * (d > 0.0f ? 1.0f / d : 0.0f));
    out[b].qs[lane] = (signed char)q;
    int hs = q;
    for (int o = 8; o > 0; o >>= 1) hs += (int)gpu_shfl_xor((float)hs, o);
    if ((lane & 15) == 0) out[b].hsum[lane >> 4] = (short)hs;
    if (lane == 0) out[b].d = d;
}

void fused_inputs(int reps) {
    std::mt19937 rng(11);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    auto dev = [&](size_t n, float sd) {
        std::vector<float> h(n);
        for (auto& v : h) v = sd * nd(rng);
        float* p;
        CK(cudaMalloc(&p, n * 4));
        CK(cudaMemcpy(p, h.data(), n * 4, cudaMemcpyHostToDevice));
        return p;
    };
    auto max_rel = [](const float* a, const float* b, size_t n) {
        std::vector<float> ha(n), hb(n);
        CK(cudaMemcpy(ha.data(), a, n * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hb.data(), b, n * 4, cudaMemcpyDeviceToHost));
        double d = 0, mx = 0;
        for (size_t i = 0; i < n; ++i) d = fmax(d, fabs(ha[i] - hb[i])), mx = fmax(mx, fabs(hb[i]));
        return d / mx;
    };
    printf("\n| input computed by the product | shape | two launches (us) | one launch (us) | max rel diff |\n");
    printf("|---|---|---|---|---|\n");
    // (what, k, m, rows a thread, threads, swiglu (else norm))
    struct Case {
        const char* what;
        int k, m, R, nt;
        bool swiglu;
    };
    for (const Case c : {Case{"shared expert down: SwiGLU", 2048, 4096, 1, 256, true},
                         Case{"wq_b: RMS norm x weight", 1024, 32768, 2, 256, false}}) {
        const long long row_bytes = (long long)c.k / 32 * 18, bytes = row_bytes * c.m;
        const int copies = (int)std::max<long long>(2, 256000000LL / bytes);
        const std::vector<unsigned char> hw = random_blocks(rng, DT_ROCMFP4, bytes);
        unsigned char* wbase;
        CK(cudaMalloc(&wbase, bytes * copies));
        for (int i = 0; i < copies; ++i) CK(cudaMemcpy(wbase + i * bytes, hw.data(), bytes, cudaMemcpyHostToDevice));
        float *a = dev(c.k, 2.0f), *b = dev(c.k, 1.0f), *x, *o1, *o2;
        CK(cudaMalloc(&x, c.k * 4));
        CK(cudaMalloc(&o1, c.m * 4));
        CK(cudaMalloc(&o2, c.m * 4));
        int L = 1;
        while (2 * L <= c.k / 256 && L < 32) L *= 2;
        const int grid = (c.m + c.R * c.nt / L - 1) / (c.R * c.nt / L);
        int turn = 0;
        auto wnext = [&] { return wbase + (turn++ % copies) * bytes; };
        auto runs = [&](auto src, float* out) {
            if (c.R == 2) runs_src_variant<2><<<grid, c.nt>>>(wnext(), row_bytes, c.k, c.m, src, out);
            else runs_src_variant<1><<<grid, c.nt>>>(wnext(), row_bytes, c.k, c.m, src, out);
        };
        auto two = [&] {
            if (c.swiglu) swiglu_kernel<<<(c.k + 255) / 256, 256>>>(a, b, x, c.k, 10.0f);
            else norm_kernel<<<1, 256>>>(a, b, 1e-6f, c.k, x);
            runs(fp4_src_x{x}, o1);
        };
        auto one = [&] {
            if (c.swiglu) runs(fp4_src_swiglu{a, b, 10.0f}, o2);
            else runs(fp4_src_norm{a, b, 1e-6f, 0.0f}, o2);
        };
        CK(cudaMemset(o1, 0, c.m * 4));
        CK(cudaMemset(o2, 0xff, c.m * 4));  // NaN unless the fused launch writes it
        two();
        one();
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        const double d = max_rel(o2, o1, c.m);
        const double t2 = graph_us(cudaStreamPerThread, reps, two), t1 = graph_us(cudaStreamPerThread, reps, one);
        printf("| %s | %d x %d | %.2f | %.2f | %.1e |\n", c.what, c.k, c.m, t2, t1, d);
        for (void* p : {(void*)wbase, (void*)a, (void*)b, (void*)x, (void*)o1, (void*)o2}) CK(cudaFree(p));
    }
    // The routed experts' down input: 6 x 2048 SwiGLU values quantised to q8_1.
    const long long n = 6 * 2048, nb = n / 32;
    float *g = dev(n, 2.0f), *u = dev(n, 1.0f), *x;
    q8_1_block *q1, *q2;
    CK(cudaMalloc(&x, n * 4));
    CK(cudaMalloc(&q1, nb * sizeof(q8_1_block)));
    CK(cudaMalloc(&q2, nb * sizeof(q8_1_block)));
    auto two = [&] {
        swiglu_kernel<<<(n + 255) / 256, 256>>>(g, u, x, (int)n, 10.0f);
        quantize_q8_1<<<(nb + 7) / 8, 256>>>(x, q1, nb, 0, nullptr);
    };
    auto one = [&] { quantize_swiglu_kernel<<<(nb + 7) / 8, 256>>>(g, u, 10.0f, q2, nb); };
    CK(cudaMemset(q1, 0, nb * sizeof(q8_1_block)));
    CK(cudaMemset(q2, 0xff, nb * sizeof(q8_1_block)));
    two();
    one();
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    std::vector<q8_1_block> h1(nb), h2(nb);
    CK(cudaMemcpy(h1.data(), q1, nb * sizeof(q8_1_block), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h2.data(), q2, nb * sizeof(q8_1_block), cudaMemcpyDeviceToHost));
    const bool same = memcmp(h1.data(), h2.data(), nb * sizeof(q8_1_block)) == 0;
    const double t2 = graph_us(cudaStreamPerThread, reps, two), t1 = graph_us(cudaStreamPerThread, reps, one);
    printf("| routed down input: SwiGLU + quantise | 6 x 2048 | %.2f | %.2f | %s |\n", t2, t1,
           same ? "same bytes" : "DIFFERENT bytes");
    for (void* p : {(void*)g, (void*)u, (void*)x, (void*)q1, (void*)q2}) CK(cudaFree(p));
}

// ---- the runs kernel's floor (2026-12-04): what is left without its dot products ----
// The committed matvec_fp4_runs_q8 at its layouts with the decode and dot products
// replaced by an xor of the loaded words (so the loads stay): STAGE = 0 only the
// weights' loads; 1 also the dependent-launch wait, the block's quantisation of x into
// shared memory, the scale table and the barrier, as the kernel does them. The gap from
// these to the committed kernel is its decode and dots; from the stream read to these,
// its one-wave load-then-work structure.
template <int R, int STAGE>
__global__ void __launch_bounds__(FP4_RUNS_MAX_THREADS, 1)
    runs_floor_variant(const unsigned char* __restrict__ w, long long row_bytes, int k, int m,
                       const float* __restrict__ x, float* __restrict__ out) {
    __shared__ fp4_q8_smem sm;
    const int L = fp4_runs_lanes(k), runs = k >> 8, t = threadIdx.x;
    int j, r0;
    const unsigned char* rows[R];
    float acc[R];
    fp4_run<R> run;
    fp4_runs_begin<R>(w, row_bytes, L, m, j, r0, rows, acc, run);
    unsigned int h = 0;
    if (STAGE) {
        gpu_count_launch(nullptr, 0);
        fp4_q8_stage<false>(fp4_src_x{x}, k, sm.xq, sm.ds);
        for (int i = t; i < 256; i += blockDim.x) sm.sc[i] = ue4m3(i);
        __syncthreads();
        h = ((const unsigned int*)sm.xq)[t & 63];
    }
    for (int g = j; g < runs; g += L) {
        if (g != j) fp4_run_load<R>(rows, g, run);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int i = 0; i < 36; ++i) h ^= run.v[r][i];
    }
    if (h == 0x9e3779b9u) out[r0] = 1.0f;  // keeps the loads
}

// ---- candidates (2026-12-04): the runs kernel's occupancy and load order ----
// The committed runs kernel holds 2 rows' runs a thread at 128 registers, 16 warps an SM:
// its decode after the data lands (+3.2 - 3.8 us) runs on 4 warps a scheduler. Here the
// same sums (the same bits) with: MINB blocks an SM (the registers capped to fit them,
// so R = 1 at 64), IL the two rows' words loaded interleaved (row 0 q, row 1 q, ...: the
// first block's dots then wait for the first loads of both rows only), XFIRST the
// weights' loads issued after x is staged (is x's staging slowed by queueing behind
// them?).
template <int R>
__device__ void fp4_run_load_il(const unsigned char* const (&rows)[R], int g, fp4_run<R>& run) {
#pragma unroll
    for (int q = 0; q < 9; ++q)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const gpu_u4 u = ((const gpu_u4*)(rows[r] + 144 * g))[q];
            run.v[r][4 * q] = u.x;
            run.v[r][4 * q + 1] = u.y;
            run.v[r][4 * q + 2] = u.z;
            run.v[r][4 * q + 3] = u.w;
        }
}
// fp4_q8_stage with each thread's loads of x issued in groups of 4 before any is used
// (the committed loop's chunks each wait for their own load: at k = 8192 and 256
// threads, 8 round trips to L2 behind the weights' traffic). The same values.
template <int NT>
__device__ void fp4_q8_stage_hoisted(const float* __restrict__ x, int k, gpu_u4* xq,
                                     float (*ds)[FP4_RUNS_MAX_K / 256]) {
    for (int c0 = threadIdx.x; c0 < k / 4; c0 += 4 * NT) {
        gpu_f4 vv[4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
            if (c0 + u * NT < k / 4) vv[u] = ((const gpu_f4*)x)[c0 + u * NT];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int c = c0 + u * NT;
            if (c >= k / 4) break;  // the same for the whole warp (k / 4 % 64 == 0)
            fp4_q8_chunk<false>(vv[u], c, xq, ds);
        }
    }
}

// The runs kernel streaming its runs: a thread takes V runs of one row (lanes L = runs /
// V a row), two in flight (registers, double-buffered), so the dots of one overlap the
// next one's loads, instead of every weight landing before any dot. Each run's sum is
// kept apart and the V are added in the committed butterfly's order (virtual lane j + L
// i of the committed kernel's runs / 1 lanes), so the bits are the committed kernel's.
// x staged as fp4_q8_stage_hoisted. Needs runs % V == 0 and runs / V <= 32.
template <int V, int NT, int MINB>
__global__ void __launch_bounds__(NT, MINB)
    runs_pipe_variant(const unsigned char* __restrict__ w, long long row_bytes, int k, int m,
                      const float* __restrict__ x, float* __restrict__ out) {
    __shared__ fp4_q8_smem sm;
    const int runs = k >> 8, L = runs / V, t = threadIdx.x;
    const int j = t & (L - 1), r0 = blockIdx.x * (NT / L) + t / L;
    const unsigned char* rows[1];
    float acc0[1];
    rows_block_start<1>(w, row_bytes, r0, m, rows, acc0);
    fp4_run<1> buf[2];
    fp4_run_load<1>(rows, j, buf[0]);
    if (V > 1) fp4_run_load<1>(rows, j + L, buf[1]);
    gpu_count_launch(nullptr, 0);
    fp4_q8_stage_hoisted<NT>(x, k, sm.xq, sm.ds);
    for (int i = t; i < 256; i += NT) sm.sc[i] = ue4m3(i);
    __syncthreads();
    float a[V];
#pragma unroll
    for (int i = 0; i < V; ++i) {
        float acc[1] = {0.0f};
        fp4_run_dot_q8<1>(buf[i & 1], j + L * i, sm, acc);
        a[i] = acc[0];
        if (i + 2 < V) fp4_run_load<1>(rows, j + L * (i + 2), buf[i & 1]);
    }
#pragma unroll
    for (int o = V / 2; o > 0; o >>= 1)
#pragma unroll
        for (int i = 0; i < o; ++i) a[i] += a[i + o];
    for (int o = L / 2; o > 0; o >>= 1) a[0] += gpu_shfl_xor(a[0], o);
    if (j == 0 && r0 < m) out[r0] = a[0];
}

template <int R, bool IL, bool XFIRST, int NT, int MINB, bool HOIST = false>
__global__ void __launch_bounds__(NT, MINB)
    runs_cand_variant(const unsigned char* __restrict__ w, long long row_bytes, int k, int m,
                      const float* __restrict__ x, float* __restrict__ out) {
    __shared__ fp4_q8_smem sm;
    const int L = fp4_runs_lanes(k), runs = k >> 8, t = threadIdx.x;
    const int j = t & (L - 1), r0 = (blockIdx.x * (NT / L) + t / L) * R;
    const unsigned char* rows[R];
    float acc[R];
    fp4_run<R> run;
    rows_block_start<R>(w, row_bytes, r0, m, rows, acc);
    if (!XFIRST) {
        if (IL) fp4_run_load_il<R>(rows, j, run);
        else fp4_run_load<R>(rows, j, run);
    }
    gpu_count_launch(nullptr, 0);
    if (HOIST) fp4_q8_stage_hoisted<NT>(x, k, sm.xq, sm.ds);
    else fp4_q8_stage<false>(fp4_src_x{x}, k, sm.xq, sm.ds);
    for (int i = t; i < 256; i += NT) sm.sc[i] = ue4m3(i);
    if (XFIRST) {
        if (IL) fp4_run_load_il<R>(rows, j, run);
        else fp4_run_load<R>(rows, j, run);
    }
    __syncthreads();
    for (int g = j; g < runs; g += L) {
        if (g != j) {
            if (IL) fp4_run_load_il<R>(rows, g, run);
            else fp4_run_load<R>(rows, g, run);
        }
        fp4_run_dot_q8<R>(run, g, sm, acc);
    }
    fp4_runs_store<R>(acc, L, j, r0, m, out);
}

// ---- candidate (2026-12-01; measured 2026-12-02: no gain, round 10 of the notes) ----
// Half runs. matvec_fp4_runs_q8 keeps a thread's whole runs in registers (36 words each,
// loaded before the dependent-launch wait), which caps an SM at 16 warps, and Nsight
// Compute found it latency bound (round 9 of docs/notes/dense-matvec-h200.md). Here a
// thread takes half a run (72 bytes = nine 8-byte words: blocks 0-3 or 4-7 of the run),
// so twice the threads share a row and, at MINB blocks an SM, more warps fit. The same
// per-block sums (fp4_blocks_dot_q8); a row's sum adds over 2L lanes (another order).
// Needs k % 256 == 0 with k / 256 a power of two <= 16 (one half run a lane), rows
// 8-byte aligned. Grouped (pairs > 1): block row y is pair y, expert ids[y] of the
// copies `expert_bytes` apart, input column y, output column y.
// grid = (ceil(m / (R * 256 / (2L))), pairs), block = 256.
template <int R, int MINB>
__global__ void __launch_bounds__(256, MINB)
    runs_half_variant(const unsigned char* __restrict__ w, long long expert_bytes, long long row_bytes, int k,
                      int m, const float* __restrict__ x, const int* __restrict__ ids,
                      float* __restrict__ out) {
    __shared__ fp4_q8_smem sm;
    const int L2 = 2 * fp4_runs_lanes(k), t = threadIdx.x, j = t & (L2 - 1), p = blockIdx.y;
    const int r0 = (blockIdx.x * (256 / L2) + t / L2) * R;
    const unsigned char* we = w + (ids ? (long long)ids[p] * expert_bytes : 0);
    const unsigned char* rows[R];
    float acc[R];
    rows_block_start<R>(we, row_bytes, r0, m, rows, acc);
    unsigned int v[R][18];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const unsigned long long* q = (const unsigned long long*)(rows[r] + 72 * j);
#pragma unroll
        for (int i = 0; i < 9; ++i) {
            const unsigned long long u = q[i];
            v[r][2 * i] = (unsigned int)u;
            v[r][2 * i + 1] = (unsigned int)(u >> 32);
        }
    }
    gpu_count_launch(nullptr, 0);
    fp4_q8_stage<false>(fp4_src_x{x + (long long)p * k}, k, sm.xq, sm.ds);
    for (int i = t; i < 256; i += 256) sm.sc[i] = ue4m3(i);
    __syncthreads();
    fp4_blocks_dot_q8<R, 4, 18>(v, j >> 1, 4 * (j & 1), sm, acc);
    fp4_runs_store<R>(acc, L2, j, r0, m, out + (long long)p * m);
}

// Launches runs_half_variant<R, MINB>: one product (pairs = 1, ids null) or `pairs`
// grouped ones (ids of the experts, not bounds-checked: the bench passes 0..pairs-1).
// False (nothing launched) unless k / 256 is a power of two <= 16.
template <int R, int MINB>
bool launch_half(const unsigned char* w, long long expert_bytes, long long row_bytes, int k, int m, const float* x,
                 const int* ids, int pairs, float* out) {
    const int runs = k / 256;
    if (k % 256 || runs < 1 || runs > 16 || (runs & (runs - 1))) return false;
    const int L2 = 2 * runs, per_block = R * 256 / L2;  // the kernel's 2 fp4_runs_lanes(k)
    runs_half_variant<R, MINB><<<dim3((m + per_block - 1) / per_block, pairs), 256>>>(w, expert_bytes, row_bytes,
                                                                                      k, m, x, ids, out);
    return true;
}

// A half-runs row's name with its registers and local memory (ptxas decides spills).
template <int R, int MINB>
const char* half_name(char (&nm)[96]) {
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, runs_half_variant<R, MINB>));
    snprintf(nm, sizeof nm, "half runs R=%d, 256 threads, %d blocks an SM (candidate; %d regs, %zu B local)", R,
             MINB, fa.numRegs, fa.localSizeBytes);
    return nm;
}

// RUNS=R:NT (e.g. 2:512) keeps only that layout of the runs kernels (one launch to
// profile under ncu); unset, all of them.
static bool runs_wanted(int R, int nt) {
    const char* want = getenv("RUNS");
    char have[16];
    snprintf(have, sizeof have, "%d:%d", R, nt);
    return !want || !strcmp(want, have);
}

// The output projection's groups as one decode step runs them: 8 groups (experts 0..7 of
// the weight copies, rotated between launches), each with its own input column, in one
// grouped launch: the committed matvec_dense_rows_id against matvec_fp4_runs_q8_id at
// (rows a thread, threads a block). Graph-replayed us; bytes = the 8 groups' weights.
void grouped_wo_a(const Shape& s, unsigned char* wbase, long long stride, int copies, long long row_bytes,
                  const std::vector<float>& hx, const std::vector<double>& ref, double refmax, int reps) {
    const int G = 8, sets = copies / G;
    float *x8, *out8;
    int* ids;
    CK(cudaMalloc(&x8, (size_t)G * s.k * 4));
    CK(cudaMalloc(&out8, (size_t)G * s.m * 4));
    CK(cudaMalloc(&ids, G * 4));
    const int hid[G] = {0, 1, 2, 3, 4, 5, 6, 7};
    CK(cudaMemcpy(ids, hid, sizeof hid, cudaMemcpyHostToDevice));
    for (int g = 0; g < G; ++g) CK(cudaMemcpy(x8 + (size_t)g * s.k, hx.data(), s.k * 4, cudaMemcpyHostToDevice));
    int L = 1;
    while (2 * L <= s.k / 256 && L < 32) L *= 2;
    auto timed = [&](const char* name, auto launch) {
        int turn = 0;
        auto set = [&] { return wbase + (long long)(turn++ % sets) * G * stride; };
        CK(cudaMemset(out8, 0, (size_t)G * s.m * 4));
        launch(set());
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        std::vector<float> got((size_t)G * s.m);
        CK(cudaMemcpy(got.data(), out8, got.size() * 4, cudaMemcpyDeviceToHost));
        double err = 0;
        for (int g = 0; g < G; ++g)
            for (int r = 0; r < s.m; ++r) err = fmax(err, fabs(got[(size_t)g * s.m + r] - ref[r]) / refmax);
        const double us = graph_us(cudaStreamPerThread, reps, [&] { launch(set()); });
        const double bytes = (double)G * row_bytes * s.m;
        printf("| wo_a, 8 groups in one launch | %d x %d x 8 | %.1f | %s | | %.2f | %.0f | | %.1e |\n", s.k, s.m,
               bytes / 1e6, name, us, bytes / us / 1e3, err);
    };
    for (int R : {2, 4}) {
        char nm[64];
        snprintf(nm, sizeof nm, "matvec_dense_rows_id R=%d", R);
        timed(nm, [&](unsigned char* w) {
            matvec_dense_rows_id<<<dim3((s.m + R - 1) / R, G), 128>>>(w, stride, row_bytes, s.ty, s.k, s.m, G, x8, 1,
                                                                       G, ids, out8, R, nullptr);
        });
    }
    for (int nt : {128, 256, 512})
        for (int R : {1, 2}) {
            if (!runs_wanted(R, nt)) continue;
            const int per_block = R * nt / L;
            char nm[64];
            snprintf(nm, sizeof nm, "matvec_fp4_runs_q8_id R=%d, %d threads", R, nt);
            timed(nm, [&](unsigned char* w) {
                matvec_fp4_runs_q8_id<<<dim3((s.m + per_block - 1) / per_block, G), nt>>>(
                    w, stride, row_bytes, s.k, s.m, G, x8, 1, G, ids, out8, R, 0, nullptr);
            });
        }
    if (s.k % 1024 == 0)
        for (int nt : {256, 512}) {
            const int S = s.k / 1024, GR = nt / (32 * S) > 0 ? nt / (32 * S) : 1;  // groups of 16 rows
            char nm[64];
            snprintf(nm, sizeof nm, "matvec_fp4_mma_id, %d threads", 32 * S * GR);
            timed(nm, [&](unsigned char* w) {
                matvec_fp4_mma_id<<<dim3((s.m + 16 * GR - 1) / (16 * GR), G), 32 * S * GR>>>(
                    w, stride, row_bytes, s.k, s.m, G, x8, 1, G, ids, out8, GR, nullptr);
            });
        }
    const int runs = s.k / 256;
    if (!getenv("RUNS") && s.k % 256 == 0 && runs <= 16 && !(runs & (runs - 1))) {  // half runs (round 10: no gain)
        char nm[96];
        timed(half_name<1, 3>(nm),
              [&](unsigned char* w) { launch_half<1, 3>(w, stride, row_bytes, s.k, s.m, x8, ids, G, out8); });
        timed(half_name<2, 2>(nm),
              [&](unsigned char* w) { launch_half<2, 2>(w, stride, row_bytes, s.k, s.m, x8, ids, G, out8); });
        timed(half_name<2, 3>(nm),
              [&](unsigned char* w) { launch_half<2, 3>(w, stride, row_bytes, s.k, s.m, x8, ids, G, out8); });
    }
    CK(cudaFree(x8));
    CK(cudaFree(out8));
    CK(cudaFree(ids));
}

// Busy-waits `ns` nanoseconds on one block: stands in for the glue kernels that run
// between two products (few SMs, little memory traffic).
__global__ void spin_ns(long long ns) {
    long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); while (t - t0 < ns);
}

// Starts filling L2 with the bytes [p, p + n) (16-byte aligned inwards): each thread
// issues bulk prefetches of 32 KiB pieces (sm_90). The kernel lasts until the memory
// system has taken them all, i.e. about as long as reading the range.
__global__ void __launch_bounds__(32) l2_prefetch(const unsigned char* p, long long n) {
    const unsigned long long a = ((unsigned long long)p + 15) & ~15ull;
    const unsigned long long e = ((unsigned long long)p + (unsigned long long)n) & ~15ull;
    const unsigned long long lane = blockIdx.x * 32 + threadIdx.x, lanes = gridDim.x * 32ull, chunk = 32768;
    for (unsigned long long o = a + lane * chunk; o < e; o += lanes * chunk) {
        const unsigned int len = (unsigned int)(e - o < chunk ? e - o : chunk);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(o), "r"(len) : "memory");
    }
}

// Does an L2 prefetch of a product's weights, issued while glue runs, make the product
// faster? wq_b's shape (ROCmFP4 1024 x 32768, 18.9 MB) on the runs kernel; weights
// rotated over 256 MB so each iteration starts cold. Event-timed loops of `reps`
// iterations on one stream, the prefetch either inline or on a second stream forked
// with events (joined at the iteration's end). (Measured 2026-11-30 21:50 UTC: no gain,
// see docs/notes/ds4-gpu-h200.md; the engine does not prefetch.)
void prefetch_l2(int reps) {
    const int k = 1024, m = 32768;
    const long long row_bytes = k / 32 * 18, bytes = row_bytes * m, stride = (bytes + 255) / 256 * 256;
    const int copies = 14;
    unsigned char* wbase;
    CK(cudaMalloc(&wbase, stride * copies));
    std::mt19937 rng(7);
    const std::vector<unsigned char> hw = random_blocks(rng, DT_ROCMFP4, bytes);
    for (int c = 0; c < copies; ++c) CK(cudaMemcpy(wbase + c * stride, hw.data(), bytes, cudaMemcpyHostToDevice));
    float *dx, *dout;
    CK(cudaMalloc(&dx, k * 4));
    CK(cudaMalloc(&dout, m * 4));
    CK(cudaMemset(dx, 0, k * 4));
    cudaStream_t s1, s2;
    CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    cudaEvent_t e0, e1, fork, join;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
    int turn = 0;
    auto w_at = [&](int c) { return wbase + (long long)(c % copies) * stride; };
    auto consume = [&](const unsigned char* w, cudaStream_t st) {
        // The engine's plan for wq_b: 2 rows a thread group, 256 threads, 4 lanes a row.
        matvec_fp4_runs_q8<<<(m + 127) / 128, 256, 0, st>>>(w, row_bytes, k, m, dx, dout, 2, nullptr);
    };
    auto pf = [&](const unsigned char* w, cudaStream_t st, int blocks) {
        l2_prefetch<<<blocks, 32, 0, st>>>(w, bytes);
    };
    auto timed = [&](const char* what, auto body) {
        for (int i = 0; i < 4; ++i) body(w_at(turn++));
        CK(cudaEventRecord(e0, s1));
        for (int i = 0; i < reps; ++i) body(w_at(turn++));
        CK(cudaEventRecord(e1, s1));
        CK(cudaEventSynchronize(e1));
        CK(cudaGetLastError());
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        printf("| %s | %.2f |\n", what, 1e3 * ms / reps);
    };
    printf("\n| wq_b (runs kernel, 18.9 MB) after a glue stand-in | us an iteration |\n|---|---|\n");
    timed("product alone (cold)", [&](const unsigned char* w) { consume(w, s1); });
    timed("product twice on the same weights (the second from L2)", [&](const unsigned char* w) {
        consume(w, s1), consume(w, s1);
    });
    for (int blocks : {16, 64}) {
        char nm[96];
        snprintf(nm, sizeof nm, "prefetch alone, %d blocks", blocks);
        timed(nm, [&](const unsigned char* w) { pf(w, s1, blocks); });
    }
    for (long long glue : {0LL, 10000LL, 20000LL}) {
        char nm[128];
        snprintf(nm, sizeof nm, "glue %lld us, product", glue / 1000);
        timed(nm, [&](const unsigned char* w) { spin_ns<<<1, 32, 0, s1>>>(glue), consume(w, s1); });
        for (int blocks : {16, 64}) {
            snprintf(nm, sizeof nm, "prefetch inline (%d blocks), glue %lld us, product", blocks, glue / 1000);
            timed(nm, [&](const unsigned char* w) {
                pf(w, s1, blocks), spin_ns<<<1, 32, 0, s1>>>(glue), consume(w, s1);
            });
            snprintf(nm, sizeof nm, "prefetch on a side stream (%d blocks), glue %lld us, product", blocks,
                     glue / 1000);
            timed(nm, [&](const unsigned char* w) {
                CK(cudaEventRecord(fork, s1));
                CK(cudaStreamWaitEvent(s2, fork));
                pf(w, s2, blocks);
                CK(cudaEventRecord(join, s2));
                spin_ns<<<1, 32, 0, s1>>>(glue), consume(w, s1);
                CK(cudaStreamWaitEvent(s1, join));
            });
        }
    }
    CK(cudaFree(wbase));
    CK(cudaFree(dx));
    CK(cudaFree(dout));
}

int main(int argc, char** argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 50;
    const Shape shapes[] = {
        {"output head q8_0", DT_Q8_0, 4096, 129280},
        {"wq_b fp4", DT_ROCMFP4, 1024, 32768},
        {"wo_b fp4", DT_ROCMFP4, 8192, 4096},
        {"shexp gate fp4", DT_ROCMFP4, 4096, 2048},
        {"shexp down fp4", DT_ROCMFP4, 2048, 4096},
        {"wo_a group fp4", DT_ROCMFP4, 4096, 1024},
        {"wq_a fp4", DT_ROCMFP4, 4096, 1024},
        {"wkv fp4", DT_ROCMFP4, 4096, 512},
        {"indexer q8_0", DT_Q8_0, 1024, 8192},
        {"compressor q8_0", DT_Q8_0, 4096, 1024},
        {"q8_0 expert gate", DT_Q8_0, 4096, 2048},
        {"q8_0 expert down", DT_Q8_0, 2048, 4096},
    };
    std::mt19937 rng(20261130);
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    printf("| shape | k x m | MB | variant | us launched | us in a graph | GB/s (graph) | of stream (graph) | max rel err |\n");
    printf("|---|---|---|---|---|---|---|---|---|\n");
    const char* only = getenv("ONLY");  // run the shapes whose name holds this
    for (const Shape& s : shapes) {
        if (only && !strstr(s.what, only)) continue;
        const int bpb = s.ty == DT_Q8_0 ? 34 : 18;
        const long long row_bytes = (long long)s.k / 32 * bpb, bytes = row_bytes * s.m;
        const std::vector<unsigned char> hw = random_blocks(rng, s.ty, bytes);
        std::vector<float> hx(s.k);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        for (auto& v : hx) v = nd(rng);
        std::vector<double> ref(s.m);
        double refmax = 0;
        for (int r = 0; r < s.m; ++r) {
            double acc = 0;
            for (int i = 0; i < s.k; ++i) acc += host_value(hw.data() + r * row_bytes, s.ty, i) * hx[i];
            ref[r] = acc;
            refmax = fmax(refmax, fabs(acc));
        }
        unsigned char* dw;
        float *dx, *dout;
        // Copies of the weights rotated between launches, 256 MB or more in all: every
        // launch reads from memory, not from the 50 MB L2 (as a decode step does).
        const long long stride = (bytes + 255) / 256 * 256;
        const int copies = (int)std::min<long long>(64, (256000000LL + bytes - 1) / bytes);
        unsigned char* wbase;
        CK(cudaMalloc(&wbase, stride * copies));
        dw = wbase;
        CK(cudaMalloc(&dx, s.k * 4));
        CK(cudaMalloc(&dout, (size_t)s.m * 8));
        CK(cudaMemcpy(wbase, hw.data(), bytes, cudaMemcpyHostToDevice));
        for (int c = 1; c < copies; ++c)
            CK(cudaMemcpy(wbase + c * stride, wbase, bytes, cudaMemcpyDeviceToDevice));
        int turn = 0;
        auto next = [&] { dw = wbase + (turn++ % copies) * stride; };
        CK(cudaMemcpy(dx, hx.data(), s.k * 4, cudaMemcpyHostToDevice));
        std::vector<float> got(s.m);
        auto run = [&](const char* name, auto launch, bool check) {
            CK(cudaMemset(dout, 0, (size_t)s.m * 4));
            next();
            launch();
            CK(cudaGetLastError());
            CK(cudaDeviceSynchronize());
            double err = 0;
            if (check) {
                CK(cudaMemcpy(got.data(), dout, (size_t)s.m * 4, cudaMemcpyDeviceToHost));
                for (int r = 0; r < s.m; ++r) err = fmax(err, fabs(got[r] - ref[r]));
                err /= refmax;
            }
            for (int i = 0; i < 3; ++i) next(), launch();
            CK(cudaEventRecord(e0));
            for (int i = 0; i < reps; ++i) next(), launch();
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            const double us_stream = 1e3 * ms / reps;
            // The same launches replayed from a CUDA graph (as decode runs them).
            const double us = graph_us(cudaStreamPerThread, reps, [&] { next(), launch(); });
            printf("| %s | %d x %d | %.1f | %s | %.2f | %.2f | %.0f | ", s.what, s.k, s.m, bytes / 1e6, name,
                   us_stream, us, bytes / us / 1e3);
            return std::make_pair(us, err);
        };
        double stream_us = 0;
        {
            auto r = run("stream read", [&] { stream_read<<<132 * 8, 256>>>((const gpu_f4*)dw, bytes / 16, dout); }, false);
            stream_us = r.first;
            printf("100%% | - |\n");
        }
        auto row = [&](const char* name, auto launch, bool check) {
            auto r = run(name, launch, check);
            printf("%.0f%% | %.1e |\n", 100 * stream_us / r.first, r.second);
        };
        const long long parts_m = s.m;
        int parts = 1;
        while (parts < 8 && parts_m * parts < 8192 && s.k >= parts * 512) parts *= 2;
        if (getenv("OLD_VARIANTS")) row("committed matvec_dense", [&] {
            matvec_dense<<<dim3((s.m + 8 / parts - 1) / (8 / parts), 1), 256>>>(dw, row_bytes, s.ty, s.k, s.m, dx, 1, dout, parts, nullptr);
        }, true);
        row("committed matvec_dense_rows", [&] {
            const int rr = s.m >= 8192 ? 4 : 2;
            matvec_dense_rows<<<(s.m + rr - 1) / rr, 128>>>(dw, row_bytes, s.ty, s.k, s.m, dx, dout, rr, nullptr);
        }, true);
        if (copies >= 2) {
            // The grouped form: pair 0 = expert 1 (a copy of the weights), pair 1 = id -1.
            int* dids;
            const int ids[2] = {1, -1};
            CK(cudaMalloc(&dids, 8));
            CK(cudaMemcpy(dids, ids, 8, cudaMemcpyHostToDevice));
            CK(cudaMemset(dout, 0xff, (size_t)s.m * 8));
            const int rr = s.m >= 8192 ? 4 : 2;
            matvec_dense_rows_id<<<dim3((s.m + rr - 1) / rr, 2), 128>>>(wbase, stride, row_bytes, s.ty, s.k, s.m,
                                                                     copies, dx, 0, 2, dids, dout, rr, nullptr);
            CK(cudaDeviceSynchronize());
            std::vector<float> two(2 * (size_t)s.m);
            CK(cudaMemcpy(two.data(), dout, two.size() * 4, cudaMemcpyDeviceToHost));
            double err = 0;
            bool zeros = true;
            for (int r = 0; r < s.m; ++r) {
                err = fmax(err, fabs(two[r] - ref[r]) / refmax);
                zeros = zeros && two[s.m + r] == 0.0f;
            }
            printf("| %s | %d x %d | | matvec_dense_rows_id (expert 1, id -1) | | | | | %.1e, zeros %s |\n", s.what,
                   s.k, s.m, err, zeros ? "yes" : "NO");
            CK(cudaFree(dids));
        }
#define V_ROW(R, U)                                                                          \
    {                                                                                        \
        cudaFuncAttributes fa;                                                               \
        if (s.ty == DT_Q8_0) CK(cudaFuncGetAttributes(&fa, rows_variant<DT_Q8_0, R, U>));    \
        else CK(cudaFuncGetAttributes(&fa, rows_variant<DT_ROCMFP4, R, U>));                 \
        char nm[64];                                                                         \
        snprintf(nm, sizeof nm, "dense_rows R=%d U=%d (%d regs)", R, U, fa.numRegs);         \
        row(nm, [&] {                                                                        \
            if (s.ty == DT_Q8_0) rows_variant<DT_Q8_0, R, U><<<(s.m + R - 1) / R, 128>>>(dw, row_bytes, s.k, s.m, dx, dout); \
            else rows_variant<DT_ROCMFP4, R, U><<<(s.m + R - 1) / R, 128>>>(dw, row_bytes, s.k, s.m, dx, dout); \
        }, true);                                                                            \
    }
#define S_ROW(R)                                                                             \
    {                                                                                        \
        cudaFuncAttributes fa;                                                               \
        if (s.ty == DT_Q8_0) CK(cudaFuncGetAttributes(&fa, staged_variant<DT_Q8_0, R>));     \
        else CK(cudaFuncGetAttributes(&fa, staged_variant<DT_ROCMFP4, R>));                  \
        char nm[64];                                                                         \
        snprintf(nm, sizeof nm, "dense_staged R=%d (%d regs)", R, fa.numRegs);               \
        row(nm, [&] {                                                                        \
            if (s.ty == DT_Q8_0) staged_variant<DT_Q8_0, R><<<(s.m + R - 1) / R, 128>>>(dw, row_bytes, s.k, s.m, dx, dout); \
            else staged_variant<DT_ROCMFP4, R><<<(s.m + R - 1) / R, 128>>>(dw, row_bytes, s.k, s.m, dx, dout); \
        }, true);                                                                            \
    }
        if (s.ty == DT_Q8_0)
            for (int R : {1, 2, 4}) {
                char nm[64];
                snprintf(nm, sizeof nm, "Q8_0 rows without I2F, R=%d (candidate)", R);
                row(nm, [&] {
                    if (R == 4) q8_magic_variant<4><<<(s.m + 3) / 4, 128>>>(dw, row_bytes, s.k, s.m, dx, dout);
                    else if (R == 2) q8_magic_variant<2><<<(s.m + 1) / 2, 128>>>(dw, row_bytes, s.k, s.m, dx, dout);
                    else q8_magic_variant<1><<<s.m, 128>>>(dw, row_bytes, s.k, s.m, dx, dout);
                }, true);
            }
        if (getenv("OLD_VARIANTS")) {  // the candidates of rounds 3-5
            V_ROW(2, 1)
            V_ROW(4, 1)
            S_ROW(2)
        }
        {
            // 8-bit activations: x quantised once (quantize_q8_1; its own time is the last
            // row), the product kernel matvec_dense_q8_multi on this one product.
            q8_1_block* dq;
            CK(cudaMalloc(&dq, (size_t)s.k / 32 * sizeof(q8_1_block)));
            quantize_q8_1<<<(s.k / 32 + 7) / 8, 256>>>(dx, dq, s.k / 32, 0, nullptr);
            CK(cudaDeviceSynchronize());
            for (int R : {1, 2, 4}) {
                char nm[64];
                snprintf(nm, sizeof nm, "matvec_dense_q8_multi R=%d (8-bit act.)", R);
                row(nm, [&] {
                    dense_multi p = {};
                    p.w[0] = dw;
                    p.out[0] = dout;
                    p.m[0] = s.m;
                    p.rows[0] = R;
                    p.n = 1;
                    matvec_dense_q8_multi<<<(s.m + R - 1) / R, 128>>>(p, row_bytes, s.ty, s.k, dq, nullptr);
                }, true);
            }
            if (s.ty == DT_ROCMFP4 && getenv("OLD_VARIANTS")) {
                row("fp4 x q8_1 dp4a R=8", [&] {
                    fp4_q8_variant<8><<<(s.m + 7) / 8, 128>>>(dw, row_bytes, s.k, s.m, dq, dout);
                }, true);
            }
            row("quantize_q8_1 of x alone", [&] {
                quantize_q8_1<<<(s.k / 32 + 7) / 8, 256>>>(dx, dq, s.k / 32, 0, nullptr);
            }, false);
            CK(cudaFree(dq));
        }
        if (s.ty == DT_ROCMFP4 && s.k % 256 == 0 && s.k <= FP4_RUNS_MAX_K) {
            int L = 1;
            while (2 * L <= s.k / 256 && L < 32) L *= 2;
            cudaFuncAttributes fa;
            CK(cudaFuncGetAttributes(&fa, matvec_fp4_runs_q8));
            // Every block quantises all of x: wider blocks spread that over more rows.
            for (int nt : {128, 256, 512})
                for (int R : {1, 2}) {
                    if (!runs_wanted(R, nt)) continue;
                    const int per_block = R * nt / L;
                    char nm[80];
                    snprintf(nm, sizeof nm, "matvec_fp4_runs_q8 R=%d, %d threads (8-bit act., %d regs)", R,
                             nt, fa.numRegs);
                    row(nm, [&] {
                        matvec_fp4_runs_q8<<<(s.m + per_block - 1) / per_block, nt>>>(dw, row_bytes, s.k, s.m,
                                                                                      dx, dout, R, nullptr);
                    }, true);
                }
            // The committed layouts' floor (see runs_floor_variant).
            for (int R : {1, 2})
                for (int nt : {256, 512}) {
                    if (!runs_wanted(R, nt)) continue;
                    const int per_block = R * nt / L;
                    for (int stage : {0, 1}) {
                        char nm[96];
                        snprintf(nm, sizeof nm, "runs floor R=%d, %d threads, %s", R, nt,
                                 stage ? "loads + staging" : "loads only");
                        row(nm, [&] {
                            const int gb = (s.m + per_block - 1) / per_block;
                            if (R == 2 && stage) runs_floor_variant<2, 1><<<gb, nt>>>(dw, row_bytes, s.k, s.m, dx, dout);
                            else if (R == 2) runs_floor_variant<2, 0><<<gb, nt>>>(dw, row_bytes, s.k, s.m, dx, dout);
                            else if (stage) runs_floor_variant<1, 1><<<gb, nt>>>(dw, row_bytes, s.k, s.m, dx, dout);
                            else runs_floor_variant<1, 0><<<gb, nt>>>(dw, row_bytes, s.k, s.m, dx, dout);
                        }, false);
                    }
                }
            // The candidates above, each checked bit for bit against the committed kernel.
            {
                std::vector<float> want(s.m), have(s.m);
                auto bits = [&](auto launch) {
                    CK(cudaMemset(dout, 0, (size_t)s.m * 4));
                    launch(dw);
                    CK(cudaDeviceSynchronize());
                    CK(cudaMemcpy(have.data(), dout, (size_t)s.m * 4, cudaMemcpyDeviceToHost));
                };
                const int Rc = s.m >= 16384 || s.k == FP4_RUNS_MAX_K ? 2 : 1;
                const int ntc = s.m >= 16384 ? 256 : s.k == FP4_RUNS_MAX_K ? 512 : 256;
                bits([&](unsigned char* w) {
                    matvec_fp4_runs_q8<<<(s.m + Rc * ntc / L - 1) / (Rc * ntc / L), ntc>>>(w, row_bytes, s.k, s.m,
                                                                                          dx, dout, Rc, nullptr);
                });
                want = have;
#define RUNS_CAND(R, IL, XF, NT, MINB, HO)                                                               \
    {                                                                                            \
        auto kern = runs_cand_variant<R, IL, XF, NT, MINB, HO>;                                      \
        cudaFuncAttributes fa;                                                                   \
        CK(cudaFuncGetAttributes(&fa, kern));                                                    \
        const int gb = (s.m + R * NT / L - 1) / (R * NT / L);                                   \
        bits([&](unsigned char* w) { kern<<<gb, NT>>>(w, row_bytes, s.k, s.m, dx, dout); });     \
        const bool same = !memcmp(want.data(), have.data(), (size_t)s.m * 4);                    \
        char nm[128];                                                                            \
        snprintf(nm, sizeof nm, "runs cand R=%d %d thr x %d blk/SM%s%s%s (%d regs, %zu B local, %s)", R, NT, \
                 MINB, IL ? " interleaved" : "", XF ? " x first" : "", HO ? " hoisted x" : "", fa.numRegs,  \
                 fa.localSizeBytes,                                                              \
                 same ? "same bits" : "DIFFERENT bits");                                          \
        row(nm, [&] { kern<<<gb, NT>>>(dw, row_bytes, s.k, s.m, dx, dout); }, true);             \
    }
                RUNS_CAND(2, false, false, 512, 1, false)
                RUNS_CAND(2, false, false, 512, 1, true)
                RUNS_CAND(2, false, false, 256, 2, false)
                RUNS_CAND(2, false, false, 256, 2, true)
                RUNS_CAND(1, false, false, 256, 2, true)
#undef RUNS_CAND
#define RUNS_PIPE(V, NT)                                                                             \
    if ((s.k >> 8) % V == 0 && (s.k >> 8) / V <= 32) {                                               \
        auto kern = runs_pipe_variant<V, NT, 512 / NT>;                                              \
        cudaFuncAttributes fa;                                                                       \
        CK(cudaFuncGetAttributes(&fa, kern));                                                        \
        const int Lp = (s.k >> 8) / V, gb = (s.m + NT / Lp - 1) / (NT / Lp);                        \
        bits([&](unsigned char* w) { kern<<<gb, NT>>>(w, row_bytes, s.k, s.m, dx, dout); });         \
        const bool same = !memcmp(want.data(), have.data(), (size_t)s.m * 4);                        \
        char nm[128];                                                                                \
        snprintf(nm, sizeof nm, "runs pipe V=%d, %d thr, %d blocks (%d regs, %zu B local, %s)", V, NT, gb, \
                 fa.numRegs, fa.localSizeBytes, same ? "same bits" : "DIFFERENT bits");             \
        row(nm, [&] { kern<<<gb, NT>>>(dw, row_bytes, s.k, s.m, dx, dout); }, true);                 \
    }
                RUNS_PIPE(2, 128)
                RUNS_PIPE(2, 256)
                RUNS_PIPE(2, 512)
                RUNS_PIPE(4, 128)
                RUNS_PIPE(4, 256)
                RUNS_PIPE(4, 512)
                RUNS_PIPE(8, 128)
                RUNS_PIPE(8, 256)
#undef RUNS_PIPE
            }
            // The same products with their integer sums on the matrix units (the same bits).
            if (s.k % 1024 == 0)
                for (int nt : {256, 512}) {
                    const int S = s.k / 1024, G = nt / (32 * S) > 0 ? nt / (32 * S) : 1;
                    CK(cudaFuncGetAttributes(&fa, matvec_fp4_mma));
                    char nm[96];
                    snprintf(nm, sizeof nm, "matvec_fp4_mma %d threads (%d regs, %zu B local)", 32 * S * G,
                             fa.numRegs, fa.localSizeBytes);
                    row(nm, [&] {
                        matvec_fp4_mma<<<(s.m + 16 * G - 1) / (16 * G), 32 * S * G>>>(dw, row_bytes, s.k, s.m, dx,
                                                                                   dout, G, nullptr);
                    }, true);
                }
            if (s.k / 256 <= 16 && !(L & (L - 1)) && L == s.k / 256 && !getenv("RUNS")) {  // half runs
                char nm[96];
                row(half_name<1, 3>(nm),
                    [&] { launch_half<1, 3>(dw, 0, row_bytes, s.k, s.m, dx, nullptr, 1, dout); }, true);
                row(half_name<1, 4>(nm),
                    [&] { launch_half<1, 4>(dw, 0, row_bytes, s.k, s.m, dx, nullptr, 1, dout); }, true);
                row(half_name<2, 2>(nm),
                    [&] { launch_half<2, 2>(dw, 0, row_bytes, s.k, s.m, dx, nullptr, 1, dout); }, true);
                row(half_name<2, 3>(nm),
                    [&] { launch_half<2, 3>(dw, 0, row_bytes, s.k, s.m, dx, nullptr, 1, dout); }, true);
            }
        }
        if (s.ty == DT_ROCMFP4 && strstr(s.what, "wo_a") && copies >= 16) grouped_wo_a(s, wbase, stride, copies,
                                                                                        row_bytes, hx, ref, refmax, reps);
        CK(cudaFree(wbase));
        CK(cudaFree(dx));
        CK(cudaFree(dout));
    }
    if (!only || strstr("fused", only)) fused_inputs(reps);
    if (!only || strstr("prefetch", only)) prefetch_l2(reps);
    return 0;
}
