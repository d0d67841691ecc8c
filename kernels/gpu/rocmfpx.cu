// ROCmFPx type 107 (Q2_0_ROCMFP2) kernels: activation quantisation to q8_1, decode
// mat-vec (MMVQ, 1..8 columns), tiled mat-mat for more columns (MMQ, dp4a), and the
// grouped MoE mat-vec with its expert sort. Formulas: ../shared/spec/rocmfpx.md.
//
// Type 107 block (10 bytes, 32 weights, not 4-byte aligned): qs[8] (2-bit codes, LSB
// first), e[2] (UE4M3 bytes). Two meanings, picked by the `affine` kernel argument:
//   two-scale: w_i = kv[c_i] * E[i >= 16], kv = {-1, 0, 1, 2}
//   affine:    w_i = c_i * S - O, S = E[0], O = E[1]
// Both are written per 16-weight half h as  A_h * c - B_h  (two-scale: A = B = E[h];
// affine: A = S, B = O), so a half's dot with q8_1 values q (scale d) is
//   d * (A_h * sum c*q - B_h * sum q).
// A_h has 4 significant bits and |sum c*q| < 2^13, so both products are exact in f32
// and the only rounding is the subtraction: two-scale gives exactly d*E*sum(kv*q).
#include "common.cuh"
#define MOE_ROCMFPX_CU  // (ds4.cu reads its mat-vec warps: see there)

// Launch-counter slots (kept in sync with KERNELS in backends/gpu-common/src/kernels.rs).
#define KID_QUANTIZE_Q8_1 0
#define KID_MMVQ_107_N1 1 // .. 8 for n = 1..8
#define KID_MMQ_DP4A_107 9
#define KID_MOE_SORT 10
#define KID_MMVQ_GROUPED_107 11
#define KID_ADD_F32 12
#define KID_GET_ROWS_F32 13
#define KID_GET_ROWS_107 14
#define KID_MMQ_MMA_107 15
#define KID_MATVEC_DENSE 16
#define KID_GET_ROWS_DENSE 17
#define KID_MATVEC_DENSE_ID 30 // 18..29, 31, 44..49: ds4.cu
#define KID_MATVEC_DENSE_ROWS 32
#define KID_MATVEC_DENSE_ROWS_ID 33
#define KID_MATVEC_F32_WIDE 34
#define KID_MMQ_MMA_DENSE 35
#define KID_MMQ_MMA_ID 36
#define KID_MMVQ_ID_107 37
#define KID_MATVEC_FP4_RUNS_Q8 38
#define KID_MATVEC_FP4_RUNS_Q8_ID 39
#define KID_MATVEC_FP4_RUNS_Q8_ID_SWIGLU 58
#define KID_MATVEC_DENSE_ROWS_MULTI 40
#define KID_MATVEC_DENSE_Q8_MULTI 41
#define KID_MATVEC_DENSE_Q8_ID 42
#define KID_QUANTIZE_Q8_1_SWIGLU 43
#define KID_MMB_DENSE 50
#define KID_MMB_ID 51
#define KID_MATVEC_FP4_MMA 52
#define KID_MATVEC_FP4_MMA_ID 53
#define KID_MATVEC_FP4_RUNS_Q8_NORM 60
#define KID_MMW_DENSE 61
#define KID_MMW_ID 62
#define KID_F32_TO_BF16 63
#define KID_MMW_DENSE_M2 64
#define KID_MMW_ID_M2 65
#define KID_L2_PREFETCH 66
#define KID_MATVEC_DENSE_COLS 67
#define KID_MATVEC_FP4_RUNS_Q8_COLS 68
#define KID_MATVEC_DENSE_COLS_MULTI 69
#define KID_MATVEC_FP4_RUNS_Q8_B2 78
#define KID_MATVEC_FP4_RUNS_Q8_ID_B2 79
#define KID_MATMUL_F32_TILES 54
#define KID_MATMUL_F32_REDUCE 55

#define RF2_BLOCK_BYTES 10
#define MOE_MAX_EXPERTS 1024

struct __attribute__((aligned(8))) rf_int2 {
    int x, y;
};

// UE4M3 scale byte; invalid bytes (0x7F, bit 7 set) decode to 0. Normal bytes (e >= 1)
// are the byte shifted into a float's exponent / mantissa plus a bias (exponent e + 119);
// with bias 120 a subnormal byte (e = 0) is 2^-7 (1 + m / 8), and less 2^-7 exactly
// m 2^-10. Selects, not branches: the decode sits in the MMVQ kernels' inner loops
// (their SASS had a branch and a reconvergence pair per call).
GPU_DEV float ue4m3(unsigned int b) {
    b &= 0xffu;
    const bool sub = b < 8u;
    const float f = __int_as_float((int)((b << 20) + (sub ? 120u << 23 : 119u << 23)));
    const float v = sub ? f - 0.0078125f : f;
    return b >= 0x7fu ? 0.0f : v;
}

// Four 2-bit codes (one byte) to four bytes 0..3.
GPU_DEV int rf2_expand4(unsigned int byte) {
    unsigned int x = byte & 0xffu;
    x = (x | (x << 12)) & 0x000f000fu;
    x = (x | (x << 6)) & 0x03030303u;
    return (int)x;
}

// ---------------------------------------------------------------------------------
// Activations: q8_1_store (common.cuh), one warp per 32 values.
extern "C" __global__ void __launch_bounds__(256)
    quantize_q8_1(const float* __restrict__ x, q8_1_block* __restrict__ out, long long n_blocks,
                  int planes, unsigned int* counters) {
    gpu_count_launch(counters, KID_QUANTIZE_Q8_1);
    const int lane = threadIdx.x & 31;
    const long long b = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (b >= n_blocks) return;
    q8_1_store(x[b * 32 + lane], b, lane, out, planes);
}

// The same of the clamped SwiGLU of g and u (as ds4_swiglu computes it, the same bits):
// the routed experts' down product quantises its input without a SwiGLU launch.
extern "C" __global__ void __launch_bounds__(256)
    quantize_q8_1_swiglu(const float* __restrict__ g, const float* __restrict__ u, float lim,
                         q8_1_block* __restrict__ out, long long n_blocks, int planes,
                         unsigned int* counters) {
    gpu_count_launch(counters, KID_QUANTIZE_Q8_1_SWIGLU);
    const int lane = threadIdx.x & 31;
    const long long b = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (b >= n_blocks) return;
    q8_1_store(gpu_swiglu(g[b * 32 + lane], u[b * 32 + lane], lim), b, lane, out, planes);
}

// ---------------------------------------------------------------------------------
// One warp dots R weight rows with NC activation columns (activations loaded once for
// the R rows). Every (row, column) sum is built in the same order whatever R and NC
// are, so the grouped kernel below matches the per-column kernel bit for bit.
//
// Fast path (rows 4-byte aligned, even number of blocks): lane l takes block pairs
// l, l+32, ... as five 4-byte words each (two pairs in flight per lane). Otherwise
// lane l takes half-blocks l, l+32, ... with 2-byte loads.

// One 16-weight half (codes w, scales A / B) of block blk, half h, for R rows. With the
// activations plane-ordered, (w >> 2s) & 0x03030303 holds codes s, s+4, s+8, s+12 as
// bytes: the dp4a partner of the half's word s. The half's sum of q comes with the block.
template <int NC, int R>
GPU_DEV void rf2_half(const unsigned int (&w)[R], const float (&A)[R], const float (&B)[R],
                      int blk, int h, const q8_1_block* const (&cols)[NC], float (&acc)[R][NC]) {
    int c0[R], c1[R], c2[R], c3[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        c0[r] = (int)(w[r] & 0x03030303u);
        c1[r] = (int)((w[r] >> 2) & 0x03030303u);
        c2[r] = (int)((w[r] >> 4) & 0x03030303u);
        c3[r] = (int)((w[r] >> 6) & 0x03030303u);
    }
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        const q8_1_block* qb = cols[c] + blk;
        const rf_int2* q = (const rf_int2*)(qb->qs + 16 * h);
        const rf_int2 qa = q[0], qc = q[1];
        const float d = qb->d;
        const int sq = qb->hsum[h];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            int cq = gpu_dp4a(c0[r], qa.x, 0);
            cq = gpu_dp4a(c1[r], qa.y, cq);
            cq = gpu_dp4a(c2[r], qc.x, cq);
            cq = gpu_dp4a(c3[r], qc.y, cq);
            const float t = gpu_sub(gpu_mul(A[r], gpu_i2f_small(cq)), gpu_mul(B[r], gpu_i2f_small(sq)));
            acc[r][c] = gpu_add(acc[r][c], gpu_mul(d, t));
        }
    }
}

// Both halves of block blk (code words w0, w1) for R rows, affine scales (A = S, B = O
// for the whole block): one integer sum over the block's 32 codes against the block's
// sum of q, so one scale step a block instead of one a half.
template <int NC, int R>
GPU_DEV void rf2_block_affine(const unsigned int (&w0)[R], const unsigned int (&w1)[R],
                              const float (&A)[R], const float (&B)[R], int blk,
                              const q8_1_block* const (&cols)[NC], float (&acc)[R][NC]) {
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        const q8_1_block* qb = cols[c] + blk;
        const rf_int2* q = (const rf_int2*)qb->qs;
        const rf_int2 q0 = q[0], q1 = q[1], q2 = q[2], q3 = q[3];
        const float d = qb->d;
        const int sq = qb->hsum[0] + qb->hsum[1];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            int cq = gpu_dp4a((int)(w0[r] & 0x03030303u), q0.x, 0);
            cq = gpu_dp4a((int)((w0[r] >> 2) & 0x03030303u), q0.y, cq);
            cq = gpu_dp4a((int)((w0[r] >> 4) & 0x03030303u), q1.x, cq);
            cq = gpu_dp4a((int)((w0[r] >> 6) & 0x03030303u), q1.y, cq);
            cq = gpu_dp4a((int)(w1[r] & 0x03030303u), q2.x, cq);
            cq = gpu_dp4a((int)((w1[r] >> 2) & 0x03030303u), q2.y, cq);
            cq = gpu_dp4a((int)((w1[r] >> 4) & 0x03030303u), q3.x, cq);
            cq = gpu_dp4a((int)((w1[r] >> 6) & 0x03030303u), q3.y, cq);
            const float t = gpu_sub(gpu_mul(A[r], gpu_i2f_small(cq)), gpu_mul(B[r], gpu_i2f_small(sq)));
            acc[r][c] = gpu_add(acc[r][c], gpu_mul(d, t));
        }
    }
}

// A scale byte (the low 8 bits of b) as a float: converted (ue4m3, ~9 instructions),
// or looked up in a block's shared table of ue4m3 over all 256 bytes (the same values;
// an address and a shared load).
struct rf2_sc_calc {
    GPU_MEMBER float operator()(unsigned int b) const { return ue4m3(b); }
};
struct rf2_sc_lut {
    const float* t;
    GPU_MEMBER float operator()(unsigned int b) const { return t[b & 0xffu]; }
};

// The A / B scales of half h of a block with scale bytes e (two-scale: A = B = E[h];
// affine: A = S = E[0], B = O = E[1] for both halves).
template <int R, typename SC = rf2_sc_calc>
GPU_DEV void rf2_scales(const unsigned int (&e)[R], int h, int affine, float (&A)[R],
                        float (&B)[R], const SC& sc = SC()) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        A[r] = sc(affine || h == 0 ? e[r] : e[r] >> 8);
        B[r] = affine ? sc(e[r] >> 8) : A[r];
    }
}

// A block pair (20 bytes = five words v[0..4]) for R rows: blocks 2p and 2p+1. AFF: 1
// affine blocks, 0 two-scale ones, -1 as `affine` says (a template constant leaves
// the other kind's code out of the loop); SC: the scales' conversion (rf2_scales).
template <int NC, int R, int AFF = -1, typename SC = rf2_sc_calc>
GPU_DEV void rf2_pair(const unsigned int (&v)[R][5], int p, const q8_1_block* const (&cols)[NC],
                      int affine, float (&acc)[R][NC], const SC& sc = SC()) {
    unsigned int w[R], e[R];
    float A[R], B[R];
    if (AFF < 0 ? affine : AFF) {
        unsigned int w1[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            w[r] = v[r][0];
            w1[r] = v[r][1];
            e[r] = v[r][2] & 0xffffu;
        }
        rf2_scales<R>(e, 0, 1, A, B, sc);
        rf2_block_affine<NC, R>(w, w1, A, B, 2 * p, cols, acc);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            w[r] = (v[r][2] >> 16) | (v[r][3] << 16);
            w1[r] = (v[r][3] >> 16) | (v[r][4] << 16);
            e[r] = v[r][4] >> 16;
        }
        rf2_scales<R>(e, 0, 1, A, B, sc);
        rf2_block_affine<NC, R>(w, w1, A, B, 2 * p + 1, cols, acc);
        return;
    }
    // Two-scale: a scale a half.
#pragma unroll
    for (int r = 0; r < R; ++r) { w[r] = v[r][0]; e[r] = v[r][2] & 0xffffu; }
    rf2_scales<R>(e, 0, 0, A, B, sc);
    rf2_half<NC, R>(w, A, B, 2 * p, 0, cols, acc);
#pragma unroll
    for (int r = 0; r < R; ++r) w[r] = v[r][1];
    rf2_scales<R>(e, 1, 0, A, B, sc);
    rf2_half<NC, R>(w, A, B, 2 * p, 1, cols, acc);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        w[r] = (v[r][2] >> 16) | (v[r][3] << 16);
        e[r] = v[r][4] >> 16;
    }
    rf2_scales<R>(e, 0, 0, A, B, sc);
    rf2_half<NC, R>(w, A, B, 2 * p + 1, 0, cols, acc);
#pragma unroll
    for (int r = 0; r < R; ++r) w[r] = (v[r][3] >> 16) | (v[r][4] << 16);
    rf2_scales<R>(e, 1, 0, A, B, sc);
    rf2_half<NC, R>(w, A, B, 2 * p + 1, 1, cols, acc);
}

// The ROCmFP2 decode products' weight loads: evict-first in L2 (gpu_load_stream_*), or
// plain with RF2_NO_STREAM_HINT (A/B runs).
#if defined(RF2_NO_STREAM_HINT)
#define RF2_HINT false
#else
#define RF2_HINT true
#endif

template <int NC, int R, int AFF = -1, typename SC = rf2_sc_calc>
GPU_DEV void rf2_rows_dot(const unsigned char* const (&rows)[R], int nb,
                          const q8_1_block* const (&cols)[NC], int affine, float (&acc)[R][NC],
                          const SC& sc = SC()) {
    if (AFF >= 0) affine = AFF;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[r][c] = 0.0f;
    // nb even makes the row length a multiple of 4 bytes, so one check covers all rows.
    if ((nb & 1) == 0 && (((unsigned long long)rows[0]) & 3u) == 0) {
        const int np = nb >> 1;
        for (int p = lane; p < np; p += 2 * GPU_WARP) {
            const int p2 = p + GPU_WARP;
            unsigned int v[R][5], v2[R][5];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const unsigned int* src = (const unsigned int*)rows[r] + 5 * p;
#pragma unroll
                for (int j = 0; j < 5; ++j) v[r][j] = gpu_load_stream_u32<RF2_HINT>(src + j);
            }
            if (p2 < np) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const unsigned int* src = (const unsigned int*)rows[r] + 5 * p2;
#pragma unroll
                    for (int j = 0; j < 5; ++j) v2[r][j] = gpu_load_stream_u32<RF2_HINT>(src + j);
                }
            }
            rf2_pair<NC, R, AFF>(v, p, cols, affine, acc, sc);
            if (p2 < np) rf2_pair<NC, R, AFF>(v2, p2, cols, affine, acc, sc);
        }
    } else {
        for (int hb = lane; hb < 2 * nb; hb += GPU_WARP) {
            const int blk = hb >> 1, h = hb & 1;
            unsigned int w[R], e[R];
            float A[R], B[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const unsigned char* bp = rows[r] + (long long)blk * RF2_BLOCK_BYTES;
                w[r] = gpu_load_stream_u32_a2<RF2_HINT>(bp + 4 * h);
                e[r] = gpu_load_stream_u16<RF2_HINT>(bp + 8);
            }
            rf2_scales<R>(e, h, affine, A, B, sc);
            rf2_half<NC, R>(w, A, B, blk, h, cols, acc);
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < NC; ++c) acc[r][c] = gpu_warp_sum(acc[r][c]);
}

// Rows per warp of the MMVQ kernels: more columns reuse each activation load over
// more rows (the activations are read from L1 once per R rows). HIP keeps 2 past 4
// columns: with 4 rows, 5 - 8 columns spill 42 - 62 VGPRs on gfx1100 at the 256 a
// lane can hold (the same sums: every (row, column) sum is built in the same order
// whatever R is). The backends' grids follow (mmvq_rows_per_warp in gpu-common).
#if defined(GPU_HIP)
#define RF_MMVQ_ROWS(NC) ((NC) == 1 ? 4 : 2)
#else
#define RF_MMVQ_ROWS(NC) ((NC) == 1 ? 4 : (NC) <= 4 ? 2 : 4)
#endif

// MMVQ: out[c*m + r] = dot(row r, column c); a 128-thread block = 4 warps x R rows.
template <int NC>
GPU_DEV void mmvq_107(const unsigned char* __restrict__ w, int nb, int m,
                      const q8_1_block* __restrict__ act, float* __restrict__ out, int affine) {
    constexpr int R = RF_MMVQ_ROWS(NC);
    const int r0 = (blockIdx.x * 4 + (threadIdx.x >> 5)) * R;
    if (r0 >= m) return;
    const q8_1_block* cols[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) cols[c] = act + (long long)c * nb;
    const unsigned char* rows[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        // Rows past the end repeat the last row (computed, never stored).
        const int rr = r0 + r < m ? r0 + r : m - 1;
        rows[r] = w + (long long)rr * nb * RF2_BLOCK_BYTES;
    }
    float acc[R][NC];
    rf2_rows_dot<NC, R>(rows, nb, cols, affine, acc);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (r0 + r < m)
#pragma unroll
                for (int c = 0; c < NC; ++c) out[(long long)c * m + r0 + r] = acc[r][c];
    }
}

#define RF_MMVQ(N)                                                                                 \
    extern "C" __global__ void __launch_bounds__(128)                                              \
        mmvq_107_n##N(const unsigned char* __restrict__ w, int nb, int m,                          \
                      const q8_1_block* __restrict__ act, float* __restrict__ out, int affine,     \
                      unsigned int* counters) {                                                    \
        gpu_count_launch(counters, KID_MMVQ_107_N1 + (N) - 1);                                     \
        mmvq_107<N>(w, nb, m, act, out, affine);                                                   \
    }
RF_MMVQ(1)
RF_MMVQ(2)
RF_MMVQ(3)
RF_MMVQ(4)
RF_MMVQ(5)
RF_MMVQ(6)
RF_MMVQ(7)
RF_MMVQ(8)

// ---------------------------------------------------------------------------------
// Grouped MoE mat-vec. Pairs p = token * n_slots + slot, ids[p] = expert or -1.
// moe_sort (one block) lists the pairs of each expert: offsets[e]..offsets[e+1] index
// `sorted`; masked pairs (and ids outside 0..E) form a last list, `offsets[E]..[E+1]`.
// active[1..1+active[0]] lists the non-empty lists (E = the masked one), so the grouped
// kernel launches min(pairs, E) + 1 block rows, not one per expert.
extern "C" __global__ void __launch_bounds__(256)
    moe_sort(const int* __restrict__ ids, int n_pairs, int n_experts, int* __restrict__ offsets,
             int* __restrict__ active, int* __restrict__ sorted, unsigned int* counters) {
    gpu_count_launch(counters, KID_MOE_SORT);
    __shared__ int cnt[MOE_MAX_EXPERTS + 1];
    __shared__ int part[256];
    __shared__ int n_active;
    const int t = threadIdx.x;
    if (t == 0) n_active = 0;
    const int ne = n_experts + 1; // + the masked list
    for (int e = t; e < ne; e += 256) cnt[e] = 0;
    __syncthreads();
    for (int p = t; p < n_pairs; p += 256) {
        const int e = ids[p];
        atomicAdd(&cnt[(e >= 0 && e < n_experts) ? e : n_experts], 1);
    }
    __syncthreads();
    // Exclusive scan: each thread owns a run of `per` entries, then a scan of the runs.
    const int per = (ne + 255) / 256;
    int local = 0;
    for (int i = 0; i < per; ++i) {
        const int e = t * per + i;
        if (e < ne) local += cnt[e];
    }
    part[t] = local;
    __syncthreads();
    for (int s = 1; s < 256; s <<= 1) {
        const int v = t >= s ? part[t - s] : 0;
        __syncthreads();
        part[t] += v;
        __syncthreads();
    }
    int run = part[t] - local;
    for (int i = 0; i < per; ++i) {
        const int e = t * per + i;
        if (e < ne) {
            const int c = cnt[e];
            if (c > 0) active[1 + atomicAdd(&n_active, 1)] = e;
            offsets[e] = run;
            cnt[e] = run; // becomes the scatter cursor
            run += c;
        }
    }
    if (t == 255) offsets[ne] = part[255];
    __syncthreads();
    if (t == 0) active[0] = n_active;
    for (int p = t; p < n_pairs; p += 256) {
        const int e = ids[p];
        const int pos = atomicAdd(&cnt[(e >= 0 && e < n_experts) ? e : n_experts], 1);
        sorted[pos] = p;
    }
}

// grid = (ceil(m / (4 * RF_GROUPED_ROWS)), min(pairs, n_experts) + 1); block row y takes
// the y-th non-empty list: an expert streams its rows once for all of its pairs (8
// columns at a time); the masked list (e == n_experts) gets exact zeros. A warp takes
// RF_GROUPED_ROWS rows: 4 measured 28% slower than 1 on the decode step
// (docs/notes/ds4-gpu-h200.md), so 1.
// Activation column of pair p: p when act_per_pair, else p / n_slots (the token).
#define RF_GROUPED_ROWS 1
template <int NC>
GPU_DEV void grouped_chunk(const unsigned char* const (&rows)[RF_GROUPED_ROWS], int nb, int m,
                           int r0, const q8_1_block* __restrict__ act, int act_per_pair,
                           int n_slots, const int* __restrict__ pairs, float* __restrict__ out,
                           int affine) {
    const q8_1_block* cols[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        const int p = pairs[c];
        cols[c] = act + (long long)(act_per_pair ? p : p / n_slots) * nb;
    }
    float acc[RF_GROUPED_ROWS][NC];
    rf2_rows_dot<NC, RF_GROUPED_ROWS>(rows, nb, cols, affine, acc);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int r = 0; r < RF_GROUPED_ROWS; ++r)
            if (r0 + r < m)
#pragma unroll
                for (int c = 0; c < NC; ++c) out[(long long)pairs[c] * m + r0 + r] = acc[r][c];
    }
}

extern "C" __global__ void __launch_bounds__(128)
    mmvq_grouped_107(const unsigned char* __restrict__ w, long long expert_bytes, int nb, int m,
                     int n_experts, const q8_1_block* __restrict__ act, int act_per_pair,
                     int n_slots, const int* __restrict__ offsets, const int* __restrict__ active,
                     const int* __restrict__ sorted, float* __restrict__ out, int affine,
                     unsigned int* counters) {
    gpu_count_launch(counters, KID_MMVQ_GROUPED_107);
    const int r0 = (blockIdx.x * 4 + (threadIdx.x >> 5)) * RF_GROUPED_ROWS;
    if (r0 >= m || (int)blockIdx.y >= active[0]) return;
    const int e = active[1 + blockIdx.y];
    const int begin = offsets[e], end = offsets[e + 1];
    if (e == n_experts) {
        if ((threadIdx.x & 31) == 0)
            for (int i = begin; i < end; ++i)
                for (int r = r0; r < r0 + RF_GROUPED_ROWS && r < m; ++r)
                    out[(long long)sorted[i] * m + r] = 0.0f;
        return;
    }
    const unsigned char* rows[RF_GROUPED_ROWS];
#pragma unroll
    for (int r = 0; r < RF_GROUPED_ROWS; ++r) {
        // Rows past the end repeat the last row (computed, never stored).
        const int rr = r0 + r < m ? r0 + r : m - 1;
        rows[r] = w + (long long)e * expert_bytes + (long long)rr * nb * RF2_BLOCK_BYTES;
    }
    for (int i = begin; i < end; i += 8) {
        const int* pairs = sorted + i;
        switch (end - i < 8 ? end - i : 8) {
        case 1: grouped_chunk<1>(rows, nb, m, r0, act, act_per_pair, n_slots, pairs, out, affine); break;
        case 2: grouped_chunk<2>(rows, nb, m, r0, act, act_per_pair, n_slots, pairs, out, affine); break;
        case 3: grouped_chunk<3>(rows, nb, m, r0, act, act_per_pair, n_slots, pairs, out, affine); break;
        case 4: grouped_chunk<4>(rows, nb, m, r0, act, act_per_pair, n_slots, pairs, out, affine); break;
        case 5: grouped_chunk<5>(rows, nb, m, r0, act, act_per_pair, n_slots, pairs, out, affine); break;
        case 6: grouped_chunk<6>(rows, nb, m, r0, act, act_per_pair, n_slots, pairs, out, affine); break;
        case 7: grouped_chunk<7>(rows, nb, m, r0, act, act_per_pair, n_slots, pairs, out, affine); break;
        default: grouped_chunk<8>(rows, nb, m, r0, act, act_per_pair, n_slots, pairs, out, affine); break;
        }
    }
}

// One token's MATMUL_ID (a decode step): its pairs name distinct experts, so block row
// y = pair y reads ids[y] itself and no moe_sort runs; masked ids (outside 0..E) give
// zeros. Each warp takes R = `rows` (1, 2, 4) rows, loading each activation once for
// them (with one row a warp the activations' L1 loads outnumber the weights': ncu, 18:00
// UTC); every output is the same sum as mmvq_grouped_107's, whatever R. Block z takes
// the product with weights and outputs z w_step / z out_step bytes on (MATMUL_ID_MULTI:
// the routed experts' gate and up share the input, its quantisation and the launch).
// RF2_ID_LEAN (a compile option, the CUDA backend's default; `MOE_GPU_RF2_ID=0` off): the block kind is a template
// constant (AFF) and the scales come from a shared table (SC): a warp's 4-row stage of
// affine blocks 1001 -> ~740 instructions by count, the same values.
// grid = (ceil(m / (4 R)), pairs, products), block = 128.
// One warp's part of mmvq_id_107 (its R rows from r0 of expert e's product into o, from
// the activation column col), also run by the fused routed MoE (ds4_moe_routed).
template <int R, int AFF = -1, typename SC = rf2_sc_calc>
GPU_DEV void mmvq_id_warp(const unsigned char* __restrict__ w, long long expert_bytes, int nb,
                          int m, int n_experts, const q8_1_block* col, int e, int r0, float* o,
                          int affine, const SC& sc = SC()) {
    if (r0 >= m) return;
    const bool lead = (threadIdx.x & 31) == 0;
    if (e < 0 || e >= n_experts) {
        if (lead)
#pragma unroll
            for (int r = 0; r < R; ++r)
                if (r0 + r < m) o[r0 + r] = 0.0f;
        return;
    }
    const unsigned char* rows[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        // Rows past the end repeat the last row (computed, never stored).
        const int rr = r0 + r < m ? r0 + r : m - 1;
        rows[r] = w + (long long)e * expert_bytes + (long long)rr * nb * RF2_BLOCK_BYTES;
    }
    const q8_1_block* const cols[1] = {col};
    float acc[R][1];
    rf2_rows_dot<1, R, AFF>(rows, nb, cols, affine, acc, sc);
    if (lead)
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (r0 + r < m) o[r0 + r] = acc[r][0];
}

template <int R, int AFF = -1, typename SC = rf2_sc_calc>
GPU_DEV void mmvq_id_rows(const unsigned char* __restrict__ w, long long expert_bytes, int nb,
                          int m, int n_experts, const q8_1_block* __restrict__ act,
                          int act_per_pair, int n_slots, const int* __restrict__ ids,
                          float* __restrict__ out, int affine, const SC& sc = SC()) {
    const int r0 = (blockIdx.x * 4 + (threadIdx.x >> 5)) * R, p = blockIdx.y;
    if (r0 >= m) return;
    mmvq_id_warp<R, AFF>(w, expert_bytes, nb, m, n_experts,
                         act + (long long)(act_per_pair ? p : p / n_slots) * nb, ids[p], r0,
                         out + (long long)p * m, affine, sc);
}

extern "C" __global__ void __launch_bounds__(128)
    mmvq_id_107(const unsigned char* __restrict__ w, long long expert_bytes, int nb, int m,
                int n_experts, const q8_1_block* __restrict__ act, int act_per_pair, int n_slots,
                const int* __restrict__ ids, float* __restrict__ out, int affine, int rows,
                long long w_step, long long out_step, unsigned int* counters) {
#if defined(RF2_ID_LEAN)
    // (filled before the dependent-launch wait: the table depends on nothing)
    __shared__ float sct[256];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) sct[i] = ue4m3(i);
    __syncthreads();
    const rf2_sc_lut sc = {sct};
#endif
    gpu_count_launch(counters, KID_MMVQ_ID_107);
    // Both steps are in bytes.
    w += blockIdx.z * w_step;
    out = (float*)((char*)out + blockIdx.z * out_step);
#if defined(RF2_ID_LEAN)
#define RF2_ID_ROWS(R)                                                                             \
    (affine ? mmvq_id_rows<R, 1>(w, expert_bytes, nb, m, n_experts, act, act_per_pair, n_slots,  \
                                 ids, out, affine, sc)                                            \
            : mmvq_id_rows<R, 0>(w, expert_bytes, nb, m, n_experts, act, act_per_pair, n_slots,  \
                                 ids, out, affine, sc))
    if (rows == 4) RF2_ID_ROWS(4);
    else if (rows == 2) RF2_ID_ROWS(2);
    else RF2_ID_ROWS(1);
#undef RF2_ID_ROWS
#else
    if (rows == 4)
        mmvq_id_rows<4>(w, expert_bytes, nb, m, n_experts, act, act_per_pair, n_slots, ids, out, affine);
    else if (rows == 2)
        mmvq_id_rows<2>(w, expert_bytes, nb, m, n_experts, act, act_per_pair, n_slots, ids, out, affine);
    else
        mmvq_id_rows<1>(w, expert_bytes, nb, m, n_experts, act, act_per_pair, n_slots, ids, out, affine);
#endif
}

// ---------------------------------------------------------------------------------
// MMQ, tiled dp4a path (no tensor cores): a 256-thread block computes a 64-row x
// 32-column tile; per stage it stages 4 weight blocks of 64 rows (codes as int8 plus
// A/B per half) and 4 activation blocks of 32 columns in shared memory. Warp w owns
// rows 8w..8w+7, lane l owns column l.
#define MMQ_BM 64
#define MMQ_BN 32
#define MMQ_KB 4

extern "C" __global__ void __launch_bounds__(256)
    mmq_dp4a_107(const unsigned char* __restrict__ w, int nb, int m, int n,
                 const q8_1_block* __restrict__ act, float* __restrict__ out, int affine,
                 unsigned int* counters) {
    gpu_count_launch(counters, KID_MMQ_DP4A_107);
    __shared__ int wq[MMQ_BM][MMQ_KB * 8];
    __shared__ float wa[MMQ_BM][MMQ_KB * 2];
    __shared__ float wb[MMQ_BM][MMQ_KB * 2];
    __shared__ int aq[MMQ_BN][MMQ_KB * 8 + 1];
    __shared__ float ad[MMQ_BN][MMQ_KB];
    __shared__ int asq[MMQ_BN][MMQ_KB * 2];

    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int r0 = blockIdx.x * MMQ_BM, c0 = blockIdx.y * MMQ_BN;
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.0f;

    for (int kb0 = 0; kb0 < nb; kb0 += MMQ_KB) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int idx = t + 256 * i;
            const int row = idx >> 3, blk = (idx >> 1) & 3, h = idx & 1;
            const int gr = r0 + row, gb = kb0 + blk;
            int q0 = 0, q1 = 0, q2 = 0, q3 = 0;
            float A = 0.0f, B = 0.0f;
            if (gr < m && gb < nb) {
                const unsigned char* bp = w + ((long long)gr * nb + gb) * RF2_BLOCK_BYTES;
                const unsigned int wv = gpu_load_u32_a2(bp + 4 * h);
                const unsigned int e = gpu_load_u16(bp + 8);
                A = ue4m3(affine ? e : (h ? e >> 8 : e));
                B = affine ? ue4m3(e >> 8) : A;
                q0 = rf2_expand4(wv);
                q1 = rf2_expand4(wv >> 8);
                q2 = rf2_expand4(wv >> 16);
                q3 = rf2_expand4(wv >> 24);
            }
            int* dst = &wq[row][blk * 8 + h * 4];
            dst[0] = q0;
            dst[1] = q1;
            dst[2] = q2;
            dst[3] = q3;
            wa[row][blk * 2 + h] = A;
            wb[row][blk * 2 + h] = B;
        }
        {
            const int col = t >> 3, blk = (t >> 1) & 3, h = t & 1;
            const int gc = c0 + col, gb = kb0 + blk;
            rf_int2 qa = {0, 0}, qc = {0, 0};
            float d = 0.0f;
            if (gc < n && gb < nb) {
                const q8_1_block* qb = act + (long long)gc * nb + gb;
                const rf_int2* q = (const rf_int2*)(qb->qs + 16 * h);
                qa = q[0];
                qc = q[1];
                d = qb->d;
            }
            int* dst = &aq[col][blk * 8 + h * 4];
            dst[0] = qa.x;
            dst[1] = qa.y;
            dst[2] = qc.x;
            dst[3] = qc.y;
            int s = gpu_dp4a(0x01010101, qa.x, 0);
            s = gpu_dp4a(0x01010101, qa.y, s);
            s = gpu_dp4a(0x01010101, qc.x, s);
            s = gpu_dp4a(0x01010101, qc.y, s);
            asq[col][blk * 2 + h] = s;
            if (h == 0) ad[col][blk] = d;
        }
        __syncthreads();
#pragma unroll
        for (int blk = 0; blk < MMQ_KB; ++blk) {
            int a[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) a[j] = aq[lane][blk * 8 + j];
            const float d = ad[lane][blk];
            const float s0 = gpu_i2f_small(asq[lane][blk * 2]), s1 = gpu_i2f_small(asq[lane][blk * 2 + 1]);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int row = warp * 8 + i;
                const int* wr = &wq[row][blk * 8];
                int q0 = gpu_dp4a(wr[0], a[0], 0);
                q0 = gpu_dp4a(wr[1], a[1], q0);
                q0 = gpu_dp4a(wr[2], a[2], q0);
                q0 = gpu_dp4a(wr[3], a[3], q0);
                int q1 = gpu_dp4a(wr[4], a[4], 0);
                q1 = gpu_dp4a(wr[5], a[5], q1);
                q1 = gpu_dp4a(wr[6], a[6], q1);
                q1 = gpu_dp4a(wr[7], a[7], q1);
                const float t0 = wa[row][blk * 2] * gpu_i2f_small(q0) - wb[row][blk * 2] * s0;
                const float t1 = wa[row][blk * 2 + 1] * gpu_i2f_small(q1) - wb[row][blk * 2 + 1] * s1;
                acc[i] += d * (t0 + t1);
            }
        }
        __syncthreads();
    }
    const int gc = c0 + lane;
    if (gc < n) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int gr = r0 + warp * 8 + i;
            if (gr < m) out[(long long)gc * m + gr] = acc[i];
        }
    }
}

// ---------------------------------------------------------------------------------
// MMQ on matrix units: a 256-thread block (8 warps) computes a 128-row x 64-column
// tile; warp w owns rows 32*(w&3).., columns 32*(w>>2).. (a column tile of at most 16:
// rows 16w.., columns 0..15; see mma_row). Per stage it stages 4
// weight blocks of 128 rows (codes widened to int8: affine c, two-scale c-1 = kv) and
// 4 activation blocks of 64 columns in shared memory. The integer sums run on the
// matrix units; the per-16-weight scales are applied in f32 per k-block:
//   affine:    acc += d*S*sum(c*q) - O*(d*sum q)          (one K=32 product per block)
//   two-scale: acc += d*(E0*sum_h0(kv*q) + E1*sum_h1(kv*q)) (one K=16 product per half)
// CUDA sm_80+: mma.sync m16n8k32 / m16n8k16 s8 (PTX). HIP gfx1100/gfx1151: WMMA
// 16x16x16 iu8 (wave32). Elsewhere the same tile runs on dp4a (the backends pick
// mmq_dp4a_107 there instead).
#define MMA_BM 128
#define MMA_BN 64
#define MMA_KB 4
#define MMA_LD (MMA_KB * 8 + 4) // words per staged row: 32 + 4 pad (conflict-free frags)

#if defined(GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define RF_MMA_PTX 1
#elif defined(GPU_HIP) && (defined(__gfx1100__) || defined(__gfx1151__))
#define RF_MMA_WMMA 1
typedef int rf_v4i __attribute__((ext_vector_type(4)));
typedef int rf_v8i __attribute__((ext_vector_type(8)));
#endif

// A warp's sub-tile is MT x NT mma tiles: 16 rows by 8 columns each on CUDA (NT even),
// 16 x 16 (NT / 2 of them across) on RDNA. MT = 2, NT = 4: 32 rows x 32 columns, the
// wide layout (8 warps as 4 x 2 over the 128 x 64 tile); MT = 1, NT = 2: 16 x 16, the
// narrow one (8 warps down the 128 rows, the tile's first 16 columns), for column tiles
// of at most 16 (a routed expert's few tokens in prefill), where the wide layout would
// leave half the warps idle and the rest computing mostly empty columns.
#define MMA_NE(MT, NT) ((MT) * (NT) * 4)  // output elements a lane
// Row / column of element i of a lane's MMA_NE elements.
#if defined(RF_MMA_WMMA)
// Tile i / 8 (row-major over MT x NT / 2); lane l holds rows 2j + l/16, column l%16 of
// each (j = i % 8).
template <int MT, int NT>
GPU_DEV int mma_row(int i, int lane) { return ((i >> 3) / (NT / 2)) * 16 + 2 * (i & 7) + (lane >> 4); }
template <int MT, int NT>
GPU_DEV int mma_col(int i, int lane) { return ((i >> 3) % (NT / 2)) * 16 + (lane & 15); }
#else
// Tile i / 4 (row-major over MT x NT, mma.sync C layout): g = lane/4, t = lane%4;
// element j = i % 4 of a tile is row g + 8*(j/2), column 2t + j%2.
template <int MT, int NT>
GPU_DEV int mma_row(int i, int lane) { return ((i >> 2) / NT) * 16 + (lane >> 2) + ((i & 2) << 2); }
template <int MT, int NT>
GPU_DEV int mma_col(int i, int lane) { return ((i >> 2) % NT) * 8 + 2 * (lane & 3) + (i & 1); }
#endif

// Integer dot products of the warp's 16 MT rows (ws, row stride MMA_LD words) with its
// 8 NT columns (as_) over word range [w0, w0 + nw) of the staged k (nw = 4: one half,
// 8: the whole block); out[i] for element i as mapped above.
template <int MT, int NT>
GPU_DEV void mma_tile_dot(const int* ws, const int* as_, int w0, int nw, int (&out)[MMA_NE(MT, NT)]) {
    const int lane = threadIdx.x & 31;
#if defined(RF_MMA_PTX)
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int* r0 = ws + (mt * 16 + g) * MMA_LD + w0 + t;
        const int* r1 = r0 + 8 * MMA_LD;
        const int a0 = r0[0], a1 = r1[0];
        const int a2 = nw == 8 ? r0[4] : 0, a3 = nw == 8 ? r1[4] : 0;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int* c = as_ + (nt * 8 + g) * MMA_LD + w0 + t;
            int* d = out + (mt * NT + nt) * 4;
            if (nw == 8) {
                asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
                             "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
                             : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                             : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(c[0]), "r"(c[4]), "r"(0));
            } else {
                asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 "
                             "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};"
                             : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                             : "r"(a0), "r"(a1), "r"(c[0]), "r"(0));
            }
        }
    }
#elif defined(RF_MMA_WMMA)
    const int l = lane & 15;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < NT / 2; ++nt) {
            rf_v8i acc = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int k = 0; k < nw; k += 4) {
                const int* ra = ws + (mt * 16 + l) * MMA_LD + w0 + k;
                const int* rb = as_ + (nt * 16 + l) * MMA_LD + w0 + k;
                const rf_v4i a = {ra[0], ra[1], ra[2], ra[3]};
                const rf_v4i b = {rb[0], rb[1], rb[2], rb[3]};
                acc = __builtin_amdgcn_wmma_i32_16x16x16_iu8_w32(true, a, true, b, acc, false);
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) out[(mt * (NT / 2) + nt) * 8 + j] = acc[j];
        }
    }
#else
#pragma unroll
    for (int i = 0; i < MMA_NE(MT, NT); ++i) {
        const int* ra = ws + mma_row<MT, NT>(i, lane) * MMA_LD + w0;
        const int* rb = as_ + mma_col<MT, NT>(i, lane) * MMA_LD + w0;
        int s = 0;
        for (int k = 0; k < nw; ++k) s = gpu_dp4a(ra[k], rb[k], s);
        out[i] = s;
    }
#endif
}

// ---------------------------------------------------------------------------------
// Small ops.
extern "C" __global__ void __launch_bounds__(256)
    add_f32(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ out,
            long long n, unsigned int* counters) {
    gpu_count_launch(counters, KID_ADD_F32);
    const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

// out[i*cols + j] = table[ids[i]][j]; grid = (ceil(cols/256), n_ids).
extern "C" __global__ void __launch_bounds__(256)
    get_rows_f32(const float* __restrict__ table, const int* __restrict__ ids, int rows, int cols,
                 float* __restrict__ out, unsigned int* counters) {
    gpu_count_launch(counters, KID_GET_ROWS_F32);
    const int j = blockIdx.x * 256 + threadIdx.x;
    const int id = ids[blockIdx.y];
    if (j >= cols) return;
    out[(long long)blockIdx.y * cols + j] =
        (id >= 0 && id < rows) ? table[(long long)id * cols + j] : 0.0f;
}

extern "C" __global__ void __launch_bounds__(256)
    get_rows_107(const unsigned char* __restrict__ table, const int* __restrict__ ids, int rows,
                 int cols, float* __restrict__ out, int affine, unsigned int* counters) {
    gpu_count_launch(counters, KID_GET_ROWS_107);
    const int j = blockIdx.x * 256 + threadIdx.x;
    const int id = ids[blockIdx.y];
    if (j >= cols) return;
    float v = 0.0f;
    if (id >= 0 && id < rows) {
        const unsigned char* bp =
            table + ((long long)id * (cols / 32) + (j >> 5)) * RF2_BLOCK_BYTES;
        const int i = j & 31;
        const int code = (bp[i >> 2] >> (2 * (i & 3))) & 3;
        if (affine) {
            v = (float)code * ue4m3(bp[8]) - ue4m3(bp[9]);
        } else {
            v = (float)(code - 1) * ue4m3(bp[8 + (i >= 16)]);
        }
    }
    out[(long long)blockIdx.y * cols + j] = v;
}

// ---------------------------------------------------------------------------------
// The other tensor types of a model (f32, f16, bf16, ggml's q8_0 and mxfp4, ROCmFP4): a
// decode-as-you-go mat-vec with f32 activations and a row decoder for GET_ROWS. A plain
// reference path (weights decoded per column tile), not a tuned one.
#define DT_F32 0
#define DT_F16 1
#define DT_Q8_0 8
#define DT_BF16 30
#define DT_MXFP4 39
#define DT_ROCMFP4 100
#define DT_ROCMFP4_FAST 101

GPU_DEV float half_to_float(unsigned int h) {
    const unsigned int s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        const float v = (float)m * 5.9604644775390625e-8f;  // subnormal: m * 2^-24
        return s ? -v : v;
    }
    if (e == 31) return __int_as_float((int)(s | 0x7f800000u | (m << 13)));
    return __int_as_float((int)(s | ((e + 112u) << 23) | (m << 13)));
}

// Value i of one row of type `ty` (row starts at a block boundary).
GPU_DEV float dense_value(const unsigned char* row, int ty, int i) {
    if (ty == DT_F32) return ((const float*)row)[i];
    if (ty == DT_F16) return half_to_float(((const unsigned short*)row)[i]);
    if (ty == DT_BF16) return __int_as_float((int)((unsigned int)((const unsigned short*)row)[i] << 16));
    if (ty == DT_Q8_0) {
        const unsigned char* b = row + (i >> 5) * 34;  // f16 scale, 32 int8
        return half_to_float(gpu_load_u16(b)) * (float)(signed char)b[2 + (i & 31)];
    }
    if (ty == DT_ROCMFP4 || ty == DT_ROCMFP4_FAST) {
        // qs[16] (element j low nibble, j+16 high), then UE4M3 scale(s): one per half
        // (100) or one per block (101). Code: bit 3 sign, m = bits 0..2, |v| = m <= 4 ? m : 2m-4.
        const int fast = ty == DT_ROCMFP4_FAST;
        const unsigned char* b = row + (i >> 5) * (fast ? 17 : 18);
        const int j = i & 31;
        const int q = (b[j & 15] >> (j >= 16 ? 4 : 0)) & 15;
        const int m = q & 7;
        const float mag = (float)(m <= 4 ? m : 2 * m - 4);
        const float s = ue4m3(b[16 + (fast ? 0 : (j >= 16))]);
        return (q & 8 ? -mag : mag) * s;
    }
    // mxfp4: an e8m0 byte, then 16 bytes holding element j (low nibble) and j+16 (high).
    const unsigned char* b = row + (i >> 5) * 17;
    const int j = i & 31;
    const int q = (b[1 + (j & 15)] >> (j >= 16 ? 4 : 0)) & 15;
    const int c = q & 7;
    const int mag = c < 5 ? c : (c == 5 ? 6 : (c == 6 ? 8 : 12));  // e2m1 values x 2
    const unsigned int e = b[0];
    // 2^(e - 128): the e2m1 value is mag / 2 times 2^(e - 127).
    const float scale = e < 2u ? __int_as_float((int)(0x00200000u << e)) : __int_as_float((int)((e - 1u) << 23));
    return (q & 8 ? -(float)mag : (float)mag) * scale;
}

// Values i..i+3 of a row of type TY (i a multiple of 4; TY -1: any dense type).
template <int TY>
GPU_DEV void dense_quad(const unsigned char* row, int ty, int i, float* v) {
    if (TY == DT_Q8_0) {
        const unsigned char* b = row + (i >> 5) * 34;
        const float d = half_to_float(gpu_load_u16(b));
        const unsigned int u0 = gpu_load_u16(b + 2 + (i & 31)), u1 = gpu_load_u16(b + 4 + (i & 31));
        v[0] = d * (float)(signed char)(u0 & 0xffu);
        v[1] = d * (float)(signed char)(u0 >> 8);
        v[2] = d * (float)(signed char)(u1 & 0xffu);
        v[3] = d * (float)(signed char)(u1 >> 8);
    } else if (TY == DT_ROCMFP4) {
        const unsigned char* b = row + (i >> 5) * 18;
        const int j = i & 31, hi = j >= 16;
        const unsigned int q = gpu_load_u16(b + (j & 15)) | (gpu_load_u16(b + (j & 15) + 2) << 16);
        const float sc = ue4m3(b[16 + hi]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int c = (int)((q >> (8 * e + (hi ? 4 : 0))) & 15u), m = c & 7;
            const float a = (float)(m + (m > 4 ? m - 4 : 0));
            v[e] = (c & 8 ? -a : a) * sc;
        }
    } else if (TY == DT_F32) {
        const gpu_f4 f = *(const gpu_f4*)(row + 4 * (long long)i);
        v[0] = f.x;
        v[1] = f.y;
        v[2] = f.z;
        v[3] = f.w;
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = dense_value(row, ty, i + e);
    }
}

// This lane's part of one row's dot products with nc columns: the warp walks the row
// 128 values per step (lane l: values 4l..4l+3, so activation loads are contiguous
// across the warp), four steps per iteration with all their loads issued first.
template <int TY, int NC>
GPU_DEV void dense_dots4(const unsigned char* row, int ty, int k, const float* x, int nc,
                         float* acc, int part, int parts, bool vec) {
    const int lane = threadIdx.x & 31;
    const int steps = (k + 127) / 128;
    for (int s0 = part; s0 < steps; s0 += 4 * parts) {
        float v[4][4];
        int idx[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int s = s0 + u * parts;
            idx[u] = s * 128 + 4 * lane;
            if (s < steps && idx[u] < k) {
                dense_quad<TY>(row, ty, idx[u], v[u]);
            } else {
                idx[u] = -1;
            }
        }
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            if (c >= nc) break;
            const float* xc = x + (long long)c * k;
            float sum = 0.0f;
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                if (idx[u] < 0) continue;
                if (vec) {
                    const gpu_f4 a = *(const gpu_f4*)(xc + idx[u]);
                    sum += v[u][0] * a.x + v[u][1] * a.y + v[u][2] * a.z + v[u][3] * a.w;
                } else {
#pragma unroll
                    for (int e = 0; e < 4; ++e) sum += v[u][e] * xc[idx[u] + e];
                }
            }
            acc[c] += sum;
        }
    }
}

// dense_dots4 for a run-time type: the types with their own decoder, else the generic one.
template <int NC>
GPU_DEV void dense_dots4_any(const unsigned char* row, int ty, int k, const float* x, int nc,
                             float* acc, int part, int parts, bool vec) {
    if (ty == DT_Q8_0) dense_dots4<DT_Q8_0, NC>(row, ty, k, x, nc, acc, part, parts, vec);
    else if (ty == DT_ROCMFP4) dense_dots4<DT_ROCMFP4, NC>(row, ty, k, x, nc, acc, part, parts, vec);
    else if (ty == DT_F32 && (((unsigned long long)row) & 15ull) == 0)
        dense_dots4<DT_F32, NC>(row, ty, k, x, nc, acc, part, parts, vec);
    else dense_dots4<-1, NC>(row, ty, k, x, nc, acc, part, parts, vec);
}

// Partial dot products of one row with `nc` (<= 8) columns x + c*k for this lane, as
// part `part` of `parts` warps sharing the row (k % 4 == 0: dense_dots4, else
// lane-strided single values).
GPU_DEV void dense_row_dots(const unsigned char* row, int ty, int k, const float* x, int nc,
                            float* acc, int part, int parts) {
    const int lane = threadIdx.x & 31;
    const bool vec = ((((unsigned long long)x) | ((unsigned long long)k * 4)) & 15ull) == 0;
    if ((k & 3) == 0) {
        // One column (decode) gets its own instance: the 8-column loop's registers would
        // cut the occupancy the single-column case needs.
        if (nc == 1) dense_dots4_any<1>(row, ty, k, x, nc, acc, part, parts, vec);
        else dense_dots4_any<8>(row, ty, k, x, nc, acc, part, parts, vec);
    } else {
        for (int i = part * 32 + lane; i < k; i += parts * 32) {
            const float v = dense_value(row, ty, i);
#pragma unroll
            for (int c = 0; c < 8; ++c) {
                if (c >= nc) break;
                acc[c] += v * x[(long long)c * k + i];
            }
        }
    }
}

// Sums the `parts` warps of each row of a 256-thread block and writes row r's `nc`
// results to out[c * m + r] (sh: 8 x 8 floats).
GPU_DEV void dense_rows_store(float* acc, int nc, int parts, int r, int m, float* out,
                              float* sh) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int c = 0; c < 8; ++c)
        if (c < nc) acc[c] = gpu_warp_sum(acc[c]);
    if (parts > 1) {
        if (lane == 0)
            for (int c = 0; c < 8; ++c) sh[warp * 8 + c] = acc[c];
        __syncthreads();
        if (lane == 0 && warp % parts == 0)
            for (int c = 0; c < 8; ++c) {
                float s = 0.0f;
                for (int j = 0; j < parts; ++j) s += sh[(warp + j) * 8 + c];
                acc[c] = s;
            }
    }
    if (lane == 0 && warp % parts == 0 && r < m)
        for (int c = 0; c < nc; ++c) out[(long long)c * m + r] = acc[c];
}

// out[c*m + r] = sum_i W[r][i] * x[c*k + i], 8 columns per grid row. A 256-thread block
// takes 8 / parts rows, `parts` (1, 2, 4, 8) warps per row: more warps per row for the
// few-row products (mHC mixes, router) keep enough loads in flight.
// grid = (ceil(m / (8 / parts)), ceil(n / 8)), block = 256.
extern "C" __global__ void __launch_bounds__(256)
    matvec_dense(const unsigned char* __restrict__ w, long long row_bytes, int ty, int k, int m,
                 const float* __restrict__ x, int n, float* __restrict__ out, int parts,
                 unsigned int* counters) {
    gpu_count_launch(counters, KID_MATVEC_DENSE);
    __shared__ float sh[64];
    const int warp = threadIdx.x >> 5;
    const int r = blockIdx.x * (8 / parts) + warp / parts, c0 = blockIdx.y * 8;
    const int nc = n - c0 < 8 ? n - c0 : 8;
    float acc[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[c] = 0.0f;
    if (r < m)
        dense_row_dots(w + (long long)r * row_bytes, ty, k, x + (long long)c0 * k, nc, acc,
                       warp % parts, parts);
    dense_rows_store(acc, nc, parts, r, m, out + (long long)c0 * m, sh);
}

// f16 to f32 for scales (never inf / NaN): the 15 magnitude bits become a float's
// exponent and mantissa, rescaled by 2^112 (subnormal halves come out right too).
GPU_DEV float half_scale(unsigned int h) {
    const float mag = __int_as_float((int)((h & 0x7fffu) << 13)) * 5.192296858534828e33f;
    return (h & 0x8000u) ? -mag : mag;
}

// One 8-value unit of a Q8_0 / ROCmFP4 row against activations a (values 0..3 of the
// unit) and c (4..7), added to acc: Q8_0: wa = f16 scale, wb / wc = the 8 codes;
// ROCmFP4: wa = 4 code bytes (low nibbles: values 0..3 of the block's first half, high:
// the same of its second half), wb = the two scale bytes; lut / sc: the shared tables of
// dense_rows. Every multiply-add is an explicit fmaf: the compiler may not contract
// differently where this is inlined, so every kernel using it gets the same bits.
template <int TY>
GPU_DEV float dense_unit_dot(unsigned int wa, unsigned int wb, unsigned int wc, gpu_f4 a,
                             gpu_f4 c, const float* lut, const float* sc, float acc) {
    if (TY == DT_Q8_0) {
        float s = gpu_mul((float)(signed char)(wb & 0xffu), a.x);
        s = fmaf((float)(signed char)((wb >> 8) & 0xffu), a.y, s);
        s = fmaf((float)(signed char)((wb >> 16) & 0xffu), a.z, s);
        s = fmaf((float)(signed char)(wb >> 24), a.w, s);
        s = fmaf((float)(signed char)(wc & 0xffu), c.x, s);
        s = fmaf((float)(signed char)((wc >> 8) & 0xffu), c.y, s);
        s = fmaf((float)(signed char)((wc >> 16) & 0xffu), c.z, s);
        s = fmaf((float)(signed char)(wc >> 24), c.w, s);
        return fmaf(half_scale(wa), s, acc);
    }
    float lo = gpu_mul(lut[wa & 15u], a.x);
    lo = fmaf(lut[(wa >> 8) & 15u], a.y, lo);
    lo = fmaf(lut[(wa >> 16) & 15u], a.z, lo);
    lo = fmaf(lut[(wa >> 24) & 15u], a.w, lo);
    float hi = gpu_mul(lut[(wa >> 4) & 15u], c.x);
    hi = fmaf(lut[(wa >> 12) & 15u], c.y, hi);
    hi = fmaf(lut[(wa >> 20) & 15u], c.z, hi);
    hi = fmaf(lut[(wa >> 28) & 15u], c.w, hi);
    return fmaf(sc[wb >> 8], hi, fmaf(sc[wb & 255u], lo, acc));
}

// The shared tables of the ROCmFP4 decode: lut = the 16 codes' signed magnitudes,
// sc = the 256 UE4M3 scale bytes (a 128-thread block fills them).
GPU_DEV void fp4_tables(float* lut, float* sc) {
    const int t = threadIdx.x;
    if (t < 16) {
        const int mm = t & 7;
        const float a = (float)(mm + (mm > 4 ? mm - 4 : 0));
        lut[t] = t & 8 ? -a : a;
    }
    sc[t] = ue4m3(t);
    sc[t + 128] = ue4m3(t + 128);
    __syncthreads();
}

// The start of a block's R rows r0.. (rows past m repeat the last one: computed, never
// stored) with their sums at zero.
template <int R>
GPU_DEV void rows_block_start(const unsigned char* w, long long row_bytes, int r0, int m,
                              const unsigned char* (&rows)[R], float (&acc)[R]) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        rows[r] = w + (long long)(r0 + r < m ? r0 + r : m - 1) * row_bytes;
        acc[r] = 0.0f;
    }
}

// The end of a 128-thread block's R row sums: each thread's partial acc[r] summed over
// the block (warp sums, then the 4 warps in order) into out[r0 + r] (red: 4 x R floats
// of shared memory).
template <int R>
GPU_DEV void rows_block_store(const float (&acc)[R], float (*red)[R], int r0, int m,
                              float* __restrict__ out) {
    const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float v = gpu_warp_sum(acc[r]);
        if (lane == 0) red[warp][r] = v;
    }
    __syncthreads();
    if (t < R && r0 + t < m) out[r0 + t] = red[0][t] + red[1][t] + red[2][t] + red[3][t];
}

// The shared memory of a dense_rows block: the ROCmFP4 tables and the row sums' warp
// partials.
template <int R>
struct rows_smem {
    float lut[16];
    float sc[256];
    float red[4][R];
};

// A dense_rows block's start: the ROCmFP4 tables (TY) and rows_block_start.
template <int TY, int R>
GPU_DEV void rows_block_begin(rows_smem<R>& sm, const unsigned char* w, long long row_bytes,
                              int r0, int m, const unsigned char* (&rows)[R], float (&acc)[R]) {
    if (TY == DT_ROCMFP4) fp4_tables(sm.lut, sm.sc);
    rows_block_start<R>(w, row_bytes, r0, m, rows, acc);
}

// Decode mat-vec (one f32 column) of Q8_0 or ROCmFP4 (100) weights: a 128-thread block
// on R rows, thread t taking the 8-value units t, t + 128, ... of each row (unit = a
// quarter of a Q8_0 block, or 4 code bytes = 8 values of a ROCmFP4 block), so a block
// reads R contiguous runs and each activation load serves R rows. ROCmFP4 codes and
// scale bytes decode through shared tables. U > 1 stages U units' loads before their
// arithmetic; measured on the V4-Flash shapes (scripts/device/dense_matvec_bench.sh),
// U = 1 (the compiler's own scheduling) was as fast or faster, so the kernels use it.
// Needs k % 32 == 0, rows 2-byte aligned, x 16-byte aligned. Block blk takes rows
// blk * R..; grid = ceil(m / R).
template <int TY, int R, int U>
GPU_DEV void dense_rows(const unsigned char* __restrict__ w, long long row_bytes, int k, int m,
                        const float* __restrict__ x, float* __restrict__ out, int blk) {
    __shared__ rows_smem<R> sm;
    const float* lut = sm.lut;
    const float* sc = sm.sc;
    const int t = threadIdx.x, r0 = blk * R;
    const unsigned char* rows[R];
    float acc[R];
    rows_block_begin<TY, R>(sm, w, row_bytes, r0, m, rows, acc);
    const int units = (k >> 5) * 4;
    // Q8_0: wa = scale, wb / wc = 8 codes; ROCmFP4: wa = 4 code bytes, wb = scale bytes.
    for (int u0 = t; u0 < units; u0 += 128 * U) {
        unsigned int wa[U][R], wb[U][R], wc[U][R];
        gpu_f4 xa[U], xc[U];
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const int u = u0 + 128 * j;
            if (u >= units) {  // zero scales and activations: adds nothing
                xa[j] = xc[j] = gpu_f4{0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int r = 0; r < R; ++r) wa[j][r] = wb[j][r] = wc[j][r] = 0u;
                continue;
            }
            const int b = u >> 2, q = u & 3;
            const float* xb = x + b * 32;
            if (TY == DT_Q8_0) {
                xa[j] = *(const gpu_f4*)(xb + 8 * q);
                xc[j] = *(const gpu_f4*)(xb + 8 * q + 4);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const unsigned char* blk = rows[r] + b * 34;
                    wa[j][r] = gpu_load_stream_u16(blk);
                    wb[j][r] = gpu_load_stream_u32_a2(blk + 2 + 8 * q);
                    wc[j][r] = gpu_load_stream_u32_a2(blk + 6 + 8 * q);
                }
            } else {
                // Code byte i holds element i (low nibble, first scale), i + 16 (high, second).
                xa[j] = *(const gpu_f4*)(xb + 4 * q);
                xc[j] = *(const gpu_f4*)(xb + 16 + 4 * q);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const unsigned char* blk = rows[r] + b * 18;
                    wa[j][r] = gpu_load_stream_u32_a2(blk + 4 * q);
                    wb[j][r] = gpu_load_stream_u16(blk + 16);
                    wc[j][r] = 0u;
                }
            }
        }
#pragma unroll
        for (int j = 0; j < U; ++j)
#pragma unroll
            for (int r = 0; r < R; ++r)
                acc[r] = dense_unit_dot<TY>(wa[j][r], wb[j][r], wc[j][r], xa[j], xc[j], lut, sc, acc[r]);
    }
    rows_block_store<R>(acc, sm.red, r0, m, out);
}

// dense_rows for a run-time type (DT_Q8_0 or DT_ROCMFP4) and rows per block (1, 2 or 4),
// one unit in flight; with X = q8_1_block (activations quantised), dense_rows_q8.
template <int TY, int R>
GPU_DEV void dense_rows_x(const unsigned char* __restrict__ w, long long row_bytes, int k, int m,
                          const float* __restrict__ x, float* __restrict__ out, int blk) {
    dense_rows<TY, R, 1>(w, row_bytes, k, m, x, out, blk);
}
template <int TY, int R>
GPU_DEV void dense_rows_q8(const unsigned char* __restrict__ w, long long row_bytes, int k, int m,
                           const q8_1_block* __restrict__ act, float* __restrict__ out, int blk);
template <int TY, int R>
GPU_DEV void dense_rows_x(const unsigned char* __restrict__ w, long long row_bytes, int k, int m,
                          const q8_1_block* __restrict__ act, float* __restrict__ out, int blk) {
    dense_rows_q8<TY, R>(w, row_bytes, k, m, act, out, blk);
}
template <typename X>
GPU_DEV void dense_rows_any(const unsigned char* __restrict__ w, long long row_bytes, int ty,
                            int k, int m, const X* __restrict__ x, float* __restrict__ out,
                            int rows, int blk) {
    if (ty == DT_Q8_0) {
        if (rows == 4) dense_rows_x<DT_Q8_0, 4>(w, row_bytes, k, m, x, out, blk);
        else if (rows == 2) dense_rows_x<DT_Q8_0, 2>(w, row_bytes, k, m, x, out, blk);
        else dense_rows_x<DT_Q8_0, 1>(w, row_bytes, k, m, x, out, blk);
    } else {
        if (rows == 4) dense_rows_x<DT_ROCMFP4, 4>(w, row_bytes, k, m, x, out, blk);
        else if (rows == 2) dense_rows_x<DT_ROCMFP4, 2>(w, row_bytes, k, m, x, out, blk);
        else dense_rows_x<DT_ROCMFP4, 1>(w, row_bytes, k, m, x, out, blk);
    }
}

extern "C" __global__ void __launch_bounds__(128)
    matvec_dense_rows(const unsigned char* __restrict__ w, long long row_bytes, int ty, int k,
                      int m, const float* __restrict__ x, float* __restrict__ out, int rows,
                      unsigned int* counters) {
    gpu_count_launch(counters, KID_MATVEC_DENSE_ROWS);
    dense_rows_any(w, row_bytes, ty, k, m, x, out, rows, blockIdx.x);
}

// Up to DENSE_MULTI_MAX products of one input (same type, k and row length) in one
// launch: product i's blocks are first[i]..first[i + 1] (first[0] = 0), rows[i] rows a
// block, each block as matvec_dense_rows runs it, so every output is its MATMUL's,
// bit for bit. A decode step's small products of one activation (wq_a + wkv, the
// compressors' kv + gate, the shared expert's gate + up) are bound by their loads'
// latency more than by their bytes; one launch pays it once. Must match DenseMulti in
// gpu-common's ops.rs.
#define DENSE_MULTI_MAX 8
struct dense_multi {
    const unsigned char* w[DENSE_MULTI_MAX];
    float* out[DENSE_MULTI_MAX];
    int m[DENSE_MULTI_MAX];
    int first[DENSE_MULTI_MAX];
    int rows[DENSE_MULTI_MAX];
    int n;
};
static_assert(sizeof(dense_multi) == 232, "DenseMulti in gpu-common's ops.rs");

// This block's product of a dense_multi launch: its weights, output, rows, rows a block
// and block index within the product. Static indices only: the parameter block stays
// where it is.
struct dense_part {
    const unsigned char* w;
    float* out;
    int m, rows, blk;
};
GPU_DEV dense_part dense_multi_part(const dense_multi& p) {
    const int b = blockIdx.x;
    dense_part d = {p.w[0], p.out[0], p.m[0], p.rows[0], b};
#pragma unroll
    for (int i = 1; i < DENSE_MULTI_MAX; ++i)
        if (i < p.n && b >= p.first[i]) d = {p.w[i], p.out[i], p.m[i], p.rows[i], b - p.first[i]};
    return d;
}

extern "C" __global__ void __launch_bounds__(128)
    matvec_dense_rows_multi(dense_multi p, long long row_bytes, int ty, int k,
                            const float* __restrict__ x, unsigned int* counters) {
    gpu_count_launch(counters, KID_MATVEC_DENSE_ROWS_MULTI);
    const dense_part d = dense_multi_part(p);
    dense_rows_any(d.w, row_bytes, ty, k, d.m, x, d.out, d.rows, d.blk);
}

// ---------------------------------------------------------------------------------
// A drafted pass's products: 2 - 15 f32 columns (8 a grid row) of Q8_0 / ROCmFP4
// weights, laid out as dense_rows (a 128-thread block on R rows, thread t taking the
// 8-value units t, t + 128, ... of each row), each unit's weights decoded once into
// floats and dotted with every column, so the weights are read once for all columns
// (matvec_dense, their fallback before, re-decoded a row per warp at 4x a one-column
// product's time). Column c of row r is the same bits as matvec_dense_rows on column c
// alone: the same operations per unit (dense_unit_dot's, on the decoded values) in the
// same order, the same block sum.

// One unit's 8 weights as floats: Q8_0 the codes (s0 = the block's scale); ROCmFP4 the
// signed magnitudes, values 0..3 of each half (v[0..3] first half, v[4..7] second; s0 /
// s1 the halves' scales).
template <int TY>
GPU_DEV void dense_unit_decode(unsigned int wa, unsigned int wb, unsigned int wc, const float* lut,
                               const float* sc, float (&v)[8], float& s0, float& s1) {
    if (TY == DT_Q8_0) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            v[e] = (float)(signed char)((wb >> (8 * e)) & 0xffu);
            v[4 + e] = (float)(signed char)((wc >> (8 * e)) & 0xffu);
        }
        s0 = half_scale(wa);
        s1 = 0.0f;
        return;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        v[e] = lut[(wa >> (8 * e)) & 15u];
        v[4 + e] = lut[(wa >> (8 * e + 4)) & 15u];
    }
    s0 = sc[wb & 255u];
    s1 = sc[wb >> 8];
}

// dense_unit_dot on a decoded unit: the same multiply-adds in the same order.
template <int TY>
GPU_DEV float dense_unit_dot_decoded(const float (&v)[8], float s0, float s1, gpu_f4 a, gpu_f4 c,
                                     float acc) {
    float lo = gpu_mul(v[0], a.x);
    lo = fmaf(v[1], a.y, lo);
    lo = fmaf(v[2], a.z, lo);
    lo = fmaf(v[3], a.w, lo);
    if (TY == DT_Q8_0) {
        lo = fmaf(v[4], c.x, lo);
        lo = fmaf(v[5], c.y, lo);
        lo = fmaf(v[6], c.z, lo);
        lo = fmaf(v[7], c.w, lo);
        return fmaf(s0, lo, acc);
    }
    float hi = gpu_mul(v[4], c.x);
    hi = fmaf(v[5], c.y, hi);
    hi = fmaf(v[6], c.z, hi);
    hi = fmaf(v[7], c.w, hi);
    return fmaf(s1, hi, fmaf(s0, lo, acc));
}

// Sums V values a lane over the warp in gpu_warp_sum's tree (xor 16, 8, .., 1; each
// addition one lane's own value plus its partner's, as there), with half of the values
// left a step while more than one is: 31 shuffles for 32 values, where a warp sum each
// takes 5 apiece (V a power of two up to 32). v[0] ends as the sum of the value whose
// index the lane returns: the halves split on the lane's high bits (xor 16 first), so the
// lanes whose low log2(32 / V) bits are 0 hold each index once.
template <int V>
GPU_DEV int warp_sum_spread(float (&v)[V]) {
    const int lane = threadIdx.x & 31;
    int first = 0;
#pragma unroll
    for (int m = 16, cnt = V; m > 0; m >>= 1) {
        if (cnt > 1) {
            const int half = cnt / 2;
            const bool up = (lane & m) != 0;
#pragma unroll
            for (int i = 0; i < V / 2; ++i) {
                if (i >= half) break;
                const float keep = up ? v[i + half] : v[i], send = up ? v[i] : v[i + half];
                v[i] = keep + gpu_shfl_xor(send, m);
            }
            if (up) first += half;
            cnt = half;
        } else {
            v[0] += gpu_shfl_xor(v[0], m);
        }
    }
    return first;
}

// R rows by NC column slots (columns past nc repeat the last one: computed, never
// stored) of one block: x = the block's first column, out = its first output column.
// A unit's activations for every column stay in registers while the R rows' weights
// are decoded against them, so each activation load serves R rows (the columns' loads,
// not the weights', set the pace of a few-row block: 8 columns of 4 rows read 7x a
// ROCmFP4 unit's bytes from L1 a row).
template <int TY, int R, int NC>
GPU_DEV void dense_cols(rows_smem<32>& sm, const unsigned char* __restrict__ w, long long row_bytes,
                        int k, int m, const float* __restrict__ x, int nc, float* __restrict__ out,
                        int blk) {
    const int t = threadIdx.x, r0 = blk * R;
    const unsigned char* rows[R];
    float unused[R];
    if (TY == DT_ROCMFP4) fp4_tables(sm.lut, sm.sc);
    rows_block_start<R>(w, row_bytes, r0, m, rows, unused);
    float acc[R * NC];
#pragma unroll
    for (int i = 0; i < R * NC; ++i) acc[i] = 0.0f;
    const int units = (k >> 5) * 4;
    for (int u = t; u < units; u += 128) {
        const int b = u >> 2, q = u & 3;
        // Q8_0: values 8q..8q+7 of the block; ROCmFP4: 4q..4q+3 and 16+4q..16+4q+3.
        const int oa = TY == DT_Q8_0 ? b * 32 + 8 * q : b * 32 + 4 * q;
        const int oc = TY == DT_Q8_0 ? oa + 4 : oa + 16;
        gpu_f4 xa[NC], xb[NC];
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const float* xc = x + (long long)(c < nc ? c : nc - 1) * k;
            xa[c] = *(const gpu_f4*)(xc + oa);
            xb[c] = *(const gpu_f4*)(xc + oc);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            unsigned int wa, wb, wc = 0u;
            if (TY == DT_Q8_0) {
                const unsigned char* bp = rows[r] + b * 34;
                wa = gpu_load_stream_u16(bp);
                wb = gpu_load_stream_u32_a2(bp + 2 + 8 * q);
                wc = gpu_load_stream_u32_a2(bp + 6 + 8 * q);
            } else {
                const unsigned char* bp = rows[r] + b * 18;
                wa = gpu_load_stream_u32_a2(bp + 4 * q);
                wb = gpu_load_stream_u16(bp + 16);
            }
            float v[8], s0, s1;
            dense_unit_decode<TY>(wa, wb, wc, sm.lut, sm.sc, v, s0, s1);
#pragma unroll
            for (int c = 0; c < NC; ++c)
                acc[r * NC + c] = dense_unit_dot_decoded<TY>(v, s0, s1, xa[c], xb[c], acc[r * NC + c]);
        }
    }
    // rows_block_store's sums (warp sums, then the 4 warps in order) for every slot.
    const int warp = t >> 5, lane = t & 31;
    const int i = warp_sum_spread<R * NC>(acc);
    if ((lane & (32 / (R * NC) - 1)) == 0) sm.red[warp][i] = acc[0];
    __syncthreads();
    if (t < R * NC) {
        const int r = t / NC, c = t % NC;
        if (c < nc && r0 + r < m)
            out[(long long)c * m + r0 + r] = sm.red[0][t] + sm.red[1][t] + sm.red[2][t] + sm.red[3][t];
    }
}

template <int TY, int R>
GPU_DEV void dense_cols_nc(rows_smem<32>& sm, const unsigned char* __restrict__ w,
                           long long row_bytes, int k, int m, const float* __restrict__ x, int nc,
                           float* __restrict__ out, int blk) {
    // At most 32 sums a thread (warp_sum_spread): 8 rows take up to 4 columns (the host
    // gives them no more).
    if (nc <= 2) dense_cols<TY, R, 2>(sm, w, row_bytes, k, m, x, nc, out, blk);
    else if (nc <= 4 || R > 4) dense_cols<TY, R, 4>(sm, w, row_bytes, k, m, x, nc, out, blk);
    else dense_cols<TY, R, (R > 4 ? 4 : 8)>(sm, w, row_bytes, k, m, x, nc, out, blk);
}

// Block blk of one product's grid row blockIdx.y (its columns 8 y ..): the type and rows
// a block picked at run time. One shared block for every form (declared by the kernel:
// each form declaring its own would add up).
GPU_DEV void dense_cols_block(rows_smem<32>& sm, const unsigned char* __restrict__ w,
                              long long row_bytes, int ty, int k, int m,
                              const float* __restrict__ x, int n, float* __restrict__ out,
                              int rows, int blk) {
    const int c0 = blockIdx.y * 8, nc = n - c0 < 8 ? n - c0 : 8;
    const float* xc = x + (long long)c0 * k;
    float* oc = out + (long long)c0 * m;
    if (ty == DT_Q8_0) {
        if (rows == 8) dense_cols_nc<DT_Q8_0, 8>(sm, w, row_bytes, k, m, xc, nc, oc, blk);
        else dense_cols_nc<DT_Q8_0, 4>(sm, w, row_bytes, k, m, xc, nc, oc, blk);
    } else {
        if (rows == 8) dense_cols_nc<DT_ROCMFP4, 8>(sm, w, row_bytes, k, m, xc, nc, oc, blk);
        else dense_cols_nc<DT_ROCMFP4, 4>(sm, w, row_bytes, k, m, xc, nc, oc, blk);
    }
}

// out[c * m + r] = row r of W (Q8_0 or ROCmFP4, ty) . column c of x, n columns (2 - 8 a
// grid row: blockIdx.y takes columns 8 y ..), rows = 4, or 8 for n <= 4, a 128-thread
// block. Needs k % 32 == 0, rows 2-byte aligned, x 16-byte aligned.
// grid = (ceil(m / rows), ceil(n / 8)).
extern "C" __global__ void __launch_bounds__(128)
    matvec_dense_cols(const unsigned char* __restrict__ w, long long row_bytes, int ty, int k,
                      int m, const float* __restrict__ x, int n, float* __restrict__ out,
                      int rows, unsigned int* counters) {
    gpu_count_launch(counters, KID_MATVEC_DENSE_COLS);
    __shared__ rows_smem<32> sm;
    dense_cols_block(sm, w, row_bytes, ty, k, m, x, n, out, rows, blockIdx.x);
}

// Up to DENSE_MULTI_MAX products of one n-column input (same type, k and row length) in
// one launch, as matvec_dense_rows_multi for one column: product i's blocks are
// first[i]..first[i + 1] of grid row 0, rows[i] rows a block, each block as
// matvec_dense_cols runs it (the same bits). A drafted pass's small products of one
// input (wq_a + wkv, the compressors' kv + gate, the shared expert's gate + up) pay the
// launch and the loads' latency once. grid = (the products' blocks, ceil(n / 8)).
extern "C" __global__ void __launch_bounds__(128)
    matvec_dense_cols_multi(dense_multi p, long long row_bytes, int ty, int k,
                            const float* __restrict__ x, int n, unsigned int* counters) {
    gpu_count_launch(counters, KID_MATVEC_DENSE_COLS_MULTI);
    __shared__ rows_smem<32> sm;
    const dense_part d = dense_multi_part(p);
    dense_cols_block(sm, d.w, row_bytes, ty, k, d.m, x, n, d.out, d.rows, d.blk);
}

// Byte permute, PTX prmt semantics: result byte i = byte (s_i & 7) of {a (0-3), b (4-7)},
// or that byte's sign bit replicated where s_i & 8 (s_i = nibble i of s). The rule in
// plain integer code (gpu_perm off CUDA; the reference of the HIP forms below).
GPU_DEV unsigned int gpu_perm_ref(unsigned int a, unsigned int b, unsigned int s) {
    const unsigned long long ab = ((unsigned long long)b << 32) | a;
    unsigned int r = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned int sel = (s >> (4 * i)) & 15u;
        unsigned int byte = (unsigned int)(ab >> (8 * (sel & 7u))) & 0xffu;
        if (sel & 8u) byte = (byte & 0x80u) ? 0xffu : 0u;
        r |= byte << (8 * i);
    }
    return r;
}
GPU_DEV unsigned int gpu_perm(unsigned int a, unsigned int b, unsigned int s) {
#if defined(GPU_CUDA) && defined(__CUDA_ARCH__)
    unsigned int r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
    return r;
#else
    return gpu_perm_ref(a, b, s);
#endif
}

// gpu_perm where the rule needs less, for AMD's v_perm_b32, whose selectors are bytes
// (0-3: S1's bytes, 4-7: S0's, 8-11: the sign of byte 1, 3, 5 or 7, 12: 0x00, 13 up:
// 0xff) where prmt's are nibbles: the PTX form is emulated bit by bit there (~25
// instructions a permute; the ROCmFP4 decode is made of them). On CUDA both are prmt.
// gpu_perm_nosign: every selector nibble below 8 (no sign replication).
// gpu_perm_pos: a and b hold no byte of 0x80 or more, so a nibble of 8 or more gives 0.
// (kernels/check.sh checks both against gpu_perm_ref through clang's constant folding.)
#if defined(GPU_HIP)
// The four nibbles of s's low 16 bits (HI: of its high 16 bits) as the bytes of a
// v_perm_b32 selector.
template <bool HI = false>
GPU_DEV unsigned int gpu_perm_bytes(unsigned int s) {
    // s's bytes 0, 1 (2, 3) at 0 and 2
    const unsigned int t = __builtin_amdgcn_perm(0u, s, HI ? 0x0c030c02u : 0x0c010c00u);
    return (t & 0x000f000fu) | ((t << 4) & 0x0f000f00u);
}
// A v_perm_b32 selector of nibbles for tables of no byte of 0x80 or more: 12-15 become
// 8-11 (the sign of an odd byte, 0 here), so every nibble of 8 or more gives 0 as prmt's.
GPU_DEV unsigned int gpu_perm_pos_sel(unsigned int u) { return u & ~((u >> 1) & 0x04040404u); }
#endif
GPU_DEV unsigned int gpu_perm_nosign(unsigned int a, unsigned int b, unsigned int s) {
#if defined(GPU_HIP)
    return __builtin_amdgcn_perm(b, a, gpu_perm_bytes(s));
#else
    return gpu_perm(a, b, s);
#endif
}
GPU_DEV unsigned int gpu_perm_pos(unsigned int a, unsigned int b, unsigned int s) {
#if defined(GPU_HIP)
    return __builtin_amdgcn_perm(b, a, gpu_perm_pos_sel(gpu_perm_bytes(s)));
#else
    return gpu_perm(a, b, s);
#endif
}

// ROCmFP4 code bytes to int8 values by byte permutes: word wq holds 8 codes (byte i: low
// nibble = value i of a block's first half, high = value i of its second); lo / hi get
// the first / second half's four values. A positive and a negative 8-entry table, the
// sign bit picking between them per byte.
GPU_DEV void fp4_values8(unsigned int wq, unsigned int& lo, unsigned int& hi) {
    const unsigned int idx = wq & 0x77777777u;
    // Result byte i from the negative table (4 + i) where code i's sign bit is set.
    const unsigned int sel = 0x32103210u | ((wq >> 1) & 0x44444444u);
    const unsigned int p0 = gpu_perm_nosign(0x03020100u, 0x0a080604u, idx & 0xffffu);
    const unsigned int n0 = gpu_perm_nosign(0xfdfeff00u, 0xf6f8fafcu, idx & 0xffffu);
    const unsigned int p1 = gpu_perm_nosign(0x03020100u, 0x0a080604u, idx >> 16);
    const unsigned int n1 = gpu_perm_nosign(0xfdfeff00u, 0xf6f8fafcu, idx >> 16);
    // a = values of codes (lo0, hi0, lo1, hi1), b = (lo2, hi2, lo3, hi3).
    const unsigned int a = gpu_perm_nosign(p0, n0, sel & 0xffffu);
    const unsigned int b = gpu_perm_nosign(p1, n1, sel >> 16);
    lo = gpu_perm_nosign(a, b, 0x6420u);
    hi = gpu_perm_nosign(a, b, 0x7531u);
}

// An integer |i| < 2^22 as a float without the int-to-float conversion unit.
GPU_DEV float small_int_float(int i) { return __int_as_float(0x4b400000 + i) - 12582912.0f; }

// dense_rows with q8_1 activations (quantize_q8_1, values in order): the same units per
// thread, the products as dp4a (ROCmFP4 codes through fp4_values8), each unit's integer
// sums scaled by the weights' and the activations' scales. Against the f32-activation
// dense_rows this trades the shared-table decode (the L1 / shared pipe that bounds it,
// ncu 15:40 / 18:00) for byte permutes, and reads a quarter of the activation bytes.
template <int TY, int R>
GPU_DEV void dense_rows_q8(const unsigned char* __restrict__ w, long long row_bytes, int k, int m,
                           const q8_1_block* __restrict__ act, float* __restrict__ out, int blk) {
    __shared__ rows_smem<R> sm;
    const float* sc = sm.sc;
    const int t = threadIdx.x, r0 = blk * R;
    const unsigned char* rows[R];
    float acc[R];
    rows_block_begin<TY, R>(sm, w, row_bytes, r0, m, rows, acc);
    const int units = (k >> 5) * 4;
    for (int u = t; u < units; u += 128) {
        const int b = u >> 2, q = u & 3;
        const q8_1_block* qb = act + b;
        // Q8_0: values 8q..8q+7; ROCmFP4: 4q..4q+3 of each half.
        const int xa = *(const int*)(qb->qs + (TY == DT_Q8_0 ? 8 * q : 4 * q));
        const int xc = *(const int*)(qb->qs + (TY == DT_Q8_0 ? 8 * q + 4 : 16 + 4 * q));
        const float d = qb->d;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float v;
            if (TY == DT_Q8_0) {
                const unsigned char* blk8 = rows[r] + b * 34;
                const int s = gpu_dp4a((int)gpu_load_stream_u32_a2(blk8 + 2 + 8 * q), xa,
                                       gpu_dp4a((int)gpu_load_stream_u32_a2(blk8 + 6 + 8 * q), xc, 0));
                v = gpu_mul(half_scale(gpu_load_stream_u16(blk8)), small_int_float(s));
            } else {
                const unsigned char* blk4 = rows[r] + b * 18;
                unsigned int lo, hi;
                fp4_values8(gpu_load_stream_u32_a2(blk4 + 4 * q), lo, hi);
                const unsigned int e = gpu_load_stream_u16(blk4 + 16);
                v = fmaf(sc[e >> 8], small_int_float(gpu_dp4a((int)hi, xc, 0)),
                         gpu_mul(sc[e & 255u], small_int_float(gpu_dp4a((int)lo, xa, 0))));
            }
            acc[r] = fmaf(d, v, acc[r]);  // explicit: the same bits in every kernel
        }
    }
    rows_block_store<R>(acc, sm.red, r0, m, out);
}

// matvec_dense_rows_multi with q8_1 activations (act: x quantised once for all the
// products): up to DENSE_MULTI_MAX products of one input, product i on blocks
// first[i]..first[i + 1], rows[i] (1, 2 or 4) rows a block. grid = the blocks in all.
extern "C" __global__ void __launch_bounds__(128)
    matvec_dense_q8_multi(dense_multi p, long long row_bytes, int ty, int k,
                          const q8_1_block* __restrict__ act, unsigned int* counters) {
    gpu_count_launch(counters, KID_MATVEC_DENSE_Q8_MULTI);
    const dense_part d = dense_multi_part(p);
    dense_rows_any(d.w, row_bytes, ty, k, d.m, act, d.out, d.rows, d.blk);
}

// Grouped matvec_dense_rows (see matvec_dense_id for pairs and ids): block row y is
// pair p = y, with expert ids[p]'s rows and activation column p (per_pair) or
// p / n_slots (x: f32 columns of k values, or q8_1 ones of k / 32 blocks); ids outside
// 0..E give zeros. grid = (ceil(m / rows), pairs).
template <typename X>
GPU_DEV void dense_rows_id(const unsigned char* __restrict__ w, long long expert_bytes,
                           long long row_bytes, int ty, int k, int m, int n_experts,
                           const X* __restrict__ x, long long x_col, int per_pair, int n_slots,
                           const int* __restrict__ ids, float* __restrict__ out, int rows) {
    const int p = blockIdx.y, e = ids[p];
    float* o = out + (long long)p * m;
    if (e < 0 || e >= n_experts) {  // the same for the whole block
        const int r = blockIdx.x * rows + threadIdx.x;
        if (threadIdx.x < rows && r < m) o[r] = 0.0f;
        return;
    }
    dense_rows_any(w + (long long)e * expert_bytes, row_bytes, ty, k, m,
                   x + (per_pair ? p : p / n_slots) * x_col, o, rows, blockIdx.x);
}

extern "C" __global__ void __launch_bounds__(128)
    matvec_dense_rows_id(const unsigned char* __restrict__ w, long long expert_bytes,
                         long long row_bytes, int ty, int k, int m, int n_experts,
                         const float* __restrict__ x, int per_pair, int n_slots,
                         const int* __restrict__ ids, float* __restrict__ out, int rows,
                         unsigned int* counters) {
    gpu_count_launch(counters, KID_MATVEC_DENSE_ROWS_ID);
    dense_rows_id(w, expert_bytes, row_bytes, ty, k, m, n_experts, x, k, per_pair, n_slots, ids,
                  out, rows);
}

// The same with q8_1 activations (MOE_GPU_Q8_DECODE).
extern "C" __global__ void __launch_bounds__(128)
    matvec_dense_q8_id(const unsigned char* __restrict__ w, long long expert_bytes,
                       long long row_bytes, int ty, int k, int m, int n_experts,
                       const q8_1_block* __restrict__ act, int per_pair, int n_slots,
                       const int* __restrict__ ids, float* __restrict__ out, int rows,
                       unsigned int* counters) {
    gpu_count_launch(counters, KID_MATVEC_DENSE_Q8_ID);
    dense_rows_id(w, expert_bytes, row_bytes, ty, k, m, n_experts, act, k / 32, per_pair,
                  n_slots, ids, out, rows);
}

// ---------------------------------------------------------------------------------
// ROCmFP4 decode mat-vec from 16-byte loads with 8-bit activations (matvec_fp4_runs_q8).
// With k % 256 == 0 a row is runs of 8 blocks, 144 bytes = 9 aligned 16-byte words
// (rows 16-byte aligned), so thread j of the L threads sharing a row set (L = runs per
// row, at most 32, a power of two) takes runs j, j + L, ... of R rows: each thread has
// 9 R words in flight, loaded before the dependent-launch wait (the weights never
// change) so they can overlap the previous kernel's tail. Each block quantises x itself (per 32
// values d = amax / 127, q = round(x / d), as quantize_q8_1) into shared memory, so no
// launch is added; codes become int8 values through byte permutes and the products are
// dp4a, about 2 instructions a weight by count (dense_rows' shared-table decode runs
// ~12 by Nsight Compute and is bound by the L1 / shared-memory pipe). Byte i of a code word holds value i of the block's
// first half (low nibble) and of its second (high); a permute picks four nibbles'
// magnitudes at once, and the two halves (two scales) are kept apart by activation
// words with every other byte zero. Sign: codes with bit 3 set select a zero byte (PTX
// reads a selector's bit 3 as "replicate the sign", and no magnitude has one), so the
// positive and negative codes' magnitudes come from two permutes (the second of the
// word with every bit 3 flipped) into two sums.
#define FP4_RUNS_MAX_K 8192
#define FP4_RUNS_MAX_THREADS 512  // threads a block (see matvec_fp4_runs_q8)
// The bulk path's chunks a block (4, or 8 with FP4_BULK_CHUNKS=8) and how many of them
// it asks for at once (FP4_BULK_INFLIGHT; all by default). Compile options for A/B runs:
// see fp4_runs_q8_bulk.
#define FP4_BULK_MAX_CHUNKS 8
#if !defined(FP4_BULK_CHUNKS)
#define FP4_BULK_CHUNKS 4
#endif
#if !defined(FP4_BULK_INFLIGHT)
#define FP4_BULK_INFLIGHT FP4_BULK_MAX_CHUNKS
#endif
#define FP4M_LD 33  // staged words (gpu_u4) a run in the matrix-unit kernel (see fp4_mma_smem)

// Threads sharing a row: the largest power of two <= min(k / 256, 32).
GPU_DEV int fp4_runs_lanes(int k) {
    int l = 1;
    while (2 * l <= k / 256 && l < 32) l *= 2;
    return l;
}

// The runs kernels' weight loads: evict-first in L2 (gpu_load_stream_u4), or plain with
// RUNS_NO_STREAM_HINT (A/B runs).
#if defined(RUNS_NO_STREAM_HINT)
#define RUNS_HINT false
#else
#define RUNS_HINT true
#endif

// One run (8 blocks) of each of R rows, as 32-bit words.
template <int R>
struct fp4_run {
    unsigned int v[R][36];
};

template <int R>
GPU_DEV void fp4_run_load(const unsigned char* const (&rows)[R], int g, fp4_run<R>& run) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const gpu_u4* p = (const gpu_u4*)(rows[r] + 144 * g);
#pragma unroll
        for (int q = 0; q < 9; ++q) {
            const gpu_u4 u = gpu_load_stream_u4<RUNS_HINT>(p + q);
            run.v[r][4 * q] = u.x;
            run.v[r][4 * q + 1] = u.y;
            run.v[r][4 * q + 2] = u.z;
            run.v[r][4 * q + 3] = u.w;
        }
    }
}

// The end of a runs kernel: each row's sum over the L threads sharing it, stored by the
// first of them.
template <int R>
GPU_DEV void fp4_runs_store(float (&acc)[R], int L, int j, int r0, int m, float* __restrict__ out) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        for (int o = L / 2; o > 0; o >>= 1) acc[r] += gpu_shfl_xor(acc[r], o);
        if (j == 0 && r0 + r < m) out[r0 + r] = acc[r];
    }
}

// Pair blockIdx.y of a grouped decode product: expert ids[p]'s weights, or null for an
// id outside 0..E after this block's `per_block` rows of the pair's output o are zeroed
// (the same for the whole block).
GPU_DEV const unsigned char* fp4_pair_weights(const unsigned char* w, long long expert_bytes,
                                              int n_experts, const int* __restrict__ ids,
                                              float* __restrict__ o, int m, int per_block) {
    const int e = ids[blockIdx.y];
    if (e >= 0 && e < n_experts) return w + (long long)e * expert_bytes;
    for (int i = threadIdx.x; i < per_block; i += blockDim.x) {
        const int r = blockIdx.x * per_block + i;
        if (r < m) o[r] = 0.0f;
    }
    return nullptr;
}

// A runs-kernel thread's rows: lane j of the L (fp4_runs_lanes) sharing R rows from r0,
// their pointers and zeroed sums, and run j of each loaded.
template <int R>
GPU_DEV void fp4_runs_begin(const unsigned char* __restrict__ w, long long row_bytes, int L, int m,
                            int& j, int& r0, const unsigned char* (&rows)[R], float (&acc)[R],
                            fp4_run<R>& run) {
    const int t = threadIdx.x;
    j = t & (L - 1);
    r0 = (blockIdx.x * ((int)blockDim.x / L) + t / L) * R;
    rows_block_start<R>(w, row_bytes, r0, m, rows, acc);
    fp4_run_load<R>(rows, j, run);
}

// The quantised activations of one block of 32 values, as the dot below reads them: for
// code word t (bytes = values 4t..4t+3 of each half), x = values (4t, 4t+1) of half 0 in
// bytes 0 and 2, y = (16 + 4t, 17 + 4t) in bytes 1 and 3, z / w the same for 4t + 2, 4t + 3.
// Stored as xq[32 * run + ((4 i + t) ^ (run & 7))] (block i of the run), so a quarter
// warp's lanes (consecutive runs) read different banks; the block's d as ds[i][run].
struct fp4_q8_smem {
    gpu_u4 xq[FP4_RUNS_MAX_K / 8];
    float ds[8][FP4_RUNS_MAX_K / 256];
    float sc[256];
    unsigned long long bar[FP4_BULK_MAX_CHUNKS];  // the bulk path's chunks (fp4_runs_q8_bulk)
#if defined(FP4_LOOP_LEAN)
    unsigned int perm_lo;  // FP4_LOOP_LEAN: the magnitudes' first table word (fp4_runs_q8_bulk)
#endif
};

// Where the runs kernel's activations come from, 4 values (chunk c) at a time: x itself
// (fp4_src_x), or a transform the kernel computes while it quantises, so the transform
// needs no launch of its own: the clamped SwiGLU of a gate and an up vector
// (fp4_src_swiglu, the same bits as ds4_swiglu), or x RMS-normed times w
// (fp4_src_norm, its sum of squares taken by the block in begin). All 16-byte aligned.
// column(off): the same source `off` values on (a grouped product's pair's column).
struct fp4_src_x {
    const float* __restrict__ x;
    GPU_MEMBER void begin(int) {}
    GPU_MEMBER gpu_f4 at(int c) const { return ((const gpu_f4*)x)[c]; }
    GPU_MEMBER fp4_src_x column(long long off) const { return {x + off}; }
};
struct fp4_src_swiglu {
    const float *g, *u;
    float lim;
    GPU_MEMBER void begin(int) {}
    GPU_MEMBER fp4_src_swiglu column(long long off) const { return {g + off, u + off, lim}; }
    GPU_MEMBER gpu_f4 at(int c) const {
        const gpu_f4 a = ((const gpu_f4*)g)[c], b = ((const gpu_f4*)u)[c];
        return gpu_f4{gpu_swiglu(a.x, b.x, lim), gpu_swiglu(a.y, b.y, lim), gpu_swiglu(a.z, b.z, lim),
                      gpu_swiglu(a.w, b.w, lim)};
    }
};
struct fp4_src_norm {
    const float *x, *w;
    float eps, r;
    // r = 1 / sqrt(mean(x^2) + eps) over x[0..k), the whole block taking part.
    GPU_MEMBER void begin(int k) {
        __shared__ float part[FP4_RUNS_MAX_THREADS / 32];
        float s = 0.0f;
        for (int c = threadIdx.x; c < k / 4; c += blockDim.x) {
            const gpu_f4 v = ((const gpu_f4*)x)[c];
            s += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
        s = gpu_warp_sum(s);
        if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
        __syncthreads();
        float t = 0.0f;
        for (int i = 0; i < (int)blockDim.x / 32; ++i) t += part[i];
        r = 1.0f / sqrtf(t / (float)k + eps);
    }
    GPU_MEMBER gpu_f4 at(int c) const {
        const gpu_f4 v = ((const gpu_f4*)x)[c], s = ((const gpu_f4*)w)[c];
        return gpu_f4{s.x * (v.x * r), s.y * (v.y * r), s.z * (v.z * r), s.w * (v.w * r)};
    }
};

// Quantise chunk c (values 4c..4c+3, v) into the shared layout: 8 adjacent lanes hold a
// block of 32, so a block's amax is theirs. Word t of block i of a run holds (see
// fp4_q8_smem) x / y / z / w; PAIRED (the matrix-unit kernel, fp4_mma_smem) keeps a
// half's two words side by side, (x, z, y, w), its runs FP4M_LD apart unswizzled.
template <bool PAIRED>
GPU_DEV void fp4_q8_chunk(const gpu_f4 v, int c, gpu_u4* xq, float (*ds)[FP4_RUNS_MAX_K / 256]) {
    float amax = gpu_absmax(gpu_absmax(fabsf(v.x), fabsf(v.y)), gpu_absmax(fabsf(v.z), fabsf(v.w)));
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) amax = gpu_absmax(amax, gpu_shfl_xor(amax, o));
    const float d = amax / 127.0f;
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    const unsigned int q0 = (unsigned int)(int)roundf(v.x * inv) & 0xffu;
    const unsigned int q1 = (unsigned int)(int)roundf(v.y * inv) & 0xffu;
    const unsigned int q2 = (unsigned int)(int)roundf(v.z * inv) & 0xffu;
    const unsigned int q3 = (unsigned int)(int)roundf(v.w * inv) & 0xffu;
    const int b = c >> 3, cb = c & 7, run = b >> 3, i = b & 7;
    const int t = cb & 3, half = cb >> 2;
    // Half 0 -> words x, z at bytes 0 / 2; half 1 -> words y, w at bytes 1 / 3.
    const unsigned int lo = (q0 | (q1 << 16)) << (8 * half), hi = (q2 | (q3 << 16)) << (8 * half);
    if (PAIRED) {
        unsigned int* slot = (unsigned int*)&xq[FP4M_LD * run + 4 * i + t];
        slot[2 * half] = lo;
        slot[2 * half + 1] = hi;
    } else {
        unsigned int* slot = (unsigned int*)&xq[32 * run + ((4 * i + t) ^ (run & 7))];
        slot[half] = lo;
        slot[2 + half] = hi;
    }
    if (cb == 0) ds[i][run] = d;
}

// Quantise the source's k values into the shared layout (fp4_q8_chunk): thread t takes
// chunks t, t + blockDim, ... (the same for a warp's lanes: k / 4 is whole 64s). BATCH
// (the bulk path, whose weights hold no registers): it asks for up to 4 chunks before
// quantising any, so their loads (the previous kernel's output, from L2 while the weights
// stream in) overlap instead of taking a round trip each: the same values, `wo_b` 11.64
// -> 10.65 us alone (scripts/device/runs_floor.sh SERIAL=1, 2026-12-04; FP4_STAGE_SERIAL,
// a compile option for A/B runs, turns it off).
template <bool PAIRED, bool BATCH = false, typename SRC>
GPU_DEV void fp4_q8_stage(const SRC& src, int k, gpu_u4* xq, float (*ds)[FP4_RUNS_MAX_K / 256]) {
#if defined(FP4_STAGE_SERIAL)
    constexpr bool batch = false;
#else
    constexpr bool batch = BATCH;
#endif
    if (!batch) {
        for (int c = threadIdx.x; c < k / 4; c += blockDim.x) fp4_q8_chunk<PAIRED>(src.at(c), c, xq, ds);
        return;
    }
    const int n = k / 4, step = blockDim.x;
    for (int c0 = threadIdx.x; c0 < n; c0 += 4 * step) {
        gpu_f4 v[4] = {};
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (c0 + i * step < n) v[i] = src.at(c0 + i * step);
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (c0 + i * step < n) fp4_q8_chunk<PAIRED>(v[i], c0 + i * step, xq, ds);
    }
}

// A block's part of a row's sum from its two half-blocks' integer sums s0 / s1, the
// activations' scale d and the weights' scale bytes e (half 0 low): both decode kernels
// take it from here, so their sums are the same bits.
GPU_DEV float fp4_block_scaled(float d, unsigned int e, int s0, int s1, const float* sc) {
    return d * (sc[e & 255u] * gpu_i2f_small(s0) + sc[e >> 8] * gpu_i2f_small(s1));
}

// Block i of a run (32 values, words from b0 = 9 i / 2; odd i starts mid-word) against
// its quantised activations a (the 4 words fp4_q8_stage laid out) and their scale d: its
// part of the row's sum.
// A ROCmFP4 code word's magnitudes (0, 1, 2, 3, 4, 6, 8, 10 for codes 0..7; lo = the
// table's first word, 0x03020100) as the runs kernels' dot takes them: pa / pb the
// positive codes' of the word's low / high 16 bits (0 for negative codes), na / nb the
// negative codes'. On HIP each half's nibbles are spread into selector bytes once for
// both of its permutes.
GPU_DEV void fp4_word_mags(unsigned int w, unsigned int lo, unsigned int& pa, unsigned int& na,
                           unsigned int& pb, unsigned int& nb) {
#if defined(GPU_HIP)
    const unsigned int ul = gpu_perm_bytes(w), uh = gpu_perm_bytes<true>(w);
    pa = __builtin_amdgcn_perm(0x0a080604u, lo, gpu_perm_pos_sel(ul));
    na = __builtin_amdgcn_perm(0x0a080604u, lo, gpu_perm_pos_sel(ul ^ 0x08080808u));
    pb = __builtin_amdgcn_perm(0x0a080604u, lo, gpu_perm_pos_sel(uh));
    nb = __builtin_amdgcn_perm(0x0a080604u, lo, gpu_perm_pos_sel(uh ^ 0x08080808u));
#else
    const unsigned int wn = w ^ 0x88888888u;
    pa = gpu_perm_pos(lo, 0x0a080604u, w);
    na = gpu_perm_pos(lo, 0x0a080604u, wn);
    pb = gpu_perm_pos(lo, 0x0a080604u, w >> 16);
    nb = gpu_perm_pos(lo, 0x0a080604u, wn >> 16);
#endif
}

GPU_DEV float fp4_block_dot_q8(const unsigned int* v, int b0, bool odd, const gpu_u4 (&a)[4],
                               float d, const fp4_q8_smem& sm, unsigned int lo = 0x03020100u) {
    int p0 = 0, n0 = 0, p1 = 0, n1 = 0;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        const unsigned int w = odd ? (v[b0 + t] >> 16) | (v[b0 + t + 1] << 16) : v[b0 + t];
        unsigned int pa, na, pb, nb;
        fp4_word_mags(w, lo, pa, na, pb, nb);
        p0 = gpu_dp4a((int)pa, (int)a[t].x, p0);
        n0 = gpu_dp4a((int)na, (int)a[t].x, n0);
        p1 = gpu_dp4a((int)pa, (int)a[t].y, p1);
        n1 = gpu_dp4a((int)na, (int)a[t].y, n1);
        p0 = gpu_dp4a((int)pb, (int)a[t].z, p0);
        n0 = gpu_dp4a((int)nb, (int)a[t].z, n0);
        p1 = gpu_dp4a((int)pb, (int)a[t].w, p1);
        n1 = gpu_dp4a((int)nb, (int)a[t].w, n1);
    }
    const unsigned int e = odd ? v[b0 + 4] >> 16 : v[b0 + 4] & 0xffffu;
    return fp4_block_scaled(d, e, p0 - n0, p1 - n1, sm.sc);
}

// Blocks i0 .. i0 + NB of run g (i0 a multiple of 4: v holds R rows' words from block
// i0 on, W a row) against the staged activations, added to acc.
template <int R, int NB, int W>
GPU_DEV void fp4_blocks_dot_q8(const unsigned int (&v)[R][W], int g, int i0, const fp4_q8_smem& sm,
                               float (&acc)[R], unsigned int lo = 0x03020100u) {
    const int sw = g & 7;
    const gpu_u4* xr = sm.xq + 32 * g;
#if defined(FP4_LOOP_LEAN)
    // (4 i + t) ^ sw = 4 (i ^ s2) + (t ^ s1) (sw = 4 s2 + s1): word t of an even block i
    // at ev[t] + 4 i, of an odd one at od[t] + 4 (i - 1), offsets the loads carry as
    // immediates, where the plain form works an address out for every load.
    const int s1 = sw & 3, s2 = sw >> 2;
    const gpu_u4 *ev[4], *od[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        ev[t] = xr + 4 * s2 + (t ^ s1);
        od[t] = xr + 4 - 4 * s2 + (t ^ s1);
    }
#endif
#pragma unroll
    for (int ii = 0; ii < NB; ++ii) {
        const int i = i0 + ii;  // (the same parity as ii)
        gpu_u4 a[4];
#if defined(FP4_LOOP_LEAN)
#pragma unroll
        for (int t = 0; t < 4; ++t) a[t] = i & 1 ? od[t][4 * (i - 1)] : ev[t][4 * i];
#else
#pragma unroll
        for (int t = 0; t < 4; ++t) a[t] = xr[(4 * i + t) ^ sw];
#endif
        const float d = sm.ds[i][g];
        const int b0 = (9 * ii) >> 1;
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] += fp4_block_dot_q8(v[r], b0, ii & 1, a, d, sm, lo);
    }
}

// A whole run (8 blocks) of R rows.
template <int R>
GPU_DEV void fp4_run_dot_q8(const fp4_run<R>& run, int g, const fp4_q8_smem& sm,
                            float (&acc)[R], unsigned int lo = 0x03020100u) {
    fp4_blocks_dot_q8<R, 8, 36>(run.v, g, 0, sm, acc, lo);
}

#if defined(GPU_BULK)
// The runs kernel with its block's rows brought into shared memory by bulk copies (the
// host gave the launch R NT / L rows of dynamic shared memory): thread 0 asks for them
// in FP4_BULK_CHUNKS chunks of whole rows before x is quantised (the plain kernel before its
// dependent-launch wait, the grouped ones after it: they read their expert's id first),
// each chunk with its own barrier, and the threads quantise x meanwhile. Thread (row slot q, lane j) takes rows q + P i (P =
// NT / L), so the warps of the first chunk's rows start on it while the later ones are
// still on their way. The same sums as the register path (each row's order depends only
// on k). Measured (2026-12-04, one launch of 18.9 MB graph-replayed, H200): wo_b 13.1 ->
// 11.3 us, wq_b's shape 11.8 -> 8.8; the weights' loads no longer hold the registers
// and the memory pipe the quantisation and dot need.
// With FP4_BULK_INFLIGHT below the chunks, only that many are asked for at first and
// chunk c + FP4_BULK_INFLIGHT once chunk c has landed (by the thread of its first row,
// which waits for it anyway): chunks asked for together land together, at the end of
// the transfer. Alone (scripts/device/runs_floor.sh, 2026-12-04 21:00) 8 chunks with 2 in
// flight took wq_b 10.2 -> 8.4 us, wo_b 10.6 -> 9.6, wo_a's groups 10.5 -> 9.2 (the
// shared expert's down 4.7 -> 5.6); in the decode graph within the spread (notes).
template <int R, typename SRC>
GPU_DEV void fp4_runs_q8_bulk(const unsigned char* __restrict__ w, long long row_bytes, int k,
                              int m, SRC src, float* __restrict__ out, bool wait,
                              unsigned int* counters, int kid, fp4_q8_smem& sm) {
    const int L = fp4_runs_lanes(k), t = threadIdx.x, P = (int)blockDim.x / L;
    const int j = t & (L - 1), q = t / L, rb = R * P, row0 = blockIdx.x * rb;
    const int chunks = rb % FP4_BULK_CHUNKS == 0 ? FP4_BULK_CHUNKS : (rb % 4 == 0 ? 4 : 1);
    const int per = rb / chunks;
    auto ask = [&](int c) {
        const int r = row0 + c * per, n = m - r < per ? m - r : per;
        gpu_bulk_load<RUNS_HINT>(gpu_dyn_smem + (long long)c * per * row_bytes, w + (long long)r * row_bytes,
                                 n > 0 ? (unsigned int)(n * row_bytes) : 0u, &sm.bar[c]);
    };
    if (t == 0) {
        for (int c = 0; c < chunks; ++c) gpu_mbar_init(&sm.bar[c]);
        gpu_mbar_init_fence();
        for (int c = 0; c < chunks && c < FP4_BULK_INFLIGHT; ++c) ask(c);
    }
    if (wait) gpu_count_launch(counters, kid);
    src.begin(k);  // after the wait: the source is the previous kernel's output
    fp4_q8_stage<false, true>(src, k, sm.xq, sm.ds);
    for (int i = t; i < 256; i += blockDim.x) sm.sc[i] = ue4m3(i);
#if defined(FP4_LOOP_LEAN)
    // The permutes' first table word from shared memory: a value ptxas keeps in one
    // register, where the literal it copies from a uniform register before every permute
    // (~100 of a run's ~835 instructions).
    if (t == 0) sm.perm_lo = 0x03020100u;
#endif
    __syncthreads();
#if defined(FP4_LOOP_LEAN)
    const unsigned int lo = sm.perm_lo;
#else
    const unsigned int lo = 0x03020100u;
#endif
#pragma unroll
    for (int i = 0; i < R; ++i) {
        // Rows past m (the last block's) sum whatever the chunk holds and are not stored.
        const int lr = q + P * i;
        gpu_mbar_wait(&sm.bar[lr / per]);
        if (FP4_BULK_INFLIGHT < FP4_BULK_MAX_CHUNKS && j == 0 && lr % per == 0 &&
            lr / per + FP4_BULK_INFLIGHT < chunks)
            ask(lr / per + FP4_BULK_INFLIGHT);
        const unsigned char* row = gpu_dyn_smem + (long long)lr * row_bytes;
        float acc[1] = {0.0f};
        for (int g = j; g < k >> 8; g += L) {
            fp4_run<1> run;
            const gpu_u4* p = (const gpu_u4*)(row + 144 * g);
#pragma unroll
            for (int u = 0; u < 9; ++u) {
                const gpu_u4 v = p[u];
                run.v[0][4 * u] = v.x;
                run.v[0][4 * u + 1] = v.y;
                run.v[0][4 * u + 2] = v.z;
                run.v[0][4 * u + 3] = v.w;
            }
            fp4_run_dot_q8<1>(run, g, sm, acc, lo);
        }
        fp4_runs_store<1>(acc, L, j, row0 + lr, m, out);
    }
}
#endif

template <int R, typename SRC>
GPU_DEV void fp4_runs_q8(const unsigned char* __restrict__ w, long long row_bytes, int k, int m,
                         SRC src, float* __restrict__ out, bool wait, unsigned int* counters,
                         int kid, fp4_q8_smem& sm) {
#if defined(GPU_BULK)
    if (gpu_dyn_smem_bytes() >= (unsigned int)(R * ((int)blockDim.x / fp4_runs_lanes(k)) * row_bytes)) {
        fp4_runs_q8_bulk<R>(w, row_bytes, k, m, src, out, wait, counters, kid, sm);
        return;
    }
#endif
    const int L = fp4_runs_lanes(k), runs = k >> 8, t = threadIdx.x;
    int j, r0;
    const unsigned char* rows[R];
    float acc[R];
    fp4_run<R> run;
    fp4_runs_begin<R>(w, row_bytes, L, m, j, r0, rows, acc, run);
    if (wait) gpu_count_launch(counters, kid);
    src.begin(k);  // after the wait: the source is the previous kernel's output
    fp4_q8_stage<false>(src, k, sm.xq, sm.ds);
    for (int i = t; i < 256; i += blockDim.x) sm.sc[i] = ue4m3(i);
    __syncthreads();
    for (int g = j; g < runs; g += L) {
        if (g != j) fp4_run_load<R>(rows, g, run);
        fp4_run_dot_q8<R>(run, g, sm, acc);
    }
    fp4_runs_store<R>(acc, L, j, r0, m, out);
}

// One f32 column of ROCmFP4 weights, rows = R in 1, 2 rows per thread. Needs k % 256
// == 0, k <= FP4_RUNS_MAX_K, w and row_bytes 16-byte aligned, x 16-byte aligned.
// Block = NT in 128, 256, 512 threads, grid = ceil(m / (R NT / L)): every block
// quantises all of x, so wider blocks spread that over more rows. A kernel's registers
// are those of its largest path: with a 4-row path too it took 247 a thread, two
// blocks an SM (ncu, 18:00 UTC), so two rows at most and 128 registers (512 threads an
// SM; CUDA's reading of the bound; HIP reads the second number as waves per execution
// unit, not tuned on AMD yet).
extern "C" __global__ void __launch_bounds__(FP4_RUNS_MAX_THREADS, 1)
    matvec_fp4_runs_q8(const unsigned char* __restrict__ w, long long row_bytes, int k, int m,
                       const float* __restrict__ x, float* __restrict__ out, int rows,
                       unsigned int* counters) {
    __shared__ fp4_q8_smem sm;
    const int kid = KID_MATVEC_FP4_RUNS_Q8;
    const fp4_src_x src = {x};
    if (rows == 2) fp4_runs_q8<2>(w, row_bytes, k, m, src, out, true, counters, kid, sm);
    else fp4_runs_q8<1>(w, row_bytes, k, m, src, out, true, counters, kid, sm);
}

// matvec_fp4_runs_q8 of x RMS-normed times g (NORM_MATMUL: fp4_src_norm, each block
// taking x's sum of squares itself after the dependent-launch wait, while its rows'
// bulk copies are on their way): a norm's launch fewer before the product. g as x.
extern "C" __global__ void __launch_bounds__(FP4_RUNS_MAX_THREADS, 1)
    matvec_fp4_runs_q8_norm(const unsigned char* __restrict__ w, long long row_bytes, int k,
                            int m, const float* __restrict__ x, const float* __restrict__ g,
                            float eps, float* __restrict__ out, int rows, unsigned int* counters) {
    __shared__ fp4_q8_smem sm;
    const int kid = KID_MATVEC_FP4_RUNS_Q8_NORM;
    const fp4_src_norm src = {x, g, eps, 0.0f};
    if (rows == 2) fp4_runs_q8<2>(w, row_bytes, k, m, src, out, true, counters, kid, sm);
    else fp4_runs_q8<1>(w, row_bytes, k, m, src, out, true, counters, kid, sm);
}

// A drafted pass's ROCmFP4 products of 2 - 15 columns on the runs kernel's register
// path, where each thread has one run of each of its rows (k / 256 a power of two, at
// most 32): the runs are loaded once, then each column in turn is quantised into shared
// memory and dotted against them, so the weights are read once for all columns. Column
// c is the same bits as matvec_fp4_runs_q8 on column c alone (the same quantisation,
// integer sums and order), so a drafted row's products are a decode step's.
// Arguments as matvec_fp4_runs_q8, with x and out n columns of k / m values; grid,
// block and rows as its plan for one column (its register path).
template <int R>
GPU_DEV void fp4_runs_q8_cols(const unsigned char* __restrict__ w, long long row_bytes, int k,
                              int m, const float* __restrict__ x, int n, float* __restrict__ out,
                              unsigned int* counters, fp4_q8_smem& sm) {
    const int L = fp4_runs_lanes(k), t = threadIdx.x;
    int j, r0;
    const unsigned char* rows[R];
    float acc[R];
    fp4_run<R> run;
    fp4_runs_begin<R>(w, row_bytes, L, m, j, r0, rows, acc, run);
    gpu_count_launch(counters, KID_MATVEC_FP4_RUNS_Q8_COLS);
    for (int i = t; i < 256; i += blockDim.x) sm.sc[i] = ue4m3(i);
    for (int c = 0; c < n; ++c) {
        if (c > 0) __syncthreads();  // every dot of the last column is done with xq
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int i = 0; i < 36; ++i) gpu_opaque(run.v[r][i]);
        const fp4_src_x src = {x + (long long)c * k};
        fp4_q8_stage<false>(src, k, sm.xq, sm.ds);
        __syncthreads();
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = 0.0f;
        fp4_run_dot_q8<R>(run, j, sm, acc);
        fp4_runs_store<R>(acc, L, j, r0, m, out + (long long)c * m);
    }
}

extern "C" __global__ void __launch_bounds__(FP4_RUNS_MAX_THREADS, 1)
    matvec_fp4_runs_q8_cols(const unsigned char* __restrict__ w, long long row_bytes, int k,
                            int m, const float* __restrict__ x, int n, float* __restrict__ out,
                            int rows, unsigned int* counters) {
    __shared__ fp4_q8_smem sm;
    if (rows == 2) fp4_runs_q8_cols<2>(w, row_bytes, k, m, x, n, out, counters, sm);
    else fp4_runs_q8_cols<1>(w, row_bytes, k, m, x, n, out, counters, sm);
}

// The grouped forms' block (pairs and ids as matvec_dense_rows_id): block row y is pair
// p, with expert ids[p]'s rows and the source's column p (per_pair) or p / n_slots; ids
// outside 0..E give zeros. grid = (ceil(m / (rows NT / L)), pairs). The block's
// dependent-launch wait (and launch count, kid) is here: with `fixed` (the ids never
// change: MATMUL_ID's i[0], the output projection's groups and the shared expert's one
// id) after its rows are asked for, as the plain kernel's, so the weights stream under
// the previous kernel; else first, as the ids may be its output. A pair's zeros are
// written after the wait either way (the previous kernel may still read `out`). MAXR:
// the most rows a thread the kernel compiles (1: the two-blocks-an-SM forms).
template <typename SRC, int MAXR = 2>
GPU_DEV void fp4_runs_q8_pair(const unsigned char* __restrict__ w, long long expert_bytes,
                              long long row_bytes, int k, int m, int n_experts, const SRC& src,
                              int per_pair, int n_slots, const int* __restrict__ ids,
                              float* __restrict__ out, int rows, bool fixed,
                              unsigned int* counters, int kid, fp4_q8_smem& sm) {
    const int p = blockIdx.y;
    const bool early = fixed && ids[p] >= 0 && ids[p] < n_experts;
    if (!early) gpu_count_launch(counters, kid);
    float* o = out + (long long)p * m;
    const unsigned char* we = fp4_pair_weights(w, expert_bytes, n_experts, ids, o, m,
                                               rows * (int)blockDim.x / fp4_runs_lanes(k));
    if (!we) return;
    const SRC col = src.column((long long)(per_pair ? p : p / n_slots) * k);
    if (MAXR == 2 && rows == 2) fp4_runs_q8<MAXR>(we, row_bytes, k, m, col, o, early, counters, kid, sm);
    else fp4_runs_q8<1>(we, row_bytes, k, m, col, o, early, counters, kid, sm);
}

// The grouped form of matvec_fp4_runs_q8 (see fp4_runs_q8_pair).
extern "C" __global__ void __launch_bounds__(FP4_RUNS_MAX_THREADS, 1)
    matvec_fp4_runs_q8_id(const unsigned char* __restrict__ w, long long expert_bytes,
                          long long row_bytes, int k, int m, int n_experts,
                          const float* __restrict__ x, int per_pair, int n_slots,
                          const int* __restrict__ ids, float* __restrict__ out, int rows,
                          int fixed, unsigned int* counters) {
    __shared__ fp4_q8_smem sm;
    fp4_runs_q8_pair(w, expert_bytes, row_bytes, k, m, n_experts, fp4_src_x{x}, per_pair, n_slots,
                     ids, out, rows, fixed != 0, counters, KID_MATVEC_FP4_RUNS_Q8_ID, sm);
}

// FP4_B2 (A/B runs, MOE_GPU_FP4_B2=1): the plain and grouped kernels at one row a thread
// with registers for two 512-thread blocks a multiprocessor (the bulk path takes 58
// with one row), so that twice the warps hide the dot's shared-memory and dp4a
// latencies after the weights have landed; each block takes half the rows (and
// quantises all of x, as every block does). The same sums (a row's order depends only
// on k). Arguments as the one-block forms, rows = 1.
extern "C" __global__ void __launch_bounds__(FP4_RUNS_MAX_THREADS, 2)
    matvec_fp4_runs_q8_b2(const unsigned char* __restrict__ w, long long row_bytes, int k, int m,
                          const float* __restrict__ x, float* __restrict__ out, int rows,
                          unsigned int* counters) {
    __shared__ fp4_q8_smem sm;
    (void)rows;
    fp4_runs_q8<1>(w, row_bytes, k, m, fp4_src_x{x}, out, true, counters, KID_MATVEC_FP4_RUNS_Q8_B2, sm);
}
extern "C" __global__ void __launch_bounds__(FP4_RUNS_MAX_THREADS, 2)
    matvec_fp4_runs_q8_id_b2(const unsigned char* __restrict__ w, long long expert_bytes,
                             long long row_bytes, int k, int m, int n_experts,
                             const float* __restrict__ x, int per_pair, int n_slots,
                             const int* __restrict__ ids, float* __restrict__ out, int rows,
                             int fixed, unsigned int* counters) {
    __shared__ fp4_q8_smem sm;
    fp4_runs_q8_pair<fp4_src_x, 1>(w, expert_bytes, row_bytes, k, m, n_experts, fp4_src_x{x}, per_pair,
                                   n_slots, ids, out, 1, fixed != 0, counters,
                                   KID_MATVEC_FP4_RUNS_Q8_ID_B2, sm);
    (void)rows;
}

// The grouped form on the clamped SwiGLU of gate g and up u (fp4_src_swiglu, the same
// bits as ds4_swiglu) instead of x: SWIGLU_MATMUL_ID of ROCmFP4 weights for one token
// (the shared expert's down as one "expert") without a SwiGLU launch. Arguments and
// grid as matvec_fp4_runs_q8_id, g and u in place of x (16-byte aligned).
extern "C" __global__ void __launch_bounds__(FP4_RUNS_MAX_THREADS, 1)
    matvec_fp4_runs_q8_id_swiglu(const unsigned char* __restrict__ w, long long expert_bytes,
                                 long long row_bytes, int k, int m, int n_experts,
                                 const float* __restrict__ g, const float* __restrict__ u,
                                 float lim, int per_pair, int n_slots,
                                 const int* __restrict__ ids, float* __restrict__ out, int rows,
                                 int fixed, unsigned int* counters) {
    __shared__ fp4_q8_smem sm;
    fp4_runs_q8_pair(w, expert_bytes, row_bytes, k, m, n_experts, fp4_src_swiglu{g, u, lim},
                     per_pair, n_slots, ids, out, rows, fixed != 0, counters,
                     KID_MATVEC_FP4_RUNS_Q8_ID_SWIGLU, sm);
}

// ---------------------------------------------------------------------------------
// ROCmFP4 decode mat-vec with its integer products on the matrix units (matvec_fp4_mma;
// CUDA sm_80+ mma.sync, elsewhere the same layout on dp4a). The runs kernel above is
// bound by its decode, not by the weights' bytes (wq_b: 12.5 us cold, 10.6 us from L2,
// 5.8 us for a plain read): every 8 weights take four byte permutes and eight dp4a, and
// each dp4a does half its products, because the two half-blocks' scales differ and an
// activation word carries one half's values in every other byte. Here a warp takes 16
// rows: lane (g = lane / 4, q = lane % 4) holds one run of rows g and g + 8, and one
// m16n8k32 product takes a code word of each (the permutes' 8 magnitudes a row, as the
// runs kernel makes them) against a B whose column 2q + h holds lane q's run's half-h
// activations and zeros elsewhere: C's column (q, h) is then lane q's own half-block sum
// for each row, nothing added across runs. Two products a word (the positive and the
// negative codes' magnitudes) replace sixteen dp4a. The integer sums are those of
// fp4_block_dot_q8, the block scales fp4_block_scaled's, the blocks go in the same
// order and the runs are added as fp4_runs_store's butterfly adds them: the same bits as
// the runs kernel, for whose one-run-a-thread plans it can stand in (opt-in,
// MOE_GPU_FP4_MMA: measured slower on the H200 2026-12-03, wq_b 10.57 us vs 11.00 but
// wo_b 15.7 vs 12.9 and decode -2%: with a third fewer instructions the decode products
// are no faster, so their issue count is not what bounds them; again 2026-12-07, H100,
// after the runs kernel's bulk path: decode 0.92 of it with 256 threads, 0.90 - 0.94
// with 512).
// A block is S = runs / 4 warps along k (warp ks's lanes take runs 4 ks + q) by G
// (`groups`) groups of 16 rows: 32 S G threads. Needs k % 1024 == 0, k <=
// FP4_RUNS_MAX_K, S G <= 16, w / row_bytes / x 16-byte aligned.
#define FP4M_MAX_THREADS 512
// A zero run for lanes with no B column, 16 words past the last run (other banks).
#define FP4M_ZERO (FP4_RUNS_MAX_K / 256 * FP4M_LD + 4)
struct alignas(8) fp4m_u2 {  // B's two words, one 8-byte shared load
    unsigned int x, y;
};
struct fp4_mma_smem {
    gpu_u4 xq[FP4M_ZERO + 32];  // run r's word t of block i at FP4M_LD r + 4 i + t
    float ds[8][FP4_RUNS_MAX_K / 256];
    float sc[256];
    float part[FP4M_MAX_THREADS / 32 * 64];  // row sums by run (S > 1): 16 G rows x 4 S runs
};

// C (+)= A B for one code word of the lane's rows a / b (pa: positive codes' magnitudes,
// na: negative codes'; byte i of _lo / _hi holds values of k slots 4q + i / 16 + 4q + i),
// with B's words b0 / b1 (the mma.sync layout); off CUDA the same sums from the lane's
// own staged words own (x, z, y, w).
GPU_DEV void fp4_mma_word(unsigned int wa, unsigned int wb, unsigned int b0, unsigned int b1,
                          const gpu_u4& own, int (&cp)[4], int (&cn)[4]) {
    unsigned int m[8];  // the magnitudes of codes 0..7, as fp4_word_mags gives them
    fp4_word_mags(wa, 0x03020100u, m[0], m[1], m[2], m[3]);
    fp4_word_mags(wb, 0x03020100u, m[4], m[5], m[6], m[7]);
    const int pal = (int)m[0], nal = (int)m[1], pah = (int)m[2], nah = (int)m[3];
    const int pbl = (int)m[4], nbl = (int)m[5], pbh = (int)m[6], nbh = (int)m[7];
#if defined(RF_MMA_PTX)
    (void)own;
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+r"(cp[0]), "+r"(cp[1]), "+r"(cp[2]), "+r"(cp[3])
                 : "r"(pal), "r"(pbl), "r"(pah), "r"(pbh), "r"(b0), "r"(b1));
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+r"(cn[0]), "+r"(cn[1]), "+r"(cn[2]), "+r"(cn[3])
                 : "r"(nal), "r"(nbl), "r"(nah), "r"(nbh), "r"(b0), "r"(b1));
#else
    (void)b0;
    (void)b1;
    const int x = (int)own.x, z = (int)own.y, y = (int)own.z, w = (int)own.w;
    cp[0] = gpu_dp4a(pah, z, gpu_dp4a(pal, x, cp[0]));
    cp[1] = gpu_dp4a(pah, w, gpu_dp4a(pal, y, cp[1]));
    cp[2] = gpu_dp4a(pbh, z, gpu_dp4a(pbl, x, cp[2]));
    cp[3] = gpu_dp4a(pbh, w, gpu_dp4a(pbl, y, cp[3]));
    cn[0] = gpu_dp4a(nah, z, gpu_dp4a(nal, x, cn[0]));
    cn[1] = gpu_dp4a(nah, w, gpu_dp4a(nal, y, cn[1]));
    cn[2] = gpu_dp4a(nbh, z, gpu_dp4a(nbl, x, cn[2]));
    cn[3] = gpu_dp4a(nbh, w, gpu_dp4a(nbl, y, cn[3]));
#endif
}

template <typename SRC>
GPU_DEV void fp4_mma_rows(const unsigned char* __restrict__ w, long long row_bytes, int k, int m,
                          SRC src, float* __restrict__ out, bool wait, unsigned int* counters,
                          int kid, int groups, fp4_mma_smem& sm) {
    const int runs = k >> 8, S = runs >> 2, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3, j = 4 * (warp % S) + q;  // this lane's run
    const int ra = (warp / S) * 16 + g, rb0 = blockIdx.x * groups * 16;  // row a in the block
    const unsigned char* rows[2];
    float acc[2];
    rows[0] = w + (long long)(rb0 + ra < m ? rb0 + ra : m - 1) * row_bytes;
    rows[1] = w + (long long)(rb0 + ra + 8 < m ? rb0 + ra + 8 : m - 1) * row_bytes;
    acc[0] = acc[1] = 0.0f;
    fp4_run<2> run;
    fp4_run_load<2>(rows, j, run);  // before the wait: the weights never change
    if (wait) gpu_count_launch(counters, kid);
    src.begin(k);
    fp4_q8_stage<true>(src, k, sm.xq, sm.ds);
    for (int i = threadIdx.x; i < 256; i += blockDim.x) sm.sc[i] = ue4m3(i);
    for (int i = threadIdx.x; i < 32; i += blockDim.x) sm.xq[FP4M_ZERO + i] = gpu_u4{0u, 0u, 0u, 0u};
    __syncthreads();
    const gpu_u4* own = sm.xq + FP4M_LD * j;
    // B: lane (g, q) holds column g (lane g / 2's run, half g % 2) at the k slots of q:
    // that run's half when q is g / 2, else zeros.
    const unsigned int* bsrc = (const unsigned int*)(q == (g >> 1) ? own : sm.xq + FP4M_ZERO) + 2 * (g & 1);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int b0 = (9 * i) >> 1;  // block i's first word (odd i: from its upper half)
        const bool odd = i & 1;
        int cp[4] = {0, 0, 0, 0}, cn[4] = {0, 0, 0, 0};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const unsigned int* va = run.v[0];
            const unsigned int* vb = run.v[1];
            const unsigned int wa = odd ? (va[b0 + t] >> 16) | (va[b0 + t + 1] << 16) : va[b0 + t];
            const unsigned int wb = odd ? (vb[b0 + t] >> 16) | (vb[b0 + t + 1] << 16) : vb[b0 + t];
#if defined(RF_MMA_PTX)
            const fp4m_u2 bw = *(const fp4m_u2*)(bsrc + 4 * (4 * i + t));
            fp4_mma_word(wa, wb, bw.x, bw.y, own[0], cp, cn);
#else
            (void)bsrc;
            fp4_mma_word(wa, wb, 0u, 0u, own[4 * i + t], cp, cn);
#endif
        }
        const float d = sm.ds[i][j];
        const unsigned int ea = odd ? run.v[0][b0 + 4] >> 16 : run.v[0][b0 + 4] & 0xffffu;
        const unsigned int eb = odd ? run.v[1][b0 + 4] >> 16 : run.v[1][b0 + 4] & 0xffffu;
        acc[0] += fp4_block_scaled(d, ea, cp[0] - cn[0], cp[1] - cn[1], sm.sc);
        acc[1] += fp4_block_scaled(d, eb, cp[2] - cn[2], cp[3] - cn[3], sm.sc);
    }
    // A row's runs added as fp4_runs_store's butterfly over `runs` lanes adds them (at
    // step o, value jj < o + value jj + o): within the warp when S = 1, else in shared
    // memory, one thread a row.
    if (S == 1) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            for (int o = 2; o > 0; o >>= 1) acc[r] += gpu_shfl_xor(acc[r], o);
            const int row = rb0 + ra + 8 * r;
            if (q == 0 && row < m) out[row] = acc[r];
        }
        return;
    }
    sm.part[ra * runs + j] = acc[0];
    sm.part[(ra + 8) * runs + j] = acc[1];
    __syncthreads();
    for (int r = threadIdx.x; r < 16 * groups; r += blockDim.x) {
        float* v = sm.part + r * runs;
        for (int o = runs / 2; o > 0; o >>= 1)
            for (int jj = 0; jj < o; ++jj) v[jj] = v[jj] + v[jj + o];
        if (rb0 + r < m) out[rb0 + r] = v[0];
    }
}

// One f32 column of ROCmFP4 weights. grid = ceil(m / (16 groups)), block = 32 S groups
// (S = k / 1024).
extern "C" __global__ void __launch_bounds__(FP4M_MAX_THREADS, 1)
    matvec_fp4_mma(const unsigned char* __restrict__ w, long long row_bytes, int k, int m,
                   const float* __restrict__ x, float* __restrict__ out, int groups,
                   unsigned int* counters) {
    __shared__ fp4_mma_smem sm;
    fp4_mma_rows(w, row_bytes, k, m, fp4_src_x{x}, out, true, counters, KID_MATVEC_FP4_MMA, groups, sm);
}

// The grouped form (pairs and ids as matvec_fp4_runs_q8_id): block row y is pair p, with
// expert ids[p]'s rows and activation column p (per_pair) or p / n_slots; ids outside
// 0..E give zeros. grid = (ceil(m / (16 groups)), pairs), block as matvec_fp4_mma.
extern "C" __global__ void __launch_bounds__(FP4M_MAX_THREADS, 1)
    matvec_fp4_mma_id(const unsigned char* __restrict__ w, long long expert_bytes,
                      long long row_bytes, int k, int m, int n_experts,
                      const float* __restrict__ x, int per_pair, int n_slots,
                      const int* __restrict__ ids, float* __restrict__ out, int groups,
                      unsigned int* counters) {
    __shared__ fp4_mma_smem sm;
    gpu_count_launch(counters, KID_MATVEC_FP4_MMA_ID);
    const int p = blockIdx.y;
    float* o = out + (long long)p * m;
    const unsigned char* we = fp4_pair_weights(w, expert_bytes, n_experts, ids, o, m, 16 * groups);
    if (!we) return;
    const float* xe = x + (long long)(per_pair ? p : p / n_slots) * k;
    fp4_mma_rows(we, row_bytes, k, m, fp4_src_x{xe}, o, false, counters, 0, groups, sm);
}

// Decode mat-vec of f32 weights with few rows (the mHC mixes: 24 rows of 16384; the
// router: 256 of 4096): a 1024-thread block per row, so each SM a row lands on has the
// whole row's loads in flight at once. w is read as weights (gpu_load_stream_u4): no
// earlier kernel of the stream may write it. Needs k % 4 == 0, w and x 16-byte aligned.
// grid = m, block = 1024.
extern "C" __global__ void __launch_bounds__(1024)
    matvec_f32_wide(const float* __restrict__ w, int k, int m, const float* __restrict__ x,
                    float* __restrict__ out, unsigned int* counters) {
    gpu_count_launch(counters, KID_MATVEC_F32_WIDE);
    __shared__ float sh[32];
    float v[1];
    f32_wide_dots<1>(w + (long long)blockIdx.x * k, k, x, sh, v);
    if (threadIdx.x == 0 && (int)blockIdx.x < m) out[blockIdx.x] = v[0];
}

// f32 products of many columns (a prefill chunk's mHC mixes and router):
// out[c m + r] = sum_i W[r][i] x_c[i] on FP32 multiply-adds from shared-memory tiles.
// matvec_dense re-reads a row's weights for every 8 columns and ran the 512-column
// mixes at ~3.5 TFLOP/s. Here a block takes 32 rows x 64 columns over one slice of k
// (`span` values, a multiple of F32T_BK; grid z = slice), staging 32 values of k at a
// time transposed, and each thread keeps 2 rows x 4 columns. Each sum runs over its
// slice in order of k; with more than one slice, slice z writes out + z n m and
// matmul_f32_reduce adds the slices in order, so the bits never depend on scheduling.
// Needs k % 4 == 0, w and x 16-byte aligned. grid = (ceil(m / 32), ceil(n / 64), slices),
// block = 256.
#define F32T_BM 32
#define F32T_BN 64
#define F32T_BK 32
// Values 4q..4q+3 of a step's row or column j into the transposed stage s.
template <int LD>
GPU_DEV void f32t_put(float (*s)[LD], int q, int j, const gpu_f4 v) {
    s[4 * q][j] = v.x;
    s[4 * q + 1][j] = v.y;
    s[4 * q + 2][j] = v.z;
    s[4 * q + 3][j] = v.w;
}
extern "C" __global__ void __launch_bounds__(256)
    matmul_f32_tiles(const float* __restrict__ w, int k, int m, const float* __restrict__ x, int n,
                     int span, float* __restrict__ out, unsigned int* counters) {
    gpu_count_launch(counters, KID_MATMUL_F32_TILES);
    // ws[i][r]: value i of this step for row r; xs[i][c] the same for column c (rows
    // padded so the transposed stores spread over the banks; xs's stay 16-byte aligned).
    __shared__ float ws[F32T_BK][F32T_BM + 1];
    __shared__ __attribute__((aligned(16))) float xs[F32T_BK][F32T_BN + 4];
    const int t = threadIdx.x, tx = t & 15, ty = t >> 4;
    const int r0 = blockIdx.x * F32T_BM, c0 = blockIdx.y * F32T_BN;
    const int k0 = blockIdx.z * span, k1 = k0 + span < k ? k0 + span : k;
    float acc[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    for (int kb = k0; kb < k1; kb += F32T_BK) {
        // 32 rows x 8 float4 of w (one a thread), 64 columns x 8 float4 of x (two);
        // past the ends zeros (k1 and every i are multiples of 4).
        const gpu_f4 zero = {0.0f, 0.0f, 0.0f, 0.0f};
        {
            const int r = t >> 3, q = t & 7, i = kb + 4 * q;
            f32t_put(ws, q, r, r0 + r < m && i < k1 ? *(const gpu_f4*)(w + (long long)(r0 + r) * k + i) : zero);
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int e = t + 256 * u, c = e >> 3, q = e & 7, i = kb + 4 * q;
            f32t_put(xs, q, c, c0 + c < n && i < k1 ? *(const gpu_f4*)(x + (long long)(c0 + c) * k + i) : zero);
        }
        __syncthreads();
#pragma unroll 8
        for (int i = 0; i < F32T_BK; ++i) {
            const float a0 = ws[i][2 * ty], a1 = ws[i][2 * ty + 1];
            const gpu_f4 b = *(const gpu_f4*)&xs[i][4 * tx];
            acc[0][0] = fmaf(a0, b.x, acc[0][0]);
            acc[0][1] = fmaf(a0, b.y, acc[0][1]);
            acc[0][2] = fmaf(a0, b.z, acc[0][2]);
            acc[0][3] = fmaf(a0, b.w, acc[0][3]);
            acc[1][0] = fmaf(a1, b.x, acc[1][0]);
            acc[1][1] = fmaf(a1, b.y, acc[1][1]);
            acc[1][2] = fmaf(a1, b.z, acc[1][2]);
            acc[1][3] = fmaf(a1, b.w, acc[1][3]);
        }
        __syncthreads();
    }
    float* o = out + (long long)blockIdx.z * n * m;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int r = r0 + 2 * ty + i, c = c0 + 4 * tx + j;
            if (r < m && c < n) o[(long long)c * m + r] = acc[i][j];
        }
}

// out[i] = part[i] + part[len + i] + ... over `slices` parts, in that order (the end of
// matmul_f32_tiles with slices of k). grid = ceil(len / 256), block = 256.
extern "C" __global__ void __launch_bounds__(256)
    matmul_f32_reduce(const float* __restrict__ part, int slices, long long len,
                      float* __restrict__ out, unsigned int* counters) {
    gpu_count_launch(counters, KID_MATMUL_F32_REDUCE);
    const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
    if (i >= len) return;
    float s = part[i];
    for (int z = 1; z < slices; ++z) s += part[(long long)z * len + i];
    out[i] = s;
}

// out[i*cols + j] = value j of row ids[i]; grid = (ceil(cols/256), n_ids).
extern "C" __global__ void __launch_bounds__(256)
    get_rows_dense(const unsigned char* __restrict__ table, long long row_bytes, int ty,
                   const int* __restrict__ ids, int rows, int cols, float* __restrict__ out,
                   unsigned int* counters) {
    gpu_count_launch(counters, KID_GET_ROWS_DENSE);
    const int j = blockIdx.x * 256 + threadIdx.x;
    const int id = ids[blockIdx.y];
    if (j >= cols) return;
    out[(long long)blockIdx.y * cols + j] =
        (id >= 0 && id < rows) ? dense_value(table + (long long)id * row_bytes, ty, j) : 0.0f;
}

// Grouped mat-vec for the dense types (see matvec_dense): pair p (= token * n_slots +
// slot) multiplies expert ids[p]'s rows with its activation column (p when per_pair,
// else p / n_slots); ids outside 0..E give zeros.
// grid = (ceil(m / (8 / parts)), pairs), block 256.
extern "C" __global__ void __launch_bounds__(256)
    matvec_dense_id(const unsigned char* __restrict__ w, long long expert_bytes,
                    long long row_bytes, int ty, int k, int m, int n_experts,
                    const float* __restrict__ x, int per_pair, int n_slots,
                    const int* __restrict__ ids, float* __restrict__ out, int parts,
                    unsigned int* counters) {
    gpu_count_launch(counters, KID_MATVEC_DENSE_ID);
    __shared__ float sh[64];
    const int warp = threadIdx.x >> 5, p = blockIdx.y;
    const int r = blockIdx.x * (8 / parts) + warp / parts;
    const int e = ids[p];
    float acc[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[c] = 0.0f;
    if (r < m && e >= 0 && e < n_experts)
        dense_row_dots(w + (long long)e * expert_bytes + (long long)r * row_bytes, ty, k,
                       x + (long long)(per_pair ? p : p / n_slots) * k, 1, acc, warp % parts, parts);
    dense_rows_store(acc, 1, parts, r, m, out + (long long)p * m, sh);
}

// ---------------------------------------------------------------------------------
// MMQ tiles on the matrix units for every quantised weight type (the layout above
// mma_tile_dot): type 107 (both meanings), Q8_0 and ROCmFP4 (100), all with q8_1
// activations, as llama.cpp's MMQ does. Weight codes are staged as int8: 107 as
// described above, Q8_0 as stored, ROCmFP4 through a table of its integer magnitudes
// (0..4, 6, 8, 10, signed). Per block the f32 epilogue applies the scales:
//   one product of K = 32 (Q8_0: A = its scale, O = 0; 107 affine: A = S, O = O):
//       acc += d * A * sum(c*q) - O * (d * sum q)
//   two of K = 16 (107 two-scale: kv codes, A_h = E_h; ROCmFP4: A_h = its half's scale):
//       acc += d * (A_0 * sum_h0(c*q) + A_1 * sum_h1(c*q))
// A tile is 128 rows x 64 columns; column j of a tile reads activation column acol[j]
// and writes output column ocol[j] (-1: none), so dense products and the experts'
// sorted pairs share the tile.
#define MT_107 107

// Block bytes of a staged type.
template <int TY>
GPU_DEV constexpr int mma_block_bytes() {
    return TY == MT_107 ? RF2_BLOCK_BYTES : (TY == DT_Q8_0 ? 34 : 18);
}

// Four ROCmFP4 codes (the low nibbles of a word's bytes) to four int8 (lut8: 16 bytes).
GPU_DEV int fp4_codes4(unsigned int nib, const int* lut8) {
    return lut8[nib & 15u] | (lut8[(nib >> 8) & 15u] << 8) | (lut8[(nib >> 16) & 15u] << 16) |
           (lut8[(nib >> 24) & 15u] << 24);
}

// The tile's shared memory, declared once per kernel (one copy for all types).
struct mma_smem {
    int wq[MMA_BM * MMA_LD];
    float wa[MMA_BM][MMA_KB * 2]; // A per half
    float wo[MMA_BM][MMA_KB];     // O (107 affine)
    int aq[MMA_BN * MMA_LD];
    float ad[MMA_BN][MMA_KB];  // d
    float ads[MMA_BN][MMA_KB]; // d * sum q
    int lut8[16];
    int acol[MMA_BN], ocol[MMA_BN];
};

template <int TY, bool NARROW>
GPU_DEV void mma_tile(mma_smem& sm, const unsigned char* __restrict__ w, long long row_bytes,
                      int nb, int m, int r0, int ncols, const q8_1_block* __restrict__ act,
                      float* __restrict__ out, int affine) {
    const int* acol = sm.acol;
    const int* ocol = sm.ocol;
    int* wq = sm.wq;
    int* aq = sm.aq;
    float(*wa)[MMA_KB * 2] = sm.wa;
    float(*wo)[MMA_KB] = sm.wo;
    float(*ad)[MMA_KB] = sm.ad;
    float(*ads)[MMA_KB] = sm.ads;
    int* lut8 = sm.lut8;
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    constexpr int MT = NARROW ? 1 : 2, NT = NARROW ? 2 : 4, NE = MMA_NE(MT, NT);
    const int wr = NARROW ? warp * 16 : (warp & 3) * 32, wc = NARROW ? 0 : (warp >> 2) * 32;
    const bool halves = TY == DT_ROCMFP4 || (TY == MT_107 && !affine);
    // Valid columns come first: a warp whose 32 columns are all past them (an expert
    // with few tokens) skips its products. (Skipping column tiles within a warp
    // measured 1.5x slower: the runtime bound undoes the unrolled fragment code.)
    const bool busy = wc < ncols;
    if (TY == DT_ROCMFP4 && t < 16) {
        const int mm = t & 7, mag = mm <= 4 ? mm : 2 * mm - 4;
        lut8[t] = (t & 8 ? -mag : mag) & 0xff;
    }
    if (TY == DT_ROCMFP4) __syncthreads();
    float acc[NE];
#pragma unroll
    for (int i = 0; i < NE; ++i) acc[i] = 0.0f;

    // Software pipeline: the next stage's global loads are issued (into registers)
    // before this stage's products, so their latency hides behind the matrix work.
    // Thread t stages (row, block) items t and t + 256 of the weights and (column,
    // block) item t of the activations. Raw words: 107: codes h0, h1, scale bytes;
    // Q8_0: 8 code words, scale; ROCmFP4: 4 code words, scale bytes.
    constexpr int NW = TY == MT_107 ? 3 : (TY == DT_Q8_0 ? 9 : 5);
    unsigned int wraw[2][NW];
    rf_int2 araw[4];
    float adr = 0.0f;
    auto load = [&](int kb0) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int idx = t + 256 * i;
            const int gr = r0 + (idx >> 2), gb = kb0 + (idx & 3);
            if (gr < m && gb < nb) {
                const unsigned char* bp = w + gr * row_bytes + (long long)gb * mma_block_bytes<TY>();
                if (TY == MT_107) {
                    wraw[i][0] = gpu_load_u32_a2(bp);
                    wraw[i][1] = gpu_load_u32_a2(bp + 4);
                    wraw[i][2] = gpu_load_u16(bp + 8);
                } else if (TY == DT_Q8_0) {
#pragma unroll
                    for (int j = 0; j < 8; ++j) wraw[i][j] = gpu_load_u32_a2(bp + 2 + 4 * j);
                    wraw[i][8] = gpu_load_u16(bp);
                } else {
#pragma unroll
                    for (int q = 0; q < 4; ++q) wraw[i][q] = gpu_load_u32_a2(bp + 4 * q);
                    wraw[i][4] = gpu_load_u16(bp + 16);
                }
            } else {
#pragma unroll
                for (int j = 0; j < NW; ++j) wraw[i][j] = 0u; // zero codes and scales
            }
        }
        const int gc = acol[t >> 2], gb = kb0 + (t & 3);
        if (gc >= 0 && gb < nb) {
            const q8_1_block* qb = act + (long long)gc * nb + gb;
            const rf_int2* q = (const rf_int2*)qb->qs;
#pragma unroll
            for (int j = 0; j < 4; ++j) araw[j] = q[j];
            adr = qb->d;
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) araw[j] = rf_int2{0, 0};
            adr = 0.0f;
        }
    };
    load(0);
    for (int kb0 = 0; kb0 < nb; kb0 += MMA_KB) {
        // Weights: decode the raw words into int8 codes and f32 scales.
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int idx = t + 256 * i;
            const int row = idx >> 2, blk = idx & 3;
            int* dst = wq + row * MMA_LD + blk * 8;
            const unsigned int* r = wraw[i];
            float A0, A1, O = 0.0f;
            if (TY == MT_107) {
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const int c = rf2_expand4(r[h] >> (8 * j));
                        // two-scale: bytes c-1 (kv) via (c + 0x7f) ^ 0x80, no carries.
                        dst[4 * h + j] = affine ? c : (int)(((unsigned int)c + 0x7f7f7f7fu) ^ 0x80808080u);
                    }
                A0 = ue4m3(r[2]);
                A1 = affine ? A0 : ue4m3(r[2] >> 8);
                O = affine ? ue4m3(r[2] >> 8) : 0.0f;
            } else if (TY == DT_Q8_0) {
#pragma unroll
                for (int j = 0; j < 8; ++j) dst[j] = (int)r[j];
                A0 = A1 = half_scale(r[8]);
            } else {
                // Code byte j: element j (low nibble), element j + 16 (high nibble).
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    dst[q] = fp4_codes4(r[q], lut8);
                    dst[4 + q] = fp4_codes4(r[q] >> 4, lut8);
                }
                A0 = ue4m3(r[4]);
                A1 = ue4m3(r[4] >> 8);
            }
            wa[row][blk * 2] = A0;
            wa[row][blk * 2 + 1] = A1;
            wo[row][blk] = O;
        }
        // Activations: 64 columns x 4 blocks, one (column, block) per thread.
        {
            const int col = t >> 2, blk = t & 3;
            int* dst = aq + col * MMA_LD + blk * 8;
            int s = 0;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                dst[2 * j] = araw[j].x;
                dst[2 * j + 1] = araw[j].y;
                s = gpu_dp4a(0x01010101, araw[j].x, s);
                s = gpu_dp4a(0x01010101, araw[j].y, s);
            }
            ad[col][blk] = adr;
            ads[col][blk] = adr * gpu_i2f_small(s);
        }
        __syncthreads();
        if (kb0 + MMA_KB < nb) load(kb0 + MMA_KB);
        const int* ws = wq + wr * MMA_LD;
        const int* as_ = aq + wc * MMA_LD;
#pragma unroll 1
        for (int blk = 0; blk < (busy ? MMA_KB : 0); ++blk) {
            if (!halves) {
                int s[NE];
                mma_tile_dot<MT, NT>(ws, as_, blk * 8, 8, s);
#pragma unroll
                for (int i = 0; i < NE; ++i) {
                    const int row = wr + mma_row<MT, NT>(i, lane), col = wc + mma_col<MT, NT>(i, lane);
                    const float ds = ad[col][blk] * wa[row][blk * 2];
                    acc[i] = fmaf(ds, gpu_i2f_small(s[i]), acc[i]);
                    if (TY == MT_107) acc[i] = fmaf(-wo[row][blk], ads[col][blk], acc[i]);
                }
            } else {
                int s0[NE], s1[NE];
                mma_tile_dot<MT, NT>(ws, as_, blk * 8, 4, s0);
                mma_tile_dot<MT, NT>(ws, as_, blk * 8 + 4, 4, s1);
#pragma unroll
                for (int i = 0; i < NE; ++i) {
                    const int row = wr + mma_row<MT, NT>(i, lane), col = wc + mma_col<MT, NT>(i, lane);
                    const float v = fmaf(wa[row][blk * 2], gpu_i2f_small(s0[i]),
                                         wa[row][blk * 2 + 1] * gpu_i2f_small(s1[i]));
                    acc[i] = fmaf(ad[col][blk], v, acc[i]);
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < NE; ++i) {
        const int gr = r0 + wr + mma_row<MT, NT>(i, lane), oc = ocol[wc + mma_col<MT, NT>(i, lane)];
        if (gr < m && oc >= 0) out[(long long)oc * m + gr] = acc[i];
    }
}

// mma_tile for a run-time type (MT_107, DT_Q8_0, DT_ROCMFP4): the narrow warp layout
// for a column tile of at most 16 columns (MMQ_NARROW_OFF, a compile option: never;
// A/B runs), else the wide one.
template <int TY>
GPU_DEV void mma_tile_w(mma_smem& sm, const unsigned char* __restrict__ w, long long row_bytes,
                        int nb, int m, int r0, int ncols, const q8_1_block* __restrict__ act,
                        float* __restrict__ out, int affine) {
#if !defined(MMQ_NARROW_OFF)
    if (ncols <= 16) {  // (the same for the whole block)
        mma_tile<TY, true>(sm, w, row_bytes, nb, m, r0, ncols, act, out, affine);
        return;
    }
#endif
    mma_tile<TY, false>(sm, w, row_bytes, nb, m, r0, ncols, act, out, affine);
}
GPU_DEV void mma_tile_any(mma_smem& sm, int ty, const unsigned char* __restrict__ w,
                          long long row_bytes, int nb, int m, int r0, int ncols,
                          const q8_1_block* __restrict__ act, float* __restrict__ out, int affine) {
    if (ty == MT_107) mma_tile_w<MT_107>(sm, w, row_bytes, nb, m, r0, ncols, act, out, affine);
    else if (ty == DT_Q8_0) mma_tile_w<DT_Q8_0>(sm, w, row_bytes, nb, m, r0, ncols, act, out, affine);
    else mma_tile_w<DT_ROCMFP4>(sm, w, row_bytes, nb, m, r0, ncols, act, out, affine);
}

// Columns c0 .. c0 + 63 of a dense product with n columns (SM: a tile kernel's shared
// memory, with acol / ocol).
template <typename SM>
GPU_DEV void tile_dense_cols(SM& sm, int c0, int n) {
    if (threadIdx.x < MMA_BN) {
        const int c = c0 + (int)threadIdx.x;
        sm.acol[threadIdx.x] = sm.ocol[threadIdx.x] = c < n ? c : -1;
    }
    __syncthreads();
}

// A grouped tile's columns: sorted pairs c0 .. c0 + 63 of a list ending at `end`, each
// reading activation column p (per pair) or p / n_slots (per token), -1 past the end.
template <typename SM>
GPU_DEV void tile_pair_cols(SM& sm, int c0, int end, const int* __restrict__ sorted,
                            int act_per_pair, int n_slots) {
    __syncthreads();  // the last tile's stores have read ocol
    if (threadIdx.x < MMA_BN) {
        const int i = c0 + (int)threadIdx.x;
        const int p = i < end ? sorted[i] : -1;
        sm.acol[threadIdx.x] = p < 0 ? -1 : (act_per_pair ? p : p / n_slots);
        sm.ocol[threadIdx.x] = p;
    }
    __syncthreads();
}

// The list block row y of a grouped tile kernel takes: the y-th non-empty one, expert e
// with pairs begin .. end of `sorted`. False when there is none, or when it is the masked
// list (e = n_experts), whose rows r0 .. r0 + 127 of its pairs get zeros here.
GPU_DEV bool tile_list(const int* __restrict__ active, const int* __restrict__ offsets,
                       const int* __restrict__ sorted, int n_experts, float* __restrict__ out,
                       int r0, int m, int& e, int& begin, int& end) {
    if ((int)blockIdx.y >= active[0]) return false;
    e = active[1 + blockIdx.y];
    begin = offsets[e];
    end = offsets[e + 1];
    if (e != n_experts) return true;
    for (int i = begin; i < end; ++i)
        for (int r = r0 + (int)threadIdx.x; r < r0 + MMA_BM && r < m; r += (int)blockDim.x)
            out[(long long)sorted[i] * m + r] = 0.0f;
    return false;
}

// out[c*m + r] = sum_i W[r][i] * x_c[i] for type-107 weights, x as q8_1.
// grid = (ceil(m / 128), ceil(n / 64)), block = 256.
extern "C" __global__ void __launch_bounds__(256)
    mmq_mma_107(const unsigned char* __restrict__ w, int nb, int m, int n,
                const q8_1_block* __restrict__ act, float* __restrict__ out, int affine,
                unsigned int* counters) {
    gpu_count_launch(counters, KID_MMQ_MMA_107);
    __shared__ mma_smem sm;
    tile_dense_cols(sm, blockIdx.y * MMA_BN, n);
    mma_tile_w<MT_107>(sm, w, (long long)nb * RF2_BLOCK_BYTES, nb, m, blockIdx.x * MMA_BM,
                     n - (int)blockIdx.y * MMA_BN, act, out, affine);
}

// The same for Q8_0 (ty 8) or ROCmFP4 (ty 100) weights (prefill of the dense products),
// bn (64 or 16) columns a tile: 16 takes the narrow warp layout, for products whose
// 64-column tiles would leave most multiprocessors idle (4x the blocks, each weight
// tile decoded 4x as often). grid = (ceil(m / 128), ceil(n / bn)), block = 256.
extern "C" __global__ void __launch_bounds__(256)
    mmq_mma_dense(const unsigned char* __restrict__ w, long long row_bytes, int ty, int nb, int m,
                  int n, const q8_1_block* __restrict__ act, float* __restrict__ out, int bn,
                  unsigned int* counters) {
    gpu_count_launch(counters, KID_MMQ_MMA_DENSE);
    __shared__ mma_smem sm;
    const int c0 = (int)blockIdx.y * bn, end = n < c0 + bn ? n : c0 + bn;
    tile_dense_cols(sm, c0, end);
    mma_tile_any(sm, ty, w, row_bytes, nb, m, blockIdx.x * MMA_BM, end - c0, act, out, 0);
}

// Grouped MMQ (MATMUL_ID with many pairs per expert; pairs sorted by moe_sort as for
// mmvq_grouped_107): block row y takes the y-th non-empty list and runs its pairs as
// tiles of 64 columns over 128 rows of that expert; the masked list gets zeros.
// ty: 107 (with `affine`), 8 (Q8_0) or 100 (ROCmFP4).
// grid = (ceil(m / 128), min(pairs, n_experts) + 1), block = 256.
extern "C" __global__ void __launch_bounds__(256)
    mmq_mma_id(const unsigned char* __restrict__ w, long long expert_bytes, long long row_bytes,
               int ty, int nb, int m, int n_experts, const q8_1_block* __restrict__ act,
               int act_per_pair, int n_slots, const int* __restrict__ offsets,
               const int* __restrict__ active, const int* __restrict__ sorted,
               float* __restrict__ out, int affine, unsigned int* counters) {
    gpu_count_launch(counters, KID_MMQ_MMA_ID);
    __shared__ mma_smem sm;
    const int r0 = blockIdx.x * MMA_BM;
    int e, begin, end;
    if (!tile_list(active, offsets, sorted, n_experts, out, r0, m, e, begin, end)) return;
    for (int c0 = begin; c0 < end; c0 += MMA_BN) {
        tile_pair_cols(sm, c0, end, sorted, act_per_pair, n_slots);
        mma_tile_any(sm, ty, w + (long long)e * expert_bytes, row_bytes, nb, m, r0, end - c0, act,
                     out, affine);
    }
}

// ---------------------------------------------------------------------------------
// Prefill products on bf16 matrix units (MMB; CUDA sm_80+, opt-in: MOE_GPU_MMB=1; on the
// H200 10% slower end to end than the int8 tiles, 16x closer to the CPU's sums on the
// ROCmFP4 fixture - docs/notes/ds4-gpu-h200.md, 2026-12-03 22:07): type-107 (both meanings) and
// ROCmFP4 (100) weights are decoded to bf16 with their scales folded in (107 affine:
// c S - O and two-scale: (c - 1) E rounded to bf16; ROCmFP4's values are exact), the
// f32 activations are rounded to bf16 as they are staged (no q8_1 pass), and the
// matrix units accumulate in f32 over the whole k. The int8 tiles above must scale
// every output element once a 32-value block in f32 (5 - 7 instructions per element
// and block, most of their work); here nothing follows the products but the store.
// Tile and warp layouts as mma_tile's (128 x 64, wide 32 x 32 or narrow 16 x 16 a
// warp); a stage is MMB_KB k-blocks. Weight decode: 107 through a table of prmt
// selectors (a code byte -> two pairs of bf16 picked from the block's four values),
// ROCmFP4 through a table of signed code pairs as bf16 times the half's scale.
#define MMB_KB 2
#define MMB_LD (MMB_KB * 16 + 4)  // 32-bit words a staged row (bf16 pairs) + 4 pad

struct mmb_smem {
    unsigned int wq[MMA_BM * MMB_LD];
    unsigned int aq[MMA_BN * MMB_LD];
    unsigned int lut[256];
    int acol[MMA_BN], ocol[MMA_BN];
};

// Both bf16 halves of a times those of b (exact here: code magnitudes times scales).
GPU_DEV unsigned int gpu_bf16x2_mul(unsigned int a, unsigned int b) {
#if defined(RF_MMA_PTX)
    unsigned int r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
    return r;
#else
    const float lo = __int_as_float((int)(a << 16)) * __int_as_float((int)(b << 16));
    const float hi = __int_as_float((int)(a & 0xffff0000u)) * __int_as_float((int)(b & 0xffff0000u));
    return gpu_bf16x2(lo, hi);
#endif
}

// The decode table of type TY, entry t: 107: for code byte t (codes c0..c3), the prmt
// selectors of (c0, c1) in the low half and (c2, c3) in the high half, picking bf16
// value c (bytes 2c, 2c + 1) of a block's four; ROCmFP4: codes (t & 15, t >> 4) as
// signed bf16 magnitudes.
template <int TY>
GPU_DEV unsigned int mmb_lut(unsigned int t) {
    if (TY == MT_107) {
        unsigned int s = 0;
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const unsigned int c0 = (t >> (4 * p)) & 3u, c1 = (t >> (4 * p + 2)) & 3u;
            s |= (0x1010u + 34u * c0 + 8704u * c1) << (16 * p);
        }
        return s;
    }
    float v[2];
#pragma unroll
    for (int p = 0; p < 2; ++p) {
        const int c = (int)((t >> (4 * p)) & 15u), mm = c & 7;
        const float a = (float)(mm <= 4 ? mm : 2 * mm - 4);
        v[p] = c & 8 ? -a : a;
    }
    return gpu_bf16x2(v[0], v[1]);
}

// Raw words of one weight block: 107: the two code words and the scale bytes; ROCmFP4:
// the four code words and the scale bytes.
template <int TY>
GPU_DEV constexpr int mmb_raw_words() {
    return TY == MT_107 ? 3 : 5;
}

// One block's 32 values as 16 bf16 pairs (value 2j in the low half of dst[j]).
template <int TY>
GPU_DEV void mmb_decode(const unsigned int (&r)[mmb_raw_words<TY>()], int affine,
                        const unsigned int* lut, unsigned int* dst) {
    if (TY == MT_107) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            // Half h's four values (affine: both halves the same).
            const float e = ue4m3(h && !affine ? r[2] >> 8 : r[2]);
            const float o = affine ? ue4m3(r[2] >> 8) : e;  // value c = c e - o
            const unsigned int t0 = gpu_bf16x2(-o, e - o);
            const unsigned int t1 = gpu_bf16x2(2.0f * e - o, 3.0f * e - o);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const unsigned int sel = lut[(r[h] >> (8 * i)) & 255u];
                dst[8 * h + 2 * i] = gpu_perm(t0, t1, sel);
                dst[8 * h + 2 * i + 1] = gpu_perm(t0, t1, sel >> 16);
            }
        }
    } else {
        const float e0 = ue4m3(r[4]), e1 = ue4m3(r[4] >> 8);
        const unsigned int s0 = gpu_bf16x2(e0, e0), s1 = gpu_bf16x2(e1, e1);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            // Bytes 4q..4q+3: values 4q.. (low nibbles, scale 0), 16 + 4q.. (high, scale 1).
            const unsigned int w = r[q];
            dst[2 * q] = gpu_bf16x2_mul(lut[(w & 0xfu) | ((w >> 4) & 0xf0u)], s0);
            dst[2 * q + 1] = gpu_bf16x2_mul(lut[((w >> 16) & 0xfu) | ((w >> 20) & 0xf0u)], s0);
            dst[8 + 2 * q] = gpu_bf16x2_mul(lut[((w >> 4) & 0xfu) | ((w >> 8) & 0xf0u)], s1);
            dst[8 + 2 * q + 1] = gpu_bf16x2_mul(lut[((w >> 20) & 0xfu) | ((w >> 24) & 0xf0u)], s1);
        }
    }
}

// The warp's bf16 products over one staged k16 step s: as mma_tile_dot's layout.
template <int MT, int NT>
GPU_DEV void mmb_tile_dot(const unsigned int* ws, const unsigned int* as_, int s,
                          float (&acc)[MMA_NE(MT, NT)]) {
#if defined(RF_MMA_PTX)
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const unsigned int* r0 = ws + (mt * 16 + g) * MMB_LD + 8 * s + t;
        const unsigned int* r1 = r0 + 8 * MMB_LD;
        const unsigned int a0 = r0[0], a1 = r1[0], a2 = r0[4], a3 = r1[4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const unsigned int* c = as_ + (nt * 8 + g) * MMB_LD + 8 * s + t;
            float* d = acc + (mt * NT + nt) * 4;
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                         "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                         : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                         : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(c[0]), "r"(c[4]));
        }
    }
#else
    // (never launched off CUDA sm_80+: the backends pick the int8 tiles there)
    (void)ws;
    (void)as_;
    (void)s;
    (void)acc;
#endif
}

// Columns acol[] (f32 columns of x, k values each; -1: zeros) of the MMB tile at rows r0..
template <int TY, bool NARROW>
GPU_DEV void mmb_tile(mmb_smem& sm, const unsigned char* __restrict__ w, long long row_bytes,
                      int nb, int m, int r0, int ncols, const float* __restrict__ x,
                      float* __restrict__ out, int affine) {
    constexpr int MT = NARROW ? 1 : 2, NT = NARROW ? 2 : 4, NE = MMA_NE(MT, NT);
    constexpr int NW = mmb_raw_words<TY>();
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int wr = NARROW ? warp * 16 : (warp & 3) * 32, wc = NARROW ? 0 : (warp >> 2) * 32;
    const long long k = (long long)nb * 32;
    float acc[NE];
#pragma unroll
    for (int i = 0; i < NE; ++i) acc[i] = 0.0f;
    // Thread t stages weight block (row t / 2, block t % 2) and activation values
    // 16 (t % 4).. of column t / 4; the next stage's loads are issued before this
    // stage's products (software pipeline, as mma_tile).
    const int wrow = t >> 1, wblk = t & 1, acl = t >> 2, apart = t & 3;
    const int gcol = sm.acol[acl];
    unsigned int wraw[NW];
    gpu_f4 araw[4];
    auto load = [&](int kb0) {
        const int gr = r0 + wrow, gb = kb0 + wblk;
        if (gr < m && gb < nb) {
            const unsigned char* bp = w + gr * row_bytes + (long long)gb * mma_block_bytes<TY>();
            if (TY == MT_107) {
                wraw[0] = gpu_load_u32_a2(bp);
                wraw[1] = gpu_load_u32_a2(bp + 4);
                wraw[2] = gpu_load_u16(bp + 8);
            } else {
#pragma unroll
                for (int q = 0; q < 4; ++q) wraw[q] = gpu_load_u32_a2(bp + 4 * q);
                wraw[4] = gpu_load_u16(bp + 16);
            }
        } else {
#pragma unroll
            for (int j = 0; j < NW; ++j) wraw[j] = 0u;  // zero scales: zero values
        }
        const long long k0 = (long long)kb0 * 32 + 16 * apart;
        if (gcol >= 0 && k0 < k) {
            const gpu_f4* xp = (const gpu_f4*)(x + (long long)gcol * k + k0);
#pragma unroll
            for (int j = 0; j < 4; ++j) araw[j] = xp[j];
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) araw[j] = gpu_f4{0.0f, 0.0f, 0.0f, 0.0f};
        }
    };
    load(0);
    for (int kb0 = 0; kb0 < nb; kb0 += MMB_KB) {
        {
            unsigned int v[16];
            mmb_decode<TY>(wraw, affine, sm.lut, v);
            gpu_u4* dst = (gpu_u4*)(sm.wq + wrow * MMB_LD + 16 * wblk);
#pragma unroll
            for (int j = 0; j < 4; ++j) dst[j] = gpu_u4{v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]};
            unsigned int a[8];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                a[2 * j] = gpu_bf16x2(araw[j].x, araw[j].y);
                a[2 * j + 1] = gpu_bf16x2(araw[j].z, araw[j].w);
            }
            gpu_u4* da = (gpu_u4*)(sm.aq + acl * MMB_LD + 8 * apart);
            da[0] = gpu_u4{a[0], a[1], a[2], a[3]};
            da[1] = gpu_u4{a[4], a[5], a[6], a[7]};
        }
        __syncthreads();
        if (kb0 + MMB_KB < nb) load(kb0 + MMB_KB);
        if (wc < ncols) {  // (valid columns come first: a warp past them has none)
            const unsigned int* ws = sm.wq + wr * MMB_LD;
            const unsigned int* as_ = sm.aq + wc * MMB_LD;
#pragma unroll
            for (int s = 0; s < 2 * MMB_KB; ++s) mmb_tile_dot<MT, NT>(ws, as_, s, acc);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < NE; ++i) {
        const int gr = r0 + wr + mma_row<MT, NT>(i, lane), oc = sm.ocol[wc + mma_col<MT, NT>(i, lane)];
        if (gr < m && oc >= 0) out[(long long)oc * m + gr] = acc[i];
    }
}

// The table, then the tile in the narrow layout for at most 16 columns, else the wide.
template <int TY>
GPU_DEV void mmb_tile_w(mmb_smem& sm, const unsigned char* __restrict__ w, long long row_bytes,
                        int nb, int m, int r0, int ncols, const float* __restrict__ x,
                        float* __restrict__ out, int affine) {
    if (ncols <= 16) mmb_tile<TY, true>(sm, w, row_bytes, nb, m, r0, ncols, x, out, affine);
    else mmb_tile<TY, false>(sm, w, row_bytes, nb, m, r0, ncols, x, out, affine);
}

template <int TY>
GPU_DEV void mmb_lut_fill(mmb_smem& sm) {
    sm.lut[threadIdx.x] = mmb_lut<TY>(threadIdx.x);  // (256 threads)
}

// out[c*m + r] = sum_i W[r][i] * x[c*k + i] for type-107 (ty 107, `affine`) or ROCmFP4
// (ty 100) weights, x f32 (16-byte aligned). grid = (ceil(m / 128), ceil(n / 64)),
// block = 256.
extern "C" __global__ void __launch_bounds__(256)
    mmb_dense(const unsigned char* __restrict__ w, long long row_bytes, int ty, int nb, int m,
              int n, const float* __restrict__ x, float* __restrict__ out, int affine,
              unsigned int* counters) {
    gpu_count_launch(counters, KID_MMB_DENSE);
    __shared__ mmb_smem sm;
    const int r0 = blockIdx.x * MMA_BM, ncols = n - (int)blockIdx.y * MMA_BN;
    if (ty == MT_107) mmb_lut_fill<MT_107>(sm);
    else mmb_lut_fill<DT_ROCMFP4>(sm);
    tile_dense_cols(sm, blockIdx.y * MMA_BN, n);  // (also orders the table)
    if (ty == MT_107) mmb_tile_w<MT_107>(sm, w, row_bytes, nb, m, r0, ncols, x, out, affine);
    else mmb_tile_w<DT_ROCMFP4>(sm, w, row_bytes, nb, m, r0, ncols, x, out, affine);
}

// The grouped form (MATMUL_ID, pairs sorted by moe_sort; as mmq_mma_id): block row y
// takes the y-th non-empty list, its pairs as tiles of 64 columns over 128 rows of
// that expert; the masked list gets zeros. x: f32 columns of k (per pair or per token).
// grid = (ceil(m / 128), min(pairs, n_experts) + 1), block = 256.
extern "C" __global__ void __launch_bounds__(256)
    mmb_id(const unsigned char* __restrict__ w, long long expert_bytes, long long row_bytes,
           int ty, int nb, int m, int n_experts, const float* __restrict__ x, int act_per_pair,
           int n_slots, const int* __restrict__ offsets, const int* __restrict__ active,
           const int* __restrict__ sorted, float* __restrict__ out, int affine,
           unsigned int* counters) {
    gpu_count_launch(counters, KID_MMB_ID);
    __shared__ mmb_smem sm;
    const int r0 = blockIdx.x * MMA_BM;
    int e, begin, end;
    if (!tile_list(active, offsets, sorted, n_experts, out, r0, m, e, begin, end)) return;
    if (ty == MT_107) mmb_lut_fill<MT_107>(sm);
    else mmb_lut_fill<DT_ROCMFP4>(sm);
    for (int c0 = begin; c0 < end; c0 += MMA_BN) {
        tile_pair_cols(sm, c0, end, sorted, act_per_pair, n_slots);  // (orders the table too)
        const unsigned char* we = w + (long long)e * expert_bytes;
        if (ty == MT_107) mmb_tile_w<MT_107>(sm, we, row_bytes, nb, m, r0, end - c0, x, out, affine);
        else mmb_tile_w<DT_ROCMFP4>(sm, we, row_bytes, nb, m, r0, end - c0, x, out, affine);
    }
}

// ---------------------------------------------------------------------------------
// Prefill products on bf16 matrix units with the weights streamed (MMW; CUDA sm_80+,
// opt-in: MOE_GPU_MMB=stream): the MMB tiles' sums laid out for throughput. The same
// weight values (mmb_decode's tables and rounding), the same activation rounding
// (f32_to_bf16 is mmb_tile's conversion) and, for every output, the same mma
// sequence over k: the same bits as mmb_dense / mmb_id. What differs is the pipeline.
// The MMB tiles stage 64 values at a time through registers (the next stage's loads one
// stage ahead, two barriers a stage) and write every decoded weight to shared memory
// before the products read it back. Here MMW_STAGES stages of MMW_KS values are in
// flight at once by cp.async (each row's raw blocks as stored, the activations as the
// bf16 pairs f32_to_bf16 wrote once a product), one barrier a stage, and each warp
// decodes its own 16 rows straight into its A fragments: a tile is 128 rows by BN
// columns (64, or 16 for a routed expert's few tokens), warp w takes rows 16 w ..
// 16 w + 15 and every column, so each weight is decoded once a tile.
// Needs nb % 4 == 0 (k a multiple of MMW_KS), row_bytes and the bases 8-byte aligned,
// xb 16-byte aligned, and the launch's dynamic shared memory for its stages
// (mmw_stage_bytes; where the host gives only the narrow size, wider tiles run as
// narrow ones).
#define MMW_BM 128
#define MMW_KS 128               // k values a stage: 4 blocks of 32
#define MMW_STAGES 4
#define MMW_ALD (MMW_KS / 2 + 4)  // words a staged activation column: 64 bf16 pairs + 4 pad

// x (4 n values) as 2 n bf16 pairs, value 2i in the low half of word i (round to nearest
// even, as mmb_tile stages them). Needs x 16-byte aligned. grid = ceil(n / 256), block 256.
extern "C" __global__ void __launch_bounds__(256)
    f32_to_bf16(const float* __restrict__ x, long long n, unsigned int* __restrict__ out,
                unsigned int* counters) {
    gpu_count_launch(counters, KID_F32_TO_BF16);
    const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
    if (i >= n) return;
    const gpu_f4 v = ((const gpu_f4*)x)[i];
    out[2 * i] = gpu_bf16x2(v.x, v.y);
    out[2 * i + 1] = gpu_bf16x2(v.z, v.w);
}

// A stage's raw weight bytes a row (4 blocks as stored), and a stage's bytes in all.
template <int TY>
GPU_DEV constexpr int mmw_row_bytes() {
    return 4 * mma_block_bytes<TY>();
}
template <int TY, int BN>
GPU_DEV constexpr int mmw_stage_bytes() {
    return MMW_BM * mmw_row_bytes<TY>() + BN * MMW_ALD * 4;
}

// A tile's columns (tile_dense_cols / tile_pair_cols fill them) and the decode table:
// 107: the prmt selector of a nibble's two codes (16 entries); ROCmFP4: mmb_lut's 256.
// MMW_E4_LUT (a compile option, the CUDA backend's default): lut[256 + b] also holds ue4m3(b)'s bits,
// which the blocks' tables then look up instead of converting (the same values).
#if defined(MMW_E4_LUT)
#define MMW_LUT_WORDS 512
#else
#define MMW_LUT_WORDS 256
#endif
struct mmw_cols {
    int acol[MMA_BN], ocol[MMA_BN];
    unsigned int lut[MMW_LUT_WORDS];
};

template <int TY>
GPU_DEV void mmw_lut_fill(mmw_cols& sm) {
    for (unsigned int i = threadIdx.x; i < (TY == MT_107 ? 16u : 256u); i += blockDim.x)
        sm.lut[i] = TY == MT_107 ? 0x1010u + 34u * (i & 3u) + 8704u * (i >> 2) : mmb_lut<DT_ROCMFP4>(i);
#if defined(MMW_E4_LUT)
    for (unsigned int i = threadIdx.x; i < 256u; i += blockDim.x) sm.lut[256 + i] = (unsigned int)__float_as_int(ue4m3(i));
#endif
}

#if defined(RF_MMA_PTX)
// cp.async of BYTES (8 or 16) from src to the shared-memory address dst (gpu_smem_addr);
// with on = false zeros (src unread). mmw_copy: to a generic pointer into shared memory.
template <int BYTES>
GPU_DEV void mmw_copy_s(unsigned int dst, const void* src, bool on) {
    if (BYTES == 16)
        gpu_cp_async16(dst, src, on);
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(on ? 8 : 0)
                     : "memory");
}
template <int BYTES>
GPU_DEV void mmw_copy(void* dst, const void* src, bool on) {
    mmw_copy_s<BYTES>(gpu_smem_addr(dst), src, on);
}

// MMW_LDSM (a compile option, for A/B runs): the B fragments of two column tiles by one
// ldmatrix.x4 (gpu_ldsm4; the same words as the scalar loads): matrix i of lane group i =
// l / 8 is columns 8 (nt + i / 2) .. + 7 by k values 8 (i % 2) .. + 7 of the k16 step,
// lane l giving its row's address, and d_i comes back as b0 / b1 of tile nt, then of
// nt + 1.

// Code word h of a staged 107 block at p (rows are 8-byte aligned, blocks 10 bytes:
// odd blocks start mid-word).
template <int BLK>
GPU_DEV unsigned int mmw_word107(const unsigned char* p) {
    return BLK & 1 ? gpu_load_u32_a2(p) : *(const unsigned int*)p;
}

// A staged row's block BLK: its halves' decode tables, once a block. 107: mmb_decode's
// four values c e - o of each half as bf16 pairs (t0: values 0, 1; t1: 2, 3; an affine
// block's halves share them); ROCmFP4: each half's scale as a bf16 pair (s).
struct mmw_tab {
    unsigned int t0[2], t1[2];
};
template <int TY, int BLK>
GPU_DEV mmw_tab mmw_tables(const unsigned char* row, int affine, const unsigned int* lut) {
    constexpr int BB = mma_block_bytes<TY>();
    const unsigned int sc = gpu_load_u16(row + BLK * BB + (TY == MT_107 ? 8 : 16));
#if defined(MMW_E4_LUT)
    const float e0 = __int_as_float((int)lut[256 + (sc & 0xffu)]),
                e1 = __int_as_float((int)lut[256 + (sc >> 8)]);
#else
    (void)lut;
    const float e0 = ue4m3(sc), e1 = ue4m3(sc >> 8);
#endif
    mmw_tab tb;
    if (TY == MT_107) {
        // (mmb_decode: half h's scale e and offset o; affine: S and O for both halves,
        // two-scale: E_h for both)
        const float o0 = affine ? e1 : e0;
        tb.t0[0] = gpu_bf16x2(-o0, e0 - o0);
        tb.t1[0] = gpu_bf16x2(2.0f * e0 - o0, 3.0f * e0 - o0);
        if (affine) {
            tb.t0[1] = tb.t0[0];
            tb.t1[1] = tb.t1[0];
        } else {
            tb.t0[1] = gpu_bf16x2(-e1, e1 - e1);
            tb.t1[1] = gpu_bf16x2(2.0f * e1 - e1, 3.0f * e1 - e1);
        }
    } else {
        tb.t0[0] = gpu_bf16x2(e0, e0);
        tb.t0[1] = gpu_bf16x2(e1, e1);
    }
    return tb;
}

// One staged row's A-fragment pairs for k16 step h of block BLK: the values (2q, 2q + 1)
// into lo and (2q + 8, 2q + 9) into hi (q = lane % 4), as bf16 pairs of mmb_decode's
// values (the block's tables tb); row points at the row's stage bytes.
template <int TY, int BLK>
GPU_DEV void mmw_frag(const unsigned char* row, const mmw_tab& tb, int h, int q,
                      const unsigned int* lut, unsigned int& lo, unsigned int& hi) {
    const unsigned char* b = row + BLK * mma_block_bytes<TY>();
    if (TY == MT_107) {
        const unsigned int w = mmw_word107<BLK>(b + 4 * h);
        lo = gpu_perm(tb.t0[h], tb.t1[h], lut[(w >> (4 * q)) & 15u]);
        hi = gpu_perm(tb.t0[h], tb.t1[h], lut[(w >> (4 * q + 16)) & 15u]);
    } else {
        // Bytes 2q, 2q + 1 (and 2q + 8, 2q + 9): values 2q, 2q + 1 of half h in nibble h.
        const unsigned int x0 = gpu_load_u16(b + 2 * q) >> (4 * h), x1 = gpu_load_u16(b + 2 * q + 8) >> (4 * h);
        lo = gpu_bf16x2_mul(lut[(x0 & 0xfu) | ((x0 >> 4) & 0xf0u)], tb.t0[h]);
        hi = gpu_bf16x2_mul(lut[(x1 & 0xfu) | ((x1 >> 4) & 0xf0u)], tb.t0[h]);
    }
}

// Block BLK of a stage for a warp's MT m-tiles (rows 16 mt + g, + 8 from `rows`, the
// warp's first staged row) against the staged activations as_ (BN = 8 NT columns): the
// rows' decode tables once, then each k16 step's A fragments and NT B fragments, each B
// fragment feeding the MT products. acc[(mt NT + nt) 4 ..] is tile (mt, nt) (mma_row).
template <int TY, int MT, int NT, int BLK>
GPU_DEV void mmw_block(const unsigned char* rows, const unsigned int* as_, int lane, int affine,
                       const unsigned int* lut, float (&acc)[MMA_NE(MT, NT)]) {
    constexpr int WRB = mmw_row_bytes<TY>();
    const int g = lane >> 2, q = lane & 3;
    mmw_tab tab[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) tab[mt][r] = mmw_tables<TY, BLK>(rows + (16 * mt + 8 * r + g) * WRB, affine, lut);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int ks = 2 * BLK + h;  // the k16 step within the stage
        unsigned int a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            mmw_frag<TY, BLK>(rows + (16 * mt + g) * WRB, tab[mt][0], h, q, lut, a[mt][0], a[mt][2]);
            mmw_frag<TY, BLK>(rows + (16 * mt + 8 + g) * WRB, tab[mt][1], h, q, lut, a[mt][1], a[mt][3]);
        }
#if defined(MMW_LDSM)
        const unsigned int* cl =
            as_ + ((lane >> 4) * 8 + (lane & 7)) * MMW_ALD + 4 * ((lane >> 3) & 1) + 8 * ks;
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
            unsigned int b[4];
            gpu_ldsm4(gpu_smem_addr(cl + nt * 8 * MMW_ALD), b[0], b[1], b[2], b[3]);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                float* d = acc + (mt * NT + nt) * 4;
                gpu_mma_bf16(d, a[mt][0], a[mt][1], a[mt][2], a[mt][3], b[0], b[1]);
                gpu_mma_bf16(d + 4, a[mt][0], a[mt][1], a[mt][2], a[mt][3], b[2], b[3]);
            }
        }
#else
        const unsigned int* c = as_ + g * MMW_ALD + 8 * ks + q;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const unsigned int b0 = c[nt * 8 * MMW_ALD], b1 = c[nt * 8 * MMW_ALD + 4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                gpu_mma_bf16(acc + (mt * NT + nt) * 4, a[mt][0], a[mt][1], a[mt][2], a[mt][3], b0, b1);
        }
#endif
    }
}

// The tile at rows r0.. of w over columns acol[0..BN) (bf16 pair columns of xb, k / 2
// words each; -1: zeros), stored to out[ocol[j] m + row] for ocol[j] >= 0. smem: the
// launch's dynamic shared memory (MMW_STAGES stages). Warp w takes rows 16 MT w ..
// 16 MT (w + 1) - 1: 256 threads of one m-tile each (MT = 1) or 128 of two (MT = 2:
// each B fragment feeds two products, half the activations' shared-memory reads a
// product; the host's MOE_GPU_MMW_ROWS=32). AFF: `affine` as the launch gives it (-1),
// or known to be 0 / 1 when compiled (mmw_tile_aff).
template <int TY, int BN, int MT, int AFF = -1>
static __device__ __attribute__((noinline)) void mmw_tile(unsigned char* smem, const int* acol, const int* ocol,
                      const unsigned int* lut, const unsigned char* __restrict__ w,
                      long long row_bytes, int nb, int m, int r0,
                      const unsigned int* __restrict__ xb, float* __restrict__ out, int affine) {
    constexpr int NT = BN / 8, NE = MMA_NE(MT, NT), WRB = mmw_row_bytes<TY>(), G = WRB / 8;
    constexpr int SB = mmw_stage_bytes<TY, BN>(), AOFF = MMW_BM * WRB, NTH = 256 / MT;
    const int t = threadIdx.x, lane = t & 31, wr = (t >> 5) * 16 * MT;
    if (blockDim.x != NTH) asm volatile("trap;");  // (the host's block size must match the layout)
    const long long kw = (long long)nb * 16;  // words (bf16 pairs) a column of xb
    const int stages = nb / 4;
    float acc[NE];
#pragma unroll
    for (int i = 0; i < NE; ++i) acc[i] = 0.0f;
    // Stage s's copies into buffer s % MMW_STAGES: 8-byte pieces of the rows' raw
    // blocks (zeros past m: zero scales, zero values), 16-byte pieces of the columns.
#if defined(MMW_FAST_ISSUE)
    // Each thread's pieces are fixed for the tile, so their addresses are worked out
    // once here and a stage adds its offsets: TPR threads a row (lane pairs take a row's
    // neighbouring pieces), pieces k, k + TPR, ... of it; the activation pieces as the
    // loop below, each column's word offset kept (-1: zeros). The same bytes land in
    // the same places; only the address arithmetic differs.
    constexpr int TPR = NTH / MMW_BM, WCP = (G + TPR - 1) / TPR, ACP = BN * 16 / NTH;
    static_assert(NTH % MMW_BM == 0 && (BN * 16) % NTH == 0, "mmw_tile: copy layout");
    const unsigned int s0 = gpu_smem_addr(smem);
    const int wrow = t / TPR, wk = t % TPR;
    const bool won = r0 + wrow < m;
    const unsigned char* wsrc = w + (won ? (long long)(r0 + wrow) * row_bytes + 8 * wk : 0);
    const unsigned int wdst = wrow * WRB + 8 * wk;
    long long aoff[ACP];
#pragma unroll
    for (int j = 0; j < ACP; ++j) {
        const int gc = acol[(t >> 4) + j * (NTH >> 4)];
        aoff[j] = gc >= 0 ? gc * kw + 4 * (t & 15) : -1;
    }
    const unsigned int adst = AOFF + 4 * ((t >> 4) * MMW_ALD + 4 * (t & 15));
    auto issue = [&](int s) {
        const unsigned int st = s0 + (s % MMW_STAGES) * SB;
#pragma unroll
        for (int j = 0; j < WCP; ++j) {
            if (wk + TPR * j < G)
                mmw_copy_s<8>(st + wdst + 8 * TPR * j, won ? wsrc + (long long)s * WRB + 8 * TPR * j : w, won);
        }
#pragma unroll
        for (int j = 0; j < ACP; ++j) {
            const bool on = aoff[j] >= 0;
            mmw_copy_s<16>(st + adst + j * (NTH >> 4) * MMW_ALD * 4, on ? xb + aoff[j] + 64 * s : xb, on);
        }
    };
#else
    auto issue = [&](int s) {
        unsigned char* st = smem + (s % MMW_STAGES) * SB;
        const long long off = (long long)s * WRB;  // (a stage is 4 whole blocks of a row)
        for (int i = t; i < MMW_BM * G; i += NTH) {
            const int row = i / G, part = i - row * G, gr = r0 + row;
            const bool on = gr < m;
            mmw_copy<8>(st + row * WRB + 8 * part, on ? w + gr * row_bytes + off + 8 * part : w, on);
        }
        for (int i = t; i < BN * 16; i += NTH) {
            const int col = i >> 4, part = i & 15, gc = acol[col];
            const bool on = gc >= 0;
            mmw_copy<16>(st + AOFF + 4 * (col * MMW_ALD + 4 * part),
                         on ? xb + gc * kw + 64 * s + 4 * part : xb, on);
        }
    };
#endif
#pragma unroll
    for (int s = 0; s < MMW_STAGES - 1; ++s) {
        if (s < stages) issue(s);
        gpu_cp_commit();  // (empty groups keep the count: stage s is always group s)
    }
    for (int s = 0; s < stages; ++s) {
        gpu_cp_wait<MMW_STAGES - 2>();  // this thread's copies of stage s are in
        __syncthreads();             // everyone's are, and stage s - 1's buffer is free
        if (s + MMW_STAGES - 1 < stages) issue(s + MMW_STAGES - 1);
        gpu_cp_commit();
        const unsigned char* st = smem + (s % MMW_STAGES) * SB;
        const unsigned char* rows = st + wr * WRB;
        const unsigned int* as_ = (const unsigned int*)(st + AOFF);
        const int aff = AFF < 0 ? affine : AFF;
        mmw_block<TY, MT, NT, 0>(rows, as_, lane, aff, lut, acc);
        mmw_block<TY, MT, NT, 1>(rows, as_, lane, aff, lut, acc);
        mmw_block<TY, MT, NT, 2>(rows, as_, lane, aff, lut, acc);
        mmw_block<TY, MT, NT, 3>(rows, as_, lane, aff, lut, acc);
    }
    gpu_cp_wait<0>();  // (only empty groups are left; none outlives the tile)
#pragma unroll
    for (int i = 0; i < NE; ++i) {
        const int gr = r0 + wr + mma_row<MT, NT>(i, lane), oc = ocol[mma_col<MT, NT>(i, lane)];
        if (gr < m && oc >= 0) out[(long long)oc * m + gr] = acc[i];
    }
}

// The launch's dynamic shared memory (bytes).
GPU_DEV unsigned int mmw_dyn_bytes() {
    unsigned int n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}

// mmw_tile with the weights' kind compiled in where MMW_AFF_T (a compile option, on in
// the CUDA backend by default) asks: a type-107 tile of affine blocks (the routed experts' kind) or of
// two-scale ones then builds only the tables it uses (the same values), at the price of
// a second copy of the 107 tiles' code.
template <int TY, int BN, int MT>
GPU_DEV void mmw_tile_aff(unsigned char* smem, const int* acol, const int* ocol, const unsigned int* lut,
                          const unsigned char* __restrict__ w, long long row_bytes, int nb, int m,
                          int r0, const unsigned int* __restrict__ xb, float* __restrict__ out,
                          int affine) {
#if defined(MMW_AFF_T)
    if constexpr (TY == MT_107) {
        if (affine) {
            mmw_tile<TY, BN, MT, 1>(smem, acol, ocol, lut, w, row_bytes, nb, m, r0, xb, out, 1);
            return;
        }
    }
    mmw_tile<TY, BN, MT, 0>(smem, acol, ocol, lut, w, row_bytes, nb, m, r0, xb, out, 0);
#else
    mmw_tile<TY, BN, MT>(smem, acol, ocol, lut, w, row_bytes, nb, m, r0, xb, out, affine);
#endif
}

// Columns c0 .. min(c0 + 64, end) of a tile list (acol / ocol from c0): one wide tile
// where there are more than 16 and the launch has room for its stages, else narrow
// tiles of 16 (each weight decoded again for each: the same sums).
template <int TY, int MT>
GPU_DEV void mmw_cols_tiles(unsigned char* smem, const mmw_cols& sm, int ncols,
                            const unsigned char* __restrict__ w, long long row_bytes, int nb,
                            int m, int r0, const unsigned int* __restrict__ xb,
                            float* __restrict__ out, int affine) {
    if (ncols > 16 && mmw_dyn_bytes() >= (unsigned int)(MMW_STAGES * mmw_stage_bytes<TY, MMA_BN>())) {
        mmw_tile_aff<TY, MMA_BN, MT>(smem, sm.acol, sm.ocol, sm.lut, w, row_bytes, nb, m, r0, xb, out, affine);
        return;
    }
    for (int j = 0; j < ncols && j < MMA_BN; j += 16) {
        __syncthreads();  // the last tile's buffers are read
        mmw_tile_aff<TY, 16, MT>(smem, sm.acol + j, sm.ocol + j, sm.lut, w, row_bytes, nb, m, r0, xb, out, affine);
    }
}

// mmw_dense's and mmw_id's work (below), MT m-tiles a warp.
template <int MT>
GPU_DEV void mmw_dense_tiles(unsigned char* smem, const unsigned char* __restrict__ w,
                             long long row_bytes, int ty, int nb, int m, int n,
                             const unsigned int* __restrict__ xb, float* __restrict__ out,
                             int affine) {
    __shared__ mmw_cols sm;
    const int c0 = blockIdx.x * MMA_BN, r0 = blockIdx.y * MMW_BM;
    if (ty == MT_107) mmw_lut_fill<MT_107>(sm);
    else mmw_lut_fill<DT_ROCMFP4>(sm);
    tile_dense_cols(sm, c0, n);  // (also orders the table)
    const int ncols = n - c0 < MMA_BN ? n - c0 : MMA_BN;
    if (ty == MT_107) mmw_cols_tiles<MT_107, MT>(smem, sm, ncols, w, row_bytes, nb, m, r0, xb, out, affine);
    else mmw_cols_tiles<DT_ROCMFP4, MT>(smem, sm, ncols, w, row_bytes, nb, m, r0, xb, out, affine);
}
template <int MT>
GPU_DEV void mmw_id_tiles(unsigned char* smem, const unsigned char* __restrict__ w,
                          long long expert_bytes, long long row_bytes, int ty, int nb, int m,
                          int n_experts, const unsigned int* __restrict__ xb, int act_per_pair,
                          int n_slots, const int* __restrict__ offsets,
                          const int* __restrict__ active, const int* __restrict__ sorted,
                          float* __restrict__ out, int affine) {
    __shared__ mmw_cols sm;
    const int r0 = blockIdx.x * MMW_BM;
    int e, begin, end;
    if (!tile_list(active, offsets, sorted, n_experts, out, r0, m, e, begin, end)) return;
    if (ty == MT_107) mmw_lut_fill<MT_107>(sm);
    else mmw_lut_fill<DT_ROCMFP4>(sm);
    const unsigned char* we = w + (long long)e * expert_bytes;
    for (int c0 = begin; c0 < end; c0 += MMA_BN) {
        tile_pair_cols(sm, c0, end, sorted, act_per_pair, n_slots);  // (orders the table too)
        if (ty == MT_107) mmw_cols_tiles<MT_107, MT>(smem, sm, end - c0, we, row_bytes, nb, m, r0, xb, out, affine);
        else mmw_cols_tiles<DT_ROCMFP4, MT>(smem, sm, end - c0, we, row_bytes, nb, m, r0, xb, out, affine);
    }
}
#endif

// out[c m + r] = sum_i W[r][i] x[c k + i] for type-107 (ty 107, `affine`) or ROCmFP4 (ty
// 100) weights, xb = x as bf16 pairs (f32_to_bf16). Block (x, y) takes column tile x and
// row tile y, so the tiles of one row tile run side by side and share its weights in L2.
// grid = (ceil(n / 64), ceil(m / 128)), block = 256, dynamic shared memory MMW_STAGES
// mmw_stage_bytes (64 columns, or 16: see mmw_cols_tiles). mmw_dense_m2: the same with
// two m-tiles a warp, block = 128 (the host's MOE_GPU_MMW_ROWS=32), registers for that.
extern "C" __global__ void __launch_bounds__(256, 2)
    mmw_dense(const unsigned char* __restrict__ w, long long row_bytes, int ty, int nb, int m,
                 int n, const unsigned int* __restrict__ xb, float* __restrict__ out, int affine,
                 unsigned int* counters) {
    gpu_count_launch(counters, KID_MMW_DENSE);
#if defined(RF_MMA_PTX)
    extern __shared__ __attribute__((aligned(128))) unsigned char mmw_smem[];
    mmw_dense_tiles<1>(mmw_smem, w, row_bytes, ty, nb, m, n, xb, out, affine);
#endif
}
extern "C" __global__ void __launch_bounds__(128, 2)
    mmw_dense_m2(const unsigned char* __restrict__ w, long long row_bytes, int ty, int nb, int m,
                 int n, const unsigned int* __restrict__ xb, float* __restrict__ out, int affine,
                 unsigned int* counters) {
    gpu_count_launch(counters, KID_MMW_DENSE_M2);
#if defined(RF_MMA_PTX)
    extern __shared__ __attribute__((aligned(128))) unsigned char mmw_smem[];
    mmw_dense_tiles<2>(mmw_smem, w, row_bytes, ty, nb, m, n, xb, out, affine);
#endif
}

// The grouped form (MATMUL_ID, pairs sorted by moe_sort; as mmb_id): block row y takes
// the y-th non-empty list, its pairs 64 at a time over 128 rows of that expert; the
// masked list gets zeros. xb: bf16 pair columns of k values (per pair or per token).
// grid = (ceil(m / 128), min(pairs, n_experts) + 1), block and dynamic shared memory as
// mmw_dense (mmw_id_m2: as mmw_dense_m2).
extern "C" __global__ void __launch_bounds__(256, 2)
    mmw_id(const unsigned char* __restrict__ w, long long expert_bytes, long long row_bytes,
              int ty, int nb, int m, int n_experts, const unsigned int* __restrict__ xb,
              int act_per_pair, int n_slots, const int* __restrict__ offsets,
              const int* __restrict__ active, const int* __restrict__ sorted,
              float* __restrict__ out, int affine, unsigned int* counters) {
    gpu_count_launch(counters, KID_MMW_ID);
#if defined(RF_MMA_PTX)
    extern __shared__ __attribute__((aligned(128))) unsigned char mmw_smem[];
    mmw_id_tiles<1>(mmw_smem, w, expert_bytes, row_bytes, ty, nb, m, n_experts, xb, act_per_pair,
                    n_slots, offsets, active, sorted, out, affine);
#endif
}
extern "C" __global__ void __launch_bounds__(128, 2)
    mmw_id_m2(const unsigned char* __restrict__ w, long long expert_bytes, long long row_bytes,
              int ty, int nb, int m, int n_experts, const unsigned int* __restrict__ xb,
              int act_per_pair, int n_slots, const int* __restrict__ offsets,
              const int* __restrict__ active, const int* __restrict__ sorted,
              float* __restrict__ out, int affine, unsigned int* counters) {
    gpu_count_launch(counters, KID_MMW_ID_M2);
#if defined(RF_MMA_PTX)
    extern __shared__ __attribute__((aligned(128))) unsigned char mmw_smem[];
    mmw_id_tiles<2>(mmw_smem, w, expert_bytes, row_bytes, ty, nb, m, n_experts, xb, act_per_pair,
                    n_slots, offsets, active, sorted, out, affine);
#endif
}

// ---------------------------------------------------------------------------------
// PREFETCH (ABI 1.9): up to L2P_RANGES byte ranges (address a_r, n_r bytes) asked into
// L2, for ops queued after it on another stream to find there: a decode step's glue
// (mHC sites, attention, norms) leaves the memory idle for ~40% of the step, the
// products after it stream their weights from memory at 1.5-2x their read floor. On
// sm_90 a thread asks the copy engine for a whole L2P_CHUNK (cp.async.bulk.prefetch)
// and goes on; nothing waits for the bytes and nothing is written. Thread i of the
// grid takes chunks i, i + threads, .. of the ranges laid end to end. Without the bulk
// copies (HIP, older NVIDIA) the kernel does nothing and the backend does not offer
// the op. grid = any, block = 32.
#define L2P_RANGES 4
#define L2P_CHUNK 16384
extern "C" __global__ void __launch_bounds__(32)
    l2_prefetch(unsigned long long a0, long long n0, unsigned long long a1, long long n1,
                unsigned long long a2, long long n2, unsigned long long a3, long long n3,
                unsigned int* counters) {
#if defined(GPU_BULK)
    // (counted only where it asks for anything: a check that it ran is one that it did)
    gpu_count_launch(counters, KID_L2_PREFETCH);
    const unsigned long long a[L2P_RANGES] = {a0, a1, a2, a3};
    const long long n[L2P_RANGES] = {n0, n1, n2, n3};
    const long long threads = (long long)gridDim.x * blockDim.x;
    long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x, first = 0;
#pragma unroll
    for (int r = 0; r < L2P_RANGES; ++r) {
        // (the host gives 16-byte aligned starts; a tail under 16 bytes is left out)
        const long long bytes = n[r] & ~15ll, chunks = (bytes + L2P_CHUNK - 1) / L2P_CHUNK;
        for (; c < first + chunks; c += threads) {
            const long long off = (c - first) * L2P_CHUNK;
            const long long len = bytes - off < L2P_CHUNK ? bytes - off : L2P_CHUNK;
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a[r] + off),
                         "r"((unsigned int)len)
                         : "memory");
        }
        first += chunks;
    }
#endif
}

#if defined(GPU_PERM_SELFTEST)
#define GPU_PERM_SELFTEST_N 32
// kernels/check.sh (HIP): gpu_perm_nosign / gpu_perm_pos against gpu_perm_ref on 256
// pseudo-random selectors each, inputs all constant, so clang folds the whole kernel
// (v_perm_b32 included, by its own reading of the instruction) into one stored word:
// 0x600d600d when every case agrees, 0xbad0bad0 otherwise.
extern "C" __global__ void gpu_perm_selftest(unsigned int* out) {
    unsigned int bad = 0, x = 0x2545f491u;
#pragma unroll
    for (int i = 0; i < GPU_PERM_SELFTEST_N; ++i) {
        x = x * 1664525u + 1013904223u;
        const unsigned int s = x ^ (x >> 13);
        // The ROCmFP4 magnitudes (positive), the negative table, and arbitrary bytes.
        bad += gpu_perm_pos(0x03020100u, 0x0a080604u, s) != gpu_perm_ref(0x03020100u, 0x0a080604u, s);
        bad += gpu_perm_pos(0x7f3a1c00u, 0x01020408u, s >> 16) !=
               gpu_perm_ref(0x7f3a1c00u, 0x01020408u, s >> 16);
        const unsigned int n = s & 0x77777777u;
        bad += gpu_perm_nosign(0xfdfeff00u, 0xf6f8fafcu, n) != gpu_perm_ref(0xfdfeff00u, 0xf6f8fafcu, n);
        bad += gpu_perm_nosign(x, ~x, n >> 16) != gpu_perm_ref(x, ~x, n >> 16);
        unsigned int m[4];
        fp4_word_mags(s, 0x03020100u, m[0], m[1], m[2], m[3]);
        const unsigned int sn = s ^ 0x88888888u;
        bad += m[0] != gpu_perm_ref(0x03020100u, 0x0a080604u, s);
        bad += m[1] != gpu_perm_ref(0x03020100u, 0x0a080604u, sn);
        bad += m[2] != gpu_perm_ref(0x03020100u, 0x0a080604u, s >> 16);
        bad += m[3] != gpu_perm_ref(0x03020100u, 0x0a080604u, sn >> 16);
    }
    out[0] = bad == 0 ? 0x600d600du : 0xbad0bad0u;
}
#endif
