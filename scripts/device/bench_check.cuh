// Shared by the device benchmarks. CK(call): a CUDA runtime call; on an error, prints
// where and what, and exits.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define CK(x)                                                                              \
    do {                                                                                   \
        cudaError_t e_ = (x);                                                              \
        if (e_ != cudaSuccess) {                                                           \
            fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));     \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

// Microseconds per launch of `launch()` (kernels on `st`) run `reps` times from one CUDA
// graph, the way a decode step replays them: the graph is launched once to warm up,
// then timed once.
template <typename F>
double graph_us(cudaStream_t st, int reps, F launch) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < reps; ++i) launch();
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(e0, st));
    CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return 1e3 * ms / reps;
}

// n values from N(mean, sd^2), and a device copy of a vector.
static std::vector<float> rand_vec(std::mt19937& rng, size_t n, float sd, float mean = 0.0f) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> v(n);
    for (auto& x : v) x = mean + sd * nd(rng);
    return v;
}
static float* upload(const std::vector<float>& v) {
    float* p;
    CK(cudaMalloc(&p, v.size() * 4));
    CK(cudaMemcpy(p, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
    return p;
}

// `bytes` of random blocks of weight type `ty`: Q8_0 (8; an f16 scale of ~2^-8 .. 2^-6)
// or ROCmFP4 (any other; two UE4M3 half scales near 2^-2), codes uniform.
static std::vector<unsigned char> random_blocks(std::mt19937& rng, int ty, long long bytes) {
    const int bpb = ty == 8 ? 34 : 18;
    std::vector<unsigned char> hw(bytes);
    for (long long bi = 0; bi < bytes / bpb; ++bi) {
        unsigned char* b = hw.data() + bi * bpb;
        for (int j = 0; j < bpb; ++j) b[j] = rng() & 0xff;
        if (ty == 8) {
            const unsigned short h = 0x1c00 + (rng() % 0x800);
            memcpy(b, &h, 2);
        } else {
            b[16] = 0x20 + rng() % 0x20;
            b[17] = 0x20 + rng() % 0x20;
        }
    }
    return hw;
}
