// What one kernel-to-kernel dependency costs in a decode graph, by how it is kept:
//   plain  launches without programmatic serialisation (each kernel starts after the
//          previous one has completed);
//   pdl    programmatic serialisation, every kernel waits (griddepcontrol.wait) first;
//   early  the same, each block also lets the next kernel launch as it starts (the
//          backend's GPU_PDL_EARLY);
//   flag   early launch, but no grid wait: a kernel's blocks count themselves done on
//          a counter (fence, release add) and the next kernel's blocks spin on it
//          (acquire loads) before reading its output.
// Each chain is a CUDA graph of N kernels, each reading what the one before wrote (so a
// link is a real dependency), replayed; printed: us a link. Two chains: small kernels
// of G blocks (the glue), and a streaming kernel (HOG_MB of weights, two blocks an SM)
// alternating with a 32-block consumer (a product, then the glue after it), once with
// the streaming kernel on two blocks an SM (room beside it: the consumer's blocks can
// start, and spin, while it runs) and once on one block an SM holding all the shared
// memory (none: the consumer's blocks start only as the streamer's leave, as beside the
// backend's products).
// Built and run by scripts/device/link_bench.sh (nvcc on the device machine).
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

#define CK(x)                                                                              \
    do {                                                                                   \
        cudaError_t e_ = (x);                                                              \
        if (e_ != cudaSuccess) {                                                           \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

enum Mode { PLAIN = 0, PDL = 1, EARLY = 2, FLAG = 3 };
static const char* mode_name[] = {"plain", "pdl", "early", "flag"};

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Loads past L1 (another kernel's output) and evict-first streaming loads (weights).
__device__ __forceinline__ float ld_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ float4 ld_cs4(const float4* p) {
    float4 v;
    asm volatile("ld.global.cs.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p));
    return v;
}

// The start of every kernel here: its mode's way of waiting for the previous one
// (flags[idx - 1] reaching prev_blocks in flag mode).
__device__ __forceinline__ void link_wait(int mode, const unsigned* flags, int idx, unsigned prev_blocks) {
    if (mode >= EARLY) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (mode == PDL || mode == EARLY) asm volatile("griddepcontrol.wait;" ::: "memory");
    if (mode == FLAG) {
        if (threadIdx.x == 0 && idx > 0)
            while (ld_acquire(flags + idx - 1) < prev_blocks) {
            }
        __syncthreads();
    }
}

// The end: in flag mode, this block's stores published, then counted.
__device__ __forceinline__ void link_done(int mode, unsigned* flags, int idx) {
    if (mode != FLAG) return;
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(flags + idx) : "memory");
    }
}

// Averages the previous kernel's n_in outputs; block b writes half that + b + 1 to out[b].
__global__ void __launch_bounds__(256) glue(const float* in, float* out, int n_in, unsigned* flags,
                                            int idx, unsigned prev_blocks, int mode) {
    link_wait(mode, flags, idx, prev_blocks);
    __shared__ float part[8];
    float a = 0.0f;
    for (int i = threadIdx.x; i < n_in; i += blockDim.x) a += ld_cg(in + i);
    for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = a;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int w = 0; w < 8; ++w) s += part[w];
        out[blockIdx.x] = s / (float)n_in * 0.5f + (float)blockIdx.x + 1.0f;
    }
    link_done(mode, flags, idx);
}

// Streams n4 float4s of weights (evict-first); block b writes their sum plus the
// previous kernel's first output to out[b].
__global__ void __launch_bounds__(512) hog(const float4* __restrict__ w, long long n4, const float* in,
                                           float* out, unsigned* flags, int idx, unsigned prev_blocks,
                                           int mode) {
    float acc = 0.0f;
    // The weights never change: the first loads go out before the wait, as the products'.
    const long long i0 = (long long)blockIdx.x * 512 + threadIdx.x, step = (long long)gridDim.x * 512;
    float4 first = i0 < n4 ? ld_cs4(w + i0) : make_float4(0, 0, 0, 0);
    link_wait(mode, flags, idx, prev_blocks);
    const float s = ld_cg(in);
    acc += first.x + first.y + first.z + first.w;
    for (long long i = i0 + step; i < n4; i += step) {
        const float4 u = ld_cs4(w + i);
        acc += u.x + u.y + u.z + u.w;
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    __shared__ float part[16];
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.0f;
        for (int q = 0; q < 16; ++q) t += part[q];
        out[blockIdx.x] = t + s;
    }
    link_done(mode, flags, idx);
}

template <typename... K, typename... A>
static void launch(cudaStream_t st, bool pdl, void (*k)(K...), int grid, int block, int smem,
                   A... args) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(block);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    CK(cudaLaunchKernelEx(&cfg, k, args...));
}

// us a graph replay (the mean of reps after warm-up replays).
static double time_graph(cudaStream_t st, cudaGraphExec_t ge, int reps) {
    for (int i = 0; i < 5; ++i) CK(cudaGraphLaunch(ge, st));
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    CK(cudaEventRecord(a, st));
    for (int i = 0; i < reps; ++i) CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(b, st));
    CK(cudaEventSynchronize(b));
    float ms = 0.0f;
    CK(cudaEventElapsedTime(&ms, a, b));
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return 1000.0 * ms / reps;
}

int main(int argc, char** argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 200;
    const double hog_mb = argc > 2 ? atof(argv[2]) : 18.9;
    const int n = 64;  // kernels a chain
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("device %s, %d SMs; chains of %d kernels, %d replays\n\n", prop.name, sms, n, reps);
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    float *buf[2], *check;
    unsigned* flags;
    const int maxb = 4 * sms;
    CK(cudaMalloc(&buf[0], maxb * sizeof(float)));
    CK(cudaMalloc(&buf[1], maxb * sizeof(float)));
    CK(cudaMalloc(&flags, (n + 1) * sizeof(unsigned)));
    CK(cudaMemset(buf[0], 0, maxb * sizeof(float)));
    CK(cudaMemset(buf[1], 0, maxb * sizeof(float)));
    const long long n4 = (long long)(hog_mb * 1e6 / 16.0);
    float4* w;
    CK(cudaMalloc(&w, n4 * sizeof(float4)));
    CK(cudaMemset(w, 0, n4 * sizeof(float4)));
    check = (float*)malloc(maxb * sizeof(float));

    int smem_max = 0;
    CK(cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    const int full_smem = smem_max - 64;  // (with hog's own 64 bytes of static shared memory)
    CK(cudaFuncSetAttribute(hog, cudaFuncAttributeMaxDynamicSharedMemorySize, full_smem));
    // Records a chain (the modes' results must agree: every link really waited).
    auto build = [&](int mode, bool hogs, bool full, int g, cudaGraphExec_t* ge) {
        cudaGraph_t graph;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        CK(cudaMemsetAsync(flags, 0, (n + 1) * sizeof(unsigned), st));
        int prev = 1;
        for (int i = 0; i < n; ++i) {
            const bool pdl = mode != PLAIN && i > 0;
            float *in = buf[i & 1], *out = buf[(i + 1) & 1];
            if (hogs && i % 2 == 0) {
                const int hb = full ? sms : 2 * sms;
                launch(st, pdl, hog, hb, 512, full ? full_smem : 0, (const float4*)w, n4,
                       (const float*)in, out, flags, i, (unsigned)prev, mode);
                prev = hb;
            } else {
                const int gb = hogs ? 32 : g;
                launch(st, pdl, glue, gb, 256, 0, (const float*)in, out, prev, flags, i, (unsigned)prev, mode);
                prev = gb;
            }
        }
        CK(cudaStreamEndCapture(st, &graph));
        CK(cudaGraphInstantiate(ge, graph, 0));
        CK(cudaGraphDestroy(graph));
    };
    printf("| chain | plain | pdl | early | flag | flag vs early |\n|---|---|---|---|---|---|\n");
    const int grids[] = {1, 16, 64, 132, 264};
    for (int c = 0; c < 7; ++c) {
        const bool hogs = c >= 5, full = c == 6;
        const int g = hogs ? 32 : grids[c];
        double us[4];
        float first[4];
        for (int mode = 0; mode < 4; ++mode) {
            cudaGraphExec_t ge;
            build(mode, hogs, full, g, &ge);
            CK(cudaMemset(buf[0], 0, maxb * sizeof(float)));
            CK(cudaMemset(buf[1], 0, maxb * sizeof(float)));
            CK(cudaGraphLaunch(ge, st));
            CK(cudaStreamSynchronize(st));
            CK(cudaMemcpy(check, buf[n & 1], sizeof(float), cudaMemcpyDeviceToHost));
            first[mode] = check[0];
            us[mode] = time_graph(st, ge, reps) / n;
            CK(cudaGraphExecDestroy(ge));
        }
        bool same = true;
        for (int mode = 1; mode < 4; ++mode) same = same && first[mode] == first[0];
        char label[64];
        if (hogs)
            snprintf(label, sizeof label, "hog %.1f MB %s + glue 32 (a pair / 2)", hog_mb,
                     full ? "(1 block an SM, all its shared memory)" : "(2 blocks an SM)");
        else snprintf(label, sizeof label, "glue %d blocks", g);
        printf("| %s | %.2f | %.2f | %.2f | %.2f | %.3f |%s\n", label, us[0], us[1], us[2], us[3],
               us[3] / us[2], same ? "" : " RESULTS DIFFER");
    }
    return 0;
}
