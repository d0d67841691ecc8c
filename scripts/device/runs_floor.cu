// The ROCmFP4 runs kernel on the decode shapes, each launch alone from a CUDA graph:
// its register path (no dynamic shared memory) and its bulk path (the block's rows by
// bulk copies into shared memory, as the CUDA backend launches it on sm_90), checked bit
// for bit against each other, against the time a plain coalesced read of the same bytes
// takes in one launch (scripts/device/runs_floor.sh; written 2026-12-04).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <random>
#include "../../kernels/gpu/rocmfpx.cu"
#include "bench_check.cuh"

// The floor: each block reads its share of n4 16-byte words, 18 loads a thread in
// flight, coalesced (one wave of 132 x 512 threads was the fastest form measured).
__global__ void __launch_bounds__(512) read_floor(const gpu_u4* __restrict__ w, long long n4, float* out) {
    const long long per = (n4 + gridDim.x - 1) / gridDim.x, b0 = blockIdx.x * per;
    const long long b1 = b0 + per < n4 ? b0 + per : n4;
    unsigned int s = 0;
    for (long long i = b0 + threadIdx.x; i < b1; i += 18LL * blockDim.x) {
        gpu_u4 u[18];
#pragma unroll
        for (int q = 0; q < 18; ++q) {
            const long long p = i + (long long)q * blockDim.x;
            u[q] = p < b1 ? gpu_load_stream_u4<true>(w + p) : gpu_u4{0, 0, 0, 0};
        }
#pragma unroll
        for (int q = 0; q < 18; ++q) s += u[q].x ^ u[q].y ^ u[q].z ^ u[q].w;
    }
    if (s == 0x9e3779b9u) out[0] = 1.0f;  // keeps the loads
}

// One shape at the engine's plan (rows a thread, threads a block; see fp4_runs in
// backends/gpu-common/src/ops.rs); with `dump`, its output is appended there.
static void shape(const char* name, int k, int m, int rows, int nt, int reps, FILE* dump) {
    const long long row = k / 32 * 18, bytes = row * m;
    const int copies = (int)(256e6 / bytes) + 1;  // each replay reads from memory, not L2
    std::mt19937 rng(k * 7 + m);
    unsigned char* w;
    float *x, *o1, *o2;
    CK(cudaMalloc(&w, bytes * copies));
    const std::vector<unsigned char> hw = random_blocks(rng, 100, bytes);
    for (int c = 0; c < copies; ++c) CK(cudaMemcpy(w + c * bytes, hw.data(), bytes, cudaMemcpyHostToDevice));
    std::vector<float> hx(k);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& v : hx) v = nd(rng);
    CK(cudaMalloc(&x, k * 4));
    CK(cudaMemcpy(x, hx.data(), k * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&o1, m * 4));
    CK(cudaMalloc(&o2, m * 4));
    int lanes = 1;
    while (2 * lanes <= k / 256 && lanes < 32) lanes *= 2;
    const int per_block = rows * nt / lanes, grid = (m + per_block - 1) / per_block;
    const int smem = per_block * (int)row;
    CK(cudaFuncSetAttribute(matvec_fp4_runs_q8, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int turn = 0;
    auto next = [&] { return w + (turn++ % copies) * bytes; };
    auto runs = [&](const unsigned char* wc, float* o, int dyn) {
        matvec_fp4_runs_q8<<<grid, nt, dyn>>>(wc, row, k, m, x, o, rows, nullptr);
    };
    runs(w, o1, 0);
    runs(w, o2, smem);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    std::vector<float> a(m), b(m);
    CK(cudaMemcpy(a.data(), o1, m * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.data(), o2, m * 4, cudaMemcpyDeviceToHost));
    const bool same = !memcmp(a.data(), b.data(), m * 4);
    if (dump) fwrite(b.data(), 4, m, dump);
    const double floor_us = graph_us(cudaStreamPerThread, reps, [&] {
        read_floor<<<132, 512>>>((const gpu_u4*)next(), bytes / 16, o1);
    });
    const double reg_us = graph_us(cudaStreamPerThread, reps, [&] { runs(next(), o1, 0); });
    const double bulk_us = graph_us(cudaStreamPerThread, reps, [&] { runs(next(), o1, smem); });
    // The same copy every replay: its weights stay in L2 (50 MB), what a product that
    // finds them there (MOE_DS4_PREFETCH) could take at best.
    const double l2_us = graph_us(cudaStreamPerThread, reps, [&] { runs(w, o1, smem); });
    printf("| %s | %d x %d | %.1f | %d x %d, %d KiB | %.2f | %.2f | %.2f | %.2f | %.2f | %s |\n", name, k,
           m, bytes / 1e6, grid, nt, smem >> 10, floor_us, reg_us, bulk_us, bulk_us / floor_us, l2_us,
           same ? "same bits" : "DIFFERENT bits");
    for (void* p : {(void*)w, (void*)x, (void*)o1, (void*)o2}) CK(cudaFree(p));
}

// Arguments: launches a graph (100), and a file for the outputs (the script compares two
// builds' bit for bit).
int main(int argc, char** argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 100;
    FILE* dump = argc > 2 ? fopen(argv[2], "wb") : nullptr;
    printf("| product | k x m | MB | grid x threads, shared a block | read floor us | register path us | "
           "bulk path us | bulk / floor | bulk, weights in L2 us | bulk vs register |\n"
           "|---|---|---|---|---|---|---|---|---|---|\n");
    shape("wq_b", 1024, 32768, 2, 256, reps, dump);
    shape("wo_b", 8192, 4096, 2, 512, reps, dump);
    shape("wo_a's 8 groups stacked", 4096, 8192, 2, 512, reps, dump);
    shape("shared expert's down", 2048, 4096, 1, 256, reps, dump);
    if (dump) fclose(dump);
    return 0;
}
