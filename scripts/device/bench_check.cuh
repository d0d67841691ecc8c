// Shared by the device benchmarks. CK(call): a CUDA runtime call; on an error, prints
// where and what, and exits.
#pragma once
#include <cstdio>
#include <cstdlib>

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
