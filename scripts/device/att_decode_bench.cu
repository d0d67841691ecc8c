// A decode step's attention (one token, 64 heads of 512 sharing one K=V head, a window of
// 128) on the V4-Flash shapes, timed alone: ds4_attention (a block a head, 16 warps, the
// depth-0 path) against ds4_attention_heads over key splits + ds4_attention_merge (the
// long-context path) at several split sizes, and ds4_attention_dec (the same splits
// merged in one launch). Every launch follows an L2 flush, as in a
// decode step, where a layer's ~150 MB of weights pass through L2 between two visits of
// its cache; the flush's own time (a graph of flushes alone) is taken off. Built and run
// by scripts/device/att_decode_bench.sh (nvcc). Prints a markdown table of us per
// launch and each variant's largest |difference| from ds4_attention's output.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#include "../../kernels/gpu/ds4.cu"
#include "bench_check.cuh"

// Writes n floats: evicts what a previous launch left in L2.
__global__ void flush_l2(float* p, long long n) {
    for (long long i = blockIdx.x * 256ll + threadIdx.x; i < n; i += (long long)gridDim.x * 256)
        p[i] = (float)i;
}

struct Case {
    const char* name;
    int pos, ratio, mode, k_sel, cap;
};

int main(int argc, char** argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 50;
    const int heads = 64, hd = 512, window = 128, max_cap = 32769;
    const float scale = 1.0f / sqrtf((float)hd);
    std::mt19937 rng(20261201);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    auto rv = [&](size_t n, float sd) {
        std::vector<float> v(n);
        for (auto& x : v) x = sd * nd(rng);
        return v;
    };
    float* q = upload(rv((size_t)heads * hd, 1.0f));
    float* kv = upload(rv(hd, 1.0f));
    float* ring = upload(rv((size_t)window * hd, 1.0f));
    float* rows = upload(rv((size_t)max_cap * hd, 1.0f));
    float* sinks = upload(rv(heads, 1.0f));
    const long long nflush = 40ll << 20;  // 160 MB
    float *flush, *part, *out[2];
    int *pos, *sel;
    unsigned int* sync;
    CK(cudaMalloc(&sync, 64 * 4));
    CK(cudaMemset(sync, 0, 64 * 4));
    CK(cudaMalloc(&flush, nflush * 4));
    CK(cudaMalloc(&part, (size_t)heads * 64 * (hd + 2) * 4));
    for (auto& o : out) CK(cudaMalloc(&o, (size_t)heads * hd * 4));
    CK(cudaMalloc(&pos, 4));
    CK(cudaMalloc(&sel, 512 * 4));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const Case cases[] = {
        {"depth 512, ratio 4, every row (mode 1)", 540, 4, 1, 0, 32769},
        {"depth 512, ratio 128, every row (mode 1)", 540, 128, 1, 0, 1025},
        {"depth 512, window only (mode 0)", 540, 0, 0, 0, 1},
        {"depth 4K, ratio 4, 512 selected (mode 2)", 4600, 4, 2, 512, 32769},
        {"depth 32K, ratio 4, 512 selected (mode 2)", 32800, 4, 2, 512, 32769},
        {"depth 128K, ratio 4, 512 selected (mode 2)", 131000, 4, 2, 512, 32769},
        {"depth 128K, ratio 128, every row (mode 1)", 131000, 128, 1, 0, 1025},
    };
    auto flush_only = [&] { flush_l2<<<528, 256, 0, st>>>(flush, nflush); };
    const double flush_us = graph_us(st, reps, flush_only);
    printf("L2 flush alone: %.2f us a launch (taken off every row)\n\n", flush_us);
    printf("| case | keys | variant | blocks | us a launch (after a flush) | max diff vs block a head |\n");
    printf("|---|---|---|---|---|---|\n");
    for (const Case& c : cases) {
        CK(cudaMemcpy(pos, &c.pos, 4, cudaMemcpyHostToDevice));
        const int visible = c.ratio ? std::min((c.pos + 1) / c.ratio, c.cap) : 0;
        if (c.mode == 2) {
            std::vector<int> s(visible);
            for (int i = 0; i < visible; ++i) s[i] = i;
            std::shuffle(s.begin(), s.end(), rng);
            s.resize(c.k_sel);
            CK(cudaMemcpy(sel, s.data(), c.k_sel * 4, cudaMemcpyHostToDevice));
        }
        const int keys = std::min(c.pos + 1, window) + (c.mode == 1 ? visible : c.mode == 2 ? c.k_sel : 0);
        // Most keys a token of this graph could have: what the engine sizes splits for.
        const int max_keys = window + (c.mode == 1 ? c.cap : c.k_sel);
        auto run_head = [&] {
            ds4_attention<<<dim3(heads, 1), 32 * 16, 0, st>>>(q, kv, ring, rows, sel, sinks, pos, heads, hd, window,
                                                             c.ratio, c.mode, c.k_sel, c.cap, scale, out[0], 16,
                                                             nullptr, 0, 1e-6f, 1.0f, 0, nullptr);
        };
        const double us0 = graph_us(st, reps, [&] { flush_only(); run_head(); }) - flush_us;
        printf("| %s | %d | block a head (16 warps) | %d | %.2f | - |\n", c.name, keys, heads, us0);
        std::vector<float> ref((size_t)heads * hd), got(ref.size());
        CK(cudaStreamSynchronize(st));
        CK(cudaMemcpy(ref.data(), out[0], ref.size() * 4, cudaMemcpyDeviceToHost));
        // The one-launch form (ds4_attention_dec: splits merged after a barrier of each
        // head group's blocks), at the engine's split count (33 on 132 SMs) and fewer.
        for (int most : {33, 16, 8}) {
            const int splits = std::min(most, (max_keys + 15) / 16);
            auto run_dec = [&] {
                ds4_attention_dec<<<dim3(heads / DS4_ATH_HEADS, 1, splits), 32 * DS4_ATH_WARPS, 0, st>>>(
                    q, kv, ring, rows, sel, sinks, pos, heads, hd, window, c.ratio, c.mode, c.k_sel, c.cap, scale,
                    out[1], 16, part, sync, nullptr, 0, 1e-6f, 1.0f, 0, nullptr);
            };
            const double us = graph_us(st, reps, [&] { flush_only(); run_dec(); }) - flush_us;
            CK(cudaStreamSynchronize(st));
            CK(cudaMemcpy(got.data(), out[1], got.size() * 4, cudaMemcpyDeviceToHost));
            float md = 0.0f;
            for (size_t i = 0; i < got.size(); ++i) md = fmaxf(md, fabsf(got[i] - ref[i]));
            printf("| %s | %d | one launch, splits merged after a barrier | %d x %d | %.2f | %.2e |\n", c.name,
                   keys, heads / DS4_ATH_HEADS, splits, us, md);
        }
        // kmin: the fewest keys a split takes; splits: as the engine would size the grid.
        for (int kmin : {16, 32}) {
            int splits = (max_keys + kmin - 1) / kmin;
            splits = std::min(splits, 64);
            auto run_heads = [&] {
                ds4_attention_heads<<<dim3(heads / DS4_ATH_HEADS, 1, splits), 32 * DS4_ATH_WARPS, 0, st>>>(
                    q, kv, ring, rows, sel, sinks, pos, heads, hd, window, c.ratio, c.mode, c.k_sel, c.cap, scale,
                    out[1], kmin, part, nullptr);
            };
            auto run_split = [&] {
                run_heads();
                ds4_attention_merge<<<dim3(heads, 1), DS4_ATM_THREADS, 0, st>>>(part, splits, sinks, heads, hd, out[1], kv, pos,
                                                                   window, 0, ring, nullptr);
            };
            const double us = graph_us(st, reps, [&] { flush_only(); run_split(); }) - flush_us;
            const double us_heads = graph_us(st, reps, [&] { flush_only(); run_heads(); }) - flush_us;
            CK(cudaStreamSynchronize(st));
            CK(cudaMemcpy(got.data(), out[1], got.size() * 4, cudaMemcpyDeviceToHost));
            float md = 0.0f;
            for (size_t i = 0; i < got.size(); ++i) md = fmaxf(md, fabsf(got[i] - ref[i]));
            printf("| %s | %d | splits of >= %d keys + merge (heads kernel alone %.2f) | %d x %d | %.2f | %.2e |\n",
                   c.name, keys, kmin, us_heads, heads / DS4_ATH_HEADS, splits, us, md);
        }
    }
    return 0;
}
