// DeepSeek-V4's per-token glue on the device: RMS norm + partial interleaved rotary,
// mHC pre (Sinkhorn, collapse, norm) and post, the learned compressors' pooling,
// the lightning indexer's scores and top-k, sparse attention with sinks over the
// sliding window and the compressed rows, the router, clamped SwiGLU, the MoE
// combine, a dense grouped mat-vec and a transpose. Same maths, in f32, as the host
// glue (host/engine/src/deepseek4/math.rs); only summation orders differ.
//
// Every kernel takes the positions of its chunk from device memory (`pos[t]`, the
// chunk's first at pos[0]) and sizes its grid for the worst case, so a captured decode
// step replays correctly at any position.
#include "common.cuh"
// The fused routed MoE (ds4_moe_routed) runs rocmfpx.cu's mat-vec warps. The backends
// compile the two files as one unit, rocmfpx.cu first; a compile of this file alone
// (kernels/check.sh) takes it in here.
#ifndef MOE_ROCMFPX_CU
#include "rocmfpx.cu"
#endif

#define KID_DS4_NORM_ROPE 18
#define KID_DS4_HC_PRE 19
#define KID_DS4_HC_POST 20
#define KID_DS4_COMP_POOL 21
#define KID_DS4_COMP_STORE 22
#define KID_DS4_INDEX_SCORES 23
#define KID_DS4_TOPK_ROWS 24
#define KID_DS4_ATTENTION 25
#define KID_DS4_WINDOW_STORE 26
#define KID_DS4_ROUTER 27
#define KID_DS4_SWIGLU 28
#define KID_DS4_MOE_COMBINE 29
#define KID_TRANSPOSE12 31
#define KID_DS4_HC_POST_PRE 44
#define KID_DS4_HC_SINKHORN 45
#define KID_DS4_ATTENTION_HEADS 46
#define KID_DS4_ATTENTION_MERGE 47
#define KID_DS4_INDEX_SCORES_MM 48
#define KID_DS4_INDEX_SCORES_MM_TC 49
#define KID_DS4_ATTENTION_DEC 56
#define KID_DS4_TOPK_ROWS_WIDE 57
#define KID_DS4_ROUTER_MM 59
#define KID_DS4_INDEX_SCORES_FEW 70
#define KID_DS4_ATTENTION_GRP 71
#define KID_DS4_ATTENTION_HEADS4 72
#define KID_DS4_ATTENTION_TC 73
#define KID_DS4_INDEX_SCORES_MM_TCS 74
#define KID_DS4_INDEX_SCORES_MM_TCS_BF16 75
#define KID_DS4_ATTENTION_TC_BF16 76
#define KID_DS4_MOE_ROUTED 77

#define DS4_HC_MAX 8           // mHC streams
#define DS4_COMP_MAX_DIM 1024  // compressed row width
#define DS4_HEAD_MAX 512       // attention head width (16 values per lane)
#define DS4_IDX_Q_MAX 8192     // indexer heads x dims staged in shared memory
#define DS4_IDX_DIM_MAX 256    // indexer head width (8 values per lane)
#define DS4_TOPK_MAX 16        // routed experts per token
#define DS4_ATT_WARPS 8
#define DS4_NEG_INF __int_as_float((int)0xff800000u)

GPU_DEV float ds4_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Sum over a block of `threads` (a multiple of 32); every thread gets it. `sh` holds
// 32 floats; the leading barrier lets a block call this back to back.
GPU_DEV float ds4_block_sum(float v, float* sh, int threads) {
    v = gpu_warp_sum(v);
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = threads >> 5;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    return gpu_warp_sum(l < nw ? sh[l] : 0.0f);
}

// Rotates the pair (a, b) by angle pos * f, scaled by mscale; `inverse` negates sin.
GPU_DEV void ds4_rotate(float& a, float& b, float pos, float f, float mscale, int inverse) {
    const float ang = pos * f;
    const float c = cosf(ang) * mscale;
    float s = sinf(ang) * mscale;
    if (inverse) s = -s;
    const float x0 = a, x1 = b;
    a = x0 * c - x1 * s;
    b = x1 * c + x0 * s;
}

// ---------------------------------------------------------------------------------
// RMS norm (norm 0: none, 1: plain, 2: times w) then rotary on the trailing 2*n_pairs
// values (interleaved pairs) of each d-row. x and out are [n][heads][d] (may alias).
// grid = (heads, n), block = 128.
#define DS4_NR_THREADS 128
// ONE_TRIP (a compile option, opt-in until measured: MOE_GPU_ONE_TRIP=1): rows up to
// this many values take ds4_norm_rope_row, for a decode step's one-block norms (q_a's
// 1024 values, a head's 512), which sit on the layer's critical path.
#define DS4_NR_ROW_MAX 1024

// Pair (2i, 2i + 1) of a ds4_norm_rope row: times r (and w where norm == 2), rotated
// where it lies in the trailing 2 n_pairs values (tail = d - 2 n_pairs), stored in row.
GPU_DEV void ds4_nr_pair(float a, float b, int i, int norm, float r, const float* __restrict__ w,
                         int tail, float p, const float* __restrict__ inv_freq, float mscale,
                         int inverse, float* row) {
    if (norm) {
        a *= r;
        b *= r;
        if (norm == 2) {
            a = w[2 * i] * a;
            b = w[2 * i + 1] * b;
        }
    }
    if (2 * i >= tail) ds4_rotate(a, b, p, inv_freq[(2 * i - tail) / 2], mscale, inverse);
    row[2 * i] = a;
    row[2 * i + 1] = b;
}

// One row of ds4_norm_rope with every load asked for at once: a thread's values of the
// sum (those of the loop below: t, t + 128, ..; the same sum in the same order) and its
// pairs (t, t + 128, ..), where the loop's stores (x and out may alias) keep each of
// its iterations' loads waiting for the one before: ~8 L2 round trips for q_a's norm
// against 1. The same bits as the loop.
GPU_DEV void ds4_norm_rope_row(const float* x, const float* __restrict__ w, int norm,
                               float eps, int d, const float* __restrict__ inv_freq,
                               int n_pairs, float mscale, int inverse, float p, long long base,
                               float* out, float* sh) {
    constexpr int T = DS4_NR_THREADS, NV = DS4_NR_ROW_MAX / T, NP = NV / 2;
    const int t = threadIdx.x;
    float v[NV], a[NP], b[NP];
#pragma unroll
    for (int k = 0; k < NV; ++k) v[k] = norm && t + T * k < d ? x[base + t + T * k] : 0.0f;
#pragma unroll
    for (int j = 0; j < NP; ++j) {
        const int i = t + T * j;
        a[j] = 2 * i < d ? x[base + 2 * i] : 0.0f;
        b[j] = 2 * i < d ? x[base + 2 * i + 1] : 0.0f;
    }
    float r = 1.0f;
    if (norm) {
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < NV; ++k)
            if (t + T * k < d) s += v[k] * v[k];
        s = ds4_block_sum(s, sh, T);
        r = 1.0f / sqrtf(s / (float)d + eps);
    }
    const int tail = d - 2 * n_pairs;
#pragma unroll
    for (int j = 0; j < NP; ++j) {
        const int i = t + T * j;
        if (2 * i < d) ds4_nr_pair(a[j], b[j], i, norm, r, w, tail, p, inv_freq, mscale, inverse,
                                   out + base);
    }
}

extern "C" __global__ void __launch_bounds__(DS4_NR_THREADS)
    ds4_norm_rope(const float* x, const float* __restrict__ w, int norm, float eps, int d,
                  int heads, const float* __restrict__ inv_freq, int n_pairs, float mscale,
                  int inverse, const int* __restrict__ pos, float* out, unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_NORM_ROPE);
    __shared__ float sh[32];
    const long long base = ((long long)blockIdx.y * heads + blockIdx.x) * d;
#if defined(ONE_TRIP)
    if (d <= DS4_NR_ROW_MAX) {
        const float p = n_pairs ? (float)pos[blockIdx.y] : 0.0f;
        ds4_norm_rope_row(x, w, norm, eps, d, inv_freq, n_pairs, mscale, inverse, p, base, out,
                          sh);
        return;
    }
#endif
    float r = 1.0f;
    if (norm) {
        float s = 0.0f;
        for (int i = threadIdx.x; i < d; i += 128) s += x[base + i] * x[base + i];
        s = ds4_block_sum(s, sh, 128);
        r = 1.0f / sqrtf(s / (float)d + eps);
    }
    const int tail = d - 2 * n_pairs;
    const float p = n_pairs ? (float)pos[blockIdx.y] : 0.0f;
    for (int i = threadIdx.x; 2 * i < d; i += 128)
        ds4_nr_pair(x[base + 2 * i], x[base + 2 * i + 1], i, norm, r, w, tail, p, inv_freq, mscale,
                    inverse, out + base);
}

// Divides each row (ROWS = 1) or column (ROWS = 0) of the HC x HC matrix c by its
// sum + eps.
template <int HC, int ROWS>
GPU_DEV void ds4_norm_lines(float* c, float eps) {
#pragma unroll
    for (int l = 0; l < HC; ++l) {
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < HC; ++j) sum += c[ROWS ? l * HC + j : j * HC + l];
        sum += eps;
#pragma unroll
        for (int j = 0; j < HC; ++j) c[ROWS ? l * HC + j : j * HC + l] /= sum;
    }
}

// The logits of the comb matrix (Sinkhorn's input) at entry i: mixes M, bases B.
GPU_DEV float ds4_comb_logit(const float* M, const float* B, float scale, int hc, int i) {
    return M[2 * hc + i] * scale + B[2 * hc + i];
}

// Softmax rows (+eps) of the logits L, then Sinkhorn: a column normalisation, then
// iters - 1 rounds of rows and columns (each sum + eps). In registers: HC is a
// compile-time size; out may be L.
template <int HC>
GPU_DEV void ds4_sinkhorn_logits(const float* L, int iters, float eps, float* out) {
    float c[HC * HC];
#pragma unroll
    for (int i = 0; i < HC * HC; ++i) c[i] = L[i];
#pragma unroll
    for (int i = 0; i < HC; ++i) {
        float mx = DS4_NEG_INF, sum = 0.0f;
#pragma unroll
        for (int j = 0; j < HC; ++j) mx = fmaxf(mx, c[i * HC + j]);
#pragma unroll
        for (int j = 0; j < HC; ++j) {
            c[i * HC + j] = expf(c[i * HC + j] - mx);
            sum += c[i * HC + j];
        }
#pragma unroll
        for (int j = 0; j < HC; ++j) c[i * HC + j] = c[i * HC + j] / sum + eps;
    }
    for (int it = 0; it < (iters > 1 ? iters : 1); ++it) {
        if (it > 0) ds4_norm_lines<HC, 1>(c, eps);
        ds4_norm_lines<HC, 0>(c, eps);
    }
#pragma unroll
    for (int i = 0; i < HC * HC; ++i) out[i] = c[i];
}

template <int HC>
GPU_DEV void ds4_sinkhorn(const float* M, const float* B, float scale, int iters, float eps,
                          float* out) {
    float l[HC * HC];
#pragma unroll
    for (int i = 0; i < HC * HC; ++i) l[i] = ds4_comb_logit(M, B, scale, HC, i);
    ds4_sinkhorn_logits<HC>(l, iters, eps, out);
}

// ds4_sinkhorn on one warp, lane i * HC + j holding entry (i, j) (HC * HC <= 32): every
// row / column sum is taken in the same order as the serial version, so the result is
// the same bit for bit, with 2 * iters divisions per lane instead of HC^2 per round.
// Lane L brings logit c of entry L (lanes HC * HC.. any value).
template <int HC>
GPU_DEV void ds4_sinkhorn_warp_c(float c, int iters, float eps, float* out) {
    const int L = threadIdx.x & 31;
    const bool on = L < HC * HC;
    const int i = on ? L / HC : 0, j = on ? L % HC : 0;
    float mx = DS4_NEG_INF, sum = 0.0f;
#pragma unroll
    for (int jj = 0; jj < HC; ++jj) mx = fmaxf(mx, gpu_shfl(c, i * HC + jj));
    c = expf(c - mx);
#pragma unroll
    for (int jj = 0; jj < HC; ++jj) sum += gpu_shfl(c, i * HC + jj);
    c = c / sum + eps;
    for (int it = 0; it < (iters > 1 ? iters : 1); ++it) {
        if (it > 0) {
            float rs = 0.0f;
#pragma unroll
            for (int jj = 0; jj < HC; ++jj) rs += gpu_shfl(c, i * HC + jj);
            c /= rs + eps;
        }
        float cs = 0.0f;
#pragma unroll
        for (int jj = 0; jj < HC; ++jj) cs += gpu_shfl(c, jj * HC + j);
        c /= cs + eps;
    }
    if (on) out[L] = c;
}

template <int HC>
GPU_DEV void ds4_sinkhorn_warp(const float* M, const float* B, float scale, int iters, float eps,
                               float* out) {
    const int L = threadIdx.x & 31;
    ds4_sinkhorn_warp_c<HC>(L < HC * HC ? ds4_comb_logit(M, B, scale, HC, L) : 0.0f, iters, eps, out);
}

// The Sinkhorn for hc streams into out (hc * hc values), called by a whole warp: the
// warp form up to 5 streams, lane 0 alone above.
GPU_DEV void ds4_sinkhorn_hc(int hc, const float* M, const float* B, float scale, int iters,
                             float eps, float* out) {
    switch (hc) {
    case 1: ds4_sinkhorn_warp<1>(M, B, scale, iters, eps, out); break;
    case 2: ds4_sinkhorn_warp<2>(M, B, scale, iters, eps, out); break;
    case 3: ds4_sinkhorn_warp<3>(M, B, scale, iters, eps, out); break;
    case 4: ds4_sinkhorn_warp<4>(M, B, scale, iters, eps, out); break;
    case 5: ds4_sinkhorn_warp<5>(M, B, scale, iters, eps, out); break;
    default:
        if ((threadIdx.x & 31) == 0) {
            if (hc == 6) ds4_sinkhorn<6>(M, B, scale, iters, eps, out);
            else if (hc == 7) ds4_sinkhorn<7>(M, B, scale, iters, eps, out);
            else ds4_sinkhorn<8>(M, B, scale, iters, eps, out);
        }
        break;
    }
}

// ds4_sinkhorn_hc from the logits, in place (L: hc * hc values), called by a whole warp.
GPU_DEV void ds4_sinkhorn_hc_logits(int hc, float* L, int iters, float eps) {
    const int lane = threadIdx.x & 31;
    const float c = lane < hc * hc ? L[lane] : 0.0f;
    switch (hc) {
    case 1: ds4_sinkhorn_warp_c<1>(c, iters, eps, L); break;
    case 2: ds4_sinkhorn_warp_c<2>(c, iters, eps, L); break;
    case 3: ds4_sinkhorn_warp_c<3>(c, iters, eps, L); break;
    case 4: ds4_sinkhorn_warp_c<4>(c, iters, eps, L); break;
    case 5: ds4_sinkhorn_warp_c<5>(c, iters, eps, L); break;
    default:
        if (lane == 0) {
            if (hc == 6) ds4_sinkhorn_logits<6>(L, iters, eps, L);
            else if (hc == 7) ds4_sinkhorn_logits<7>(L, iters, eps, L);
            else ds4_sinkhorn_logits<8>(L, iters, eps, L);
        }
        break;
    }
}

// The comb matrices HC_PRE / HC_POST_PRE left as logits (defer = 1), finished in place:
// wts is [nm, n] (nm = 2hc + hc^2), the logits at 2hc... grid = n, block = 32.
extern "C" __global__ void __launch_bounds__(32)
    ds4_hc_sinkhorn(float* __restrict__ wts, int hc, int iters, float eps,
                    unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_HC_SINKHORN);
    ds4_sinkhorn_hc_logits(hc, wts + (long long)blockIdx.x * (2 * hc + hc * hc) + 2 * hc, iters,
                           eps);
}

// mHC pre's weights from the staged mixes M, bases B and scales S: pre (threads < hc)
// sigmoid + eps and, in site mode, post (threads 32 .. 32 + hc) 2 sigmoid. One
// definition for ds4_hc_pre and ds4_hc_post_pre.
GPU_DEV void ds4_hc_weights(int tid, int hc, int head_mode, const float* M, const float* B,
                            const float* S, float hc_eps, float* W) {
    if (tid < hc) W[tid] = ds4_sigmoid(M[tid] * S[0] + B[tid]) + hc_eps;
    if (!head_mode && tid >= 32 && tid < 32 + hc)
        W[hc + tid - 32] = 2.0f * ds4_sigmoid(M[tid - 32 + hc] * S[1] + B[tid - 32 + hc]);
}

// x += w v on four values (a stream's part of the collapse).
GPU_DEV void ds4_axpy4(gpu_f4& x, float w, const gpu_f4 v) {
    x.x += w * v.x;
    x.y += w * v.y;
    x.z += w * v.z;
    x.w += w * v.w;
}

// g (x r) on four values (the collapse RMS-normed times its weights).
GPU_DEV gpu_f4 ds4_norm4(const gpu_f4 g, const gpu_f4 x, float r) {
    return gpu_f4{g.x * (x.x * r), g.y * (x.y * r), g.z * (x.z * r), g.w * (x.w * r)};
}

// ---------------------------------------------------------------------------------
// mHC pre: `mix` holds W * streams (the un-normalised streams; the RMS factor of the
// streams is applied here, which equals projecting the normalised streams). Site mode:
// pre = sigmoid(.)+eps, post = 2 sigmoid(.), comb = Sinkhorn(softmax rows); head mode:
// pre only. Then x = sum_h pre_h stream_h, RMS-normed times norm_w. wts gets
// [pre, post, comb] (site) or [pre] (head) per token. One block of 1024 threads per
// token (a decode step runs one token: the block's width is the parallelism), the
// Sinkhorn on warp 0 (HC <= 5) or thread 0. allow_fast = 0 keeps the general path (A/B
// runs). split = 1 (site mode, grid y = 2): on the fast path block (t, 1) runs the
// Sinkhorn (20 serial rounds, the longest chain) while block (t, 0) collapses and norms;
// both take the streams' RMS (the same sums, so the same bits). defer = 1: the comb
// matrix is left as the Sinkhorn's logits, for ds4_hc_sinkhorn to finish off the
// critical path. grid = (n, 1 + split), block = DS4_HC_THREADS.
#define DS4_HC_THREADS 1024
extern "C" __global__ void __launch_bounds__(DS4_HC_THREADS)
    ds4_hc_pre(const float* __restrict__ streams, const float* __restrict__ mix,
               const float* __restrict__ scale, const float* __restrict__ base,
               const float* __restrict__ norm_w, int d, int hc, int iters, float eps,
               float hc_eps, int head_mode, float* __restrict__ out, float* __restrict__ wts,
               int allow_fast, int split, int defer, unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_HC_PRE);
    __shared__ float sh[32];
    __shared__ float W[2 * DS4_HC_MAX + DS4_HC_MAX * DS4_HC_MAX];
    const int t = blockIdx.x, tid = threadIdx.x, role = blockIdx.y;
    const float* s = streams + (long long)t * hc * d;
    float* o = out + (long long)t * d;
    // Fast path (V4-Flash: d = 4096, 4 streams): thread i holds values 4i..4i+3 of every
    // stream in registers from one round of 16-byte loads, so nothing is read twice,
    // and the Sinkhorn (warp 0, or the second block with split) overlaps the collapse.
    const bool fast = allow_fast && hc <= 4 && (d & 3) == 0 && d <= 4 * DS4_HC_THREADS &&
                      ((((unsigned long long)s) | ((unsigned long long)o) |
                        ((unsigned long long)norm_w)) & 15ull) == 0;
    const bool two = split && fast && !head_mode;
    if (role == 1 && !two) return;  // the whole block: before any barrier
    gpu_f4 v[4];
    const bool mine = fast && 4 * tid < d;
    float acc = 0.0f;
    if (fast) {
#pragma unroll
        for (int h = 0; h < 4; ++h)
            if (h < hc && mine) v[h] = *(const gpu_f4*)(s + (long long)h * d + 4 * tid);
#pragma unroll
        for (int h = 0; h < 4; ++h)
            if (h < hc && mine)
                acc += v[h].x * v[h].x + v[h].y * v[h].y + v[h].z * v[h].z + v[h].w * v[h].w;
    } else {
        for (int i = tid; i < hc * d; i += DS4_HC_THREADS) acc += s[i] * s[i];
    }
    acc = ds4_block_sum(acc, sh, DS4_HC_THREADS);
    const float r = 1.0f / sqrtf(acc / (float)(hc * d) + eps);
    const int nm = head_mode ? hc : 2 * hc + hc * hc;
    // Stage the mixes (times the streams' RMS factor), bases and scales in parallel; the
    // Sinkhorn below then reads only shared memory.
    __shared__ float M[2 * DS4_HC_MAX + DS4_HC_MAX * DS4_HC_MAX];
    __shared__ float B[2 * DS4_HC_MAX + DS4_HC_MAX * DS4_HC_MAX];
    __shared__ float S[3];
    for (int i = tid; i < nm; i += DS4_HC_THREADS) {
        M[i] = mix[(long long)t * nm + i] * r;
        B[i] = base[i];
    }
    if (tid < (head_mode ? 1 : 3)) S[tid] = scale[tid];
    __syncthreads();
    if (role == 0) ds4_hc_weights(tid, hc, head_mode, M, B, S, hc_eps, W);
    if (fast && role == 0) __syncthreads();  // W[0..hc) is all the collapse needs
    if (!head_mode && (!two || role == 1)) {
        if (defer) {
            if (tid < hc * hc) W[2 * hc + tid] = ds4_comb_logit(M, B, S[2], hc, tid);
        } else if (tid < 32) {
            ds4_sinkhorn_hc(hc, M, B, S[2], iters, hc_eps, W + 2 * hc);
        }
    }
    if (role == 1) {  // split: this block's part of wts is the Sinkhorn's
        __syncthreads();
        if (tid < hc * hc) wts[(long long)t * nm + 2 * hc + tid] = W[2 * hc + tid];
        return;
    }
    if (fast) {
        gpu_f4 c = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int h = 0; h < 4; ++h)
            if (h < hc && mine) ds4_axpy4(c, W[h], v[h]);
        float ss = mine ? c.x * c.x + c.y * c.y + c.z * c.z + c.w * c.w : 0.0f;
        // Its barriers also publish warp 0's Sinkhorn (without split: with it, block
        // (t, 1) has the Sinkhorn and writes its part of wts).
        ss = ds4_block_sum(ss, sh, DS4_HC_THREADS);
        const int mine_w = two ? 2 * hc : nm;  // with split, block (t, 1) writes the rest
        for (int i = tid; i < mine_w; i += DS4_HC_THREADS) wts[(long long)t * nm + i] = W[i];
        const float rr = 1.0f / sqrtf(ss / (float)d + eps);
        if (mine) {
            const gpu_f4 nw = *(const gpu_f4*)(norm_w + 4 * tid);
            *(gpu_f4*)(o + 4 * tid) = ds4_norm4(nw, c, rr);
        }
        return;
    }
    __syncthreads();
    for (int i = tid; i < nm; i += DS4_HC_THREADS) wts[(long long)t * nm + i] = W[i];
    float ss = 0.0f;
    for (int i = tid; i < d; i += DS4_HC_THREADS) {
        float v = 0.0f;
        for (int h = 0; h < hc; ++h) v += W[h] * s[(long long)h * d + i];
        o[i] = v;
        ss += v * v;
    }
    ss = ds4_block_sum(ss, sh, DS4_HC_THREADS);
    const float rr = 1.0f / sqrtf(ss / (float)d + eps);
    for (int i = tid; i < d; i += DS4_HC_THREADS) o[i] = norm_w[i] * (o[i] * rr);
}

// The MoE's output: sum_j w[t][j] * y[t*k + j] (+ shared[t]), value i of token t. One
// definition for ds4_moe_combine and the mHC post that takes the MoE's outputs.
// ONE_TRIP: up to DS4_COMBINE_BATCH experts, every weight and value is asked for before
// the first product (the loop of runtime length leaves its loads in groups, one round
// trip each, on the mHC site's critical path); the same products in the same order.
#define DS4_COMBINE_BATCH 8
GPU_DEV float ds4_combine(const float* __restrict__ y, const float* __restrict__ w,
                          const float* __restrict__ shared, int d, int k, int t, int i) {
    float acc = 0.0f;
#if defined(ONE_TRIP)
    if (k <= DS4_COMBINE_BATCH) {
        float wv[DS4_COMBINE_BATCH], yv[DS4_COMBINE_BATCH];
#pragma unroll
        for (int j = 0; j < DS4_COMBINE_BATCH; ++j) {
            wv[j] = j < k ? w[(long long)t * k + j] : 0.0f;
            yv[j] = j < k ? y[((long long)t * k + j) * d + i] : 0.0f;
        }
        const float sh = shared ? shared[(long long)t * d + i] : 0.0f;
#pragma unroll
        for (int j = 0; j < DS4_COMBINE_BATCH; ++j)
            if (j < k) acc = fmaf(wv[j], yv[j], acc);
        return shared ? acc + sh : acc;
    }
#endif
    for (int j = 0; j < k; ++j)
        acc = fmaf(w[(long long)t * k + j], y[((long long)t * k + j) * d + i], acc);
    if (shared) acc += shared[(long long)t * d + i];
    return acc;
}

// Stream o's new value at one column: post_o * b + sum_j comb[j][o] * old_j (W: one
// token's [pre, post, comb]). One definition for ds4_hc_post and ds4_hc_post_pre.
GPU_DEV float ds4_post_value(const float* W, int hc, int o, float b, const float* old) {
    float acc = W[hc + o] * b;
#pragma unroll
    for (int j = 0; j < DS4_HC_MAX; ++j)
        if (j < hc) acc += W[2 * hc + j * hc + o] * old[j];
    return acc;
}

// mHC post, in place: new_k = post_k * block + sum_j comb[j][k] * old_j. With y set,
// block is the MoE's output combined here (ds4_combine of y, rw, shared; k experts a
// token), so the MoE needs no combine launch of its own.
// grid = (ceil(d / 256), n), block = 256.
extern "C" __global__ void __launch_bounds__(256)
    ds4_hc_post(float* __restrict__ streams, const float* __restrict__ block,
                const float* __restrict__ wts, int d, int hc, const float* __restrict__ y,
                const float* __restrict__ rw, int k, const float* __restrict__ shared,
                unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_HC_POST);
    const int i = blockIdx.x * 256 + threadIdx.x, t = blockIdx.y;
    if (i >= d) return;
    float* s = streams + (long long)t * hc * d;
    const float* W = wts + (long long)t * (2 * hc + hc * hc);
    float old[DS4_HC_MAX];
#pragma unroll
    for (int j = 0; j < DS4_HC_MAX; ++j) old[j] = j < hc ? s[(long long)j * d + i] : 0.0f;
    const float b = y ? ds4_combine(y, rw, shared, d, k, t, i) : block[(long long)t * d + i];
#pragma unroll
    for (int o = 0; o < DS4_HC_MAX; ++o) {
        if (o >= hc) break;
        s[(long long)o * d + i] = ds4_post_value(W, hc, o, b, old);
    }
}

// ---------------------------------------------------------------------------------
// mHC post, then the next site's mixes and mHC pre, in one launch: a decode step's
// post, mix product and pre (three dependent launches, the pre on one block) become
// one, with the mix product spread over the device. Block b of token t owns columns
// [b C, b C + C) of every stream (C = DS4_HCF_THREADS / hcp, hcp = hc rounded up to a
// power of two, hc <= 4): it applies the post (ds4_post_value, the bits of
// ds4_hc_post; post_mode 1: of `block`, 2: of the MoE's y / rw / shared, 0: none),
// then writes its share of the mixes (fn's rows against its new stream values) and of
// the streams' sum of squares to part[t][b][0..nm] (gsync: the Gram shares after them).
// The token's last block to finish (the count in sync[t]'s low 16 bits, which it puts
// back to zero) sums the shares in block order
// (the same bits whichever block is last) and runs mHC pre as ds4_hc_pre does: warp 0
// the Sinkhorn (defer = 1: its logits, for ds4_hc_sinkhorn), the other warps the
// collapse and norm. The constants (fn, base, scale, norm_w) are loaded before the
// dependent-launch wait. wts: the previous site's weights are read (post), this
// site's are written (nm a token; with head_mode only for one token, as the head's
// weights are packed tighter). Needs hc <= 4, d % 4 == 0,
// d <= DS4_HCF_MAX_D, streams / out / norm_w 16-byte aligned.
//   gsync = 1 (one token; the host keeps the blocks to DS4_HCF_GSYNC_BLOCKS and to the
// device's multiprocessors, so all of them are resident at once; kernels queued after
// it on the stream start only once each of its blocks has): no last block. Each block
// also writes its columns' share of the streams' Gram matrix G (G_ab = sum_i s_a[i]
// s_b[i], a <= b), all blocks wait for each other on sync[t] (count in the low 16 bits,
// a generation above), then each sums the shares itself (the same order, so the same
// mixes and weights as the last block's) and writes x for its own columns, from the
// stream values it holds, normed by |x|^2 = sum_ab pre_a pre_b G_ab; block 0 writes
// wts. The token's one-block collapse (64 KB from L2, a reduction) leaves the path.
// With xq (gsync only, d % 32 == 0; null otherwise) each block also stores its columns
// of x as q8_1 blocks in the type-107 mat-vecs' plane order.
// grid = (ceil(d / C), n), block = DS4_HCF_THREADS.
#define DS4_HCF_THREADS 512
#define DS4_HCF_WARPS (DS4_HCF_THREADS / 32)
#define DS4_HCF_ROWS 2  // mix rows a warp (nm <= 24 <= 2 * DS4_HCF_WARPS)
#define DS4_HCF_VALS (DS4_HCF_THREADS / 32)
#define DS4_HCF_X4 5        // collapse float4s a thread of warps 1..
#define DS4_HCF_MAX_D 8192  // <= 4 * (DS4_HCF_THREADS - 32) * DS4_HCF_X4
#define DS4_HCF_GSYNC_BLOCKS 64
#define DS4_HCF_PAIRS 10  // Gram entries a <= b of 4 streams (<= DS4_HCF_WARPS)
// Gram entry q of hc streams as the pair (a, a2), a <= a2, in row order: (0, 0), (0, 1),
// .. (0, hc - 1), (1, 1), .. One definition for the shares and for |x|^2.
GPU_DEV void ds4_gram_pair(int hc, int q, int& a, int& a2) {
    a = 0;
    while (q >= hc - a) q -= hc - a++;
    a2 = a + q;
}

// The parts of ds4_hc_post_pre's end that both of its forms run.
// The token's mixes and sum of squares from the blocks' shares (in block order: the
// same bits in whichever block sums them, mix[nm + 1..] the Gram shares' sums too), then
// mHC pre's weights as ds4_hc_pre takes them: M (mixes times the streams' RMS factor),
// B, S and Wn (pre, and post in site mode).
GPU_DEV void ds4_hcf_weights(int t, int nb, int tid, int lane, int warp, int hc, int nm, int pr,
                             int head_mode, float eps, float hc_eps, long long hd,
                             const float* part, float base_t, float scale_t, float* mix, float* M,
                             float* B, float* Wn, float* S) {
    const float* tp = part + (long long)t * nb * pr;
#if defined(HCF_SUM_BATCH)
    // HCF_SUM_BATCH (a compile option, on in the CUDA backend by default): a warp asks
    // for all of its rows' shares at once (at most 3 rows x 2 a lane: pr <= 35, nb <= 64), then adds
    // them in the same order, where the loop below waits for each share before asking
    // for the next (~6 round trips to L2 in a row on a decode step's critical path).
    if (pr <= 3 * DS4_HCF_WARPS && nb <= 64) {
        float v[3][2];
#pragma unroll
        for (int q = 0; q < 3; ++q) {
            const int r = warp + DS4_HCF_WARPS * q;
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int j = lane + 32 * u;
                v[q][u] = r < pr && j < nb ? gpu_load_l2(tp + (long long)j * pr + r) : 0.0f;
            }
        }
#pragma unroll
        for (int q = 0; q < 3; ++q) {
            const int r = warp + DS4_HCF_WARPS * q;
            if (r >= pr) break;  // (the same for the whole warp)
            float a = 0.0f;
#pragma unroll
            for (int u = 0; u < 2; ++u)
                if (lane + 32 * u < nb) a += v[q][u];
            a = gpu_warp_sum(a);
            if (lane == 0) mix[r] = a;
        }
    } else
#endif
    for (int r = warp; r < pr; r += DS4_HCF_WARPS) {
        float a = 0.0f;
        for (int j = lane; j < nb; j += 32) a += gpu_load_l2(tp + (long long)j * pr + r);
        a = gpu_warp_sum(a);
        if (lane == 0) mix[r] = a;
    }
    __syncthreads();
    const float rs = 1.0f / sqrtf(mix[nm] / (float)hd + eps);
    if (tid < nm) {
        M[tid] = mix[tid] * rs;
        B[tid] = base_t;
    }
    if (tid < (head_mode ? 1 : 3)) S[tid] = scale_t;
    __syncthreads();
    ds4_hc_weights(tid, hc, head_mode, M, B, S, hc_eps, Wn);
    __syncthreads();
}

// Warp 0: the site's weights into wts: pre and post, and the comb matrix: the Sinkhorn
// (only the next post reads it) or its logits for ds4_hc_sinkhorn (defer).
GPU_DEV void ds4_hcf_write_wts(int t, int lane, int hc, int nm, int head_mode, int defer, int iters,
                               float hc_eps, const float* M, const float* B, const float* S,
                               float* Wn, float* __restrict__ wts) {
    float* wo = wts + (long long)t * nm;
    if (lane < (head_mode ? hc : 2 * hc)) wo[lane] = Wn[lane];
    if (!head_mode && defer) {
        if (lane < hc * hc) wo[2 * hc + lane] = ds4_comb_logit(M, B, S[2], hc, lane);
    } else if (!head_mode) {
        ds4_sinkhorn_hc(hc, M, B, S[2], iters, hc_eps, Wn + 2 * hc);
        if (lane < hc * hc) wo[2 * hc + lane] = Wn[2 * hc + lane];
    }
}

// Each lane's v[i] summed over the warp, for i = lane: 32 values a lane in, 31 exchanges
// (at each step a lane keeps the half of its values its partner does not).
// (A step a template instance: every index a constant, so the array stays in registers
// even where the compiler would not unroll a nested loop of the caller's size.)
template <int O>
GPU_DEV void ds4_warp_transpose_step(float (&v)[32], int lane) {
    const bool hi = (lane & O) != 0;
#pragma unroll
    for (int i = 0; i < O; ++i) {
        const float lo_v = v[i], hi_v = v[i + O];
        v[i] = (hi ? hi_v : lo_v) + gpu_shfl_xor(hi ? lo_v : hi_v, O);
    }
    if constexpr (O > 1) ds4_warp_transpose_step<O / 2>(v, lane);
}

GPU_DEV float ds4_warp_transpose_sum(float (&v)[32]) {
    ds4_warp_transpose_step<16>(v, threadIdx.x & 31);
    return v[0];
}

// ---------------------------------------------------------------------------------
// The routers' parts: ds4_router, ds4_router_mm and the MoE site's routing
// (ds4_hc_post_pre with wr) share them.
// A router score: sigmoid (gating 2) or sqrt(softplus) (4) of the logit.
GPU_DEV float ds4_router_score(float v, int gating) {
    return gating == 2 ? ds4_sigmoid(v) : sqrtf(v > 20.0f ? v : log1pf(expf(v)));
}

// The value an expert is selected by: its score (+ its bias b in mode 1), NaN as -inf.
GPU_DEV float ds4_router_key(float score, float b, int mode) {
    const float v = mode == 1 ? score + b : score;
    return v == v ? v : DS4_NEG_INF;
}

// The weights of the k chosen experts (in choice order) from their scores, written
// with their ids for token t: one thread. One definition for both routers.
GPU_DEV void ds4_router_write(const float* sc, const int* chosen, int k, int norm_topk,
                              float routed_scale, int t, int* __restrict__ ids,
                              float* __restrict__ wout) {
    float w[DS4_TOPK_MAX];
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) {
        w[j] = sc[chosen[j]];
        sum += w[j];
    }
    for (int j = 0; j < k; ++j) {
        float v = norm_topk ? w[j] / (sum + 1e-20f) : w[j];
        ids[(long long)t * k + j] = chosen[j];
        wout[(long long)t * k + j] = v * routed_scale;
    }
}

// The hash-table row of token t (mode 2) as chosen[0..k): out-of-range tokens take row
// 0 and ids are clamped into 0..E, as on the CPU. Threads 0..k-1.
GPU_DEV void ds4_router_hashed(const int* __restrict__ table, int table_rows,
                               const int* __restrict__ tokens, int t, int n_expert, int k,
                               int* chosen) {
    const int j = threadIdx.x;
    if (j < k) {
        const int tok = tokens[t] >= 0 && tokens[t] < table_rows ? tokens[t] : 0;
        const int e = table[(long long)tok * k + j];
        chosen[j] = e < 0 ? 0 : (e >= n_expert ? n_expert - 1 : e);
    }
}

// Whether expert (v, e) goes before (bv, be) in the router's order: a higher selection
// value, or the same and a lower index; be < 0 is no expert.
GPU_DEV bool ds4_router_before(float v, int e, float bv, int be) {
    return be < 0 || (e >= 0 && (v > bv || (v == bv && e < be)));
}

// Expert e (bit i of the lane's `taken`) into the lane's best (bv, be) if it is not
// taken and goes before it.
GPU_DEV void ds4_router_consider(float v, int e, int i, unsigned int taken, float& bv, int& be) {
    if (!((taken >> i) & 1u) && ds4_router_before(v, e, bv, be)) {
        bv = v;
        be = e;
    }
}

// The k best experts of sv[0..n) (the key order of ds4_router_before) on one warp, into
// chosen[0..k) in order; NV = 8 values a lane in registers (n <= 256), 0 from shared
// memory. The same choice either way.
template <int NV>
GPU_DEV void ds4_router_pick(const float* sv, int n, int k, int* chosen) {
    const int lane = threadIdx.x & 31;
    unsigned int taken = 0;  // bit i: expert lane + 32 i
    float vals[NV > 0 ? NV : 1];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int e = lane + 32 * i;
        vals[i] = e < n ? sv[e] : DS4_NEG_INF;
        if (e >= n) taken |= 1u << i;
    }
    for (int j = 0; j < k; ++j) {
        float bv = DS4_NEG_INF;
        int be = -1;
        if (NV > 0) {
#pragma unroll
            for (int i = 0; i < NV; ++i) ds4_router_consider(vals[i], lane + 32 * i, i, taken, bv, be);
        } else {
            for (int i = 0, e = lane; e < n; ++i, e += 32) ds4_router_consider(sv[e], e, i, taken, bv, be);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = gpu_shfl_xor(bv, o);
            const int oe = __float_as_int(gpu_shfl_xor(__int_as_float(be), o));
            if (ds4_router_before(ov, oe, bv, be)) {
                bv = ov;
                be = oe;
            }
        }
        if ((be & 31) == lane) taken |= 1u << (be >> 5);
        if (lane == 0) chosen[j] = be;
    }
}

// The MoE site's routing (ds4_hc_post_pre with wr; one token, gsync, C = 128): the
// router's product and selection inside the site, so the routed experts' products wait
// for no launch of their own. x = rr norm_w * sum_h pre_h s_h is linear in the streams,
// so logit_e = sum_i wr[e][i] x[i] = rr sum_h pre_h P[e][h], P[e][h] = sum_i wr[e][i]
// norm_w[i] s_h[i]: each block adds its columns' part of P before the grid barrier (from
// the stream values it holds, while pre and rr are not yet known), and block 0 sums the
// parts after it and selects as ds4_router_mm does. Not the bits of ds4_router_mm (the
// sums run in another order): a near tie can choose differently.
struct ds4_hcf_router {
    const float* wr;    // [ne, d] f32 (null: no routing)
    float* logits;      // [ne] out
    int* ids;           // [k] out
    float* wout;        // [k] out
    float* part;        // [nb, ne, 4] scratch: the blocks' parts of P
    int ne, k, gating, norm_topk, mode;
    float scale;
};
#define DS4_HCF_ROUTE_MAX 256  // experts (8 a lane in ds4_router_pick; 2 threads an expert)

// Block b's part of P (see ds4_hcf_router): warp w takes experts w + 16 j, eight at a
// time; lane l its columns 4l .. 4l + 3 of the block's C = 128, the norm's weights nwr,
// the streams' values from sv. A warp's 32 sums (8 experts x 4 streams) are added over
// its lanes in one transposing butterfly: lane i stores expert i / 4's stream i % 4.
GPU_DEV void ds4_hcf_route_part(const ds4_hcf_router& r, int t, int b, int nb, int lane,
                                int warp, int hc, int C, int d, gpu_f4 nwr, const float* sv) {
    float a[4][4];
#pragma unroll
    for (int h = 0; h < 4; ++h) {
        const bool on = h < hc;
        a[h][0] = on ? nwr.x * sv[h * C + 4 * lane] : 0.0f;
        a[h][1] = on ? nwr.y * sv[h * C + 4 * lane + 1] : 0.0f;
        a[h][2] = on ? nwr.z * sv[h * C + 4 * lane + 2] : 0.0f;
        a[h][3] = on ? nwr.w * sv[h * C + 4 * lane + 3] : 0.0f;
    }
    float* dst = r.part + ((long long)t * nb + b) * r.ne * 4;
    for (int e0 = warp; e0 < r.ne; e0 += 8 * DS4_HCF_WARPS) {  // (the same for the warp)
        gpu_f4 w[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int e = e0 + DS4_HCF_WARPS * j;
            w[j] = e < r.ne ? *(const gpu_f4*)(r.wr + (long long)e * d + b * C + 4 * lane)
                            : gpu_f4{0.0f, 0.0f, 0.0f, 0.0f};
        }
        float v[32];
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int h = 0; h < 4; ++h)
                v[4 * j + h] = w[j].x * a[h][0] + w[j].y * a[h][1] + w[j].z * a[h][2] + w[j].w * a[h][3];
        const float p = ds4_warp_transpose_sum(v);
        const int e = e0 + DS4_HCF_WARPS * (lane >> 2);
        if (e < r.ne) dst[e * 4 + (lane & 3)] = p;
    }
}

// Block 0 after the barrier: the logits from the blocks' parts (thread e + 256 s adds
// blocks s, s + 2, .. of expert e; then the two halves in order), scaled by pre and rr,
// then the scores, keys and the choice as ds4_router_mm makes them. bias_t: thread
// tid's expert's bias, loaded before the dependent-launch wait.
GPU_DEV void ds4_hcf_route(const ds4_hcf_router& r, int t, int nb, int tid, int lane, int warp,
                           int hc, float rr, const float* Wn, float bias_t, gpu_f4* red,
                           float* sc, float* key, int* chosen) {
    const int e = tid & (DS4_HCF_ROUTE_MAX - 1), half = tid / DS4_HCF_ROUTE_MAX;
    gpu_f4 acc = {0.0f, 0.0f, 0.0f, 0.0f};
    if (e < r.ne) {
        const float* src = r.part + ((long long)t * nb * r.ne + e) * 4;
        // (16 parts asked for at once: nb <= DS4_HCF_GSYNC_BLOCKS = 64 takes two rounds)
        for (int j0 = half; j0 < nb; j0 += 32) {
            gpu_f4 v[16];
#pragma unroll
            for (int q = 0; q < 16; ++q) {
                const int j = j0 + 2 * q;
                v[q] = j < nb ? gpu_load_l2_f4(src + (long long)j * r.ne * 4)
                              : gpu_f4{0.0f, 0.0f, 0.0f, 0.0f};
            }
#pragma unroll
            for (int q = 0; q < 16; ++q) {
                acc.x += v[q].x;
                acc.y += v[q].y;
                acc.z += v[q].z;
                acc.w += v[q].w;
            }
        }
    }
    red[tid] = acc;
    __syncthreads();
    if (tid < r.ne) {
        const gpu_f4 p = red[tid], q = red[tid + DS4_HCF_ROUTE_MAX];
        const float ph[4] = {p.x + q.x, p.y + q.y, p.z + q.z, p.w + q.w};
        float l = 0.0f;
#pragma unroll
        for (int h = 0; h < 4; ++h)
            if (h < hc) l += Wn[h] * ph[h];
        l *= rr;
        r.logits[(long long)t * r.ne + tid] = l;
        sc[tid] = ds4_router_score(l, r.gating);
        key[tid] = ds4_router_key(sc[tid], bias_t, r.mode);
    }
    __syncthreads();
    if (warp == 0) {
        ds4_router_pick<8>(key, r.ne, r.k, chosen);
        gpu_syncwarp();
        if (lane == 0) ds4_router_write(sc, chosen, r.k, r.norm_topk, r.scale, t, r.ids, r.wout);
    }
}

// HCF_STAMPS (benchmark builds only: scripts/device/hc_site_bench.cu): thread 0 of each
// of the first 64 blocks of token 0 records the global timer and its SM's clock at the
// end of phase k of ds4_hc_post_pre, to show where a site's time goes.
#if defined(HCF_STAMPS) && defined(GPU_CUDA)
#define HCF_NSTAMP 8
__device__ unsigned long long hcf_stamps[64 * HCF_NSTAMP * 2];
#define HCF_STAMP(k)                                                                    \
    do {                                                                                \
        if (threadIdx.x == 0 && blockIdx.y == 0 && blockIdx.x < 64) {                  \
            unsigned long long g_, c_;                                                  \
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g_));                      \
            asm volatile("mov.u64 %0, %%clock64;" : "=l"(c_));                          \
            hcf_stamps[(blockIdx.x * HCF_NSTAMP + (k)) * 2] = g_;                       \
            hcf_stamps[(blockIdx.x * HCF_NSTAMP + (k)) * 2 + 1] = c_;                   \
        }                                                                               \
    } while (0)
#else
#define HCF_STAMP(k)
#endif

// ds4_hc_post_pre's end with gsync (see there): every block waits for the token's
// others, then takes the weights and writes its own columns of x.
GPU_DEV void ds4_hcf_grid_tail(int t, int b, int nb, int tid, int lane, int warp, int hc, int C,
                               int nm, int pr, int head_mode, int defer, int iters,
                               float eps, float hc_eps, int d, long long hd, const float* part,
                               unsigned int* __restrict__ sync, float base_t, float scale_t,
                               float nw1, const float* sv, float* mix, float* M, float* B,
                               float* Wn, float* S, float* __restrict__ wts,
                               float* __restrict__ out, q8_1_block* __restrict__ xq,
                               const ds4_hcf_router& route, float bias_t) {
    gpu_group_barrier(sync + t, (unsigned int)nb);
    HCF_STAMP(4);
    ds4_hcf_weights(t, nb, tid, lane, warp, hc, nm, pr, head_mode, eps, hc_eps, hd, part, base_t,
                    scale_t, mix, M, B, Wn, S);
    HCF_STAMP(5);
    // |x|^2 from the Gram matrix (its entries after mix[nm]).
    float x2 = 0.0f;
    for (int q = 0; q < pr - nm - 1; ++q) {
        int a, a2;
        ds4_gram_pair(hc, q, a, a2);
        x2 += (a == a2 ? 1.0f : 2.0f) * Wn[a] * Wn[a2] * mix[nm + 1 + q];
    }
    // (streams that nearly cancel could round it below 0; a sum of squares cannot be)
    const float rr = 1.0f / sqrtf(fmaxf(x2, 0.0f) / (float)d + eps);
    const int i = b * C + tid;
    float xo = 0.0f;
    if (tid < C && i < d) {
        float x = 0.0f;
#pragma unroll
        for (int h = 0; h < 4; ++h)
            if (h < hc) x += Wn[h] * sv[h * C + tid];
        xo = nw1 * (x * rr);
        out[(long long)t * d + i] = xo;
    }
    // xq: a warp's 32 columns are one q8_1 block of x (C and d multiples of 32), stored
    // as quantize_q8_1 stores it from out (planes = 1), so the MoE's grouped products
    // need no quantising launch of their own.
    if (xq && 32 * warp < C && b * C + 32 * warp < d)
        q8_1_store(xo, ((long long)t * d + b * C) / 32 + warp, lane, xq, 1);
    if (b == 0 && warp == 0) ds4_hcf_write_wts(t, lane, hc, nm, head_mode, defer, iters, hc_eps, M, B, S, Wn, wts);
    if (route.wr && b == 0) {
        __shared__ gpu_f4 red[2 * DS4_HCF_ROUTE_MAX];
        __shared__ float sc[DS4_HCF_ROUTE_MAX], key[DS4_HCF_ROUTE_MAX];
        __shared__ int chosen[DS4_TOPK_MAX];
        ds4_hcf_route(route, t, nb, tid, lane, warp, hc, rr, Wn, bias_t, red, sc, key, chosen);
    }
    HCF_STAMP(6);
}

// An mHC site's mixes are read once a step, like the products' weights: evict-first in
// L2, or plain with HC_NO_STREAM_HINT (A/B runs).
#if defined(HC_NO_STREAM_HINT)
#define HC_HINT false
#else
#define HC_HINT true
#endif

extern "C" __global__ void __launch_bounds__(DS4_HCF_THREADS)
    ds4_hc_post_pre(float* streams, const float* __restrict__ fn, const float* __restrict__ scale,
                    const float* __restrict__ base, const float* __restrict__ norm_w, int d, int hc,
                    int iters, float eps, float hc_eps, int head_mode, float* __restrict__ out,
                    float* __restrict__ wts, float* part, unsigned int* __restrict__ sync,
                    int post_mode, const float* __restrict__ block, const float* __restrict__ y,
                    const float* __restrict__ rw, int k, const float* __restrict__ shared,
                    int defer, int gsync, q8_1_block* __restrict__ xq,
                    const float* __restrict__ wr, const float* __restrict__ rbias, int n_expert,
                    int topk, int gating, int norm_topk, float routed_scale, int rmode,
                    float* __restrict__ logits, int* __restrict__ ids, float* __restrict__ wout,
                    float* rpart, unsigned int* counters) {
    __shared__ __attribute__((aligned(16))) float sv[DS4_HCF_THREADS];
    __shared__ float sh[32];
    __shared__ float mix[25 + DS4_HCF_PAIRS];
    __shared__ float M[24], B[24], Wn[24], S[3];
    __shared__ float wss[DS4_HCF_WARPS];
    __shared__ unsigned int last, arrived;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int t = blockIdx.y, b = blockIdx.x, nb = gridDim.x;
    HCF_STAMP(0);
    const int hcp = hc <= 1 ? 1 : (hc <= 2 ? 2 : 4), C = DS4_HCF_THREADS / hcp;
    const int nm = head_mode ? hc : 2 * hc + hc * hc, site_nm = 2 * hc + hc * hc;
    const int np = gsync ? hc * (hc + 1) / 2 : 0, pr = nm + 1 + np;  // a part's floats
    const long long hd = (long long)hc * d;
    // This lane's fn values: rows warp + DS4_HCF_WARPS q, block value v = lane + 32 u
    // (stream v / C, column b C + v % C), the layout of sv below.
    float wv[DS4_HCF_ROWS][DS4_HCF_VALS];
#pragma unroll
    for (int q = 0; q < DS4_HCF_ROWS; ++q) {
        const int r = warp + DS4_HCF_WARPS * q;
#pragma unroll
        for (int u = 0; u < DS4_HCF_VALS; ++u) {
            const int v = lane + 32 * u, hv = v / C, iv = b * C + v % C;
            wv[q][u] = (r < nm && hv < hc && iv < d)
                           ? __int_as_float((int)gpu_load_stream_u32<HC_HINT>(fn + r * hd + (long long)hv * d + iv))
                           : 0.0f;
        }
    }
    // The constants of the end: base and scale (threads < nm), this thread's norm
    // weights for the last block's collapse (warps 1..) or, with gsync, for its column.
    const int ct = tid - 32, nct = DS4_HCF_THREADS - 32, d4 = d / 4;
    const float base_t = tid < nm ? base[tid] : 0.0f;
    const float scale_t = tid < (head_mode ? 1 : 3) ? scale[tid] : 0.0f;
    gpu_f4 nw[DS4_HCF_X4];
#pragma unroll
    for (int u = 0; u < DS4_HCF_X4; ++u) {
        const int c = ct + u * nct;
        nw[u] = (!gsync && ct >= 0 && c < d4) ? ((const gpu_f4*)norm_w)[c]
                                              : gpu_f4{0.0f, 0.0f, 0.0f, 0.0f};
    }
    const float nw1 = gsync && tid < C && b * C + tid < d ? norm_w[b * C + tid] : 0.0f;
    // The routing's constants (see ds4_hcf_router): block b's columns of wr asked into L2
    // (a row's 512 bytes a thread), lane l's norm weights, thread e's expert's bias.
    const ds4_hcf_router route = {
        gsync && C == 128 && n_expert <= DS4_HCF_ROUTE_MAX ? wr : nullptr,
        logits, ids, wout, rpart, n_expert, topk, gating, norm_topk, rmode, routed_scale};
    gpu_f4 nwr = {0.0f, 0.0f, 0.0f, 0.0f};
    float bias_t = 0.0f;
    if (route.wr) {
#if !defined(HCF_ROUTE_NO_PREFETCH)
        if (tid < n_expert) gpu_prefetch_l2(wr + (long long)tid * d + b * C, 4 * C);
#endif
        nwr = *(const gpu_f4*)(norm_w + b * C + 4 * lane);
        if (b == 0 && rmode == 1 && tid < n_expert) bias_t = rbias[tid];
    }
    gpu_count_launch(counters, KID_DS4_HC_POST_PRE);
    HCF_STAMP(1);
    float* s = streams + (long long)t * hd;
    const int h = tid / C, i = b * C + tid % C;
    const bool on = h < hc && i < d;
    float nv = 0.0f;
    if (post_mode) {
        const float* W = wts + (long long)t * site_nm;
        float old[DS4_HC_MAX];
#pragma unroll
        for (int j = 0; j < DS4_HC_MAX; ++j) old[j] = (on && j < hc) ? s[(long long)j * d + i] : 0.0f;
        if (on) {
            const float bv =
                post_mode == 2 ? ds4_combine(y, rw, shared, d, k, t, i) : block[(long long)t * d + i];
            nv = ds4_post_value(W, hc, h, bv, old);
        }
        __syncthreads();  // every old value read before any is replaced
        if (on) s[(long long)h * d + i] = nv;
    } else if (on) {
        nv = s[(long long)h * d + i];
    }
    sv[tid] = nv;
    __syncthreads();
    HCF_STAMP(2);
    float* mine = part + ((long long)t * nb + b) * pr;
#pragma unroll
    for (int q = 0; q < DS4_HCF_ROWS; ++q) {
        const int r = warp + DS4_HCF_WARPS * q;
        if (r >= nm) break;  // the same for the whole warp
        float a = 0.0f;
#pragma unroll
        for (int u = 0; u < DS4_HCF_VALS; ++u) a += wv[q][u] * sv[lane + 32 * u];
        a = gpu_warp_sum(a);
        if (lane == 0) mine[r] = a;
    }
    if (warp >= DS4_HCF_WARPS - np) {  // Gram entry q, from the top warp down
        const int q = DS4_HCF_WARPS - 1 - warp;
        int a, a2;
        ds4_gram_pair(hc, q, a, a2);
        float g = 0.0f;
        for (int c = lane; c < C; c += 32) g += sv[a * C + c] * sv[a2 * C + c];
        g = gpu_warp_sum(g);
        if (lane == 0) mine[nm + 1 + q] = g;
    }
    const float ssq = ds4_block_sum(nv * nv, sh, DS4_HCF_THREADS);
    if (tid == 0) mine[nm] = ssq;
    if (route.wr) ds4_hcf_route_part(route, t, b, nb, lane, warp, hc, C, d, nwr, sv);
    HCF_STAMP(3);
    if (gsync) {
        ds4_hcf_grid_tail(t, b, nb, tid, lane, warp, hc, C, nm, pr, head_mode, defer, iters, eps,
                          hc_eps, d, hd, part, sync, base_t, scale_t, nw1, sv, mix, M, B, Wn, S,
                          wts, out, xq, route, bias_t);
        return;
    }
    // Count this block done once its streams and shares are out (the barrier orders
    // every thread's stores before thread 0's fence); the last one goes on.
    __syncthreads();
    if (tid == 0) {
        gpu_fence();
        last = (atomicAdd(sync + t, 1u) & 0xffffu) == (unsigned int)(nb - 1);
        if (last) {
            gpu_fence();
            sync[t] = 0;  // ready for the next launch (graph replays)
        }
        arrived = 0;
    }
    __syncthreads();
    if (!last) return;
    ds4_hcf_weights(t, nb, tid, lane, warp, hc, nm, pr, head_mode, eps, hc_eps, hd, part, base_t,
                    scale_t, mix, M, B, Wn, S);
    if (warp == 0) {
        ds4_hcf_write_wts(t, lane, hc, nm, head_mode, defer, iters, hc_eps, M, B, S, Wn, wts);
        return;
    }
    // Warps 1..: x = sum_h pre_h stream_h (the other blocks' columns from L2), its RMS
    // over these warps without a block barrier (warp 0 has left): each warp's sum in
    // wss, the count in `arrived`, then every thread adds wss in warp order.
    gpu_f4 xv[DS4_HCF_X4];
    float ss = 0.0f;
#pragma unroll
    for (int u = 0; u < DS4_HCF_X4; ++u) {
        const int c = ct + u * nct;
        gpu_f4 x = {0.0f, 0.0f, 0.0f, 0.0f};
        if (c < d4) {
#pragma unroll
            for (int hh = 0; hh < 4; ++hh)
                if (hh < hc) ds4_axpy4(x, Wn[hh], gpu_load_l2_f4(s + (long long)hh * d + 4 * c));
        }
        xv[u] = x;
        ss += x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
    }
    ss = gpu_warp_sum(ss);
    if (lane == 0) {
        wss[warp] = ss;
        __threadfence_block();
        atomicAdd(&arrived, 1u);
    }
    while (*(volatile unsigned int*)&arrived < (unsigned int)(DS4_HCF_WARPS - 1)) {
    }
    __threadfence_block();
    float tot = 0.0f;
    for (int w = 1; w < DS4_HCF_WARPS; ++w) tot += ((volatile float*)wss)[w];
    const float rr = 1.0f / sqrtf(tot / (float)d + eps);
    gpu_f4* o = (gpu_f4*)(out + (long long)t * d);
#pragma unroll
    for (int u = 0; u < DS4_HCF_X4; ++u) {
        const int c = ct + u * nct;
        if (c < d4) {
            o[c] = ds4_norm4(nw[u], xv[u], rr);
        }
    }
}

// ---------------------------------------------------------------------------------
// The lightning indexer's scores for a prefill chunk as a tiled product: the chunk's
// (token, head) queries (M = n ih of them) against the rows (N), K = id. A block takes
// DS4_IXM_M consecutive queries (DS4_IXM_M / ih whole tokens) and DS4_IXM_N rows, stages
// both DS4_IXM_K dims at a time in shared memory (k-major), and each thread keeps an
// 8 x 8 tile of dot products: 8 queries (8 heads of one token) by rows tx + 16 j. Then
// each thread's relu(dot) * sm * w_h over its 8 heads, and the token's ih / 8 threads'
// parts added in a fixed order: score[t][r] for the rows visible to t. Query tiles
// share each staged row among 128 queries, so the rows leave L2 n ih / 128 times, not
// n times. Needs ih % 8 == 0, 128 % ih == 0, id % DS4_IXM_K == 0, q and rows 16-byte
// aligned, no rotary. grid = (ceil(cap / DS4_IXM_N), ceil(n ih / DS4_IXM_M)), block 256.
#define DS4_IXM_M 128
#define DS4_IXM_N 128
#define DS4_IXM_K 32
#define DS4_IXM_LD (DS4_IXM_M + 4)  // (row stride: float4 reads stay aligned)

// The tile's products on the tensor cores (ds4_index_scores_mm_tc on CUDA sm_80+, ih a
// multiple of 32): f32 operands as three TF32 products, a_hi b_hi + a_hi b_lo + a_lo
// b_hi (hi = x rounded to TF32, lo = the rest rounded to TF32: about f32's accuracy,
// the dropped a_lo b_lo being ~2^-22 of the product). Warp w takes queries 32 (w % 4) .. + 31 and
// rows 64 (w / 4) .. + 63 of the tile: 2 x 8 mma tiles of 16 x 8 (m16n8k8), its 64
// accumulators in acc[8][8]: tile (mt, nt)'s C fragment at acc[4 mt + nt / 2][4 (nt % 2)..].
#if defined(GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define DS4_IXM_TC 1
GPU_DEV unsigned int ds4_tf32(float x) {
    unsigned int r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// x as hi + lo, both TF32 bit patterns.
GPU_DEV void ds4_tf32_split(float x, unsigned int& hi, unsigned int& lo) {
    hi = ds4_tf32(x);
    lo = ds4_tf32(x - __int_as_float((int)hi));
}

// x as hi + lo truncated to TF32 (the low 13 bits cleared): three instructions, where
// cvt.rna compiles to several on sm_90 (the attention's logits loop: 19 instructions an
// mma with it, 8 with this). hi is within 2^-10 of x and lo within 2^-10 of the rest, so
// hi + lo is within 2^-20 of x, toward zero (cvt.rna's split: ~2^-22).
GPU_DEV void ds4_tf32_split_t(float x, unsigned int& hi, unsigned int& lo) {
    hi = (unsigned int)__float_as_int(x) & 0xffffe000u;
    lo = (unsigned int)__float_as_int(x - __int_as_float((int)hi)) & 0xffffe000u;
}

GPU_DEV void ds4_mma_tf32(float* d, const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The three TF32 products of a (hi, lo) and b (hi b0 b1, lo b0 b1) into d: the small
// terms first.
GPU_DEV void ds4_mma3(float* d, const unsigned int (&ah)[4], const unsigned int (&al)[4],
                      unsigned int bh0, unsigned int bh1, unsigned int bl0, unsigned int bl1) {
    ds4_mma_tf32(d, ah, bl0, bl1);
    ds4_mma_tf32(d, al, bh0, bh1);
    ds4_mma_tf32(d, ah, bh0, bh1);
}

// The operands' TF32 split: rounding (cvt.rna), or with IXM_SPLIT_TRUNC (an A/B
// option) truncating, as ds4_attention_tc's.
#if defined(IXM_SPLIT_TRUNC)
#define DS4_IXM_SPLIT ds4_tf32_split_t
#else
#define DS4_IXM_SPLIT ds4_tf32_split
#endif

// One staged chunk (DS4_IXM_K dims) of the warp's 32 x 64 products. Fragments (g =
// lane / 4, c = lane % 4): A (16 x 8, row-major) a0 = (g, c), a1 = (g + 8, c), a2 = (g,
// c + 4), a3 = (g + 8, c + 4); B (8 x 8) b0 = (c, g), b1 = (c + 4, g); C (16 x 8) d0 / d1
// = (g, 2c / 2c + 1), d2 / d3 = (g + 8, 2c / 2c + 1).
GPU_DEV void ds4_ixm_tc_chunk(const float (*As)[DS4_IXM_LD], const float (*Bs)[DS4_IXM_LD],
                              float (&acc)[8][8]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, c = lane & 3, mb = 32 * (warp & 3), nb = 64 * (warp >> 2);
#pragma unroll
    for (int k = 0; k < DS4_IXM_K; k += 8) {
        unsigned int ah[2][4], al[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            const int m = mb + 16 * mt + g;
            DS4_IXM_SPLIT(As[k + c][m], ah[mt][0], al[mt][0]);
            DS4_IXM_SPLIT(As[k + c][m + 8], ah[mt][1], al[mt][1]);
            DS4_IXM_SPLIT(As[k + c + 4][m], ah[mt][2], al[mt][2]);
            DS4_IXM_SPLIT(As[k + c + 4][m + 8], ah[mt][3], al[mt][3]);
        }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const int n = nb + 8 * nt + g;
            unsigned int bh0, bl0, bh1, bl1;
            DS4_IXM_SPLIT(Bs[k + c][n], bh0, bl0);
            DS4_IXM_SPLIT(Bs[k + c + 4][n], bh1, bl1);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
                ds4_mma3(&acc[4 * mt + nt / 2][4 * (nt & 1)], ah[mt], al[mt], bh0, bh1, bl0, bl1);
        }
    }
}
#endif
// The end of ds4_index_scores_mm: red[y][row] holds `per` parts a token (y = token *
// per ..), added in y order for each row visible to the token. Thread e: token e / 128
// of the block (of tpb), row e % 128.
GPU_DEV void ds4_ixm_store(const float* red, int per, int tpb, int t0, int n,
                           const int* __restrict__ pos, int ratio, int cap, int r0,
                           float* __restrict__ scores) {
    for (int e = threadIdx.x; e < tpb * DS4_IXM_N; e += 256) {
        const int tl = e / DS4_IXM_N, r = e % DS4_IXM_N, tt = t0 + tl;
        if (tt >= n) continue;
        int vis = (pos[tt] + 1) / ratio;
        if (vis > cap) vis = cap;
        if (r0 + r >= vis) continue;
        float sum = 0.0f;
        for (int y = tl * per; y < (tl + 1) * per; ++y) sum += red[y * DS4_IXM_N + r];
        scores[(long long)tt * cap + r0 + r] = sum;
    }
}

#if defined(DS4_IXM_TC)
// The tensor-core tiles' end: relu(dot) * sm * w_h over the thread's 4 queries, then
// over the warp's 8 query lanes (g): per column, the warp's 32 heads of one token. The
// warps of a token (ih / 32 of them, in query order) then add up through red ([warp %
// 4][row], free for the block's use), and the scores of the tile's rows r0.. are
// stored. One definition for both tensor-core kernels: the same sums in the same order.
GPU_DEV void ds4_ixm_tc_end(const float (&acc)[8][8], float* red, int m0, int ih, int n,
                            const float* __restrict__ wproj, float sm, float ws,
                            const int* __restrict__ pos, int ratio, int cap, int r0,
                            float* __restrict__ scores) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
    const int mb = 32 * (warp & 3), nb = 64 * (warp >> 2);
    const int tw = (m0 + mb) / ih;  // the warp's token
    float wq[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int m = m0 + mb + 16 * (e >> 1) + g + 8 * (e & 1);
        wq[e] = tw < n ? wproj[(long long)tw * ih + m % ih] * ws : 0.0f;
    }
    float colsum[16];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            float v = 0.0f;
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf)
                    v += fmaxf(acc[4 * mt + nt / 2][4 * (nt & 1) + 2 * hf + j], 0.0f) * sm *
                         wq[2 * mt + hf];
#pragma unroll
            for (int o = 4; o < 32; o <<= 1) v += gpu_shfl_xor(v, o);
            colsum[2 * nt + j] = v;
        }
    if (g == 0)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int j = 0; j < 2; ++j)
                red[(warp & 3) * DS4_IXM_N + nb + 8 * nt + 2 * c + j] = colsum[2 * nt + j];
    __syncthreads();
    ds4_ixm_store(red, ih / 32, DS4_IXM_M / ih, m0 / ih, n, pos, ratio, cap, r0, scores);
}
#endif

template <bool TC>
GPU_DEV void ds4_index_scores_mm_body(const float* __restrict__ q, const float* __restrict__ wproj,
                                      const float* __restrict__ rows, const int* __restrict__ pos,
                                      int ih, int id, int ratio, int cap, float sm, float ws,
                                      float* __restrict__ scores, int n) {
    __shared__ __attribute__((aligned(16))) float As[DS4_IXM_K][DS4_IXM_LD];
    __shared__ __attribute__((aligned(16))) float Bs[DS4_IXM_K][DS4_IXM_LD];
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int m0 = blockIdx.y * DS4_IXM_M, r0 = blockIdx.x * DS4_IXM_N;
    const int tpb = DS4_IXM_M / ih;  // tokens a block
    const int t0 = m0 / ih;
    // The block's last token sees the most rows (positions rise through a chunk).
    const int t_last = t0 + tpb - 1 < n ? t0 + tpb - 1 : n - 1;
    int vis_last = (pos[t_last] + 1) / ratio;
    if (vis_last > cap) vis_last = cap;
    if (r0 >= vis_last) return;  // the same for the whole block
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;
    const int mq = n * ih;
#if defined(DS4_IXM_TC)
    const bool use_tc = TC && ih % 32 == 0;  // (a warp's 32 queries: one token)
#endif
    for (int k0 = 0; k0 < id; k0 += DS4_IXM_K) {
        __syncthreads();  // the last chunk read by every thread
        // 128 x 32 values of each operand: thread i loads float4 (row i / 8 + 32 u,
        // dims 4 (i % 8)..), stored transposed.
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int e = tid + 256 * u, row = e >> 3, k4 = (e & 7) * 4;
            const int m = m0 + row, r = r0 + row;
            const gpu_f4 a = m < mq ? *(const gpu_f4*)(q + (long long)m * id + k0 + k4)
                                    : gpu_f4{0.0f, 0.0f, 0.0f, 0.0f};
            const gpu_f4 b = r < vis_last ? *(const gpu_f4*)(rows + (long long)r * id + k0 + k4)
                                          : gpu_f4{0.0f, 0.0f, 0.0f, 0.0f};
            As[k4][row] = a.x;
            As[k4 + 1][row] = a.y;
            As[k4 + 2][row] = a.z;
            As[k4 + 3][row] = a.w;
            Bs[k4][row] = b.x;
            Bs[k4 + 1][row] = b.y;
            Bs[k4 + 2][row] = b.z;
            Bs[k4 + 3][row] = b.w;
        }
        __syncthreads();
#if defined(DS4_IXM_TC)
        if constexpr (TC) {
            if (use_tc) {
                // A warp whose 32 queries all lie past the chunk's keeps its zeros (a
                // decode token's 64 heads fill half of the 128-query tile); warp-uniform.
                if (m0 + 32 * ((tid >> 5) & 3) < mq) ds4_ixm_tc_chunk(As, Bs, acc);
                continue;
            }
        }
#endif
#pragma unroll 4
        for (int k = 0; k < DS4_IXM_K; ++k) {
            const gpu_f4 a0 = *(const gpu_f4*)&As[k][8 * ty], a1 = *(const gpu_f4*)&As[k][8 * ty + 4];
            const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            float bv[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) bv[j] = Bs[k][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
    }
#if defined(DS4_IXM_TC)
    if (use_tc) {
        __syncthreads();  // As is free: the warps' column sums go there
        ds4_ixm_tc_end(acc, &As[0][0], m0, ih, n, wproj, sm, ws, pos, ratio, cap, r0, scores);
        return;
    }
#endif
    // This thread's heads: queries m0 + 8 ty .. + 7, all of token t.
    const int m = m0 + 8 * ty, t = m / ih, h0 = m % ih;
    float part[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) part[j] = 0.0f;
    if (t < n) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float wh = wproj[(long long)t * ih + h0 + i] * ws;
#pragma unroll
            for (int j = 0; j < 8; ++j) part[j] += fmaxf(acc[i][j], 0.0f) * sm * wh;
        }
    }
    __syncthreads();  // As is free: the parts go there, [ty][row]
    float* red = &As[0][0];
#pragma unroll
    for (int j = 0; j < 8; ++j) red[ty * DS4_IXM_N + tx + 16 * j] = part[j];
    __syncthreads();
    ds4_ixm_store(red, ih / 8, tpb, t0, n, pos, ratio, cap, r0, scores);
}

// The indexer's scores for a prefill chunk (ds4_index_scores_mm_body), all in f32 FMAs
// (MOE_GPU_IDX_TC=0); ds4_index_scores_mm_tc (the default): the same with the products
// on the tensor cores where it can (CUDA sm_80+, heads a multiple of 32; elsewhere it is
// ds4_index_scores_mm). Two kernels, so each keeps its own registers.
extern "C" __global__ void __launch_bounds__(256)
    ds4_index_scores_mm(const float* __restrict__ q, const float* __restrict__ wproj,
                        const float* __restrict__ rows, const int* __restrict__ pos, int ih, int id,
                        int ratio, int cap, float sm, float ws, float* __restrict__ scores, int n,
                        unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_INDEX_SCORES_MM);
    ds4_index_scores_mm_body<false>(q, wproj, rows, pos, ih, id, ratio, cap, sm, ws, scores, n);
}

extern "C" __global__ void __launch_bounds__(256)
    ds4_index_scores_mm_tc(const float* __restrict__ q, const float* __restrict__ wproj,
                           const float* __restrict__ rows, const int* __restrict__ pos, int ih,
                           int id, int ratio, int cap, float sm, float ws,
                           float* __restrict__ scores, int n, unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_INDEX_SCORES_MM_TC);
    ds4_index_scores_mm_body<true>(q, wproj, rows, pos, ih, id, ratio, cap, sm, ws, scores, n);
}

// ---------------------------------------------------------------------------------
// The indexer's scores with the rows streamed past resident queries
// (ds4_index_scores_mm_tcs; CUDA sm_80+, where the host gives it DS4_IXS_SMEM(id) bytes
// of dynamic shared memory; it traps elsewhere). ds4_index_scores_mm_tc loads each
// 32-dim chunk of a tile synchronously, so its tensor cores wait for every load (~30% of
// their TF32 rate in a 128K prefill chunk; a 128K decode step's ~22 us a layer against
// ~4 for its 16 MB of rows). Here a block keeps its 128 queries, all id dims, in shared
// memory and takes `per_block` row tiles of 128 in turn (16 for a prefill chunk, 1 for a
// decode step), each in 32-dim chunks by cp.async, the next chunk in flight while this
// one is multiplied; two blocks an SM; fragments by ldmatrix; the TF32 split in integer
// instructions (DS4_IXS_SPLIT: cvt.rna's rounding, or the tiled kernel's truncation
// with IXM_SPLIT_TRUNC). Every dot product takes the same mma in the same order as in
// ds4_index_scores_mm_tc, and the end is ds4_ixm_tc_end: the same bits. Needs ih % 32
// == 0, 128 % ih == 0, id % 32 == 0, q and rows 16-byte aligned.
// ds4_index_scores_mm_tcs_bf16 (opt-in, MOE_GPU_IDX_PREC=bf16: reduced precision, as
// DeepSeek's own inference scores in fp8) is the same kernel with each query and row
// value rounded to bf16 and one bf16 product (m16n8k16) where the f32 form takes three
// TF32 ones over half the dims: a sixth of the tensor-core work and no split. Not the
// same bits: each dot product is that of the bf16-rounded operands, summed in f32.
// grid = (ceil(row tiles / per_block), ceil(n ih / 128)), block 256.
// Queries [128][id + 4], two row chunks of 32 dims [128][36] (conflict-free ldmatrix),
// the warps' sums [4][128] (the host's ds4::idx_tcs_smem computes the same).
#define DS4_IXS_SMEM(id) \
    (4 * (DS4_IXM_M * ((id) + 4) + 2 * DS4_IXM_N * (DS4_IXM_K + 4) + 4 * DS4_IXM_N))

#if defined(DS4_IXM_TC) && defined(GPU_CP_ASYNC)
// cvt.rna.tf32.f32 (to nearest, ties away from zero) as two integer instructions: half
// a TF32 unit added to the magnitude's bits, the 13 low bits cleared (a carry moves the
// exponent up as rounding does). Finite x (a NaN may come out as an infinity or a zero,
// where cvt.rna keeps it: the indexer's queries and rows are finite).
GPU_DEV unsigned int ds4_tf32_rna(float x) {
    return ((unsigned int)__float_as_int(x) + 0x1000u) & 0xffffe000u;
}

GPU_DEV void ds4_tf32_split_rna(float x, unsigned int& hi, unsigned int& lo) {
    hi = ds4_tf32_rna(x);
    lo = ds4_tf32_rna(x - __int_as_float((int)hi));
}

// The streamed kernel's split: the tiled kernel's rounding, or its truncation with
// IXM_SPLIT_TRUNC, so that the two give the same bits either way.
#if defined(IXM_SPLIT_TRUNC)
#define DS4_IXS_SPLIT ds4_tf32_split_t
#else
#define DS4_IXS_SPLIT ds4_tf32_split_rna
#endif

// One staged chunk (K dims from k0 of the queries; the rows' chunk at Bs) of
// the warp's 32 x 64 products, as ds4_ixm_tc_chunk. ldmatrix on 32-bit values: matrix i
// comes from lanes 8 i .. 8 i + 7's row addresses, and lane l gets row l / 4, value
// l % 4 of it: for A, matrices (rows +0 / +8) x (k +0 / +4) are a0 .. a3; for B,
// matrices (tile nt / nt + 1) x (k +0 / +4) are b0, b1 of tile nt, then of nt + 1.
GPU_DEV void ds4_ixs_chunk(unsigned int a_addr, unsigned int b_addr, int lda, float (&acc)[8][8]) {
    constexpr int LDB = DS4_IXM_K + 4;
#pragma unroll
    for (int k = 0; k < DS4_IXM_K; k += 8) {
        unsigned int ah[2][4], al[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            unsigned int a[4];
            gpu_ldsm4(a_addr + 4 * (16 * mt * lda + k), a[0], a[1], a[2], a[3]);
#pragma unroll
            for (int e = 0; e < 4; ++e) DS4_IXS_SPLIT(__int_as_float((int)a[e]), ah[mt][e], al[mt][e]);
        }
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            unsigned int b[4];
            gpu_ldsm4(b_addr + 4 * (16 * np * LDB + k), b[0], b[1], b[2], b[3]);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int nt = 2 * np + h;
                unsigned int bh0, bl0, bh1, bl1;
                DS4_IXS_SPLIT(__int_as_float((int)b[2 * h]), bh0, bl0);
                DS4_IXS_SPLIT(__int_as_float((int)b[2 * h + 1]), bh1, bl1);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
                    ds4_mma3(&acc[4 * mt + nt / 2][4 * (nt & 1)], ah[mt], al[mt], bh0, bh1, bl0, bl1);
            }
        }
    }
}

// The bf16 form's chunk: the same ldmatrix loads, two 8-dim steps (k, k + 8) a bf16
// product. A lane's f32 values at dims k + c and k + c + 4 (c = lane % 4) become the
// bf16 pair the product takes as dims 2c, 2c + 1 (and k + 8 + c, k + 12 + c as 2c + 8,
// 2c + 9), in the queries' fragments and the rows' alike: the dims are paired in
// another order, each dot product still takes every dim once.
GPU_DEV void ds4_ixs_chunk_bf16(unsigned int a_addr, unsigned int b_addr, int lda,
                                float (&acc)[8][8]) {
    constexpr int LDB = DS4_IXM_K + 4;
#pragma unroll
    for (int k = 0; k < DS4_IXM_K; k += 16) {
        unsigned int a[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            unsigned int x[4], y[4];  // dims k.. and k + 8..
            gpu_ldsm4(a_addr + 4 * (16 * mt * lda + k), x[0], x[1], x[2], x[3]);
            gpu_ldsm4(a_addr + 4 * (16 * mt * lda + k + 8), y[0], y[1], y[2], y[3]);
            // (rows g / g + 8: x[0], x[1] at dim c, x[2], x[3] at c + 4)
            a[mt][0] = gpu_bf16x2(__int_as_float((int)x[0]), __int_as_float((int)x[2]));
            a[mt][1] = gpu_bf16x2(__int_as_float((int)x[1]), __int_as_float((int)x[3]));
            a[mt][2] = gpu_bf16x2(__int_as_float((int)y[0]), __int_as_float((int)y[2]));
            a[mt][3] = gpu_bf16x2(__int_as_float((int)y[1]), __int_as_float((int)y[3]));
        }
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            unsigned int x[4], y[4];  // (tiles nt, nt + 1) x (dim c, c + 4)
            gpu_ldsm4(b_addr + 4 * (16 * np * LDB + k), x[0], x[1], x[2], x[3]);
            gpu_ldsm4(b_addr + 4 * (16 * np * LDB + k + 8), y[0], y[1], y[2], y[3]);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int nt = 2 * np + h;
                const unsigned int b0 = gpu_bf16x2(__int_as_float((int)x[2 * h]),
                                                   __int_as_float((int)x[2 * h + 1]));
                const unsigned int b1 = gpu_bf16x2(__int_as_float((int)y[2 * h]),
                                                   __int_as_float((int)y[2 * h + 1]));
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
                    gpu_mma_bf16(&acc[4 * mt + nt / 2][4 * (nt & 1)], a[mt][0], a[mt][1],
                                 a[mt][2], a[mt][3], b0, b1);
            }
        }
    }
}
#endif

// The body of both forms (BF16: the bf16 products).
template <bool BF16>
GPU_DEV void ds4_ixs_body(const float* __restrict__ q, const float* __restrict__ wproj,
                          const float* __restrict__ rows, const int* __restrict__ pos, int ih,
                          int id, int ratio, int cap, float sm, float ws,
                          float* __restrict__ scores, int n, int per_block) {
#if defined(DS4_IXM_TC) && defined(GPU_CP_ASYNC)
    constexpr int K = DS4_IXM_K, LDB = K + 4, CP = K / 4;  // a chunk row's stride, its 16-byte copies
    constexpr int CP_LOG = 3;
    static_assert(CP == 1 << CP_LOG, "a row chunk's copies");
    extern __shared__ __attribute__((aligned(16))) float ds4_ixs_dyn[];
    const int lda = id + 4, nk = id / K;
    float* As = ds4_ixs_dyn;                 // [128][lda]
    float* Bs = As + DS4_IXM_M * lda;        // [2][128][LDB]
    float* red = Bs + 2 * DS4_IXM_N * LDB;   // [4][128]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int m0 = blockIdx.y * DS4_IXM_M, mq = n * ih;
    const int t0 = m0 / ih, tpb = DS4_IXM_M / ih;
    // The block's last token sees the most rows (positions rise through a chunk).
    const int t_last = t0 + tpb - 1 < n ? t0 + tpb - 1 : n - 1;
    int vis_last = (pos[t_last] + 1) / ratio;
    if (vis_last > cap) vis_last = cap;
    const int tile0 = blockIdx.x * per_block;
    int tiles = (vis_last + DS4_IXM_N - 1) / DS4_IXM_N - tile0;
    if (tiles > per_block) tiles = per_block;
    if (tiles <= 0) return;  // the same for the whole block
    // The queries (zeros past the chunk's), then each (tile, chunk) in turn: the rows of
    // tile tile0 + it / nk, dims K (it % nk).., zeros past the visible ones.
    for (int e = tid; e < DS4_IXM_M * (id / 4); e += 256) {
        const int row = e / (id / 4), c4 = 4 * (e % (id / 4)), m = m0 + row;
        const bool on = m < mq;
        gpu_cp_async16(gpu_smem_addr(As + row * lda + c4), on ? q + (long long)m * id + c4 : q, on);
    }
    auto stage = [&](int it) {
        const int r0 = (tile0 + it / nk) * DS4_IXM_N, k0 = K * (it % nk);
        float* dst = Bs + (it & 1) * DS4_IXM_N * LDB;
#pragma unroll
        for (int u = 0; u < DS4_IXM_N * CP / 256; ++u) {
            const int e = tid + 256 * u, row = e >> CP_LOG, k4 = 4 * (e & (CP - 1)), r = r0 + row;
            const bool on = r < vis_last;
            gpu_cp_async16(gpu_smem_addr(dst + row * LDB + k4),
                           on ? rows + (long long)r * id + k0 + k4 : rows, on);
        }
    };
    // This lane's ldmatrix rows: lane group lg = lane / 8 gives matrix lg's row lane % 8.
    const int lr = lane & 7, lg = lane >> 3;
    const int mb = 32 * (warp & 3), nb = 64 * (warp >> 2);
    const unsigned int a_row = gpu_smem_addr(As + (mb + lr + 8 * (lg & 1)) * lda + 4 * (lg >> 1));
    const int b_off = (nb + lr + 8 * (lg >> 1)) * LDB + 4 * (lg & 1);
    // A warp whose 32 queries all lie past the chunk's keeps its zeros; warp-uniform.
    const bool active = m0 + mb < mq;
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;
    const int total = tiles * nk;
    // Chunk it's products, then, after a tile's last chunk, its scores.
    auto step = [&](int it) {
        const int kc = it % nk;
        if (active) {
            if constexpr (BF16)
                ds4_ixs_chunk_bf16(a_row + 4 * K * kc,
                                   gpu_smem_addr(Bs + (it & 1) * DS4_IXM_N * LDB + b_off), lda, acc);
            else
                ds4_ixs_chunk(a_row + 4 * K * kc,
                              gpu_smem_addr(Bs + (it & 1) * DS4_IXM_N * LDB + b_off), lda, acc);
        }
        if (kc == nk - 1) {
            ds4_ixm_tc_end(acc, red, m0, ih, n, wproj, sm, ws, pos, ratio, cap,
                           (tile0 + it / nk) * DS4_IXM_N, scores);
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f;
        }
    };
    stage(0);
    gpu_cp_commit();
    for (int it = 0; it < total; ++it) {
        if (it + 1 < total) stage(it + 1);  // (into the buffer chunk it - 1 was read from)
        gpu_cp_commit();
        gpu_cp_wait<1>();  // this thread's copies of chunk it (and the queries) landed
        __syncthreads();   // and every thread's
        step(it);
        __syncthreads();  // chunk it's buffer (and red) read by every thread
    }
#else
    __builtin_trap();  // the host launches it only where the tensor cores run it
#endif
}

extern "C" __global__ void __launch_bounds__(256, 2)
    ds4_index_scores_mm_tcs(const float* __restrict__ q, const float* __restrict__ wproj,
                            const float* __restrict__ rows, const int* __restrict__ pos, int ih,
                            int id, int ratio, int cap, float sm, float ws,
                            float* __restrict__ scores, int n, int per_block,
                            unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_INDEX_SCORES_MM_TCS);
    ds4_ixs_body<false>(q, wproj, rows, pos, ih, id, ratio, cap, sm, ws, scores, n, per_block);
}

extern "C" __global__ void __launch_bounds__(256, 2)
    ds4_index_scores_mm_tcs_bf16(const float* __restrict__ q, const float* __restrict__ wproj,
                                 const float* __restrict__ rows, const int* __restrict__ pos,
                                 int ih, int id, int ratio, int cap, float sm, float ws,
                                 float* __restrict__ scores, int n, int per_block,
                                 unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_INDEX_SCORES_MM_TCS_BF16);
    ds4_ixs_body<true>(q, wproj, rows, pos, ih, id, ratio, cap, sm, ws, scores, n, per_block);
}

// ---------------------------------------------------------------------------------
// Compressors. The projected kv / gate of position q live in this chunk's arrays
// (q >= pos[0]) or in the ring of the last 2 * ratio positions (q % (2 ratio)).
GPU_DEV float ds4_hist(const float* chunk, const float* ring, int q, int p0, int ring_len,
                       int width, int col) {
    return q >= p0 ? chunk[(long long)(q - p0) * width + col]
                   : ring[(long long)(q % ring_len) * width + col];
}

#define DS4_POOL_REGS 8  // slots a thread holds in registers (ratio 4 with overlap)
// ds4_comp_pool's slot: used, input index, column, ape entry.
struct Ds4PoolSlot {
    bool on;
    int q, col, ape;
};
// Closes every window that ends in this chunk: softmax(gate + ape)-weighted pooling per
// channel (overlapping windows: the previous window's first halves, then this one's
// second halves), RMS norm times norm_w, rotary at the window's first position; writes
// rows[w]. grid = (most windows a chunk of n can close), block = 256.
extern "C" __global__ void __launch_bounds__(256)
    ds4_comp_pool(const float* __restrict__ kv, const float* __restrict__ gate,
                  const int* __restrict__ pos, int n, const float* __restrict__ ring_kv,
                  const float* __restrict__ ring_g, const float* __restrict__ ape,
                  const float* __restrict__ norm_w, const float* __restrict__ inv_freq,
                  int n_pairs, float mscale, int ratio, int dim, int overlap, float eps, int cap,
                  float* __restrict__ rows, unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_COMP_POOL);
    __shared__ float row[DS4_COMP_MAX_DIM];
    __shared__ float sh[32];
    const int p0 = pos[0];
    const int w = p0 / ratio + (int)blockIdx.x;
    if ((w + 1) * ratio > p0 + n || w >= cap) return;
    const int width = overlap ? 2 * dim : dim, ring_len = 2 * ratio;
    const int slots = overlap ? 2 * ratio : ratio;
    for (int c = threadIdx.x; c < dim; c += 256) {
        // Slot j: with overlap, slots 0..ratio-1 are the previous window's inputs (none for
        // window 0), the rest this window's: its input index, its column in the
        // (two-half) row and its ape entry (by value, so that nothing leaves registers).
        auto slot = [&](int j) {
            const bool prev = overlap && j < ratio;
            const int jj = prev || !overlap ? j : j - ratio, col = prev || !overlap ? c : dim + c;
            return Ds4PoolSlot{!(prev && w == 0), (prev ? w - 1 : w) * ratio + jj, col,
                               jj * width + col};
        };
        auto gate_of = [&](const Ds4PoolSlot& s) {
            return ds4_hist(gate, ring_g, s.q, p0, ring_len, width, s.col) + ape[s.ape];
        };
        float m = DS4_NEG_INF, num = 0.0f, den = 0.0f;
        if (slots <= DS4_POOL_REGS) {
            // Every slot's gate and value asked for at once (a decode step pools on one
            // block: one load at a time left ~27 us of memory latency on the step); the
            // same sums in the same order as the loops below.
            float gv[DS4_POOL_REGS], xv[DS4_POOL_REGS];
            bool on[DS4_POOL_REGS];
#pragma unroll
            for (int j = 0; j < DS4_POOL_REGS; ++j) {
                const Ds4PoolSlot s = slot(j);
                on[j] = j < slots && s.on;
                gv[j] = on[j] ? gate_of(s) : 0.0f;
                xv[j] = on[j] ? ds4_hist(kv, ring_kv, s.q, p0, ring_len, width, s.col) : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < DS4_POOL_REGS; ++j)
                if (on[j]) m = fmaxf(m, gv[j]);
#pragma unroll
            for (int j = 0; j < DS4_POOL_REGS; ++j) {
                if (!on[j]) continue;
                const float e = expf(gv[j] - m);
                num += e * xv[j];
                den += e;
            }
        } else {
            for (int j = 0; j < slots; ++j) {
                const Ds4PoolSlot s = slot(j);
                if (s.on) m = fmaxf(m, gate_of(s));
            }
            for (int j = 0; j < slots; ++j) {
                const Ds4PoolSlot s = slot(j);
                if (!s.on) continue;
                const float e = expf(gate_of(s) - m);
                num += e * ds4_hist(kv, ring_kv, s.q, p0, ring_len, width, s.col);
                den += e;
            }
        }
        row[c] = num / den;
    }
    float ss = 0.0f;
    for (int c = threadIdx.x; c < dim; c += 256) ss += row[c] * row[c];
    ss = ds4_block_sum(ss, sh, 256);
    const float r = 1.0f / sqrtf(ss / (float)dim + eps);
    const int tail = dim - 2 * n_pairs;
    float* o = rows + (long long)w * dim;
    for (int i = threadIdx.x; 2 * i < dim; i += 256) {
        float a = norm_w[2 * i] * (row[2 * i] * r), b = norm_w[2 * i + 1] * (row[2 * i + 1] * r);
        if (2 * i >= tail)
            ds4_rotate(a, b, (float)(w * ratio), inv_freq[(2 * i - tail) / 2], mscale, 0);
        o[2 * i] = a;
        o[2 * i + 1] = b;
    }
}

// Keeps the chunk's last 2 * ratio positions in the rings (after ds4_comp_pool read
// them). grid = (ceil(width / 256), min(n, 2 ratio)), block = 256.
extern "C" __global__ void __launch_bounds__(256)
    ds4_comp_store(const float* __restrict__ kv, const float* __restrict__ gate,
                   const int* __restrict__ pos, int n, int ratio, int width,
                   float* __restrict__ ring_kv, float* __restrict__ ring_g,
                   unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_COMP_STORE);
    const int c = blockIdx.x * 256 + threadIdx.x;
    const int keep = n < 2 * ratio ? n : 2 * ratio;
    const int t = n - keep + (int)blockIdx.y;
    if (c >= width) return;
    const long long dst = (long long)((pos[0] + t) % (2 * ratio)) * width + c;
    ring_kv[dst] = kv[(long long)t * width + c];
    ring_g[dst] = gate[(long long)t * width + c];
}

// ---------------------------------------------------------------------------------
// Lightning indexer: score[t][s] = sum_h relu(q_th . row_s) * sm * (w_th * ws) for the
// rows visible to token t ((pos+1)/ratio). grid = (blocks, n), block = 256, the
// token's queries staged in shared memory once per block, which then takes chunks of
// 256 / groups rows b, b + blocks, ... (few blocks amortise the staging at long
// context; at short context each block has one chunk). Fast path (id % 4 == 0,
// 16-byte aligned q and rows): warp w takes head group g = w % groups (heads
// 64 / groups at a time: g * 64 / groups .., + 64, ...) of rows r0 + 32 (w / groups) +
// lane, each lane a whole row, the group's sums in registers and every query value a
// broadcast read; the groups' parts add up in shared memory, in group order. groups = 4
// (64 rows a block) or 8 (32 rows a block, half the serial work a lane: more blocks
// and shorter ones), or 0: 8 while no more than DS4_IDX_FEW rows are visible (the GPU
// is not full), else 4 (each block's staging serves more rows). (One warp per row with a warp sum per
// head spent ~30x the FMA time at 32K rows.) Otherwise 8 warps x 8 rows at a time, a
// warp per row. With inv_freq set, each head's query is rotated on its trailing
// 2 n_pairs values (scale mscale) as it is staged (ds4_norm_rope's (0, n_pairs, 0), the
// same bits), so the rotary needs no launch of its own.
#define DS4_IDX_FEW 8192
#define DS4_IDX_STAGE 16  // (DS4_IDX_Q_MAX / 512: the queries in one round)
template <int HAT>
GPU_DEV float ds4_index_group(const float* qs, const float* wh, const float* row, int g,
                              int groups, int ih, int id, float sm) {
    float score = 0.0f;
    for (int h0 = HAT * g; h0 < ih; h0 += groups * HAT) {
        float acc[HAT];
#pragma unroll
        for (int h = 0; h < HAT; ++h) acc[h] = 0.0f;
        const int nh = ih - h0 < HAT ? ih - h0 : HAT;
        for (int i = 0; i < id; i += 4) {
            const gpu_f4 v = *(const gpu_f4*)(row + i);
#pragma unroll
            for (int h = 0; h < HAT; ++h) {
                // Heads past the end read head h0's values (in bounds) and are dropped.
                const gpu_f4 a = *(const gpu_f4*)(qs + (h0 + (h < nh ? h : 0)) * id + i);
                acc[h] += a.x * v.x + a.y * v.y + a.z * v.z + a.w * v.w;
            }
        }
#pragma unroll
        for (int h = 0; h < HAT; ++h)
            if (h < nh) score += fmaxf(acc[h], 0.0f) * sm * wh[h0 + h];
    }
    return score;
}

// Token t's queries into shared memory (qs[h id + i]; with inv_freq rotated on their
// trailing 2 n_pairs values, scale mscale, at position pt) and its head weights times ws
// (wh). Block of 256 threads; ends with a barrier. DS4_IDX_STAGE pairs a thread asks for
// at once (the queries come from L2: one pair at a time put ~16 round trips in a row on
// a decode step's critical path).
GPU_DEV void ds4_index_stage(const float* qt, const float* wt, int ih, int id, float pt,
                             const float* inv_freq, int n_pairs, float mscale, float ws, float* qs,
                             float* wh) {
    const int tail = id - 2 * n_pairs, nq = ih * id;
    // Copied first (the loads of a small unrolled body leave together), then a thread
    // rotates its own pairs in place: the same values as rotating on the way.
    constexpr int stage = DS4_IDX_STAGE;  // (nvcc does not expand a macro in the pragma)
#pragma unroll stage
    for (int i = 2 * threadIdx.x; i < nq; i += 512) {
        qs[i] = qt[i];
        qs[i + 1] = qt[i + 1];
    }
    if (inv_freq)
        for (int i = 2 * threadIdx.x; i < nq; i += 512) {
            const int c = i % id;  // id is even: a pair never straddles two heads
            if (c < tail) continue;
            float a = qs[i], b = qs[i + 1];
            ds4_rotate(a, b, pt, inv_freq[(c - tail) / 2], mscale, 0);
            qs[i] = a;
            qs[i + 1] = b;
        }
    for (int h = threadIdx.x; h < ih; h += 256) wh[h] = wt[h] * ws;
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(256)
    ds4_index_scores(const float* __restrict__ q, const float* __restrict__ wproj,
                     const float* __restrict__ rows, const int* __restrict__ pos, int ih, int id,
                     int ratio, int cap, float sm, float ws, float* __restrict__ scores,
                     int groups_in, const float* __restrict__ inv_freq, int n_pairs,
                     float mscale, unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_INDEX_SCORES);
    __shared__ __attribute__((aligned(16))) float qs[DS4_IDX_Q_MAX];
    __shared__ float wh[DS4_IDX_Q_MAX / 32];
    __shared__ float gpart[256];
    const int t = blockIdx.y;
    int visible = (pos[t] + 1) / ratio;
    if (visible > cap) visible = cap;
    const int groups = groups_in ? groups_in : (visible <= DS4_IDX_FEW ? 8 : 4);
    const int per_block = 256 / groups;
    if ((int)blockIdx.x * per_block >= visible) return;
    const float* qt = q + (long long)t * ih * id;
    ds4_index_stage(qt, wproj + (long long)t * ih, ih, id, (float)pos[t], inv_freq, n_pairs,
                    mscale, ws, qs, wh);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool fast =
        (id & 3) == 0 && ((((unsigned long long)rows) | ((unsigned long long)qt)) & 15ull) == 0;
    const int step = (int)gridDim.x * per_block;
    if (fast) {
        const int g = warp % groups, half = warp / groups;
        for (int r0 = blockIdx.x * per_block; r0 < visible; r0 += step) {
            const int r = r0 + 32 * half + lane;
            const float* row = rows + (long long)(r < visible ? r : 0) * id;
            gpart[threadIdx.x] = groups == 8
                                     ? ds4_index_group<8>(qs, wh, row, g, 8, ih, id, sm)
                                     : ds4_index_group<16>(qs, wh, row, g, 4, ih, id, sm);
            __syncthreads();
            if (g == 0 && r < visible) {
                // This row's groups sit 32 apart from this thread's slot.
                float sum = gpart[threadIdx.x];
                for (int k = 1; k < groups; ++k) sum += gpart[threadIdx.x + 32 * k];
                scores[(long long)t * cap + r] = sum;
            }
            __syncthreads();  // gpart is free again
        }
        return;
    }
    for (int r0 = blockIdx.x * per_block; r0 < visible; r0 += step)
        for (int k = 0; k < per_block / 8; ++k) {
            const int r = r0 + 8 * k + warp;
            if (r >= visible) break;
            float kr[DS4_IDX_DIM_MAX / 32];
#pragma unroll
            for (int j = 0; j < DS4_IDX_DIM_MAX / 32; ++j) {
                const int i = j * 32 + lane;
                kr[j] = i < id ? rows[(long long)r * id + i] : 0.0f;
            }
            float acc = 0.0f;
            for (int h = 0; h < ih; ++h) {
                float part = 0.0f;
#pragma unroll
                for (int j = 0; j < DS4_IDX_DIM_MAX / 32; ++j) {
                    const int i = j * 32 + lane;
                    if (i < id) part += qs[h * id + i] * kr[j];
                }
                const float dot = gpu_warp_sum(part);
                acc += fmaxf(dot, 0.0f) * sm * wh[h];
            }
            if (lane == 0) scores[(long long)t * cap + r] = acc;
        }
}

// ---------------------------------------------------------------------------------
// The lightning indexer's scores for a decode step (or a few tokens) whose tokens see at
// most a few thousand rows: ds4_index_scores gives each lane a whole row, so ~520 rows
// ran on 17 blocks with every lane's 128 values in a row (~18 us), and the tiled kernel
// on 5 (~13.5 us; H100 traces, 2026-12-06). Here a block of 8 warps takes 4 rows at a
// time, grid-striding over the visible rows: warp w scores row r0 + w / 2 against heads
// 32 (w % 2) .. + 31, each lane a slice of the dims (4 lane + 128 j: float4 j of its
// row) dotted with every head of the half; the 32 partial sums per lane become one head's
// full dot a lane by a halving exchange (31 shuffles), then relu * sm * w_h and a warp
// sum give the half's part; the two halves add in shared memory (half 0 first). The
// next row's values are asked for before this row's dots. Needs id % 4 == 0, id <= 256,
// ih <= 64, ih id <= DS4_IDX_Q_MAX, q and rows 16-byte aligned. grid = (blocks, n),
// block = 256.
#define DS4_IDF_ROWS 4  // rows a block takes at a time (two warps each)
// One step of the halving exchange: lanes with bit O set keep the upper O of v[0 .. 2O),
// the others the lower O, each summed with the partner's (O a constant, so v stays in
// registers).
template <int O>
GPU_DEV void ds4_halve(float* v, int lane) {
    const bool up = (lane & O) != 0;
#pragma unroll
    for (int i = 0; i < O; ++i) {
        const float send = up ? v[i] : v[i + O], keep = up ? v[i + O] : v[i];
        v[i] = keep + gpu_shfl_xor(send, O);
    }
}
extern "C" __global__ void __launch_bounds__(256)
    ds4_index_scores_few(const float* __restrict__ q, const float* __restrict__ wproj,
                         const float* __restrict__ rows, const int* __restrict__ pos, int ih,
                         int id, int ratio, int cap, float sm, float ws,
                         float* __restrict__ scores, const float* __restrict__ inv_freq,
                         int n_pairs, float mscale, unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_INDEX_SCORES_FEW);
    __shared__ __attribute__((aligned(16))) float qs[DS4_IDX_Q_MAX];
    __shared__ float wh[64];
    __shared__ float half1[DS4_IDF_ROWS];
    const int t = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int visible = (pos[t] + 1) / ratio;
    if (visible > cap) visible = cap;
    if ((int)blockIdx.x * DS4_IDF_ROWS >= visible) return;
    ds4_index_stage(q + (long long)t * ih * id, wproj + (long long)t * ih, ih, id, (float)pos[t],
                    inv_freq, n_pairs, mscale, ws, qs, wh);
    const int hb = 32 * (warp & 1), slot = warp >> 1, nv = id / 4;
    const int step = (int)gridDim.x * DS4_IDF_ROWS;
    auto load = [&](int r, gpu_f4* v) {
#pragma unroll
        for (int j = 0; j < DS4_IDX_DIM_MAX / 128; ++j) {
            const int c = lane + 32 * j;
            v[j] = r < visible && c < nv ? *(const gpu_f4*)(rows + (long long)r * id + 4 * c)
                                         : gpu_f4{0.0f, 0.0f, 0.0f, 0.0f};
        }
    };
    gpu_f4 cur[DS4_IDX_DIM_MAX / 128], nxt[DS4_IDX_DIM_MAX / 128];
    int r = (int)blockIdx.x * DS4_IDF_ROWS + slot;
    load(r, cur);
    for (int r0 = (int)blockIdx.x * DS4_IDF_ROWS; r0 < visible; r0 += step, r += step) {
        load(r + step, nxt);
        // Lane's partial dot with each head hb + h of the half (heads past ih: zero).
        float v[32];
#pragma unroll
        for (int h = 0; h < 32; ++h) {
            float a = 0.0f;
            if (hb + h < ih) {
#pragma unroll
                for (int j = 0; j < DS4_IDX_DIM_MAX / 128; ++j) {
                    const int c = lane + 32 * j;
                    if (c < nv) {
                        const gpu_f4 x = *(const gpu_f4*)(qs + (hb + h) * id + 4 * c);
                        a += x.x * cur[j].x + x.y * cur[j].y + x.z * cur[j].z + x.w * cur[j].w;
                    }
                }
            }
            v[h] = a;
        }
        // Halving exchange: after the step of width o, lane keeps the heads whose bit o
        // matches its own, summed with its partner's; at the end v[0] is head hb + lane.
        ds4_halve<16>(v, lane);
        ds4_halve<8>(v, lane);
        ds4_halve<4>(v, lane);
        ds4_halve<2>(v, lane);
        ds4_halve<1>(v, lane);
        const int h = hb + lane;
        const float part = gpu_warp_sum(h < ih ? fmaxf(v[0], 0.0f) * sm * wh[h] : 0.0f);
        if (hb && lane == 0) half1[slot] = part;
        __syncthreads();
        if (!hb && lane == 0 && r < visible) scores[(long long)t * cap + r] = part + half1[slot];
        __syncthreads();  // half1 is free again
#pragma unroll
        for (int j = 0; j < DS4_IDX_DIM_MAX / 128; ++j) cur[j] = nxt[j];
    }
}

// Inclusive prefix sum of `f` over the block (a multiple of 32 threads, at most 1024):
// each warp's by shuffles, then the warps' totals (buf: 32 ints of shared memory, free
// again on return).
GPU_DEV int ds4_block_scan(int f, int* buf) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int o = __float_as_int(gpu_shfl(__int_as_float(f), lane >= d ? lane - d : lane));
        if (lane >= d) f += o;
    }
    if (lane == 31) buf[warp] = f;
    __syncthreads();
    int before = 0;
    for (int w = 0; w < warp && w < nw; ++w) before += buf[w];
    __syncthreads();
    return f + before;
}

// Order-preserving unsigned key of a float (larger float, larger key; -0 < +0).
GPU_DEV unsigned int ds4_key(float f) {
    const unsigned int u = (unsigned int)__float_as_int(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The k best visible rows per token (ties: lower index), or all of them when no more
// than k are visible; unused entries -1. Radix select on the keys, 8 bits per pass
// (a histogram per warp: the top bits of similar scores all land in one bin, and one
// shared counter for the block serialised every add), the pass's bin picked by a block
// scan; then the rows above the k-th key and `left` rows equal to it, each in index
// order, by warp ballots over contiguous segments. 1024 threads, so a decode step's one
// block keeps a long context's scores in flight (256 took 97 us at 32768 rows).
// grid = n, block = DS4_TOPK_THREADS.
#define DS4_TOPK_THREADS 1024
#define DS4_TOPK_WARPS (DS4_TOPK_THREADS / 32)
extern "C" __global__ void __launch_bounds__(DS4_TOPK_THREADS)
    ds4_topk_rows(const float* __restrict__ scores, const int* __restrict__ pos, int ratio,
                  int cap, int k, int* __restrict__ sel, unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_TOPK_ROWS);
    __shared__ unsigned int hist[DS4_TOPK_WARPS][256];
    __shared__ unsigned int sh_prefix;
    __shared__ int sh_left;
    __shared__ int buf[32];
    __shared__ int wg[DS4_TOPK_WARPS], we[DS4_TOPK_WARPS];
    const int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int visible = (pos[t] + 1) / ratio;
    if (visible > cap) visible = cap;
    const float* s = scores + (long long)t * cap;
    int* o = sel + (long long)t * k;
    if (visible <= k) {
        for (int i = tid; i < k; i += DS4_TOPK_THREADS) o[i] = i < visible ? i : -1;
        return;
    }
    unsigned int prefix = 0, mask = 0;
    int left = k;  // how many still to take among keys matching the prefix
    // Up to 8 keys a thread (8192 rows) are read once and kept in registers for every
    // pass (each pass re-read them from L2 on a decode step's critical path); up to 1024
    // they also serve the selection below, whose row for a thread is then its own.
    const bool held = visible <= DS4_TOPK_THREADS * 8, held1 = visible <= DS4_TOPK_THREADS;
    unsigned int hk[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int i = (tid & ~31) + lane + DS4_TOPK_THREADS * j;
        hk[j] = held && i < visible ? ds4_key(s[i]) : 0u;
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < DS4_TOPK_WARPS * 256; i += DS4_TOPK_THREADS) (&hist[0][0])[i] = 0;
        __syncthreads();
        // 8 loads in flight per thread before the adds; the loop is warp-uniform (the
        // first pass's adds are warp-wide).
        for (int b0 = tid & ~31; b0 < visible; b0 += DS4_TOPK_THREADS * 8) {
            unsigned int keys[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int i = b0 + lane + DS4_TOPK_THREADS * j;
                keys[j] = held ? hk[j] : (i < visible ? ds4_key(s[i]) : 0u);
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const bool on =
                    b0 + lane + DS4_TOPK_THREADS * j < visible && (keys[j] & mask) == prefix;
                const unsigned int bin = (keys[j] >> shift) & 255u;
                // The top byte (sign, exponent) of similar scores is a few bins: one add
                // per bin per warp; later bytes spread out, where plain adds are cheaper.
                if (shift == 24) gpu_warp_hist_add(hist[warp], bin, on);
                else if (on) atomicAdd(&hist[warp][bin], 1u);
            }
        }
        __syncthreads();
        // Thread i < 256 looks at bin c = 255 - i: with `above` keys in higher bins, the
        // k-th best is in c when above < left <= above + count(c) (exactly one such bin).
        int cnt = 0;
        if (tid < 256)
            for (int w = 0; w < DS4_TOPK_WARPS; ++w) cnt += (int)hist[w][255 - tid];
        const int incl = ds4_block_scan(cnt, buf);  // (threads >= 256 add nothing)
        if (tid < 256 && incl - cnt < left && incl >= left) {
            sh_prefix = prefix | ((unsigned int)(255 - tid) << shift);
            sh_left = left - (incl - cnt);
        }
        __syncthreads();
        prefix = sh_prefix;
        left = sh_left;
        mask |= 255u << shift;
    }
    // prefix is now the k-th best key: take every key above it, then `left` equal keys,
    // both in index order (the same selection on every run, so the attention's sums are
    // reproducible). Warp w owns rows [w seg, (w + 1) seg), read 32 at a time: its
    // counts, the warps before it give its first output slots, then it writes its rows.
    const int seg = (visible + 32 * DS4_TOPK_WARPS - 1) / (32 * DS4_TOPK_WARPS) * 32;
    const int i0 = warp * seg, i1 = i0 + seg < visible ? i0 + seg : visible;
    const unsigned int below = (1u << lane) - 1u;
    int g = 0, e = 0;
    for (int i = i0; i < i1; i += 32) {
        const unsigned int key = i + lane < i1 ? (held1 ? hk[0] : ds4_key(s[i + lane])) : 0u;
        g += __popc(gpu_ballot(i + lane < i1 && key > prefix));
        e += __popc(gpu_ballot(i + lane < i1 && key == prefix));
    }
    if (lane == 0) {
        wg[warp] = g;
        we[warp] = e;
    }
    __syncthreads();
    int og = 0, oe = 0;
    for (int w = 0; w < warp; ++w) {
        og += wg[w];
        oe += we[w];
    }
    const int first_eq = k - left;
    for (int i = i0; i < i1; i += 32) {
        const bool in = i + lane < i1;
        const unsigned int key = in ? (held1 ? hk[0] : ds4_key(s[i + lane])) : 0u;
        const unsigned int bg = gpu_ballot(in && key > prefix), be = gpu_ballot(in && key == prefix);
        if (in && key > prefix) o[og + __popc(bg & below)] = i + lane;
        if (in && key == prefix) {
            const int slot = oe + __popc(be & below);
            if (slot < left) o[first_eq + slot] = i + lane;
        }
        og += __popc(bg);
        oe += __popc(be);
    }
}

// ---------------------------------------------------------------------------------
// ds4_topk_rows for one token on many blocks: a decode step at long context, where the
// one-block kernel took ~34 us for 32768 rows on the critical path. The same selection
// and output. The NB blocks take equal slices (whole 32s) of the visible rows, and the
// radix select runs over all of them: three passes (the keys' top 12 bits, then 10, then
// 10) each add the blocks' histograms of the keys still in play into a shared one, wait
// for each other, and pick the bin of the k-th best key from it; then each block posts
// its counts above and equal to the k-th key, waits once more, and writes its rows into
// the slots after the blocks before it (above the key, and equal to it among the first
// `left`, in index order). Ties cost nothing more (a seeked cache's rows of 0.0 all land
// in one bin of each pass). The blocks wait for each other, so they must all be
// resident at once (NB <= DS4_TOPKW_MAX_BLOCKS and <= the multiprocessors; the host
// sees to it). `work` (u32, DS4_TOPKW_WORDS, 16-byte aligned, zero before the first
// launch; the barrier's count and the histograms are zero again after each): the
// barrier, the blocks' counts above (DS4_TOPKW_G) and equal (DS4_TOPKW_E), the three
// histograms (DS4_TOPKW_H). grid = NB, block = DS4_TOPKW_THREADS.
#define DS4_TOPKW_THREADS 256
#define DS4_TOPKW_MAX_BLOCKS 64
#define DS4_TOPKW_BINS 4096   // the first pass: a key's top 12 bits
#define DS4_TOPKW_BINS2 1024  // the next two: 10 bits each
#define DS4_TOPKW_G 1
#define DS4_TOPKW_E (DS4_TOPKW_G + DS4_TOPKW_MAX_BLOCKS)
#define DS4_TOPKW_H (DS4_TOPKW_E + DS4_TOPKW_MAX_BLOCKS + 3)  // (16-byte aligned)
#define DS4_TOPKW_WORDS (DS4_TOPKW_H + DS4_TOPKW_BINS + 2 * DS4_TOPKW_BINS2)

// A word another block wrote (after a barrier): past L1.
GPU_DEV unsigned int ds4_topkw_peek(const unsigned int* p) { return *(const volatile unsigned int*)p; }

// Inclusive prefix sum of v over the block, and (total) the block's sum (buf: 32 ints of
// shared memory, free again on return).
GPU_DEV int ds4_topkw_scan(int v, int* buf, int& total) {
    __shared__ int sh_total;
    const int incl = ds4_block_scan(v, buf);
    if (threadIdx.x == DS4_TOPKW_THREADS - 1) sh_total = incl;
    __syncthreads();
    total = sh_total;
    __syncthreads();
    return incl;
}

// One pass: the histogram of the slice's keys under (prefix, mask), NBINS bins from bit
// shift, added to the shared one gh; the blocks wait for each other; then the bin of gh
// that holds the need-th best key (1-based) joins prefix / mask, and need becomes its
// rank in that bin. sh: NBINS words of shared memory; gh 16-byte aligned.
template <int NBINS>
GPU_DEV void ds4_topkw_pass(const float* __restrict__ scores, int s0, int s1, int shift,
                            unsigned int& prefix, unsigned int& mask, int& need, unsigned int* sh,
                            unsigned int* gh, unsigned int* sync, int* buf) {
    constexpr int PER = NBINS / DS4_TOPKW_THREADS;  // bins a thread sums (a multiple of 4)
    const int tid = threadIdx.x;
    for (int i = tid; i < NBINS; i += DS4_TOPKW_THREADS) sh[i] = 0;
    __syncthreads();
    for (int i0 = s0; i0 < s1; i0 += 4 * DS4_TOPKW_THREADS) {  // (block-uniform)
        unsigned int key[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = i0 + tid + j * DS4_TOPKW_THREADS;
            key[j] = i < s1 ? ds4_key(scores[i]) : 0u;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const bool on = i0 + tid + j * DS4_TOPKW_THREADS < s1 && (key[j] & mask) == prefix;
            gpu_warp_hist_add(sh, (key[j] >> shift) & (unsigned int)(NBINS - 1), on);
        }
    }
    __syncthreads();
    for (int i = tid; i < NBINS; i += DS4_TOPKW_THREADS)
        if (sh[i]) atomicAdd(gh + i, sh[i]);
    gpu_group_barrier(sync, gridDim.x);
    // Thread i holds bins lo .. lo + PER - 1 (thread 0 the top ones), loaded at once
    // from L2; a block scan finds the thread whose bins cross `need`, which walks them.
    __shared__ int sh_bin, sh_above;
    const int lo = NBINS - PER * (tid + 1);
    unsigned int c[PER];
#pragma unroll
    for (int j = 0; j < PER; j += 4) {
        const gpu_f4 v = gpu_load_l2_f4((const float*)(gh + lo + j));
        c[j] = (unsigned int)__float_as_int(v.x);
        c[j + 1] = (unsigned int)__float_as_int(v.y);
        c[j + 2] = (unsigned int)__float_as_int(v.z);
        c[j + 3] = (unsigned int)__float_as_int(v.w);
    }
    int cnt = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j) cnt += (int)c[j];
    int total;
    const int incl = ds4_topkw_scan(cnt, buf, total);
    if (incl - cnt < need && incl >= need) {
        int acc = incl - cnt, bin = lo, above = acc;
        bool found = false;
#pragma unroll
        for (int j = PER - 1; j >= 0; --j) {
            if (!found && acc + (int)c[j] >= need) {
                bin = lo + j;
                above = acc;
                found = true;
            }
            acc += (int)c[j];
        }
        sh_bin = bin;
        sh_above = above;
    }
    __syncthreads();
    prefix |= (unsigned int)sh_bin << shift;
    mask |= (unsigned int)(NBINS - 1) << shift;
    need -= sh_above;
}

extern "C" __global__ void __launch_bounds__(DS4_TOPKW_THREADS)
    ds4_topk_rows_wide(const float* __restrict__ scores, const int* __restrict__ pos, int ratio,
                       int cap, int k, int* __restrict__ sel, unsigned int* __restrict__ work,
                       unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_TOPK_ROWS_WIDE);
    __shared__ unsigned int sh[DS4_TOPKW_BINS];
    __shared__ int buf[32];
    const int b = blockIdx.x, nb = gridDim.x, tid = threadIdx.x;
    int visible = (pos[0] + 1) / ratio;
    if (visible > cap) visible = cap;
    if (visible <= k) {
        for (int i = b * DS4_TOPKW_THREADS + tid; i < k; i += nb * DS4_TOPKW_THREADS)
            sel[i] = i < visible ? i : -1;
        return;
    }
    const int per = ((visible + nb - 1) / nb + 31) & ~31;
    const int s0 = b * per < visible ? b * per : visible, s1 = s0 + per < visible ? s0 + per : visible;
    unsigned int* h1 = work + DS4_TOPKW_H;
    unsigned int* h2 = h1 + DS4_TOPKW_BINS;
    unsigned int* h3 = h2 + DS4_TOPKW_BINS2;
    unsigned int prefix = 0, mask = 0;
    int need = k;
    ds4_topkw_pass<DS4_TOPKW_BINS>(scores, s0, s1, 20, prefix, mask, need, sh, h1, work, buf);
    ds4_topkw_pass<DS4_TOPKW_BINS2>(scores, s0, s1, 10, prefix, mask, need, sh, h2, work, buf);
    // Every block has read h1 (before the second pass's barrier): back to zero.
    for (int i = b * DS4_TOPKW_THREADS + tid; i < DS4_TOPKW_BINS; i += nb * DS4_TOPKW_THREADS) h1[i] = 0;
    ds4_topkw_pass<DS4_TOPKW_BINS2>(scores, s0, s1, 0, prefix, mask, need, sh, h3, work, buf);
    for (int i = b * DS4_TOPKW_THREADS + tid; i < DS4_TOPKW_BINS2; i += nb * DS4_TOPKW_THREADS) h2[i] = 0;
    // prefix is the k-th key; `left` = need of the keys equal to it are taken.
    const unsigned int kth = prefix;
    const int left = need, first_eq = k - left;
    int g = 0, e = 0;
    for (int i = s0 + tid; i < s1; i += DS4_TOPKW_THREADS) {
        const unsigned int key = ds4_key(scores[i]);
        g += key > kth;
        e += key == kth;
    }
    int tg, te;
    ds4_topkw_scan(g, buf, tg);
    ds4_topkw_scan(e, buf, te);
    if (tid == 0) {
        work[DS4_TOPKW_G + b] = (unsigned int)tg;
        work[DS4_TOPKW_E + b] = (unsigned int)te;
    }
    gpu_group_barrier(work, (unsigned int)nb);
    for (int i = b * DS4_TOPKW_THREADS + tid; i < DS4_TOPKW_BINS2; i += nb * DS4_TOPKW_THREADS) h3[i] = 0;
    // This block's first slots: the counts of the blocks before it.
    int og = 0, oe = 0;
    for (int w = tid; w < b; w += DS4_TOPKW_THREADS) {
        og += (int)ds4_topkw_peek(work + DS4_TOPKW_G + w);
        oe += (int)ds4_topkw_peek(work + DS4_TOPKW_E + w);
    }
    ds4_topkw_scan(og, buf, og);
    ds4_topkw_scan(oe, buf, oe);
    for (int i0 = s0; i0 < s1; i0 += DS4_TOPKW_THREADS) {  // (block-uniform)
        const int i = i0 + tid;
        const unsigned int key = i < s1 ? ds4_key(scores[i]) : 0u;
        const int gt = i < s1 && key > kth, eq = i < s1 && key == kth;
        // Both counts in one scan: at most DS4_TOPKW_THREADS each.
        const int both = gt | (eq << 16);
        int tot;
        const int ex = ds4_topkw_scan(both, buf, tot) - both;
        if (gt) sel[og + (ex & 0xffff)] = i;
        if (eq && oe + (ex >> 16) < left) sel[first_eq + oe + (ex >> 16)] = i;
        og += tot & 0xffff;
        oe += tot >> 16;
    }
}

// ---------------------------------------------------------------------------------
// Key kk of token t's keys in ds4_attention: the window's (position first + kk: this
// chunk's from kv, older ones from the ring at q % window), then the compressed rows
// (all visible, or the indexer's selection: null for a selected index outside them),
// the selection's entry r for key kk given (mode 2; unused otherwise).
GPU_DEV const float* ds4_att_key_sel(int kk, int r, int n_win, int first, int p0,
                                     const float* kv, const float* ring, int window, int hd,
                                     int mode, const float* rows, int cap) {
    if (kk < n_win) {
        const int qp = first + kk;
        return qp >= p0 ? kv + (long long)(qp - p0) * hd : ring + (long long)(qp % window) * hd;
    }
    const int rr = mode == 2 ? r : kk - n_win;
    return rr < 0 || rr >= cap ? nullptr : rows + (long long)rr * hd;
}

// The same with token t's selection entry read here (mode 2, past the window).
GPU_DEV const float* ds4_att_key(int kk, int n_win, int first, int p0, const float* kv,
                                 const float* ring, int window, int hd, int mode,
                                 const int* sel, int k_sel, int t, const float* rows, int cap) {
    const int r = mode == 2 && kk >= n_win ? sel[(long long)t * k_sel + kk - n_win] : 0;
    return ds4_att_key_sel(kk, r, n_win, first, p0, kv, ring, window, hd, mode, rows, cap);
}

// How many keys position p attends to: the window's n_win (from position `first`), then
// the compressed rows (mode 1: every one visible, up to cap; 2: the k_sel selected).
GPU_DEV int ds4_att_keys(int p, int window, int mode, int ratio, int cap, int k_sel, int& first,
                         int& n_win) {
    first = p - window + 1 > 0 ? p - window + 1 : 0;
    n_win = p - first + 1;
    int n_comp = 0;
    if (mode == 1) {
        n_comp = (p + 1) / ratio;
        if (n_comp > cap) n_comp = cap;
    } else if (mode == 2) {
        n_comp = k_sel;
    }
    return n_win + n_comp;
}

// One token's K=V row into its ring slot by one block (store = 1 of the attention kernels,
// in place of a ds4_window_store launch). The slot holds position p - window, which no
// query of the launch reads (the window is p - window + 1 .. p, and p itself comes from kv).
GPU_DEV void ds4_att_ring_store(const float* __restrict__ kv, float* ring, int p, int window,
                                int hd) {
    for (int i = threadIdx.x; i < hd; i += blockDim.x) ring[(long long)(p % window) * hd + i] = kv[i];
}

// ---------------------------------------------------------------------------------
// Attention with a sink logit, K = V (one shared head), for head h of token t: the
// window (positions pos-window+1 .. pos; older than this chunk from the ring at
// q % window) then compressed rows: none (mode 0), all visible (1: (pos+1)/ratio) or
// the indexer's selection (2). Each warp runs an online softmax over its keys,
// DS4_ATT_BATCH at a time; the warps are merged at the end. With inv_freq set, q is
// first RMS-normed (plain, eps) and rotated on its trailing 2 n_pairs values, and the output inverse-rotated (ds4_norm_rope's (1, n_pairs,
// 0) and (0, n_pairs, 1); the output rotation's bits the same, q's norm summed per
// warp): no launch of their own. Each warp computes q's sines and cosines itself.
// store = 1 (one token only) also writes its row into the ring (ds4_window_store's work).
// grid = (heads, n), block = 32 * nw: nw = 8, or 16 (DS4_ATT_MAX_WARPS) when few tokens
// (a decode step's 64 blocks) must keep more keys in flight per block.
#define DS4_ATT_MAX_WARPS 16
#ifndef DS4_ATT_BATCH
#define DS4_ATT_BATCH 4  // keys a warp has in flight at once (-D: benchmark builds)
#endif
extern "C" __global__ void __launch_bounds__(32 * DS4_ATT_MAX_WARPS)
    ds4_attention(const float* __restrict__ q, const float* __restrict__ kv, float* ring,
                  const float* __restrict__ rows, const int* __restrict__ sel,
                  const float* __restrict__ sinks, const int* __restrict__ pos, int heads, int hd,
                  int window, int ratio, int mode, int k_sel, int cap, float scale,
                  float* __restrict__ out, int nw, const float* __restrict__ inv_freq,
                  int n_pairs, float eps, float mscale, int store, unsigned int* counters) {
#if defined(ONE_TRIP)
    // (a weight: asked for before the dependent-launch wait, not after the warps' merge)
    const float sink_w = sinks[blockIdx.x];
#endif
    gpu_count_launch(counters, KID_DS4_ATTENTION);
    __shared__ float wm[DS4_ATT_MAX_WARPS], wl[DS4_ATT_MAX_WARPS];
    __shared__ float wacc[DS4_ATT_MAX_WARPS * DS4_HEAD_MAX];
    const int h = blockIdx.x, t = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int p0 = pos[0], p = pos[t];
    if (store && h == 0 && t == 0) ds4_att_ring_store(kv, ring, p, window, hd);
    const float* qh = q + ((long long)t * heads + h) * hd;
    float qr[DS4_HEAD_MAX / 32], acc[DS4_HEAD_MAX / 32];
#pragma unroll
    for (int j = 0; j < DS4_HEAD_MAX / 32; ++j) {
        const int i = j * 32 + lane;
        qr[j] = i < hd ? qh[i] : 0.0f;
        acc[j] = 0.0f;
    }
    const int tail = hd - 2 * n_pairs;
    if (inv_freq) {
        // Every warp norms and rotates the head's whole query; pair (i, i + 1) sits in
        // lanes (i, i + 1) of one register, the partner a shuffle away.
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < DS4_HEAD_MAX / 32; ++j) ss += qr[j] * qr[j];
        const float r = 1.0f / sqrtf(gpu_warp_sum(ss) / (float)hd + eps);
#pragma unroll
        for (int j = 0; j < DS4_HEAD_MAX / 32; ++j) {
            const int i = j * 32 + lane;
            const float mine = qr[j] * r, other = gpu_shfl_xor(mine, 1);
            float a = lane & 1 ? other : mine, b = lane & 1 ? mine : other;
            if (i < hd && i >= tail)
                ds4_rotate(a, b, (float)p, inv_freq[(i - tail) / 2], mscale, 0);
            qr[j] = lane & 1 ? b : a;
        }
    }
    int first, n_win;
    const int n_keys = ds4_att_keys(p, window, mode, ratio, cap, k_sel, first, n_win);
    float m = DS4_NEG_INF, l = 0.0f;
    // A warp takes DS4_ATT_BATCH keys at a time (warp + nw b, b < DS4_ATT_BATCH): their
    // loads leave together and their dot products reduce side by side, so a key's round
    // trip to memory is paid once a batch, not once a key (the serial chain of a short
    // grid's few warps is what a decode step waits for).
    for (int k0 = warp; k0 < n_keys; k0 += DS4_ATT_BATCH * nw) {
        const float* key[DS4_ATT_BATCH];
        bool any = false;
#pragma unroll
        for (int b = 0; b < DS4_ATT_BATCH; ++b) {
            const int kk = k0 + b * nw;
            key[b] = kk < n_keys ? ds4_att_key(kk, n_win, first, p0, kv, ring, window, hd, mode,
                                               sel, k_sel, t, rows, cap)
                                 : nullptr;
            any |= key[b] != nullptr;
        }
        if (!any) continue;  // (the same for the whole warp)
        float kr[DS4_ATT_BATCH][DS4_HEAD_MAX / 32], g[DS4_ATT_BATCH];
#pragma unroll
        for (int b = 0; b < DS4_ATT_BATCH; ++b) {
#pragma unroll
            for (int j = 0; j < DS4_HEAD_MAX / 32; ++j) {
                const int i = j * 32 + lane;
                kr[b][j] = key[b] && i < hd ? key[b][i] : 0.0f;
            }
        }
#pragma unroll
        for (int b = 0; b < DS4_ATT_BATCH; ++b) {
            float part = 0.0f;
#pragma unroll
            for (int j = 0; j < DS4_HEAD_MAX / 32; ++j) part += qr[j] * kr[b][j];
            g[b] = part;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int b = 0; b < DS4_ATT_BATCH; ++b) g[b] += gpu_shfl_xor(g[b], o);
        float mn = m;
#pragma unroll
        for (int b = 0; b < DS4_ATT_BATCH; ++b) {
            g[b] = key[b] ? g[b] * scale : DS4_NEG_INF;
            mn = fmaxf(mn, g[b]);
        }
        // (mn is finite: the batch has a key)
        const float corr = expf(m - mn);
        l *= corr;
#pragma unroll
        for (int j = 0; j < DS4_HEAD_MAX / 32; ++j) acc[j] *= corr;
#pragma unroll
        for (int b = 0; b < DS4_ATT_BATCH; ++b) {
            const float e = key[b] ? expf(g[b] - mn) : 0.0f;
            l += e;
#pragma unroll
            for (int j = 0; j < DS4_HEAD_MAX / 32; ++j) acc[j] += e * kr[b][j];
        }
        m = mn;
    }
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < DS4_HEAD_MAX / 32; ++j) wacc[warp * DS4_HEAD_MAX + j * 32 + lane] = acc[j];
    __syncthreads();
#if defined(ONE_TRIP)
    const float sink = sink_w;
#else
    const float sink = sinks[h];
#endif
    float mx = sink;
    for (int w = 0; w < nw; ++w) mx = fmaxf(mx, wm[w]);
    float den = expf(sink - mx);
    for (int w = 0; w < nw; ++w) den += wl[w] * expf(wm[w] - mx);
    float* o = out + ((long long)t * heads + h) * hd;
    for (int i = 2 * threadIdx.x; i < hd; i += 64 * nw) {
        float v0 = 0.0f, v1 = 0.0f;
        for (int w = 0; w < nw; ++w) {
            const float e = expf(wm[w] - mx);
            v0 += wacc[w * DS4_HEAD_MAX + i] * e;
            v1 += wacc[w * DS4_HEAD_MAX + i + 1] * e;
        }
        float a = v0 / den, b = v1 / den;
        if (inv_freq && i >= tail) ds4_rotate(a, b, (float)p, inv_freq[(i - tail) / 2], mscale, 1);
        o[i] = a;
        o[i + 1] = b;
    }
}

// ---------------------------------------------------------------------------------
// ds4_attention for a prefill chunk (no rotary inside: inv_freq unset): the same sums
// up to order, but a block serves DS4_ATH_HEADS heads of one token. All heads of a
// token read the same keys (one K=V head), so the block stages DS4_ATH_TILE keys at a
// time in shared memory and each warp scores them against its DS4_ATH_HPW heads: a key
// leaves L2 once per 16 heads, not once per head. A lane holds float4s 32 j + lane of a
// head (values 128 j + 4 lane ..). A tile's 32 logits a warp (2 heads x 16 keys) are
// summed over the warp in one transposing butterfly, after which lane i holds logit i
// (head i / 16, key i % 16): one exp a lane, the tile's max and sum over a half warp.
// With kper > 0 (a decode step: few tokens, many keys) block z takes its share of
// the keys (an equal part of the token's, at least kper, whole tiles) only and writes
// its partial sums to `part` (per token, head and split: the unnormalised values at part[slot hd], its max and sum at
// part[n heads splits hd + 2 slot]; ds4_attention_merge adds them up with the sink).
// Needs hd % 4 == 0, hd <= DS4_HEAD_MAX, q / kv / ring / rows / out / part 16-byte
// aligned. grid = (ceil(heads / DS4_ATH_HEADS), n, splits), block = 32 * DS4_ATH_WARPS.
#define DS4_ATH_WARPS 8
#define DS4_ATH_HPW 2
#define DS4_ATH_HEADS (DS4_ATH_WARPS * DS4_ATH_HPW)
#define DS4_ATH_TILE 16  // DS4_ATH_HPW * DS4_ATH_TILE = 32: one logit a lane
#define DS4_ATH_J (DS4_HEAD_MAX / 128)
// ds4_attention_heads4 (a prefill chunk's form, opt-in): four heads a warp (each staged
// key float4 feeds 16 FMAs, not 8), tiles of 8 keys, and the staging a pipeline.
#define DS4_ATH4_HPW 4

GPU_DEV float ds4_dot4(gpu_f4 a, gpu_f4 b, float acc) {
    return acc + a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}

// One staged tile (nt <= 32 / HPW keys in ks, kok[kk]: key kk is one) for a warp's HPW
// heads (queries qr): the logits, the online softmax's new max and sum in m and l for
// this lane's head (lane / (32 / HPW)), and the tile's values weighed into acc. Called by
// every warp of the block between the tile's staging barriers.
template <int HPW>
GPU_DEV void ds4_ath_tile(const gpu_f4 (&qr)[HPW][DS4_ATH_J], gpu_f4 (&acc)[HPW][DS4_ATH_J],
                          float& m, float& l, const gpu_f4 (*ks)[DS4_HEAD_MAX / 4],
                          const int* kok, float (*se)[32], int nt, int hd4, bool head_ok,
                          float scale) {
    constexpr int TILE = 32 / HPW;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int mk = lane % TILE;
    // A tile of null keys only (a selection's unused -1 entries, at its end while
    // fewer rows than k are visible) changes nothing: skip its arithmetic.
    int any = 0;
    for (int kk = 0; kk < nt; ++kk) any |= kok[kk];
    if (!any) return;  // the same for the whole block
    float v[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) v[i] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < TILE; ++kk) {
        if (kk < nt) {  // the same for the whole block
#pragma unroll
            for (int j = 0; j < DS4_ATH_J; ++j) {
                // (the tile's columns past hd are never written)
                const gpu_f4 k4 = 32 * j + lane < hd4 ? ks[kk][32 * j + lane] : gpu_f4{0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int hh = 0; hh < HPW; ++hh)
                    v[hh * TILE + kk] =
                        ds4_dot4(qr[hh][j], k4, v[hh * TILE + kk]);
            }
        }
    }
    const bool ok = head_ok && mk < nt && kok[mk < nt ? mk : 0];
    const float dot = ds4_warp_transpose_sum(v);  // (every lane takes part)
    const float g = ok ? dot * scale : DS4_NEG_INF;
    float mt = g;
#pragma unroll
    for (int o = TILE / 2; o > 0; o >>= 1) mt = fmaxf(mt, gpu_shfl_xor(mt, o));
    const float mn = fmaxf(m, mt);
    // Nothing valid yet for this head: no change (and no inf - inf).
    const float corr = mn == DS4_NEG_INF ? 1.0f : expf(m - mn);
    float e = ok ? expf(g - mn) : 0.0f;
    se[warp][lane] = e;
#pragma unroll
    for (int o = TILE / 2; o > 0; o >>= 1) e += gpu_shfl_xor(e, o);
    l = l * corr + e;
    m = mn;
    gpu_syncwarp();
#pragma unroll
    for (int hh = 0; hh < HPW; ++hh) {
        const float c = gpu_shfl(corr, hh * TILE);
#pragma unroll
        for (int j = 0; j < DS4_ATH_J; ++j) {
            acc[hh][j].x *= c;
            acc[hh][j].y *= c;
            acc[hh][j].z *= c;
            acc[hh][j].w *= c;
        }
    }
#pragma unroll
    for (int kk = 0; kk < TILE; ++kk) {
        if (kk < nt) {
#pragma unroll
            for (int j = 0; j < DS4_ATH_J; ++j) {
                const gpu_f4 k4 = 32 * j + lane < hd4 ? ks[kk][32 * j + lane] : gpu_f4{0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int hh = 0; hh < HPW; ++hh) {
                    const float w = se[warp][hh * TILE + kk];
                    acc[hh][j].x += w * k4.x;
                    acc[hh][j].y += w * k4.y;
                    acc[hh][j].z += w * k4.z;
                    acc[hh][j].w += w * k4.w;
                }
            }
        }
    }
    gpu_syncwarp();  // se read before the next tile's writes
}

// ds4_attention_heads' online softmax over keys k_begin .. k_end of token t for a warp's
// HPW heads: 32 / HPW keys at a time staged in ks by the whole block, then
// ds4_ath_tile. Every thread of the block calls it with the same key range.
template <int HPW>
GPU_DEV void ds4_ath_keys(const gpu_f4 (&qr)[HPW][DS4_ATH_J], gpu_f4 (&acc)[HPW][DS4_ATH_J],
                          float& m, float& l,
                          gpu_f4 (*ks)[DS4_HEAD_MAX / 4], int* kok, float (*se)[32], int t, int p0,
                          int hd, int hd4, int first, int n_win, const float* __restrict__ kv,
                          const float* ring, int window, int mode,
                          const int* __restrict__ sel, int k_sel, const float* __restrict__ rows,
                          int cap, int k_begin, int k_end, bool head_ok, float scale) {
    // STAGE: a tile's rows a staging thread takes (rpp = blockDim / (hd / 4) >= 2 threads
    // share the rows, hd <= DS4_HEAD_MAX).
    constexpr int TILE = 32 / HPW, STAGE = TILE / 2;
    // Thread -> (first tile row, float4 column) of the staging loop.
    const int rpp = (int)blockDim.x / hd4, r0 = (int)threadIdx.x / hd4, c0 = (int)threadIdx.x % hd4;
    for (int k0 = k_begin; k0 < k_end; k0 += TILE) {
        const int nt = k_end - k0 < TILE ? k_end - k0 : TILE;
        __syncthreads();  // the last tile read by every warp
        // All of a thread's rows of the tile are looked up, then loaded, at once: one
        // round trip for the selection and one for the keys, not one of each a row (long
        // context: the rows are mostly not in L2).
        if (r0 < rpp) {
            const float* key[STAGE];
#pragma unroll
            for (int i = 0; i < STAGE; ++i) {
                const int kk = r0 + i * rpp;
                key[i] = kk < nt ? ds4_att_key(k0 + kk, n_win, first, p0, kv, ring, window, hd,
                                               mode, sel, k_sel, t, rows, cap)
                                 : nullptr;
            }
            gpu_f4 kr[STAGE];
#pragma unroll
            for (int i = 0; i < STAGE; ++i)
                kr[i] = key[i] ? ((const gpu_f4*)key[i])[c0] : gpu_f4{0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int i = 0; i < STAGE; ++i) {
                const int kk = r0 + i * rpp;
                if (kk < nt) {
                    ks[kk][c0] = kr[i];
                    if (c0 == 0) kok[kk] = key[i] != nullptr;
                }
            }
        }
        __syncthreads();
        ds4_ath_tile<HPW>(qr, acc, m, l, ks, kok, se, nt, hd4, head_ok, scale);
    }
}

// ds4_ath_keys with the staging a pipeline (ds4_attention_heads4): a thread holds the
// next tile's key values in registers and the selection entries of the tile after it,
// so while the warps score the staged tile, the next tile's rows are on their way (a
// long context's rows mostly come from memory, and the plain loop waits a round trip
// for every tile with nothing else to run). The same tiles, values and order as
// ds4_ath_keys: the same bits.
template <int HPW>
GPU_DEV void ds4_ath_keys_pipe(const gpu_f4 (&qr)[HPW][DS4_ATH_J], gpu_f4 (&acc)[HPW][DS4_ATH_J],
                               float& m, float& l, gpu_f4 (*ks)[DS4_HEAD_MAX / 4], int* kok,
                               float (*se)[32], int t, int p0, int hd, int hd4, int first,
                               int n_win, const float* __restrict__ kv, const float* ring,
                               int window, int mode, const int* __restrict__ sel, int k_sel,
                               const float* __restrict__ rows, int cap, int k_begin, int k_end,
                               bool head_ok, float scale) {
    constexpr int TILE = 32 / HPW, STAGE = TILE / 2;  // (as ds4_ath_keys)
    const int rpp = (int)blockDim.x / hd4, r0 = (int)threadIdx.x / hd4, c0 = (int)threadIdx.x % hd4;
    const bool stager = r0 < rpp;
    const int* tsel = sel + (long long)t * k_sel;
    // The selection entry of key a (mode 2, past the window; else unused).
    auto sel_of = [&](int a) { return mode == 2 && a >= n_win && a < k_end ? tsel[a - n_win] : 0; };
    // Key a's row (null: past the range, or a selection entry outside the rows), its
    // selection entry r given.
    auto row_of = [&](int a, int r) -> const float* {
        return a < k_end ? ds4_att_key_sel(a, r, n_win, first, p0, kv, ring, window, hd, mode, rows, cap)
                         : nullptr;
    };
    int sv[STAGE];     // selection entries of the tile after the next
    gpu_f4 kr[STAGE];  // the next tile's values
    unsigned int okr = 0;  // bit i: the next tile's row i is a key
    if (stager) {
#pragma unroll
        for (int i = 0; i < STAGE; ++i) sv[i] = sel_of(k_begin + r0 + i * rpp);
#pragma unroll
        for (int i = 0; i < STAGE; ++i) {
            const float* key = row_of(k_begin + r0 + i * rpp, sv[i]);
            kr[i] = key ? ((const gpu_f4*)key)[c0] : gpu_f4{0.0f, 0.0f, 0.0f, 0.0f};
            okr |= key ? 1u << i : 0u;
        }
#pragma unroll
        for (int i = 0; i < STAGE; ++i) sv[i] = sel_of(k_begin + TILE + r0 + i * rpp);
    }
    for (int k0 = k_begin; k0 < k_end; k0 += TILE) {
        const int nt = k_end - k0 < TILE ? k_end - k0 : TILE;
        __syncthreads();  // the last tile read by every warp
        if (stager) {
#pragma unroll
            for (int i = 0; i < STAGE; ++i) {
                const int kk = r0 + i * rpp;
                if (kk < nt) {
                    ks[kk][c0] = kr[i];
                    if (c0 == 0) kok[kk] = (okr >> i) & 1u;
                }
            }
        }
        __syncthreads();
        if (stager && k0 + TILE < k_end) {
            // The next tile's rows asked for now, used after this tile's arithmetic.
            okr = 0;
#pragma unroll
            for (int i = 0; i < STAGE; ++i) {
                const float* key = row_of(k0 + TILE + r0 + i * rpp, sv[i]);
                kr[i] = key ? ((const gpu_f4*)key)[c0] : gpu_f4{0.0f, 0.0f, 0.0f, 0.0f};
                okr |= key ? 1u << i : 0u;
            }
#pragma unroll
            for (int i = 0; i < STAGE; ++i) sv[i] = sel_of(k0 + 2 * TILE + r0 + i * rpp);
        }
        ds4_ath_tile<HPW>(qr, acc, m, l, ks, kok, se, nt, hd4, head_ok, scale);
    }
}

// A warp's HPW heads h0 .. of one token's queries q ([heads][hd]) into qr, lane
// holding float4s 32 j + lane (zeros past hd and heads), and acc zeroed.
template <int HPW>
GPU_DEV void ds4_ath_load_q(const float* __restrict__ q, int heads, int hd, int h0,
                            gpu_f4 (&qr)[HPW][DS4_ATH_J], gpu_f4 (&acc)[HPW][DS4_ATH_J]) {
    const int lane = threadIdx.x & 31, hd4 = hd / 4;
#pragma unroll
    for (int hh = 0; hh < HPW; ++hh) {
        const gpu_f4* qh = (const gpu_f4*)(q + (long long)(h0 + hh) * hd);
#pragma unroll
        for (int j = 0; j < DS4_ATH_J; ++j) {
            const int c = 32 * j + lane;
            qr[hh][j] = h0 + hh < heads && c < hd4 ? qh[c] : gpu_f4{0.0f, 0.0f, 0.0f, 0.0f};
            acc[hh][j] = gpu_f4{0.0f, 0.0f, 0.0f, 0.0f};
        }
    }
}

// The keys block z of the heads kernels takes for position p (ds4_att_keys' first and
// n_win too): all of them (kper = 0), or split z's equal share of them (at least kper,
// whole tiles). The grid is sized for the most keys a token can have (a replayed graph
// serves every position), so a short context spreads its few keys over the first splits
// rather than leaving them all to split 0.
GPU_DEV void ds4_ath_range(int p, int window, int mode, int ratio, int cap, int k_sel, int kper,
                           int& first, int& n_win, int& k_begin, int& k_end,
                           int tile = DS4_ATH_TILE) {
    const int n_keys = ds4_att_keys(p, window, mode, ratio, cap, k_sel, first, n_win);
    int share = (n_keys + (int)gridDim.z - 1) / (int)gridDim.z;
    share = (share > kper ? share : kper) + tile - 1;
    share -= share % tile;
    k_begin = kper > 0 ? (int)blockIdx.z * share : 0;
    k_end = kper > 0 && k_begin + share < n_keys ? k_begin + share : n_keys;
}

// A split's partial sums of one head (slot of `slots`): the unnormalised values at
// part[slot hd], its max and sum at part[slots hd + 2 slot]. A split without keys
// writes max -inf (the merge weighs it at 0) and values 0 (acc as it was zeroed: the
// merge may load them before it knows the weight). Called by the whole warp.
GPU_DEV void ds4_ath_store_part(float* part, long long slots, long long slot, int hd, float mf,
                                float lf, const gpu_f4 (&acc)[DS4_ATH_J]) {
    const int lane = threadIdx.x & 31;
    if (lane == 0) {
        part[slots * hd + 2 * slot] = mf;
        part[slots * hd + 2 * slot + 1] = lf;
    }
    gpu_f4* pa = (gpu_f4*)(part + slot * hd);
#pragma unroll
    for (int j = 0; j < DS4_ATH_J; ++j)
        if (32 * j + lane < hd / 4) pa[32 * j + lane] = acc[j];
}

// ds4_attention_heads' body for HPW heads a warp (8 warps: 8 HPW heads a block).
template <int HPW>
GPU_DEV void ds4_attention_heads_body(const float* __restrict__ q, const float* __restrict__ kv,
                                      const float* __restrict__ ring, const float* __restrict__ rows,
                                      const int* __restrict__ sel, const float* __restrict__ sinks,
                                      const int* __restrict__ pos, int heads, int hd, int window,
                                      int ratio, int mode, int k_sel, int cap, float scale,
                                      float* __restrict__ out, int kper, float* __restrict__ part) {
    constexpr int TILE = 32 / HPW;
    __shared__ gpu_f4 ks[TILE][DS4_HEAD_MAX / 4];
    __shared__ int kok[TILE];
    __shared__ float se[DS4_ATH_WARPS][32];
    const int t = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int h0 = blockIdx.x * (DS4_ATH_WARPS * HPW) + warp * HPW;
    const int p0 = pos[0], p = pos[t], hd4 = hd / 4;
    gpu_f4 qr[HPW][DS4_ATH_J], acc[HPW][DS4_ATH_J];
    ds4_ath_load_q<HPW>(q + (long long)t * heads * hd, heads, hd, h0, qr, acc);
    int first, n_win, k_begin, k_end;
    ds4_ath_range(p, window, mode, ratio, cap, k_sel, kper, first, n_win, k_begin, k_end, TILE);
    // This lane's head (lane / TILE) of the warp: its running max and sum.
    const bool head_ok = h0 + lane / TILE < heads;
    float m = DS4_NEG_INF, l = 0.0f;
    if constexpr (HPW == DS4_ATH4_HPW)
        ds4_ath_keys_pipe<HPW>(qr, acc, m, l, ks, kok, se, t, p0, hd, hd4, first, n_win, kv, ring,
                               window, mode, sel, k_sel, rows, cap, k_begin, k_end, head_ok, scale);
    else
        ds4_ath_keys<HPW>(qr, acc, m, l, ks, kok, se, t, p0, hd, hd4, first, n_win, kv, ring,
                          window, mode, sel, k_sel, rows, cap, k_begin, k_end, head_ok, scale);
#pragma unroll
    for (int hh = 0; hh < HPW; ++hh) {
        const int h = h0 + hh;
        const float mf = gpu_shfl(m, hh * TILE), lf = gpu_shfl(l, hh * TILE);
        if (h >= heads) continue;  // the same for the whole warp
        if (part) {
            ds4_ath_store_part(part, (long long)gridDim.y * heads * gridDim.z,
                               ((long long)t * heads + h) * gridDim.z + blockIdx.z, hd, mf, lf,
                               acc[hh]);
            continue;
        }
        const float sink = sinks[h], mx = fmaxf(sink, mf);
        const float f = expf(mf - mx), den = expf(sink - mx) + lf * f;
        gpu_f4* o = (gpu_f4*)(out + ((long long)t * heads + h) * hd);
#pragma unroll
        for (int j = 0; j < DS4_ATH_J; ++j) {
            const int c = 32 * j + lane;
            if (c < hd4)
                o[c] = gpu_f4{acc[hh][j].x * f / den, acc[hh][j].y * f / den,
                              acc[hh][j].z * f / den, acc[hh][j].w * f / den};
        }
    }
}

extern "C" __global__ void __launch_bounds__(32 * DS4_ATH_WARPS, 2)
    ds4_attention_heads(const float* __restrict__ q, const float* __restrict__ kv,
                        const float* __restrict__ ring, const float* __restrict__ rows,
                        const int* __restrict__ sel, const float* __restrict__ sinks,
                        const int* __restrict__ pos, int heads, int hd, int window, int ratio,
                        int mode, int k_sel, int cap, float scale, float* __restrict__ out,
                        int kper, float* __restrict__ part, unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_ATTENTION_HEADS);
    ds4_attention_heads_body<DS4_ATH_HPW>(q, kv, ring, rows, sel, sinks, pos, heads, hd, window,
                                          ratio, mode, k_sel, cap, scale, out, kper, part);
}

// The same with four heads a warp (32 a block; DS4_ATH4_HPW) and its staging a pipeline:
// ~230 registers, one block an SM. grid = (ceil(heads / 32), n, splits).
extern "C" __global__ void __launch_bounds__(32 * DS4_ATH_WARPS, 1)
    ds4_attention_heads4(const float* __restrict__ q, const float* __restrict__ kv,
                         const float* __restrict__ ring, const float* __restrict__ rows,
                         const int* __restrict__ sel, const float* __restrict__ sinks,
                         const int* __restrict__ pos, int heads, int hd, int window, int ratio,
                         int mode, int k_sel, int cap, float scale, float* __restrict__ out,
                         int kper, float* __restrict__ part, unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_ATTENTION_HEADS4);
    ds4_attention_heads_body<DS4_ATH4_HPW>(q, kv, ring, rows, sel, sinks, pos, heads, hd, window,
                                           ratio, mode, k_sel, cap, scale, out, kper, part);
}

// ---------------------------------------------------------------------------------
// ds4_attention_heads on the tensor cores (ds4_attention_tc; CUDA sm_80+, a prefill
// chunk): a block serves DS4_ATC_HEADS heads of one token, its queries kept in shared
// memory for the whole pass, and takes the token's keys DS4_ATC_KEYS at a time (the
// next tile's rows on their way by cp.async while this one is scored). Both products
// of a tile run as m16n8k8 TF32 mma, each pair of f32 values as three TF32 products
// (hi hi + hi lo + lo hi, ds4_tf32_split_t: about f32's accuracy). Warp w takes head
// group w % 4 (16 heads) and half w / 4 of the head width: the logits S = Q K^T of all
// 16 keys over its half of the dims, added to the other half's through shared memory
// (both warps of a group then hold the same logits, maxima and weights), then
// O += P V (V = K) for its half of the output columns, P straight from the logits'
// registers (the C fragment of S is the A fragment of P V with k taken as keys 2c,
// 2c + 1 of each 8: any order of k gives the same products, and V's rows then sit on
// 32 banks). A tile's P V goes into fresh accumulators, added to O after the running
// max's correction in f32 FMAs. The same online softmax with the sink as the heads
// kernels, in another summation order.
// Needs hd % 16 == 0, hd <= DS4_HEAD_MAX, q / kv / ring / rows / out 16-byte aligned,
// and DS4_ATC_SMEM(hd) bytes of dynamic shared memory; kper = 0 (part unused).
// ds4_attention_tc_bf16 (opt-in, MOE_GPU_ATT_PREC=bf16; hd % 32 == 0) rounds the
// queries, keys and P to bf16 and takes one m16n8k16 bf16 product where this takes three
// TF32 ones over half the k: S over 16 dims a step (the dims of a lane's pair taken as
// c and c + 4 of an 8-dim group, for Q and K alike, as in ds4_ixs_chunk_bf16), P V over
// the tile's 16 keys in one step (S's C fragments are P's A fragment: keys 2c, 2c + 1
// and 8 + 2c, 8 + 2c + 1, the pairs a bf16 fragment takes). The softmax stays in f32;
// its sums take the unrounded weights, the products the rounded ones (as flash
// attention in bf16 does).
// grid = (ceil(heads / DS4_ATC_HEADS), n), block = 32 * DS4_ATC_WARPS.
#define DS4_ATC_HEADS 64
#define DS4_ATC_KEYS 16
#define DS4_ATC_WARPS 8
#if defined(DS4_IXM_TC) && defined(GPU_CP_ASYNC)
// Shared memory (floats; the row stride hd + 4 puts a fragment's 8 rows x 4 columns on
// 32 banks): Q [64][ld], K [2][16][ld], the warps' partial logits [2][8][32] float4s,
// then the keys' flags [2][16] (ints).
struct ds4_atc_smem_t {
    float *qs, *ks;
    gpu_f4* xs;
    int* kok;
};
GPU_DEV ds4_atc_smem_t ds4_atc_carve(float* base, int ld) {
    ds4_atc_smem_t s;
    s.qs = base;
    s.ks = s.qs + DS4_ATC_HEADS * ld;
    s.xs = (gpu_f4*)(s.ks + 2 * DS4_ATC_KEYS * ld);
    s.kok = (int*)(s.xs + 2 * DS4_ATC_WARPS * 32);
    return s;
}

// A thread's share of a key tile: key threadIdx.x / 16 of the tile, its float4s
// threadIdx.x % 16 + 16 i (i < DS4_ATC_PER), so that a thread works out one key's
// address a tile (16 threads a key; a warp's copy is two 256-byte runs of two keys).
#define DS4_ATC_PER (DS4_HEAD_MAX / 4 / 16)
static_assert(DS4_ATC_KEYS * 16 == 32 * DS4_ATC_WARPS, "16 threads a key of a tile");

// The selection entry of this thread's key in the tile at k0 (mode 2, past the window;
// else unused): read a tile ahead, so that staging a tile waits for no round trip.
GPU_DEV int ds4_atc_sel(int k0, int n_keys, int n_win, int mode, const int* tsel) {
    const int a = k0 + (threadIdx.x >> 4);
    return mode == 2 && a >= n_win && a < n_keys ? tsel[a - n_win] : 0;
}

// Keys k0 .. k0 + 15 of the token into K buffer b, this thread's key's selection entry
// sv given: every thread's share by cp.async, zeros (and flag 0) past the keys and for
// selection entries outside the rows; one commit group.
GPU_DEV void ds4_atc_stage(const ds4_atc_smem_t& s, int ld, int b, int k0, int sv, int n_keys,
                           int p0, int hd, int first, int n_win, const float* kv,
                           const float* ring, int window, int mode, const float* rows, int cap) {
    const int hd4 = hd / 4, kk = threadIdx.x >> 4, c0 = threadIdx.x & 15, a = k0 + kk;
    float* kr = s.ks + (b * DS4_ATC_KEYS + kk) * ld;
    const float* key = a < n_keys ? ds4_att_key_sel(a, sv, n_win, first, p0, kv, ring, window,
                                                    hd, mode, rows, cap)
                                  : nullptr;
#pragma unroll
    for (int i = 0; i < DS4_ATC_PER; ++i) {
        const int c4 = c0 + 16 * i;
        if (c4 >= hd4) break;  // (hd < DS4_HEAD_MAX)
        gpu_cp_async16(gpu_smem_addr(kr + 4 * c4), key ? key + 4 * c4 : kv, key != nullptr);
    }
    if (c0 == 0) s.kok[b * DS4_ATC_KEYS + kk] = key != nullptr;
    gpu_cp_commit();
}

#endif

// Dynamic shared memory ds4_attention_tc takes for head width hd (the host's
// ds4::att_tc_smem computes the same).
#define DS4_ATC_SMEM(hd) \
    (4 * ((DS4_ATC_HEADS + 2 * DS4_ATC_KEYS) * ((hd) + 4) + 2 * DS4_ATC_WARPS * 32 * 4 + 2 * DS4_ATC_KEYS))

#if defined(DS4_IXM_TC) && defined(GPU_CP_ASYNC)
// An O fragment after a tile: rows g / g + 8 rescaled by their max's correction, plus
// the tile's P V (f32 FMAs, both forms).
GPU_DEV void ds4_atc_rescale_add(float (&o)[4], const float (&corr)[2], const float (&dj)[4]) {
    o[0] = fmaf(o[0], corr[0], dj[0]);
    o[1] = fmaf(o[1], corr[0], dj[1]);
    o[2] = fmaf(o[2], corr[1], dj[2]);
    o[3] = fmaf(o[3], corr[1], dj[3]);
}

// ds4_attention_tc's body for head width HD (0: hd as given; V4-Flash's 512 has its own
// copy, whose shared-memory offsets are constants); BF16: ds4_attention_tc_bf16's.
template <int HD, bool BF16>
GPU_DEV void ds4_atc_body(const float* __restrict__ q, const float* __restrict__ kv,
                          const float* __restrict__ ring, const float* __restrict__ rows,
                          const int* __restrict__ sel, const float* __restrict__ sinks,
                          const int* __restrict__ pos, int heads, int hd_arg, int window,
                          int ratio, int mode, int k_sel, int cap, float scale,
                          float* __restrict__ out) {
    extern __shared__ __attribute__((aligned(16))) float ds4_atc_dyn[];
    const int hd = HD ? HD : hd_arg, ld = hd + 4;
    const ds4_atc_smem_t s = ds4_atc_carve(ds4_atc_dyn, ld);
    const int t = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, c = lane & 3, hg = warp & 3, half = warp >> 2;
    const int h0 = blockIdx.x * DS4_ATC_HEADS, hd4 = hd / 4, p0 = pos[0];
    int first, n_win;
    const int n_keys = ds4_att_keys(pos[t], window, mode, ratio, cap, k_sel, first, n_win);
    const int tiles = (n_keys + DS4_ATC_KEYS - 1) / DS4_ATC_KEYS;
    // The first tile's rows on their way while the queries are staged, and the second
    // tile's selection entries.
    const int* tsel = sel + (long long)t * k_sel;
    int sv = ds4_atc_sel(0, n_keys, n_win, mode, tsel);
    ds4_atc_stage(s, ld, 0, 0, sv, n_keys, p0, hd, first, n_win, kv, ring, window, mode, rows, cap);
    sv = ds4_atc_sel(DS4_ATC_KEYS, n_keys, n_win, mode, tsel);
    for (int e = threadIdx.x; e < DS4_ATC_HEADS * hd4; e += blockDim.x) {
        const int hh = e / hd4, c4 = e % hd4;
        *(gpu_f4*)(s.qs + hh * ld + 4 * c4) =
            h0 + hh < heads ? ((const gpu_f4*)(q + ((long long)t * heads + h0 + hh) * hd))[c4]
                            : gpu_f4{0.0f, 0.0f, 0.0f, 0.0f};
    }
    // This warp's rows (heads 16 hg + g and + 8 of the block): their running max and
    // sum, and the O fragments of its half of the columns (cb ..).
    const int cols = hd / 2, cb = half * cols;
    float mr[2] = {DS4_NEG_INF, DS4_NEG_INF}, lr[2] = {0.0f, 0.0f};
    float o[DS4_HEAD_MAX / 16][4];
#pragma unroll
    for (int j = 0; j < DS4_HEAD_MAX / 16; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    const float* qa = s.qs + 16 * hg * ld + cb;
    for (int it = 0; it < tiles; ++it) {
        const int b = it & 1, k0 = it * DS4_ATC_KEYS;
        gpu_cp_wait<0>();
        __syncthreads();  // tile it in every thread's view; tile it - 1 done with by all
        if (it + 1 < tiles) {
            ds4_atc_stage(s, ld, b ^ 1, k0 + DS4_ATC_KEYS, sv, n_keys, p0, hd, first, n_win, kv,
                          ring, window, mode, rows, cap);
            sv = ds4_atc_sel(k0 + 2 * DS4_ATC_KEYS, n_keys, n_win, mode, tsel);
        }
        const int* kok = s.kok + b * DS4_ATC_KEYS;
        int any = 0;
#pragma unroll
        for (int kk = 0; kk < DS4_ATC_KEYS; ++kk) any |= kok[kk];
        if (!any) continue;  // only null keys (the same for the whole block)
        const float* kb = s.ks + b * DS4_ATC_KEYS * ld;
        // S over dims cb .. cb + cols: keys 8 kt .. + 7 in C fragment kt; in f32 its small
        // terms in two more chains (three chains of hd / 16 mma, not one of 3 hd / 16).
        float sm[2][4] = {}, sa[2][4] = {}, sb[2][4] = {};
        if constexpr (BF16) {
            for (int d = 0; d < cols; d += 16) {
                const float* q0 = qa + g * ld + d + c;
                const float* q1 = q0 + 8 * ld;
                const unsigned int a0 = gpu_bf16x2(q0[0], q0[4]), a1 = gpu_bf16x2(q1[0], q1[4]);
                const unsigned int a2 = gpu_bf16x2(q0[8], q0[12]), a3 = gpu_bf16x2(q1[8], q1[12]);
#pragma unroll
                for (int kt = 0; kt < 2; ++kt) {
                    const float* kr = kb + (8 * kt + g) * ld + cb + d + c;
                    gpu_mma_bf16(sm[kt], a0, a1, a2, a3, gpu_bf16x2(kr[0], kr[4]),
                                 gpu_bf16x2(kr[8], kr[12]));
                }
            }
        } else
        for (int d = 0; d < cols; d += 8) {
            unsigned int ah[4], al[4];
            ds4_tf32_split_t(qa[g * ld + d + c], ah[0], al[0]);
            ds4_tf32_split_t(qa[(g + 8) * ld + d + c], ah[1], al[1]);
            ds4_tf32_split_t(qa[g * ld + d + c + 4], ah[2], al[2]);
            ds4_tf32_split_t(qa[(g + 8) * ld + d + c + 4], ah[3], al[3]);
#pragma unroll
            for (int kt = 0; kt < 2; ++kt) {
                const float* kr = kb + (8 * kt + g) * ld + cb + d;
                unsigned int bh0, bl0, bh1, bl1;
                ds4_tf32_split_t(kr[c], bh0, bl0);
                ds4_tf32_split_t(kr[c + 4], bh1, bl1);
                ds4_mma_tf32(sa[kt], ah, bl0, bl1);
                ds4_mma_tf32(sb[kt], al, bh0, bh1);
                ds4_mma_tf32(sm[kt], ah, bh0, bh1);
            }
        }
        // Element e = 4 kt + i: row g + 8 (i / 2), key 8 kt + 2c + i % 2. This half's
        // sums to shared memory, the other half's back, added half 0's first.
        float x[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] = sm[e >> 2][e & 3] + (sa[e >> 2][e & 3] + sb[e >> 2][e & 3]);
        s.xs[warp * 32 + lane] = gpu_f4{x[0], x[1], x[2], x[3]};
        s.xs[(DS4_ATC_WARPS + warp) * 32 + lane] = gpu_f4{x[4], x[5], x[6], x[7]};
        __syncthreads();  // both halves' sums
        const gpu_f4 y0 = s.xs[(warp ^ 4) * 32 + lane], y1 = s.xs[(DS4_ATC_WARPS + (warp ^ 4)) * 32 + lane];
        const float y[8] = {y0.x, y0.y, y0.z, y0.w, y1.x, y1.y, y1.z, y1.w};
        float mx[2] = {DS4_NEG_INF, DS4_NEG_INF};
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const int kk = 8 * (e >> 2) + 2 * c + (e & 1);
            const float dot = half == 0 ? x[e] + y[e] : y[e] + x[e];
            x[e] = k0 + kk < n_keys && kok[kk] ? dot * scale : DS4_NEG_INF;
            mx[(e >> 1) & 1] = fmaxf(mx[(e >> 1) & 1], x[e]);
        }
        float corr[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], gpu_shfl_xor(mx[r], 1));
            mx[r] = fmaxf(mx[r], gpu_shfl_xor(mx[r], 2));
            const float mn = fmaxf(mr[r], mx[r]);
            // Nothing valid yet for this row: no change (and no inf - inf).
            corr[r] = mn == DS4_NEG_INF ? 1.0f : expf(mr[r] - mn);
            float sum = 0.0f;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                if (((e >> 1) & 1) != r) continue;
                x[e] = x[e] == DS4_NEG_INF ? 0.0f : expf(x[e] - mn);  // now P
                sum += x[e];
            }
            sum += gpu_shfl_xor(sum, 1);
            sum += gpu_shfl_xor(sum, 2);
            lr[r] = lr[r] * corr[r] + sum;
            mr[r] = mn;
        }
        const float* v0 = kb + 2 * c * ld + cb + g;
        if constexpr (BF16) {
            // P as bf16: rows g / g + 8 at keys 2c, 2c + 1 (a0 / a1), then 8 + 2c, 9 + 2c
            // (a2 / a3); V's rows 2c, 2c + 1 (b0) and 8 + 2c, 9 + 2c (b1) at column 8 j + g.
            const unsigned int p0 = gpu_bf16x2(x[0], x[1]), p1 = gpu_bf16x2(x[2], x[3]);
            const unsigned int p2 = gpu_bf16x2(x[4], x[5]), p3 = gpu_bf16x2(x[6], x[7]);
#pragma unroll
            for (int j = 0; j < DS4_HEAD_MAX / 16; ++j) {
                if (8 * j < cols) {  // the same for the whole block
                    float dj[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    const float* vj = v0 + 8 * j;
                    gpu_mma_bf16(dj, p0, p1, p2, p3, gpu_bf16x2(vj[0], vj[ld]),
                                 gpu_bf16x2(vj[8 * ld], vj[9 * ld]));
                    ds4_atc_rescale_add(o[j], corr, dj);
                }
            }
            continue;
        }
        // P's A fragments: k-step kt, a0 / a1 = rows g / g + 8 at key 2c, a2 / a3 at 2c + 1.
        unsigned int ph[2][4], pl[2][4];
#pragma unroll
        for (int kt = 0; kt < 2; ++kt) {
            ds4_tf32_split_t(x[4 * kt], ph[kt][0], pl[kt][0]);
            ds4_tf32_split_t(x[4 * kt + 2], ph[kt][1], pl[kt][1]);
            ds4_tf32_split_t(x[4 * kt + 1], ph[kt][2], pl[kt][2]);
            ds4_tf32_split_t(x[4 * kt + 3], ph[kt][3], pl[kt][3]);
        }
        // O: rows 16 hg .. x columns cb .. of P V; B fragment b0 / b1 = V rows 8 kt + 2c,
        // + 1 at column 8 j + g.
#pragma unroll
        for (int j = 0; j < DS4_HEAD_MAX / 16; ++j) {
            if (8 * j < cols) {  // the same for the whole block
                float dj[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int kt = 0; kt < 2; ++kt) {
                    unsigned int bh0, bl0, bh1, bl1;
                    ds4_tf32_split_t(v0[8 * kt * ld + 8 * j], bh0, bl0);
                    ds4_tf32_split_t(v0[(8 * kt + 1) * ld + 8 * j], bh1, bl1);
                    ds4_mma3(dj, ph[kt], pl[kt], bh0, bh1, bl0, bl1);
                }
                ds4_atc_rescale_add(o[j], corr, dj);
            }
        }
    }
    // The sink, then the output.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int h = h0 + 16 * hg + g + 8 * r;
        if (h >= heads) continue;
        const float sink = sinks[h], mx = fmaxf(sink, mr[r]);
        const float f = expf(mr[r] - mx), den = expf(sink - mx) + lr[r] * f;
        float* orow = out + ((long long)t * heads + h) * hd + cb;
#pragma unroll
        for (int j = 0; j < DS4_HEAD_MAX / 16; ++j)
            if (8 * j < cols)
                *(gpu_f2*)(orow + 8 * j + 2 * c) =
                    gpu_f2{o[j][2 * r] * f / den, o[j][2 * r + 1] * f / den};
    }
}
#endif

// Both entry points: the body for V4-Flash's width or any other, BF16 its form.
#if defined(DS4_IXM_TC) && defined(GPU_CP_ASYNC)
template <bool BF16>
GPU_DEV void ds4_atc_run(const float* q, const float* kv, const float* ring, const float* rows,
                         const int* sel, const float* sinks, const int* pos, int heads, int hd,
                         int window, int ratio, int mode, int k_sel, int cap, float scale,
                         float* out) {
    if (BF16 && (hd & 31)) asm volatile("trap;");  // (the host sends it widths of 32 k only)
    if (hd == DS4_HEAD_MAX)
        ds4_atc_body<DS4_HEAD_MAX, BF16>(q, kv, ring, rows, sel, sinks, pos, heads, hd, window,
                                         ratio, mode, k_sel, cap, scale, out);
    else
        ds4_atc_body<0, BF16>(q, kv, ring, rows, sel, sinks, pos, heads, hd, window, ratio, mode,
                              k_sel, cap, scale, out);
}
#define DS4_ATC_RUN(BF16) \
    ds4_atc_run<BF16>(q, kv, ring, rows, sel, sinks, pos, heads, hd, window, ratio, mode, k_sel, cap, scale, out)
#else
#define DS4_ATC_RUN(BF16) __builtin_trap()  // the host launches it only where the tensor cores run it
#endif

extern "C" __global__ void __launch_bounds__(32 * DS4_ATC_WARPS, 1)
    ds4_attention_tc(const float* __restrict__ q, const float* __restrict__ kv,
                     const float* __restrict__ ring, const float* __restrict__ rows,
                     const int* __restrict__ sel, const float* __restrict__ sinks,
                     const int* __restrict__ pos, int heads, int hd, int window, int ratio,
                     int mode, int k_sel, int cap, float scale, float* __restrict__ out,
                     int kper, float* __restrict__ part, unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_ATTENTION_TC);
    (void)kper;
    (void)part;
    DS4_ATC_RUN(false);
}

extern "C" __global__ void __launch_bounds__(32 * DS4_ATC_WARPS, 1)
    ds4_attention_tc_bf16(const float* __restrict__ q, const float* __restrict__ kv,
                          const float* __restrict__ ring, const float* __restrict__ rows,
                          const int* __restrict__ sel, const float* __restrict__ sinks,
                          const int* __restrict__ pos, int heads, int hd, int window, int ratio,
                          int mode, int k_sel, int cap, float scale, float* __restrict__ out,
                          int kper, float* __restrict__ part, unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_ATTENTION_TC_BF16);
    (void)kper;
    (void)part;
    DS4_ATC_RUN(true);
}

// Merging one head's splits (slots slot0 .. slot0 + splits - 1 of `slots`, as
// ds4_ath_store_part wrote them: an earlier launch, or other blocks of this one before a
// gpu_group_barrier, whose acquire (thread 0's, then __syncthreads) makes plain loads see
// their writes), warp 0's
// part: every split's max and sum at once (splits <= 64: two a
// lane), then the common max with the sink, each split's weight exp(m_s - max) into ws
// (0 for a split without keys) and the denominator into *den by shuffles.
GPU_DEV void ds4_atm_weights(float* part, long long slots, long long slot0, int hd, int splits,
                             float sink, float* ws, float* den_s) {
    const int lane = threadIdx.x & 31;
    const float* ml = part + slots * hd;
    float m[2], l[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int s = lane + 32 * i;
        m[i] = s < splits ? ml[2 * (slot0 + s)] : DS4_NEG_INF;
        l[i] = s < splits ? ml[2 * (slot0 + s) + 1] : 0.0f;
    }
    const float mx = gpu_warp_max(fmaxf(sink, fmaxf(m[0], m[1])));
    float den = 0.0f;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const float w = m[i] == DS4_NEG_INF ? 0.0f : expf(m[i] - mx);
        den += w == 0.0f ? 0.0f : l[i] * w;
        if (lane + 32 * i < splits) ws[lane + 32 * i] = w;
    }
    den = gpu_warp_sum(den);
    if (lane == 0) *den_s = den + expf(sink - mx);
}

// Float4 column c of the merged head: the splits' values weighed by ws, over den (eight
// splits' loads in flight at a time; splits of weight 0 not loaded, predicated rather
// than branched around).
GPU_DEV gpu_f4 ds4_atm_column(float* part, long long slot0, int hd, int splits,
                              const float* ws, float den, int c) {
    gpu_f4 a = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 8
    for (int s = 0; s < splits; ++s) {
        const float w = ws[s];
        // (plain loads: inline assembly would stop this partial unroll, being convergent)
        const gpu_f4 v = w != 0.0f ? ((const gpu_f4*)(part + (slot0 + s) * hd))[c]
                                   : gpu_f4{0.0f, 0.0f, 0.0f, 0.0f};
        ds4_axpy4(a, w, v);
    }
    return gpu_f4{a.x / den, a.y / den, a.z / den, a.w / den};
}

// The splits of ds4_attention_heads (kper > 0) added up for head h of token t: their
// maxima and the sink give the common scale, each split's sums weigh in at
// exp(m_s - max), splits without keys at 0. Thread (group g, float4 column c) loads
// splits g, g + DS4_ATM_GROUPS, .. of column c all at once, before the weights are
// known (a split without keys wrote zeros there), so the values' round trip to memory
// overlaps the weights' instead of following it; the groups' sums are then added in
// group order. store = 1 (one token) also writes its K=V row into the ring
// (ds4_window_store's work; every split has read the window by now).
// grid = (heads, n), block = DS4_ATM_THREADS.
#define DS4_ATM_MAX_SPLITS 64
#define DS4_ATM_THREADS 512
#define DS4_ATM_GROUPS (DS4_ATM_THREADS / (DS4_HEAD_MAX / 4))
#define DS4_ATM_PER (DS4_ATM_MAX_SPLITS / DS4_ATM_GROUPS)
extern "C" __global__ void __launch_bounds__(DS4_ATM_THREADS)
    ds4_attention_merge(float* part, int splits, const float* __restrict__ sinks,
                        int heads, int hd, float* __restrict__ out, const float* __restrict__ kv,
                        const int* __restrict__ pos, int window, int store, float* __restrict__ ring,
                        unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_ATTENTION_MERGE);
    __shared__ float ws[DS4_ATM_MAX_SPLITS];
    __shared__ float den_s;
    __shared__ gpu_f4 sums[DS4_ATM_GROUPS - 1][DS4_HEAD_MAX / 4];
    const int h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x;
    if (store && h == 0 && t == 0)
        for (int i = tid; i < hd; i += DS4_ATM_THREADS) ring[(long long)(pos[0] % window) * hd + i] = kv[i];
    const long long slot0 = ((long long)t * heads + h) * splits;
    const long long slots = (long long)gridDim.y * heads * splits;
    const int c = tid % (DS4_HEAD_MAX / 4), g = tid / (DS4_HEAD_MAX / 4);
    const bool col = c < hd / 4;
    gpu_f4 v[DS4_ATM_PER];
#pragma unroll
    for (int i = 0; i < DS4_ATM_PER; ++i) {
        const int s = g + DS4_ATM_GROUPS * i;
        v[i] = col && s < splits ? ((const gpu_f4*)(part + (slot0 + s) * hd))[c]
                                 : gpu_f4{0.0f, 0.0f, 0.0f, 0.0f};
    }
    if (tid < 32) ds4_atm_weights(part, slots, slot0, hd, splits, sinks[h], ws, &den_s);
    __syncthreads();
    gpu_f4 a = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < DS4_ATM_PER; ++i) {
        const int s = g + DS4_ATM_GROUPS * i;
        const float w = s < splits ? ws[s] : 0.0f;
        ds4_axpy4(a, w, v[i]);
    }
    if (g > 0) sums[g - 1][c] = a;
    __syncthreads();
    if (g == 0 && col) {
#pragma unroll
        for (int k = 0; k < DS4_ATM_GROUPS - 1; ++k) ds4_axpy4(a, 1.0f, sums[k][c]);
        const float den = den_s;
        ((gpu_f4*)(out + ((long long)t * heads + h) * hd))[c] =
            gpu_f4{a.x / den, a.y / den, a.z / den, a.w / den};
    }
}

// The rotary of float4 column c of a head of hd (values 4c .. 4c + 3: pairs (x, y) and
// (z, w)) where its pairs lie in the trailing 2 n_pairs values, as ds4_rotate does it.
GPU_DEV void ds4_rotate4(gpu_f4& v, int c, int hd, int n_pairs, const float* __restrict__ inv_freq,
                         float p, float mscale, int inverse) {
    const int tail = hd - 2 * n_pairs, i = 4 * c;
    if (i >= tail && i < hd) ds4_rotate(v.x, v.y, p, inv_freq[(i - tail) / 2], mscale, inverse);
    if (i + 2 >= tail && i + 2 < hd)
        ds4_rotate(v.z, v.w, p, inv_freq[(i + 2 - tail) / 2], mscale, inverse);
}

// A head's query held as float4 columns 32 j + lane of a warp: RMS-normed (plain, eps)
// and rotated on its trailing 2 n_pairs values (ds4_norm_rope's (1, n_pairs, 0)).
GPU_DEV void ds4_att_q_rope(gpu_f4 (&qr)[DS4_ATH_J], int hd, int n_pairs, const float* inv_freq,
                            float p, float mscale, float eps, int lane) {
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < DS4_ATH_J; ++j) ss = ds4_dot4(qr[j], qr[j], ss);
    const float r = 1.0f / sqrtf(gpu_warp_sum(ss) / (float)hd + eps);
#pragma unroll
    for (int j = 0; j < DS4_ATH_J; ++j) {
        gpu_f4 v = {qr[j].x * r, qr[j].y * r, qr[j].z * r, qr[j].w * r};
        ds4_rotate4(v, 32 * j + lane, hd, n_pairs, inv_freq, p, mscale, 0);
        qr[j] = v;
    }
}

// ds4_attention_heads over key splits for one token (a decode step) in one launch, with
// ds4_attention's rotaries inside (inv_freq set: q RMS-normed (plain, eps) and rotated
// on its trailing 2 n_pairs values, the output inverse-rotated) and the splits merged
// without a launch of their own: block (x, z) scores split z of the token's keys (as
// with kper) for head group x and writes its partial sums to `part`; then the group's
// blocks wait for each other (sync[x]; the host keeps the grid to the multiprocessors,
// so every block is resident) and block z merges heads z, z + splits, .. of its group as
// ds4_attention_merge does. A decode step had the block-a-head kernel read every key
// from L2 once a head (64 times); here once a group of DS4_ATH_HEADS heads. store = 1
// also writes the token's K=V row into the ring (slot p % window, which no key of this
// step reads). Needs what ds4_attention_heads needs. grid = (ceil(heads /
// DS4_ATH_HEADS), 1, splits <= DS4_ATM_MAX_SPLITS), block = 32 * DS4_ATH_WARPS. (Two
// blocks an SM, so that a long context's splits of one tile each fit the device at once;
// -D DS4_ATD_MIN_BLOCKS=1 for benchmark builds.)
#ifndef DS4_ATD_MIN_BLOCKS
#define DS4_ATD_MIN_BLOCKS 2
#endif
extern "C" __global__ void __launch_bounds__(32 * DS4_ATH_WARPS, DS4_ATD_MIN_BLOCKS)
    ds4_attention_dec(const float* __restrict__ q, const float* __restrict__ kv, float* ring,
                      const float* __restrict__ rows, const int* __restrict__ sel,
                      const float* __restrict__ sinks, const int* __restrict__ pos, int heads,
                      int hd, int window, int ratio, int mode, int k_sel, int cap, float scale,
                      float* __restrict__ out, int kper, float* part, unsigned int* sync,
                      const float* __restrict__ inv_freq, int n_pairs, float eps, float mscale,
                      int store, unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_ATTENTION_DEC);
    __shared__ gpu_f4 ks[DS4_ATH_TILE][DS4_HEAD_MAX / 4];
    __shared__ int kok[DS4_ATH_TILE];
    __shared__ float se[DS4_ATH_WARPS][32];
    __shared__ float ws[DS4_ATM_MAX_SPLITS];
    __shared__ float den_s;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = blockIdx.x, z = blockIdx.z;
    const int h0 = g * DS4_ATH_HEADS + warp * DS4_ATH_HPW, p = pos[0], hd4 = hd / 4;
    const int splits = (int)gridDim.z;
    if (store && g == 0 && z == 0) ds4_att_ring_store(kv, ring, p, window, hd);
    gpu_f4 qr[DS4_ATH_HPW][DS4_ATH_J], acc[DS4_ATH_HPW][DS4_ATH_J];
    ds4_ath_load_q<DS4_ATH_HPW>(q, heads, hd, h0, qr, acc);
    if (inv_freq)
#pragma unroll
        for (int hh = 0; hh < DS4_ATH_HPW; ++hh)
            ds4_att_q_rope(qr[hh], hd, n_pairs, inv_freq, (float)p, mscale, eps, lane);
    int first, n_win, k_begin, k_end;
    ds4_ath_range(p, window, mode, ratio, cap, k_sel, kper, first, n_win, k_begin, k_end);
    const bool head_ok = h0 + lane / DS4_ATH_TILE < heads;
    float m = DS4_NEG_INF, l = 0.0f;
    ds4_ath_keys<DS4_ATH_HPW>(qr, acc, m, l, ks, kok, se, 0, p, hd, hd4, first, n_win, kv, ring,
                              window, mode, sel, k_sel, rows, cap, k_begin, k_end, head_ok, scale);
    const long long slots = (long long)heads * splits;
#pragma unroll
    for (int hh = 0; hh < DS4_ATH_HPW; ++hh) {
        const float mf = gpu_shfl(m, hh * DS4_ATH_TILE), lf = gpu_shfl(l, hh * DS4_ATH_TILE);
        if (h0 + hh < heads)  // (the same for the whole warp)
            ds4_ath_store_part(part, slots, (long long)(h0 + hh) * splits + z, hd, mf, lf, acc[hh]);
    }
    gpu_group_barrier(sync + g, (unsigned int)splits);
    for (int hm = z; hm < DS4_ATH_HEADS; hm += splits) {
        const int h = g * DS4_ATH_HEADS + hm;
        if (h >= heads) break;  // (the same for the whole block)
        if (warp == 0) ds4_atm_weights(part, slots, (long long)h * splits, hd, splits, sinks[h], ws, &den_s);
        __syncthreads();
        for (int c = threadIdx.x; c < hd4; c += blockDim.x) {
            gpu_f4 v = ds4_atm_column(part, (long long)h * splits, hd, splits, ws, den_s, c);
            if (inv_freq) ds4_rotate4(v, c, hd, n_pairs, inv_freq, (float)p, mscale, 1);
            ((gpu_f4*)(out + (long long)h * hd))[c] = v;
        }
        __syncthreads();  // ws and den_s read before the next head's
    }
}

// ds4_attention for one token (a decode step short of the long-context split) with
// DS4_ATG_HEADS heads a block and the keys split over blocks: the block-a-head kernel
// had each of 64 blocks read every key from L2 (one shared K=V head of 2 KB a key: 35 MB
// a CSA layer at position ~540, half its time); here a warp scores each key it loads
// against the group's four heads, so a key leaves L2 once a group, and the splits give
// the device more blocks with fewer keys each. The token's keys are shared out over the
// splits, at least kmin a split. Block (x, z) runs an online softmax per head over split
// z's keys (DS4_ATG_BATCH a warp at a time, in registers: no staging), merges its warps
// in shared memory and stores the partial sums as ds4_ath_store_part lays them out;
// splits past the token's keys store nothing. The
// group's last block to count itself in sync[x] (a count it puts back to zero) merges
// the stored splits with the sinks as ds4_attention_merge does, so no launch of its own
// and no block waits for another. inv_freq / store as ds4_attention. Same sums as
// ds4_attention up to order. Needs hd % 4 == 0, hd <= DS4_HEAD_MAX, q / kv / ring / rows
// / out / part 16-byte aligned. grid = (ceil(heads / DS4_ATG_HEADS), 1, splits <=
// DS4_ATM_MAX_SPLITS), block = 32 * DS4_ATG_WARPS (~200 registers: one block an SM, so
// the host keeps the grid within the multiprocessors).
#define DS4_ATG_HEADS 4
#define DS4_ATG_WARPS 8
#ifndef DS4_ATG_BATCH
#define DS4_ATG_BATCH 2  // keys a warp has in flight at once (-D: benchmark builds)
#endif
extern "C" __global__ void __launch_bounds__(32 * DS4_ATG_WARPS)
    ds4_attention_grp(const float* __restrict__ q, const float* __restrict__ kv, float* ring,
                      const float* __restrict__ rows, const int* __restrict__ sel,
                      const float* __restrict__ sinks, const int* __restrict__ pos, int heads,
                      int hd, int window, int ratio, int mode, int k_sel, int cap, float scale,
                      float* __restrict__ out, int kmin, float* part, unsigned int* sync,
                      const float* __restrict__ inv_freq, int n_pairs, float eps, float mscale,
                      int store, unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_ATTENTION_GRP);
    constexpr int G = DS4_ATG_HEADS, NW = DS4_ATG_WARPS, B = DS4_ATG_BATCH, J = DS4_ATH_J;
    __shared__ gpu_f4 wacc[NW][2][DS4_HEAD_MAX / 4];
    __shared__ float wm[NW][G], wl[NW][G];
    __shared__ float ws[G][DS4_ATM_MAX_SPLITS];
    __shared__ float den_s[G];
    __shared__ unsigned int last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tid = threadIdx.x;
    const int g = blockIdx.x, z = blockIdx.z, h0 = g * G, p = pos[0], hd4 = hd / 4;
    const int nh = heads - h0 < G ? heads - h0 : G, splits = (int)gridDim.z;
    const long long slots = (long long)heads * splits;
    if (store && g == 0 && z == 0) ds4_att_ring_store(kv, ring, p, window, hd);
    int first, n_win;
    const int n_keys = ds4_att_keys(p, window, mode, ratio, cap, k_sel, first, n_win);
    // The token's keys shared out over the splits, at least kmin a split (n_keys >= 1).
    const int kshare = (n_keys + splits - 1) / splits, kper = kshare > kmin ? kshare : kmin;
    const int used = (n_keys + kper - 1) / kper;  // splits with keys; later ones store nothing
    if (z < used) {
        gpu_f4 qr[G][J], acc[G][J];
        float m[G], l[G];
#pragma unroll
        for (int hh = 0; hh < G; ++hh) {
            // (heads past the end score head h0's query; they are never stored)
            const gpu_f4* qh = (const gpu_f4*)(q + (long long)(h0 + (hh < nh ? hh : 0)) * hd);
#pragma unroll
            for (int j = 0; j < J; ++j) {
                const int c = 32 * j + lane;
                qr[hh][j] = c < hd4 ? qh[c] : gpu_f4{0.0f, 0.0f, 0.0f, 0.0f};
                acc[hh][j] = gpu_f4{0.0f, 0.0f, 0.0f, 0.0f};
            }
            m[hh] = DS4_NEG_INF;
            l[hh] = 0.0f;
            if (inv_freq) ds4_att_q_rope(qr[hh], hd, n_pairs, inv_freq, (float)p, mscale, eps, lane);
        }
        const int k_lo = z * kper, k_hi = k_lo + kper < n_keys ? k_lo + kper : n_keys;
        for (int k0 = k_lo + warp; k0 < k_hi; k0 += B * NW) {
            const float* key[B];
            bool any = false;
#pragma unroll
            for (int b = 0; b < B; ++b) {
                const int kk = k0 + b * NW;
                key[b] = kk < k_hi ? ds4_att_key(kk, n_win, first, p, kv, ring, window, hd, mode,
                                                 sel, k_sel, 0, rows, cap)
                                   : nullptr;
                any |= key[b] != nullptr;
            }
            if (!any) continue;  // (the same for the whole warp)
            gpu_f4 kr[B][J];
#pragma unroll
            for (int b = 0; b < B; ++b)
#pragma unroll
                for (int j = 0; j < J; ++j) {
                    const int c = 32 * j + lane;
                    kr[b][j] = key[b] && c < hd4 ? ((const gpu_f4*)key[b])[c]
                                                 : gpu_f4{0.0f, 0.0f, 0.0f, 0.0f};
                }
            float s[G][B];
#pragma unroll
            for (int hh = 0; hh < G; ++hh)
#pragma unroll
                for (int b = 0; b < B; ++b) {
                    float a = 0.0f;
#pragma unroll
                    for (int j = 0; j < J; ++j) a = ds4_dot4(qr[hh][j], kr[b][j], a);
                    s[hh][b] = a;
                }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
#pragma unroll
                for (int hh = 0; hh < G; ++hh)
#pragma unroll
                    for (int b = 0; b < B; ++b) s[hh][b] += gpu_shfl_xor(s[hh][b], o);
#pragma unroll
            for (int hh = 0; hh < G; ++hh) {
                float mn = m[hh];
#pragma unroll
                for (int b = 0; b < B; ++b) {
                    s[hh][b] = key[b] ? s[hh][b] * scale : DS4_NEG_INF;
                    mn = fmaxf(mn, s[hh][b]);
                }
                // (mn is finite: the batch has a key)
                const float corr = expf(m[hh] - mn);
                l[hh] *= corr;
#pragma unroll
                for (int j = 0; j < J; ++j)
                    acc[hh][j] = gpu_f4{acc[hh][j].x * corr, acc[hh][j].y * corr,
                                        acc[hh][j].z * corr, acc[hh][j].w * corr};
#pragma unroll
                for (int b = 0; b < B; ++b) {
                    const float e = key[b] ? expf(s[hh][b] - mn) : 0.0f;
                    l[hh] += e;
#pragma unroll
                    for (int j = 0; j < J; ++j) ds4_axpy4(acc[hh][j], e, kr[b][j]);
                }
                m[hh] = mn;
            }
        }
        // The block's warps merged, two heads at a time: each warp's sums scaled to the
        // heads' common max (a warp without keys weighs 0), then added in warp order.
        if (lane == 0)
#pragma unroll
            for (int hh = 0; hh < G; ++hh) {
                wm[warp][hh] = m[hh];
                wl[warp][hh] = l[hh];
            }
        __syncthreads();
        float mb[G];
#pragma unroll
        for (int hh = 0; hh < G; ++hh) {
            mb[hh] = DS4_NEG_INF;
            for (int w = 0; w < NW; ++w) mb[hh] = fmaxf(mb[hh], wm[w][hh]);
        }
#pragma unroll
        for (int pr = 0; pr < G / 2; ++pr) {
#pragma unroll
            for (int c2 = 0; c2 < 2; ++c2) {
                const int hh = 2 * pr + c2;
                const float e = m[hh] == DS4_NEG_INF ? 0.0f : expf(m[hh] - mb[hh]);
#pragma unroll
                for (int j = 0; j < J; ++j)
                    wacc[warp][c2][32 * j + lane] = gpu_f4{acc[hh][j].x * e, acc[hh][j].y * e,
                                                           acc[hh][j].z * e, acc[hh][j].w * e};
            }
            __syncthreads();
            for (int x = tid; x < 2 * hd4; x += 32 * NW) {
                const int c2 = x / hd4, c = x - c2 * hd4, h = h0 + 2 * pr + c2;
                gpu_f4 a = {0.0f, 0.0f, 0.0f, 0.0f};
                for (int w = 0; w < NW; ++w) ds4_axpy4(a, 1.0f, wacc[w][c2][c]);
                if (h < heads) ((gpu_f4*)(part + ((long long)h * splits + z) * hd))[c] = a;
            }
            if (tid < 2 && h0 + 2 * pr + tid < heads) {
                const int hh = 2 * pr + tid;
                float mh = DS4_NEG_INF, lb = 0.0f;  // (mb[hh] again: no register array by tid)
                for (int w = 0; w < NW; ++w) mh = fmaxf(mh, wm[w][hh]);
                for (int w = 0; w < NW; ++w)
                    lb += wm[w][hh] == DS4_NEG_INF ? 0.0f : wl[w][hh] * expf(wm[w][hh] - mh);
                float* ml = part + slots * hd + 2 * ((long long)(h0 + hh) * splits + z);
                ml[0] = mh;
                ml[1] = lb;
            }
            __syncthreads();  // (wacc is written again)
        }
    }
    // The group's last block merges its splits: every thread's stores before the count,
    // the other blocks' seen after it (thread 0's fences, then the barrier).
    gpu_fence();
    __syncthreads();
    if (tid == 0) last = gpu_count_last(sync + g, (unsigned int)splits);
    __syncthreads();
    if (!last) return;
    gpu_fence();
    if (warp < nh)
        ds4_atm_weights(part, slots, (long long)(h0 + warp) * splits, hd, used, sinks[h0 + warp],
                        ws[warp], &den_s[warp]);
    __syncthreads();
    for (int x = tid; x < nh * hd4; x += 32 * NW) {
        const int hh = x / hd4, c = x - hh * hd4, h = h0 + hh;
        gpu_f4 v = ds4_atm_column(part, (long long)h * splits, hd, used, ws[hh], den_s[hh], c);
        if (inv_freq) ds4_rotate4(v, c, hd, n_pairs, inv_freq, (float)p, mscale, 1);
        ((gpu_f4*)(out + (long long)h * hd))[c] = v;
    }
}

// Keeps the chunk's last `window` K=V rows in the ring (after ds4_attention read it).
// grid = (ceil(hd / 256), min(n, window)), block = 256.
extern "C" __global__ void __launch_bounds__(256)
    ds4_window_store(const float* __restrict__ kv, const int* __restrict__ pos, int n, int hd,
                     int window, float* __restrict__ ring, unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_WINDOW_STORE);
    const int c = blockIdx.x * 256 + threadIdx.x;
    const int keep = n < window ? n : window;
    const int t = n - keep + (int)blockIdx.y;
    if (c >= hd) return;
    ring[(long long)((pos[0] + t) % window) * hd + c] = kv[(long long)t * hd + c];
}

// ---------------------------------------------------------------------------------
// Router: scores sigmoid (gating 2) or sqrt(softplus) (4); experts from the hash table
// row of the token (mode 2) or the k best scores (+ bias for selection when mode 1,
// ties: lower index); weights = the chosen scores, normalised to sum 1 when norm_topk,
// times routed_scale. grid = n, block = 256.
extern "C" __global__ void __launch_bounds__(256)
    ds4_router(const float* __restrict__ logits, const float* __restrict__ bias,
               const int* __restrict__ table, int table_rows, const int* __restrict__ tokens,
               int n_expert, int k, int gating, int norm_topk, float routed_scale, int mode,
               int* __restrict__ ids, float* __restrict__ wout, unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_ROUTER);
    __shared__ float sc[1024];
    __shared__ float sv[1024];
    __shared__ int chosen[DS4_TOPK_MAX];
    const int t = blockIdx.x, tid = threadIdx.x;
    for (int e = tid; e < n_expert; e += 256)
        sc[e] = ds4_router_score(logits[(long long)t * n_expert + e], gating);
    if (tid < k) chosen[tid] = 0;  // defensive: the op refuses k > E
    __syncthreads();
    if (mode == 2) {
        ds4_router_hashed(table, table_rows, tokens, t, n_expert, k, chosen);
    } else {
        // Each expert's rank = how many beat it (a higher selection score, or the same and
        // a lower index); ranks 0..k-1 are the choice in order: what k rounds of "best
        // not yet taken" give, in one pass and one barrier (those rounds took two
        // barriers each: 7.4 us a launch, ncu 15:31). NaN ranks as -inf, tied with it
        // by index (the CPU's total order puts a positive NaN first: scores of NaN are
        // a broken model either way).
        for (int e = tid; e < n_expert; e += 256)
            sv[e] = ds4_router_key(sc[e], mode == 1 ? bias[e] : 0.0f, mode);
        __syncthreads();
        for (int e = tid; e < n_expert; e += 256) {
            const float v = sv[e];
            int rank = 0;
#pragma unroll 8
            for (int j = 0; j < n_expert; ++j) {
                const float o = sv[j];
                rank += (o > v) | ((o == v) & (j < e));
            }
            if (rank < k) chosen[rank] = e;
        }
    }
    __syncthreads();
    if (tid == 0) ds4_router_write(sc, chosen, k, norm_topk, routed_scale, t, ids, wout);
}

// The router's product and selection for one token (a decode step) in one launch: block
// b computes logits 2b and 2b + 1 as matvec_f32_wide does, stores them and counts itself
// in sync[0]; the last block to count (it puts the count back to zero) reads the logits
// from L2 (up to four a thread), and selects on its first warp: k rounds of "best not yet
// taken" (lane l holds experts l + 32 i, its taken ones as bits of a register, then a
// warp arg-max), which is ds4_router's choice in ds4_router's order, with its scores
// and weights (the same bits). Two launches (the product, then a one-block router)
// cost ~12 us a MoE site in the 18:37 UTC trace (2026-12-04).
// 256 threads, each taking the parts of four threads of matvec_f32_wide's 1024
// (thread t those of t + 256 q, whose warps are w + 8 q: the same warp sums, then the
// same sum over the 32 in order, so the same bits). With d <= 4096 (one float4 a part)
// a thread asks for its rows' float4s, and for its expert's bias, before the
// dependent-launch wait: they are weights, which no kernel writes, and the block is
// resident beside the mHC site's kernel it waits for (1024-thread blocks with 58
// registers took whole multiprocessors and started only as that kernel's blocks left).
// Up to 256 experts the selection's values sit in registers (8 a lane).
// Needs what matvec_f32_wide needs, n_expert <= 1024. grid = ceil(n_expert / 2),
// block = DS4_ROUTER_MM_THREADS.
#define DS4_ROUTER_MM_THREADS 256
#define DS4_ROUTER_MM_PARTS (1024 / DS4_ROUTER_MM_THREADS)

// ds4_router_mm's block b computes rows r0 = 2b and r1 = r0 + 1 (the last block of an
// odd count reads its one row twice); with d <= 4096 its thread's float4s of both come
// first (`ds4_rmm_load`, before the dependent-launch wait: weights).
GPU_DEV void ds4_rmm_load(const float* __restrict__ wr, int d, int n_expert, int b,
                          gpu_u4 (&u)[2][DS4_ROUTER_MM_PARTS]) {
    constexpr int T = DS4_ROUTER_MM_THREADS, Q = DS4_ROUTER_MM_PARTS;
    const int r0 = 2 * b, r1 = r0 + 1 < n_expert ? r0 + 1 : r0;
    const float* row[2] = {wr + (long long)r0 * d, wr + (long long)r1 * d};
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int q = 0; q < Q; ++q) {
            const int i = 4 * ((int)threadIdx.x + T * q);
            if (i < d) u[r][q] = gpu_load_stream_u4(row[r] + i);
        }
}

// Block b's two logits into `logits` (thread 0 stores them; sh: 64 floats of shared
// memory). u: what ds4_rmm_load loaded where d <= 4096.
GPU_DEV void ds4_rmm_logits(const float* __restrict__ wr, int d, const float* __restrict__ x,
                            int n_expert, int b, const gpu_u4 (&u)[2][DS4_ROUTER_MM_PARTS],
                            float* sh, float* logits) {
    constexpr int T = DS4_ROUTER_MM_THREADS, Q = DS4_ROUTER_MM_PARTS;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int r0 = 2 * b, r1 = r0 + 1 < n_expert ? r0 + 1 : r0;
    const float* row[2] = {wr + (long long)r0 * d, wr + (long long)r1 * d};
    const bool early = d <= 4 * 1024;
    float acc[2][Q];
#pragma unroll
    for (int q = 0; q < Q; ++q) {
        const int vt = tid + T * q;
        if (early) {
            const int i = 4 * vt;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                acc[r][q] = 0.0f;
                if (i < d) acc[r][q] = f32_wide_term(0.0f, u[r][q], *(const gpu_f4*)(x + i));
            }
        } else {
            // (each row's sum on its own: the same bits as two rows at once)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float a[1];
                f32_wide_part<1>(row[r], d, x, vt, a);
                acc[r][q] = a[0];
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int q = 0; q < Q; ++q) {
            const float a = gpu_warp_sum(acc[r][q]);
            if (lane == 0) sh[32 * r + warp + 8 * q] = a;
        }
    __syncthreads();
    if (warp == 0) {
        const float l0 = gpu_warp_sum(sh[lane]), l1 = gpu_warp_sum(sh[32 + lane]);
        if (lane == 0) {
            logits[r0] = l0;
            if (r1 != r0) logits[r1] = l1;
        }
    }
}

// The selection from the token's logits (read from L2: other blocks wrote them) into
// chosen[0..k) on warp 0, with the scores in sc (the whole block takes a logit a thread,
// then warp 0 selects). bias_t: thread tid's expert's bias, loaded early.
GPU_DEV void ds4_rmm_select(float* logits, const float* __restrict__ bias, float bias_t,
                            const int* __restrict__ table, int table_rows,
                            const int* __restrict__ tokens, int n_expert, int k, int gating,
                            int mode, float* sc, float* sv, int* chosen) {
    const int tid = threadIdx.x;
    for (int e = tid; e < n_expert; e += DS4_ROUTER_MM_THREADS) {
        sc[e] = ds4_router_score(gpu_load_l2(logits + e), gating);
        sv[e] = ds4_router_key(sc[e], e == tid ? bias_t : (mode == 1 ? bias[e] : 0.0f), mode);
    }
    __syncthreads();
    if ((tid >> 5) != 0) return;
    if (mode == 2) {
        ds4_router_hashed(table, table_rows, tokens, 0, n_expert, k, chosen);
    } else if (n_expert <= 256) {
        ds4_router_pick<8>(sv, n_expert, k, chosen);
    } else {
        ds4_router_pick<0>(sv, n_expert, k, chosen);
    }
    gpu_syncwarp();
}

extern "C" __global__ void __launch_bounds__(DS4_ROUTER_MM_THREADS)
    ds4_router_mm(const float* __restrict__ wr, int d, const float* __restrict__ x,
                  float* logits, const float* __restrict__ bias, const int* __restrict__ table,
                  int table_rows, const int* __restrict__ tokens, int n_expert, int k,
                  int gating, int norm_topk, float routed_scale, int mode,
                  int* __restrict__ ids, float* __restrict__ wout, unsigned int* sync,
                  unsigned int* counters) {
    __shared__ float sh[2 * 32];
    __shared__ float sc[1024], sv[1024];
    __shared__ int chosen[DS4_TOPK_MAX];
    __shared__ unsigned int last;
    const int tid = threadIdx.x;
    gpu_u4 u[2][DS4_ROUTER_MM_PARTS];
    if (d <= 4 * 1024) ds4_rmm_load(wr, d, n_expert, blockIdx.x, u);
    const float bias_t = mode == 1 && tid < n_expert ? bias[tid] : 0.0f;
    gpu_count_launch(counters, KID_DS4_ROUTER_MM);
    ds4_rmm_logits(wr, d, x, n_expert, blockIdx.x, u, sh, logits);
    if (tid == 0) last = gpu_count_last(sync, gridDim.x);
    __syncthreads();
    if (!last) return;
    ds4_rmm_select(logits, bias, bias_t, table, table_rows, tokens, n_expert, k, gating, mode,
                   sc, sv, chosen);
    if (tid == 0) ds4_router_write(sc, chosen, k, norm_topk, routed_scale, 0, ids, wout);
}

// ds4_moe_routed's pf == 2 ask: lane 0 of a warp asks L2 for its rows of row group rg
// (the rows DS4_MOER_ROWS takes: 4 from (4 rg + the warp's place in its half-block) 4,
// those below m) of expert e (nothing for an id outside 0 .. n_expert), rounded
// inwards to 16 bytes.
GPU_DEV void ds4_moer_pf(const unsigned char* w, long long expert_bytes, int nb, int m,
                         int n_expert, int e, int rg) {
    const int r0 = (4 * rg + ((threadIdx.x >> 5) & 3)) * 4;
    if ((threadIdx.x & 31) != 0 || e < 0 || e >= n_expert || r0 >= m) return;
    const int rows = m - r0 < 4 ? m - r0 : 4;
    const unsigned long long a =
        (unsigned long long)(w + e * expert_bytes + (long long)r0 * nb * RF2_BLOCK_BYTES);
    const unsigned long long a16 = (a + 15) & ~15ull;
    const long long len = ((long long)rows * nb * RF2_BLOCK_BYTES - (long long)(a16 - a)) & ~15ll;
    if (len > 0) gpu_prefetch_l2((const void*)a16, (unsigned int)len);
}

// MOE_ROUTED for one token (a decode step) in one launch: ds4_router_mm's product and
// selection, mmvq_id_107's gate and up products of the chosen experts, the SwiGLU
// quantised as quantize_q8_1_swiglu does, then mmvq_id_107's down product, with a grid
// barrier after each stage but the last, so no stage waits for a launch of its own.
// Every stage runs the warps of the kernel it stands for (a block holds two of
// mmvq_id_107's 128-thread blocks), so the same bits. Each block selects the experts
// from the logits itself (a logit a thread from L2 and warp 0's pick) rather than wait
// at one more barrier for block 0's choice. The barriers need every block resident:
// the host launches it cooperatively, at most DS4_MOER_BLOCKS_PER_SM blocks a
// multiprocessor. gu: gate's weights, up's gu_step bytes on; eg: gate's outputs, up's
// eu_step bytes on; aq: the SwiGLU's q8_1 blocks (k ff / 32); 4 rows a warp. pf (A/B
// runs): 1 asks L2 for all the chosen experts' down rows once they are known; 2 has each
// warp ask for its next task's rows (the next gate / up rows, after the last of those
// its first down rows) before it sums the current one's, so DRAM streams while the warps
// of a stage, all in the same phase, compute. q8_local
// (ff <= 32 DS4_MOER_Q8_LOCAL, at least k blocks): each block takes one expert's down
// rows, quantising its SwiGLU itself (A/B runs).
#define DS4_MOER_BLOCKS_PER_SM 2
#define DS4_MOER_Q8_LOCAL 128
extern "C" __global__ void __launch_bounds__(DS4_ROUTER_MM_THREADS, DS4_MOER_BLOCKS_PER_SM)
    ds4_moe_routed(const float* __restrict__ wr, int d, const float* __restrict__ x,
                   float* logits, const float* __restrict__ bias,
                   const int* __restrict__ table, int table_rows,
                   const int* __restrict__ tokens, int n_expert, int k, int gating,
                   int norm_topk, float routed_scale, int mode, int* __restrict__ ids,
                   float* __restrict__ wout, const unsigned char* __restrict__ gu,
                   long long gu_step, long long gu_expert_bytes, int ff, int gu_affine,
                   const q8_1_block* __restrict__ xq, float* eg, long long eu_step,
                   const unsigned char* __restrict__ wd, long long d_expert_bytes,
                   int d_affine, float lim, q8_1_block* aq, float* ey, unsigned int* sync,
                   int pf, int q8_local, unsigned int* counters) {
    __shared__ float sh[2 * 32];
    __shared__ float sc[1024], sv[1024];
    __shared__ int chosen[DS4_TOPK_MAX];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
#if defined(RF2_ID_LEAN)
    __shared__ float sct[256];
    for (int i = tid; i < 256; i += DS4_ROUTER_MM_THREADS) sct[i] = ue4m3(i);
    const rf2_sc_lut scale = {sct};
#else
    const rf2_sc_calc scale;
#endif
    const int nrb = (n_expert + 1) / 2;
    const bool early = d <= 4 * 1024;
    gpu_u4 u[2][DS4_ROUTER_MM_PARTS];
    if (early && (int)blockIdx.x < nrb) ds4_rmm_load(wr, d, n_expert, blockIdx.x, u);
    const float bias_t = mode == 1 && tid < n_expert ? bias[tid] : 0.0f;
    gpu_count_launch(counters, KID_DS4_MOE_ROUTED);
    for (int b = blockIdx.x; b < nrb; b += gridDim.x) {
        if (early && b != (int)blockIdx.x) ds4_rmm_load(wr, d, n_expert, b, u);
        ds4_rmm_logits(wr, d, x, n_expert, b, u, sh, logits);
        __syncthreads();  // (sh again)
    }
    gpu_group_barrier(sync, gridDim.x);
    ds4_rmm_select(logits, bias, bias_t, table, table_rows, tokens, n_expert, k, gating, mode,
                   sc, sv, chosen);
    __syncthreads();
    if (blockIdx.x == 0 && tid == 0)
        ds4_router_write(sc, chosen, k, norm_topk, routed_scale, 0, ids, wout);
    if (pf == 1) {
        // The chosen experts' down rows asked into L2 in 4 KB pieces while gate and up
        // stream (16-byte aligned starts, whole 16-byte units inside each expert's rows).
        const long long per = (d_expert_bytes + 4095) / 4096;
        for (long long c = (long long)blockIdx.x * DS4_ROUTER_MM_THREADS + tid; c < k * per;
             c += (long long)gridDim.x * DS4_ROUTER_MM_THREADS) {
            const long long off = c % per * 4096;
            const unsigned long long a =
                (unsigned long long)(wd + chosen[c / per] * d_expert_bytes + off);
            const long long n = d_expert_bytes - off < 4096 ? d_expert_bytes - off : 4096;
            const unsigned long long a16 = (a + 15) & ~15ull;
            const long long len = (n - (long long)(a16 - a)) & ~15ll;
            if (len > 0) gpu_prefetch_l2((const void*)a16, (unsigned int)len);
        }
    }
    // A warp's rows: mmvq_id_107's warp (threadIdx.x >> 5) & 3 of its block (rg, p, z).
    const int half = warp >> 2, wib = warp & 3, nbd = d / 32, nbf = ff / 32;
    const int gg = (ff + 15) / 16, gd = (d + 15) / 16;
#if defined(RF2_ID_LEAN)
#define DS4_MOER_ROWS(W, EB, NB, M, COL, E, R0, O, AFF)                                         \
    ((AFF) ? mmvq_id_warp<4, 1>(W, EB, NB, M, n_expert, COL, E, R0, O, AFF, scale)              \
           : mmvq_id_warp<4, 0>(W, EB, NB, M, n_expert, COL, E, R0, O, AFF, scale))
#else
#define DS4_MOER_ROWS(W, EB, NB, M, COL, E, R0, O, AFF)                                         \
    mmvq_id_warp<4>(W, EB, NB, M, n_expert, COL, E, R0, O, AFF, scale)
#endif
    // pf == 2: this half's first down task (whichever form), asked for after its last
    // gate / up one.
    const int per = k > 0 ? gridDim.x / k : 1;
    const int pd0 = q8_local ? blockIdx.x / per : (2 * blockIdx.x + half) / gd;
    const int rd0 = q8_local ? 2 * (blockIdx.x % per) + half : (2 * blockIdx.x + half) % gd;
    for (int v = 2 * blockIdx.x + half; v < 2 * k * gg; v += 2 * gridDim.x) {
        const int z = v / (k * gg), p = v / gg % k, rg = v % gg;
        float* o = (float*)((char*)eg + z * eu_step) + (long long)p * ff;
        if (pf == 2) {
            const int n = v + 2 * gridDim.x;
            if (n < 2 * k * gg)
                ds4_moer_pf(gu + n / (k * gg) * gu_step, gu_expert_bytes, nbd, ff, n_expert,
                            chosen[n / gg % k], n % gg);
            else if (pd0 < k && rd0 < gd)
                ds4_moer_pf(wd, d_expert_bytes, nbf, d, n_expert, chosen[pd0], rd0);
        }
        DS4_MOER_ROWS(gu + z * gu_step, gu_expert_bytes, nbd, ff, xq, chosen[p], (4 * rg + wib) * 4,
                      o, gu_affine);
    }
    gpu_group_barrier(sync, gridDim.x);
    const float* eu = (const float*)((const char*)eg + eu_step);
    if (q8_local) {
        // gridDim.x / k blocks an expert (the rest idle), each with the expert's SwiGLU
        // quantised into its own shared memory: no stage and no barrier of its own.
        // (as float4s: 16-byte aligned, as the global blocks' 256-byte aligned start)
        __shared__ gpu_f4 aqs_raw[DS4_MOER_Q8_LOCAL * sizeof(q8_1_block) / 16];
        q8_1_block* aqs = (q8_1_block*)aqs_raw;
        const int p = blockIdx.x / per;
        if (p < k) {
            for (int b = warp; b < nbf; b += 8) {
                const long long i = (long long)p * ff + b * 32 + lane;
                q8_1_store(gpu_swiglu(gpu_load_l2(eg + i), gpu_load_l2(eu + i), lim), b, lane,
                           aqs, 1);
            }
            __syncthreads();
            for (int rg = 2 * (blockIdx.x % per) + half; rg < gd; rg += 2 * per) {
                if (pf == 2 && rg + 2 * per < gd)
                    ds4_moer_pf(wd, d_expert_bytes, nbf, d, n_expert, chosen[p], rg + 2 * per);
                DS4_MOER_ROWS(wd, d_expert_bytes, nbf, d, aqs, chosen[p], (4 * rg + wib) * 4,
                              ey + (long long)p * d, d_affine);
            }
        }
    } else {
        for (int b = 8 * blockIdx.x + warp; b < k * nbf; b += 8 * gridDim.x) {
            const long long i = (long long)b * 32 + lane;
            q8_1_store(gpu_swiglu(gpu_load_l2(eg + i), gpu_load_l2(eu + i), lim), b, lane, aq,
                       1);
        }
        gpu_group_barrier(sync, gridDim.x);
        for (int v = 2 * blockIdx.x + half; v < k * gd; v += 2 * gridDim.x) {
            const int p = v / gd, rg = v % gd, n = v + 2 * gridDim.x;
            if (pf == 2 && n < k * gd)
                ds4_moer_pf(wd, d_expert_bytes, nbf, d, n_expert, chosen[n / gd], n % gd);
            DS4_MOER_ROWS(wd, d_expert_bytes, nbf, d, aq + (long long)p * nbf, chosen[p],
                          (4 * rg + wib) * 4, ey + (long long)p * d, d_affine);
        }
    }
#undef DS4_MOER_ROWS
}

// out = silu(min(g, lim)) * clamp(u, -lim, lim) (no clamp when lim <= 0).
extern "C" __global__ void __launch_bounds__(256)
    ds4_swiglu(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ out,
               long long n, float lim, unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_SWIGLU);
    const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
    if (i >= n) return;
    out[i] = gpu_swiglu(g[i], u[i], lim);
}

// out[t] = sum_j w[t][j] * y[t*k + j] (+ shared[t]). grid = (ceil(d / 256), n).
extern "C" __global__ void __launch_bounds__(256)
    ds4_moe_combine(const float* __restrict__ y, const float* __restrict__ w,
                    const float* __restrict__ shared, int d, int k, float* __restrict__ out,
                    unsigned int* counters) {
    gpu_count_launch(counters, KID_DS4_MOE_COMBINE);
    const int i = blockIdx.x * 256 + threadIdx.x, t = blockIdx.y;
    if (i >= d) return;
    out[(long long)t * d + i] = ds4_combine(y, w, shared, d, k, t, i);
}

// out[a, c, b] = x[a, b, c] (innermost first). grid = (ceil(a / 256), b, c).
extern "C" __global__ void __launch_bounds__(256)
    transpose12(const float* __restrict__ x, int a, int b, int c, float* __restrict__ out,
                unsigned int* counters) {
    gpu_count_launch(counters, KID_TRANSPOSE12);
    const int i = blockIdx.x * 256 + threadIdx.x, y = blockIdx.y, z = blockIdx.z;
    if (i >= a) return;
    out[(long long)a * ((long long)z + (long long)c * y) + i] =
        x[(long long)a * ((long long)y + (long long)b * z) + i];
}
