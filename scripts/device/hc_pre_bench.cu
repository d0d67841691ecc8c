// mHC pre (ds4_hc_pre, kernels/gpu/ds4.cu) on the V4-Flash shape (4 streams of 4096, 20
// Sinkhorn rounds), timed alone: each configuration launched REPS times back to back
// from a CUDA graph (the way a decode step runs it), next to an empty kernel (the launch
// floor) and the Sinkhorn variants on one warp by themselves. Built and run by
// scripts/device/hc_pre_bench.sh (nvcc). Prints a markdown table of us per launch and
// the largest difference of each variant's Sinkhorn from the serial one.
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#include <random>
#include "../../kernels/gpu/ds4.cu"
#include "bench_check.cuh"

__global__ void empty_kernel(unsigned int* counters) { gpu_count_launch(counters, 0); }

// The Sinkhorn alone (mix M and base B in shared memory as ds4_hc_pre stages them).
// mode 0: ds4_sinkhorn_warp (the committed one); 1: ds4_sinkhorn (serial, thread 0).
template <int HC>
__global__ void sinkhorn_only(const float* m, const float* b, float scale, int iters, float eps,
                              int mode, float* out) {
    __shared__ float M[2 * HC + HC * HC], B[2 * HC + HC * HC], W[HC * HC];
    for (int i = threadIdx.x; i < 2 * HC + HC * HC; i += 32) {
        M[i] = m[i];
        B[i] = b[i];
    }
    __syncthreads();
    if (mode == 0) ds4_sinkhorn_warp<HC>(M, B, scale, iters, eps, W);
    else if (threadIdx.x == 0) ds4_sinkhorn<HC>(M, B, scale, iters, eps, W);
    __syncthreads();
    if (threadIdx.x < HC * HC) out[threadIdx.x] = W[threadIdx.x];
}

// ds4_hc_pre with its Sinkhorn on the collapsing block (split = 0) and on a second block
// per token (split = 1, the decode default in site mode) on the same random inputs: n
// tokens of hc streams of d (site mode: head mode has no Sinkhorn and one block either
// way); prints the largest |difference| of out and wts and a verdict line.
void compare_split() {
    bool same = true;
    std::mt19937 rng(7);
    printf("\n| d | hc | tokens | mode | max diff out | max diff wts |\n|---|---|---|---|---|---|\n");
    for (int d : {32, 64, 4096})
        for (int hc : {2, 4})
            for (int n : {1, 40}) {
                const int head = 0, nm = 2 * hc + hc * hc;
                float* streams = upload(rand_vec(rng, (size_t)n * hc * d, 1.0f));
                float* mix = upload(rand_vec(rng, (size_t)n * nm, 3.0f));
                float* scale = upload({0.5f, 0.5f, 0.5f});
                float* base = upload(rand_vec(rng, nm, 0.5f));
                float* norm_w = upload(rand_vec(rng, d, 1.0f));
                float *o[2], *w[2];
                for (int i = 0; i < 2; ++i) {
                    CK(cudaMalloc(&o[i], (size_t)n * d * 4));
                    CK(cudaMalloc(&w[i], (size_t)n * nm * 4));
                    CK(cudaMemset(o[i], 0, (size_t)n * d * 4));
                    CK(cudaMemset(w[i], 0, (size_t)n * nm * 4));
                }
                // (defer = 0 throughout: the Sinkhorn finishes inside ds4_hc_pre)
                for (int split = 0; split < 2; ++split)
                    ds4_hc_pre<<<dim3(n, 1 + split), DS4_HC_THREADS>>>(streams, mix, scale, base, norm_w, d,
                                                                        hc, 20, 1e-6f, 1e-6f, head, o[split],
                                                                        w[split], 1, split, 0, nullptr);
                CK(cudaDeviceSynchronize());
                std::vector<float> ho[2], hw[2];
                for (int i = 0; i < 2; ++i) {
                    ho[i].resize((size_t)n * d);
                    hw[i].resize((size_t)n * nm);
                    CK(cudaMemcpy(ho[i].data(), o[i], ho[i].size() * 4, cudaMemcpyDeviceToHost));
                    CK(cudaMemcpy(hw[i].data(), w[i], hw[i].size() * 4, cudaMemcpyDeviceToHost));
                }
                float dout = 0, dw = 0;
                for (size_t i = 0; i < ho[0].size(); ++i) dout = fmaxf(dout, fabsf(ho[0][i] - ho[1][i]));
                for (size_t i = 0; i < hw[0].size(); ++i) dw = fmaxf(dw, fabsf(hw[0][i] - hw[1][i]));
                printf("| %d | %d | %d | %s | %.3g | %.3g |\n", d, hc, n, head ? "head" : "site", dout, dw);
                same = same && dout == 0.0f && dw == 0.0f;
                for (float* p : {streams, mix, scale, base, norm_w, o[0], o[1], w[0], w[1]}) CK(cudaFree(p));
            }
    printf("\nsplit vs one block: %s\n", same ? "bit-identical on every shape" : "DIFFERENT");
}

int main(int argc, char** argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 200;
    const int d = 4096, hc = 4, nm = 2 * hc + hc * hc;
    std::mt19937 rng(20261130);
    float* streams = upload(rand_vec(rng, hc * d, 1.0f));
    float* mix = upload(rand_vec(rng, nm, 30.0f));
    float* scale = upload({0.1f, 0.1f, 0.1f});
    float* base = upload(rand_vec(rng, nm, 0.5f));
    float* norm_w = upload(rand_vec(rng, d, 1.0f));
    float *out, *wts, *sk;
    CK(cudaMalloc(&out, d * 4));
    CK(cudaMalloc(&wts, nm * 4));
    CK(cudaMalloc(&sk, 2 * hc * hc * 4));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    auto time = [&](auto launch) { return graph_us(st, reps, launch); };
    printf("| what | us per launch (graph, %d back to back) |\n|---|---|\n", reps);
    printf("| empty kernel (launch floor) | %.2f |\n", time([&] { empty_kernel<<<1, 32, 0, st>>>(nullptr); }));
    for (int split = 1; split >= 0; --split)
        for (int fast = 1; fast >= 0; --fast)
            for (int iters : {20, 1}) {
                if (split && !fast) continue;  // the second block has nothing to do
                const double us = time([&] {
                    ds4_hc_pre<<<dim3(1, 1 + split), DS4_HC_THREADS, 0, st>>>(
                        streams, mix, scale, base, norm_w, d, hc, iters, 1e-6f, 1e-6f, 0, out, wts, fast, split,
                        0, nullptr);
                });
                printf("| ds4_hc_pre site, %s path%s, %d Sinkhorn rounds | %.2f |\n", fast ? "fast" : "general",
                       split ? ", Sinkhorn on a second block" : "", iters, us);
            }
    printf("| ds4_hc_pre head mode (no Sinkhorn), fast path | %.2f |\n", time([&] {
               ds4_hc_pre<<<1, DS4_HC_THREADS, 0, st>>>(streams, mix, scale, base, norm_w, d, hc, 20, 1e-6f, 1e-6f,
                                                       1, out, wts, 1, 0, 0, nullptr);
           }));
    const char* names[] = {"Sinkhorn alone: warp (committed)", "Sinkhorn alone: serial, thread 0"};
    for (int mode = 0; mode < 2; ++mode)
        printf("| %s, 20 rounds | %.2f |\n", names[mode], time([&] {
                   sinkhorn_only<4><<<1, 32, 0, st>>>(mix, base, 0.1f, 20, 1e-6f, mode, sk + mode * hc * hc);
               }));
    CK(cudaStreamSynchronize(st));
    float h[2 * 16];
    CK(cudaMemcpy(h, sk, sizeof h, cudaMemcpyDeviceToHost));
    float md = 0;
    for (int i = 0; i < 16; ++i) md = fmaxf(md, fabsf(h[i] - h[16 + i]));
    printf("\nwarp vs serial Sinkhorn: max |diff| %.2e\n", md);
    compare_split();
    return 0;
}
