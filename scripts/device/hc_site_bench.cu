// A decode step's MoE mHC site (ds4_hc_post_pre with gsync, the post of the MoE's six
// experts + shared expert, xq) on the V4-Flash shape, timed where a step runs it: after
// a product that streams its weights with every multiprocessor busy ("hog", standing
// in for the attention's output projection), both launched with programmatic
// serialisation from one CUDA graph, as the CUDA backend launches them. Prints:
//   - us a launch of the hog alone, of hog + site, and of the site alone (back to back);
//   - where one site's time goes (built with HCF_STAMPS: the global timer at the end of
//     each phase of each block, from the hog's last block's exit).
// Built and run by scripts/device/hc_site_bench.sh (nvcc, with the backend's defines).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <random>
#include "../../kernels/gpu/ds4.cu"
#include "bench_check.cuh"

#define HOG_THREADS 512
__device__ unsigned long long hog_exit[1024];

// Reads n4 float4s (evict-first, as the products read weights) with 2 blocks an SM,
// writes a block's sum; records each block's exit time.
__global__ void __launch_bounds__(HOG_THREADS) hog(const float4* __restrict__ w, long long n4,
                                                   float* out) {
    gpu_grid_wait();
    float acc = 0.0f;
    for (long long i = (long long)blockIdx.x * HOG_THREADS + threadIdx.x; i < n4;
         i += (long long)gridDim.x * HOG_THREADS) {
        const gpu_u4 u = gpu_load_stream_u4((const float*)(w + i));
        acc += __uint_as_float(u.x) + __uint_as_float(u.y) + __uint_as_float(u.z) + __uint_as_float(u.w);
    }
    acc = gpu_warp_sum(acc);
    if ((threadIdx.x & 31) == 0) atomicAdd(out + blockIdx.x, acc);
    __syncthreads();
    if (threadIdx.x == 0 && blockIdx.x < 1024) {
        unsigned long long g;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
        hog_exit[blockIdx.x] = g;
    }
}

// A launch with programmatic stream serialisation (the CUDA backend's decode launches).
template <typename... K, typename... A>
static void pdl_launch(cudaStream_t st, void (*k)(K...), dim3 grid, int block, A... args) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.gridDim = grid;
    cfg.blockDim = dim3(block);
    cfg.stream = st;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, k, args...));
}

int main(int argc, char** argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 200;
    const double hog_mb = argc > 2 ? atof(argv[2]) : 18.9;  // wo_b's ROCmFP4 bytes
    const int d = 4096, hc = 4, nm = 2 * hc + hc * hc, k = 6, C = DS4_HCF_THREADS / 4;
    const int nb = d / C, pr = nm + 1 + hc * (hc + 1) / 2;
    int dev = 0, sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    printf("device %s, %d SMs; site: d %d, %d streams, %d blocks of %d threads; hog %.1f MB on %d blocks\n\n",
           prop.name, sms, d, hc, nb, DS4_HCF_THREADS, hog_mb, 2 * sms);
    std::mt19937 rng(20261206);
    float* streams = upload(rand_vec(rng, (size_t)hc * d, 1.0f));
    float* fn = upload(rand_vec(rng, (size_t)nm * hc * d, 0.01f));
    float* scale = upload(std::vector<float>{0.1f, 0.1f, 0.1f});
    float* base = upload(rand_vec(rng, nm, 0.5f));
    float* norm_w = upload(rand_vec(rng, d, 0.2f, 1.0f));
    std::vector<float> w0 = rand_vec(rng, nm, 0.1f, 0.25f);  // pre, post, comb of a site
    float* wts = upload(w0);
    float* y = upload(rand_vec(rng, (size_t)k * d, 1.0f));
    float* rw = upload(rand_vec(rng, k, 0.05f, 0.15f));
    float* shared = upload(rand_vec(rng, d, 1.0f));
    float *out, *part, *hog_out;
    unsigned int* sync;
    q8_1_block* xq;
    CK(cudaMalloc(&out, d * 4));
    CK(cudaMalloc(&part, (size_t)nb * pr * 4));
    CK(cudaMalloc(&sync, 4));
    CK(cudaMemset(sync, 0, 4));
    CK(cudaMalloc(&xq, (d / 32) * sizeof(q8_1_block)));
    CK(cudaMalloc(&hog_out, 1024 * 4));
    CK(cudaMemset(hog_out, 0, 1024 * 4));
    const long long n4 = (long long)(hog_mb * 1e6 / 16);
    float4* hw;
    CK(cudaMalloc(&hw, n4 * 16));
    CK(cudaMemset(hw, 0, n4 * 16));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    // The site reads the weights it writes (wts) on the next launch: the streams keep
    // changing, which is what a step does too (the values do not matter for the time).
    auto site = [&] {
        pdl_launch(st, ds4_hc_post_pre, dim3(nb, 1), DS4_HCF_THREADS, streams, (const float*)fn,
                   (const float*)scale, (const float*)base, (const float*)norm_w, d, hc, 20, 1e-6f,
                   1e-6f, 0, out, wts, part, sync, 2, (const float*)nullptr, (const float*)y,
                   (const float*)rw, k, (const float*)shared, 1, 1, xq, (const float*)nullptr,
                   (const float*)nullptr, 0, 0, 0, 0, 0.0f, 0, (float*)nullptr, (int*)nullptr,
                   (float*)nullptr, (float*)nullptr, (unsigned int*)nullptr);
    };
    // The router that follows the site in a step (ds4_router_mm, 256 experts, top 6):
    // its 128 blocks launch as the site starts and ask for their 4 MB of weights.
    const int ne = 256;
    float* wr = upload(rand_vec(rng, (size_t)ne * d, 0.02f));
    float* bias = upload(rand_vec(rng, ne, 0.01f));
    float* logits;
    int* ids;
    float* wout;
    unsigned int* rsync;
    CK(cudaMalloc(&logits, ne * 4));
    CK(cudaMalloc(&ids, k * 4));
    CK(cudaMalloc(&wout, k * 4));
    CK(cudaMalloc(&rsync, 4));
    CK(cudaMemset(rsync, 0, 4));
    auto router = [&] {
        pdl_launch(st, ds4_router_mm, dim3(ne / 2), DS4_ROUTER_MM_THREADS, (const float*)wr, d,
                   (const float*)out, logits, (const float*)bias, (const int*)nullptr, 0,
                   (const int*)nullptr, ne, k, 4, 1, 1.5f, 1, ids, wout, rsync, (unsigned int*)nullptr);
    };
    // The site routing itself (ds4_hc_post_pre with wr): no router launch after it.
    float *logits_r, *wout_r, *rpart;
    int* ids_r;
    CK(cudaMalloc(&logits_r, ne * 4));
    CK(cudaMalloc(&ids_r, k * 4));
    CK(cudaMalloc(&wout_r, k * 4));
    CK(cudaMalloc(&rpart, (size_t)nb * ne * 4 * 4));
    auto site_r = [&] {
        pdl_launch(st, ds4_hc_post_pre, dim3(nb, 1), DS4_HCF_THREADS, streams, (const float*)fn,
                   (const float*)scale, (const float*)base, (const float*)norm_w, d, hc, 20, 1e-6f,
                   1e-6f, 0, out, wts, part, sync, 2, (const float*)nullptr, (const float*)y,
                   (const float*)rw, k, (const float*)shared, 1, 1, xq, (const float*)wr,
                   (const float*)bias, ne, k, 4, 1, 1.5f, 1, logits_r, ids_r, wout_r, rpart,
                   (unsigned int*)nullptr);
    };
    auto hog_l = [&] { pdl_launch(st, hog, dim3(2 * sms), HOG_THREADS, (const float4*)hw, n4, hog_out); };
    const double t_hog = graph_us(st, reps, hog_l);
    const double t_pair = graph_us(st, reps, [&] {
        hog_l();
        site();
    });
    const double t_site = graph_us(st, reps, site);
    const double t_three = graph_us(st, reps, [&] {
        hog_l();
        site();
        router();
    });
    const double t_fused = graph_us(st, reps, [&] {
        hog_l();
        site_r();
    });
    // Parity: the same streams into both forms (the site updates them in place, so each
    // form starts from a saved copy), then logits, ids and weights compared.
    std::vector<float> s0((size_t)hc * d), w0s(nm);
    CK(cudaMemcpy(s0.data(), streams, s0.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(w0s.data(), wts, w0s.size() * 4, cudaMemcpyDeviceToHost));
    auto restore = [&] {
        CK(cudaMemcpy(streams, s0.data(), s0.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(wts, w0s.data(), w0s.size() * 4, cudaMemcpyHostToDevice));
    };
    restore();
    site();
    router();
    CK(cudaStreamSynchronize(st));
    restore();
    site_r();
    CK(cudaStreamSynchronize(st));
    std::vector<float> la(ne), lb(ne), wa(k), wb(k);
    std::vector<int> ia(k), ib(k);
    CK(cudaMemcpy(la.data(), logits, ne * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(lb.data(), logits_r, ne * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(wa.data(), wout, k * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(wb.data(), wout_r, k * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(ia.data(), ids, k * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(ib.data(), ids_r, k * 4, cudaMemcpyDeviceToHost));
    float dl = 0, ml = 0, dw = 0;
    for (int e = 0; e < ne; ++e) {
        dl = fmaxf(dl, fabsf(la[e] - lb[e]));
        ml = fmaxf(ml, fabsf(la[e]));
    }
    for (int j = 0; j < k; ++j) dw = fmaxf(dw, fabsf(wa[j] - wb[j]));
    printf("routing in the site vs the router launch: logits %.2e of their largest (%.3g), ids %s, weights %.2e\n\n",
           dl / ml, ml, ia == ib ? "the same" : "DIFFERENT", dw);
    printf("| what | us a launch (graph of %d) |\n|---|---|\n", reps);
    printf("| hog alone (%.1f MB; %.0f GB/s) | %.2f |\n", hog_mb, hog_mb * 1e3 / t_hog, t_hog);
    printf("| hog + site | %.2f |\n", t_pair);
    printf("| site after the hog (difference) | **%.2f** |\n", t_pair - t_hog);
    printf("| site alone, back to back | %.2f |\n", t_site);
    printf("| hog + site + router | %.2f |\n", t_three);
    printf("| router after the site (difference) | **%.2f** |\n", t_three - t_pair);
    printf("| hog + site routing itself | %.2f |\n", t_fused);
    printf("| site + router, routing in the site (difference from hog) | **%.2f** (separate: %.2f) |\n",
           t_fused - t_hog, t_three - t_hog);
#if defined(HCF_STAMPS)
    // One pair more, its stamps read back: per phase, the blocks' times from the hog's
    // last block's exit (min / median / max over blocks).
    for (int form = 0; form < 3; ++form) {  // site; site, router; site routing itself
        CK(cudaStreamSynchronize(st));
        for (int r = 0; r < 3; ++r) {
            hog_l();
            if (form == 2) {
                site_r();
            } else {
                site();
                if (form == 1) router();
            }
        }
        CK(cudaStreamSynchronize(st));
        std::vector<unsigned long long> s(64 * HCF_NSTAMP * 2), he(1024);
        CK(cudaMemcpyFromSymbol(s.data(), hcf_stamps, s.size() * 8));
        CK(cudaMemcpyFromSymbol(he.data(), hog_exit, he.size() * 8));
        unsigned long long h_last = 0;
        for (int b = 0; b < 2 * sms && b < 1024; ++b) h_last = std::max(h_last, he[b]);
        const char* names[] = {"entry", "dependent-launch wait over", "post done (streams, sv)",
                               "shares written", "grid barrier over", "weights summed",
                               "x, xq, wts written"};
        printf("\n%s: phase end, us after the hog's last block exited (min / median / max of %d blocks)\n\n",
               form == 0 ? "hog, site" : (form == 1 ? "hog, site, router" : "hog, site routing itself"), nb);
        printf("| phase | min | median | max |\n|---|---|---|---|\n");
        for (int ph = 0; ph < 7; ++ph) {
            std::vector<double> v;
            for (int b = 0; b < nb; ++b)
                v.push_back(((double)s[(b * HCF_NSTAMP + ph) * 2] - (double)h_last) / 1e3);
            std::sort(v.begin(), v.end());
            printf("| %d %s | %.2f | %.2f | %.2f |\n", ph, names[ph], v.front(), v[v.size() / 2], v.back());
        }
        // Timer granularity: the smallest non-zero difference of two stamps of a block.
        unsigned long long gran = ~0ull;
        for (int b = 0; b < nb; ++b)
            for (int ph = 1; ph < 7; ++ph) {
                const unsigned long long a = s[(b * HCF_NSTAMP + ph - 1) * 2], c = s[(b * HCF_NSTAMP + ph) * 2];
                if (c > a) gran = std::min(gran, c - a);
            }
        printf("\nsmallest step of the global timer seen: %llu ns\n", gran);
    }
#endif
    return 0;
}
