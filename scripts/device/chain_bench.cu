// The attention's output projection, two ROCmFP4 products in a row, in one launch
// against the committed two (scripts/device/chain_bench.sh; written 2026-12-04). Its own
// file so that it builds in seconds (dense_matvec_bench.cu takes minutes).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <random>
#include "../../kernels/gpu/rocmfpx.cu"
#include "bench_check.cuh"

// `bytes` of random ROCmFP4 blocks (16 code bytes, two UE4M3 half scales near 2^-2).
static std::vector<unsigned char> random_fp4(std::mt19937& rng, long long bytes) {
    std::vector<unsigned char> hw(bytes);
    for (long long bi = 0; bi < bytes / 18; ++bi) {
        unsigned char* b = hw.data() + bi * 18;
        for (int j = 0; j < 16; ++j) b[j] = rng() & 0xff;
        b[16] = 0x20 + rng() % 0x20;
        b[17] = 0x20 + rng() % 0x20;
    }
    return hw;
}

// The attention's output projection is two ROCmFP4 products in a row: the 8 groups of
// wo_a (4096 -> 1024 each, matvec_fp4_runs_q8_id) and wo_b (8192 -> 4096,
// matvec_fp4_runs_q8), 12.9 + 13.8 us a layer on the decode path against ~11 us for
// their bytes. Both take 128 blocks of 512 threads at the committed plans (2 rows a
// thread), so one launch can run them back to back: each block its 64 wo_a rows, a
// group barrier (every block resident: one an SM), then its 32 wo_b rows. With PREFETCH
// a block asks for its wo_b words before it waits at the barrier, so the second
// product's loads overlap the first one's tail and the barrier. The same sums as the
// two launches (each row's order depends only on k).
struct chain_src_l2 {  // wo_b's input, written by the other blocks of this launch
    const float* x;
    __device__ void begin(int) {}
    __device__ gpu_f4 at(int c) const { return gpu_load_l2_f4(x + 4 * c); }
};

template <bool PREFETCH>
__global__ void __launch_bounds__(512, 1)
    chain_variant(const unsigned char* __restrict__ wa, long long a_expert_bytes, long long a_row_bytes,
                  int ka, int ma, const float* __restrict__ x, float* mid,
                  const unsigned char* __restrict__ wb, long long b_row_bytes, int kb, int mb,
                  float* __restrict__ out, unsigned int* sync) {
    __shared__ fp4_q8_smem sm;
    const int t = threadIdx.x, nt = blockDim.x;
    // wo_a: block b takes group b / bpg, rows (b % bpg) 2 nt / La ..
    const int La = fp4_runs_lanes(ka), bpg = ma / (2 * nt / La);
    const int grp = blockIdx.x / bpg, bx = blockIdx.x % bpg;
    const int ja = t & (La - 1), ra = (bx * (nt / La) + t / La) * 2;
    const unsigned char* rows[2];
    float acc[2];
    fp4_run<2> run;
    rows_block_start<2>(wa + grp * a_expert_bytes, a_row_bytes, ra, ma, rows, acc);
    fp4_run_load<2>(rows, ja, run);
    fp4_q8_stage<false>(fp4_src_x{x + (long long)grp * ka}, ka, sm.xq, sm.ds);
    for (int i = t; i < 256; i += nt) sm.sc[i] = ue4m3(i);
    __syncthreads();
    for (int g = ja; g < ka >> 8; g += La) {
        if (g != ja) fp4_run_load<2>(rows, g, run);
        fp4_run_dot_q8<2>(run, g, sm, acc);
    }
    fp4_runs_store<2>(acc, La, ja, ra, ma, mid + (long long)grp * ma);
    // wo_b: block b takes rows b 2 nt / Lb ..
    const int Lb = fp4_runs_lanes(kb), jb = t & (Lb - 1), rb = (blockIdx.x * (nt / Lb) + t / Lb) * 2;
    const unsigned char* rowsb[2];
    float accb[2];
    fp4_run<2> runb;
    rows_block_start<2>(wb, b_row_bytes, rb, mb, rowsb, accb);
    if (PREFETCH) fp4_run_load<2>(rowsb, jb, runb);
    gpu_group_barrier(sync, gridDim.x);  // every block's wo_a rows are in mid
    if (!PREFETCH) fp4_run_load<2>(rowsb, jb, runb);
    fp4_q8_stage<false>(chain_src_l2{mid}, kb, sm.xq, sm.ds);
    __syncthreads();
    for (int g = jb; g < kb >> 8; g += Lb) {
        if (g != jb) fp4_run_load<2>(rowsb, g, runb);
        fp4_run_dot_q8<2>(runb, g, sm, accb);
    }
    fp4_runs_store<2>(accb, Lb, jb, rb, mb, out);
}

// `kern` launched with programmatic stream serialization (as the engine launches on
// sm_90: the kernel's launch overlaps its predecessor's tail, its griddepcontrol.wait
// holds it until the predecessor is done).
template <typename... K, typename... A>
void launch_pdl(void (*kern)(K...), dim3 grid, int block, A... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(block);
    cfg.stream = cudaStreamPerThread;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, kern, ((K)args)...));
}

void chain_wo(int reps) {
    const int groups = 8, ka = 4096, ma = 1024, kb = groups * ma, mb = 4096, nt = 512;
    const long long ra_bytes = ka / 32 * 18, ea_bytes = ra_bytes * ma, rb_bytes = kb / 32 * 18;
    const long long a_bytes = ea_bytes * groups, b_bytes = rb_bytes * mb;
    const int copies = 7;  // ~250 MB of weights in all: each replay reads from memory
    std::mt19937 rng(5);
    unsigned char *wa, *wb;
    CK(cudaMalloc(&wa, a_bytes * copies));
    CK(cudaMalloc(&wb, b_bytes * copies));
    const std::vector<unsigned char> ha = random_fp4(rng, a_bytes);
    const std::vector<unsigned char> hb = random_fp4(rng, b_bytes);
    for (int c = 0; c < copies; ++c) {
        CK(cudaMemcpy(wa + c * a_bytes, ha.data(), a_bytes, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(wb + c * b_bytes, hb.data(), b_bytes, cudaMemcpyHostToDevice));
    }
    std::vector<float> hx((size_t)groups * ka);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& v : hx) v = nd(rng);
    float *x, *mid, *out1, *out2;
    int* ids;
    unsigned int* sync;
    CK(cudaMalloc(&x, hx.size() * 4));
    CK(cudaMemcpy(x, hx.data(), hx.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&mid, kb * 4));
    CK(cudaMalloc(&out1, mb * 4));
    CK(cudaMalloc(&out2, mb * 4));
    CK(cudaMalloc(&ids, groups * 4));
    CK(cudaMalloc(&sync, 4));
    CK(cudaMemset(sync, 0, 4));
    std::vector<int> hid(groups);
    for (int g = 0; g < groups; ++g) hid[g] = g;
    CK(cudaMemcpy(ids, hid.data(), groups * 4, cudaMemcpyHostToDevice));
    int turn = 0;
    auto next = [&] { return turn++ % copies; };
    const int La = 16, Lb = 32, grid_a = ma / (2 * nt / La), grid_b = mb / (2 * nt / Lb);
    auto wo_a = [&](int c, bool pdl) {
        if (pdl)
            launch_pdl(matvec_fp4_runs_q8_id, dim3(grid_a, groups), nt, wa + c * a_bytes, ea_bytes, ra_bytes, ka,
                       ma, groups, (const float*)x, 1, 1, (const int*)ids, mid, 2, (unsigned int*)nullptr);
        else
            matvec_fp4_runs_q8_id<<<dim3(grid_a, groups), nt>>>(wa + c * a_bytes, ea_bytes, ra_bytes, ka, ma,
                                                               groups, x, 1, 1, ids, mid, 2, nullptr);
    };
    auto wo_b = [&](int c, float* o, bool pdl) {
        if (pdl)
            launch_pdl(matvec_fp4_runs_q8, dim3(grid_b), nt, wb + c * b_bytes, rb_bytes, kb, mb,
                       (const float*)mid, o, 2, (unsigned int*)nullptr);
        else
            matvec_fp4_runs_q8<<<grid_b, nt>>>(wb + c * b_bytes, rb_bytes, kb, mb, mid, o, 2, nullptr);
    };
    auto one = [&](bool prefetch, float* o) {
        const int c = next();
        auto k = prefetch ? chain_variant<true> : chain_variant<false>;
        k<<<groups * grid_a, nt>>>(wa + c * a_bytes, ea_bytes, ra_bytes, ka, ma, x, mid, wb + c * b_bytes,
                                  rb_bytes, kb, mb, o, sync);
    };
    printf("\n| wo_a (8 x 4096 -> 1024) then wo_b (8192 -> 4096), ROCmFP4, %d + %d blocks | us | vs the committed bits |\n",
           groups * grid_a, grid_b);
    printf("|---|---|---|\n");
    std::vector<float> want(mb), got(mb);
    CK(cudaMemset(out1, 0, mb * 4));
    wo_a(0, false);
    wo_b(0, out1, false);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(want.data(), out1, mb * 4, cudaMemcpyDeviceToHost));
    auto row = [&](const char* name, auto f, bool check) {
        const char* verdict = "-";
        if (check) {
            CK(cudaMemset(out2, 0xff, mb * 4));  // NaN unless written
            turn = 0;
            f(out2);
            CK(cudaGetLastError());
            CK(cudaDeviceSynchronize());
            CK(cudaMemcpy(got.data(), out2, mb * 4, cudaMemcpyDeviceToHost));
            verdict = memcmp(want.data(), got.data(), mb * 4) ? "DIFFERENT bits" : "same bits";
        }
        const double us = graph_us(cudaStreamPerThread, reps, [&] { f(out2); });
        printf("| %s | %.2f | %s |\n", name, us, verdict);
    };
    row("wo_a alone (matvec_fp4_runs_q8_id)", [&](float*) { wo_a(next(), false); }, false);
    row("wo_b alone (matvec_fp4_runs_q8)", [&](float* o) { wo_b(next(), o, false); }, false);
    row("two launches", [&](float* o) { const int c = next(); wo_a(c, false), wo_b(c, o, false); }, true);
    row("two launches, dependent launch", [&](float* o) { const int c = next(); wo_a(c, true), wo_b(c, o, true); },
        true);
    row("one launch, wo_b's words after the barrier", [&](float* o) { one(false, o); }, true);
    row("one launch, wo_b's words before the barrier", [&](float* o) { one(true, o); }, true);
    for (void* p : {(void*)wa, (void*)wb, (void*)x, (void*)mid, (void*)out1, (void*)out2, (void*)ids, (void*)sync})
        CK(cudaFree(p));
}

int main(int argc, char** argv) {
    chain_wo(argc > 1 ? atoi(argv[1]) : 50);
    return 0;
}
