// The lightning indexer's top-k (ds4_topk_rows: a decode step's one block picks the 512
// best of up to 40000 compressed rows; ds4_topk_rows_wide: the same on up to 64 blocks,
// where the source has it, DS4_TOPKW) timed alone on the device, on several score
// distributions and context depths. The scores stay in L2 between launches, as in a
// decode step, where the index-score kernel has just written them. Every selection is
// checked against the definition computed here on the host (the k best rows, ties to the
// lower index; the rows above the k-th score in index order, then those equal to it).
// Built and run by scripts/device/topk_bench.sh (nvcc); DS4_SRC names the kernel source
// (A/B against an older copy). Prints a markdown table of us per launch.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
#ifndef DS4_SRC
#define DS4_SRC "../../kernels/gpu/ds4.cu"
#endif
#include DS4_SRC
#include "bench_check.cuh"

static unsigned int host_key(float f) {
    unsigned int u;
    memcpy(&u, &f, 4);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The selection by definition: all visible rows (-1 after) when no more than k are.
static std::vector<int> reference(const std::vector<float>& s, int visible, int k) {
    std::vector<int> out(k, -1);
    if (visible <= k) {
        for (int i = 0; i < visible; ++i) out[i] = i;
        return out;
    }
    std::vector<unsigned int> key(visible);
    for (int i = 0; i < visible; ++i) key[i] = host_key(s[i]);
    std::vector<unsigned int> sorted(key);
    std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(), std::greater<unsigned int>());
    const unsigned int kth = sorted[k - 1];
    int n = 0;
    for (int i = 0; i < visible; ++i)
        if (key[i] > kth) out[n++] = i;
    for (int i = 0; i < visible && n < k; ++i)
        if (key[i] == kth) out[n++] = i;
    return out;
}

struct Case {
    const char* name;
    // dist 0: uniform [0, 1), 1: normal, 2: 33 levels (ties), 3: relu'd heads, 4: one
    // value, 5: one value but for 1% normal ones, 6: zeros but for the last 136 (normal):
    // the benchmark's seeked caches, of which only a prompt's rows were written
    int pos, cap, dist;
};

// A block of DS4_TOPK_THREADS that does nothing: the launch's own cost in a graph.
__global__ void empty_block(int* p) {
    if (p && threadIdx.x == 0) *p = 0;
}

int main(int argc, char** argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 200;
    const int k = 512, ratio = 4, max_cap = 40000;
    std::mt19937 rng(20261202);
    std::uniform_real_distribution<float> ud(0.0f, 1.0f);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    float* scores;
    int *pos, *sel;
    unsigned int* work = nullptr;
    CK(cudaMalloc(&scores, (size_t)max_cap * 4));
    CK(cudaMalloc(&pos, 4));
    CK(cudaMalloc(&sel, k * 4));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const Case cases[] = {
        {"128K, uniform", 131071, 32768, 0},
        {"128K, normal", 131071, 32768, 1},
        {"128K, 33 levels (ties)", 131071, 32768, 2},
        {"128K, sum of 64 relu'd heads", 131071, 32768, 3},
        {"128K, one value", 131071, 32768, 4},
        {"128K, one value but 1%", 131071, 32768, 5},
        {"128K, zeros but the last 136 rows", 131071, 32768, 6},
        {"128K + 529 (past 32768), zeros but the last 136", 131600, 32900, 6},
        {"160K (past 32768), normal", 159999, 40000, 1},
        {"32K, normal", 32767, 32768, 1},
        {"4K, normal", 4095, 32768, 1},
    };
    const double floor_us = graph_us(st, reps, [&] { empty_block<<<1, DS4_TOPK_THREADS, 0, st>>>(nullptr); });
    printf("an empty block of %d threads: %.2f us a launch\n\n", DS4_TOPK_THREADS, floor_us);
#ifdef DS4_TOPKW_WORDS
    CK(cudaMalloc(&work, DS4_TOPKW_WORDS * 4));
    CK(cudaMemset(work, 0, DS4_TOPKW_WORDS * 4));
    printf("| case | visible rows | us a launch | selection | wide, 16 blocks: us | 32 | 64 | selection |\n|---|---|---|---|---|---|---|---|\n");
#else
    printf("| case | visible rows | us a launch | selection |\n|---|---|---|---|\n");
#endif
    bool all = true;
    for (const Case& c : cases) {
        std::vector<float> s(c.cap);
        for (size_t i = 0; i < s.size(); ++i) {
            float& x = s[i];
            if (c.dist == 0) x = ud(rng);
            else if (c.dist == 1) x = nd(rng);
            else if (c.dist == 2) x = std::round(ud(rng) * 32.0f) / 32.0f;
            else if (c.dist == 4) x = 0.5f;
            else if (c.dist == 5) x = ud(rng) < 0.01f ? nd(rng) : 0.5f;
            else if (c.dist == 6) x = i + 136 >= (size_t)c.cap ? nd(rng) : 0.0f;
            else {
                float a = 0.0f;
                for (int h = 0; h < 64; ++h) a += fmaxf(nd(rng), 0.0f) * (0.5f + ud(rng));
                x = a * 0.0442f;
            }
        }
        const int visible = std::min((c.pos + 1) / ratio, c.cap);
        CK(cudaMemcpy(scores, s.data(), (size_t)c.cap * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(pos, &c.pos, 4, cudaMemcpyHostToDevice));
        CK(cudaMemset(sel, 0xff, k * 4));
        auto run = [&] { ds4_topk_rows<<<1, DS4_TOPK_THREADS, 0, st>>>(scores, pos, ratio, c.cap, k, sel, nullptr); };
        const double us = graph_us(st, reps, run);
        CK(cudaStreamSynchronize(st));
        std::vector<int> got(k);
        CK(cudaMemcpy(got.data(), sel, k * 4, cudaMemcpyDeviceToHost));
        const std::vector<int> want = reference(s, visible, k);
        int bad = 0;
        for (int i = 0; i < k; ++i) bad += got[i] != want[i];
        all = all && bad == 0;
        printf("| %s | %d | %.2f | %s |", c.name, visible, us, bad ? "WRONG" : "as defined");
        if (bad) fprintf(stderr, "%s: %d of %d entries differ\n", c.name, bad, k);
#ifdef DS4_TOPKW_WORDS
        // The host's grid (backends/gpu-common/src/ds4.rs) is 512 rows a block, at most
        // 64 (64 at every case's capacity here); 16 and 32 blocks for comparison.
        bool wok = true;
        for (const int nb : {16, 32, DS4_TOPKW_MAX_BLOCKS}) {
            CK(cudaMemset(sel, 0xff, k * 4));
            auto wide = [&] {
                ds4_topk_rows_wide<<<nb, DS4_TOPKW_THREADS, 0, st>>>(scores, pos, ratio, c.cap, k, sel, work, nullptr);
            };
            const double wus = graph_us(st, reps, wide);
            CK(cudaStreamSynchronize(st));
            CK(cudaMemcpy(got.data(), sel, k * 4, cudaMemcpyDeviceToHost));
            int wbad = 0;
            for (int i = 0; i < k; ++i) wbad += got[i] != want[i];
            wok = wok && wbad == 0;
            printf(" %.2f |", wus);
            if (wbad) fprintf(stderr, "%s (wide, %d blocks): %d of %d entries differ\n", c.name, nb, wbad, k);
        }
        all = all && wok;
        printf(" %s |", wok ? "as defined" : "WRONG");
#endif
        printf("\n");
    }
    printf("\n%s\n", all ? "ALL OK" : "FAILED");
    return all ? 0 : 1;
}
