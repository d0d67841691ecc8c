// Portability layer shared by every kernel source in kernels/gpu.
//
// One dialect for NVIDIA (nvcc, NVRTC, clang -x cuda) and AMD (hipcc, hiprtc,
// clang -x hip). Kernels use only the names below plus the small common subset of
// the CUDA/HIP device APIs (threadIdx, blockIdx, blockDim, gridDim, __syncthreads,
// __threadfence, __threadfence_block, atomicAdd, __int_as_float, roundf, fabsf, fmaxf,
// fminf, fmaf, expf, sqrtf). Assumptions:
// * 32-lane warps (NVIDIA warps; RDNA3/3.5 wave32, the HIP default on gfx11);
// * blocks are launched with the sizes the kernels name in __launch_bounds__.
#pragma once

#if defined(__HIP__) || defined(__HIPCC__) || defined(__HIP_DEVICE_COMPILE__) || defined(__AMDGCN__)
#define GPU_HIP 1
#else
#define GPU_CUDA 1
#endif

#define GPU_WARP 32
#define GPU_FULL_MASK 0xffffffffu

#define GPU_DEV static __device__ __forceinline__
// The same for member functions (which cannot be static).
#define GPU_MEMBER __device__ __forceinline__

// Four floats loaded in one 16-byte access (the vector types differ between toolchains).
struct __attribute__((aligned(16))) gpu_f4 {
    float x, y, z, w;
};
struct __attribute__((aligned(8))) gpu_f2 {
    float x, y;
};
struct __attribute__((aligned(16))) gpu_u4 {
    unsigned int x, y, z, w;
};

// 4-way int8 dot product with accumulate: c + sum a[i] * b[i] over signed bytes.
GPU_DEV int gpu_dp4a(int a, int b, int c) {
#if defined(GPU_HIP)
#if defined(__gfx1100__) || defined(__gfx1101__) || defined(__gfx1102__) || defined(__gfx1103__) || \
    defined(__gfx1150__) || defined(__gfx1151__) || defined(__gfx1200__) || defined(__gfx1201__)
    // RDNA3+: v_dot4_i32_iu8 with both operands signed.
    return __builtin_amdgcn_sudot4(true, a, true, b, c, false);
#elif defined(__gfx906__) || defined(__gfx908__) || defined(__gfx90a__) || defined(__gfx942__) || \
    defined(__gfx1030__)
    return __builtin_amdgcn_sdot4(a, b, c, false);
#else
    const signed char* x = (const signed char*)&a;
    const signed char* y = (const signed char*)&b;
    return c + x[0] * y[0] + x[1] * y[1] + x[2] * y[2] + x[3] * y[3];
#endif
#else
    return __dp4a(a, b, c);
#endif
}

// Bit i set where lane i's `p` holds (every lane of the warp must call it).
GPU_DEV unsigned int gpu_ballot(bool p) {
#if defined(GPU_HIP)
    // On a 64-lane wave the 32-lane "warp" of this thread is one half of the mask.
    const unsigned long long b = __ballot(p);
    return (unsigned int)(__builtin_amdgcn_wavefrontsize() == 64 ? b >> (threadIdx.x & 32) : b);
#else
    return __ballot_sync(GPU_FULL_MASK, p);
#endif
}

// Butterfly exchange within a 32-lane warp (all lanes active).
GPU_DEV float gpu_shfl_xor(float v, int mask) {
#if defined(GPU_HIP)
    return __shfl_xor(v, mask, GPU_WARP);
#else
    return __shfl_xor_sync(GPU_FULL_MASK, v, mask, GPU_WARP);
#endif
}

// Lane `src`'s value (all lanes active).
GPU_DEV float gpu_shfl(float v, int src) {
#if defined(GPU_HIP)
    return __shfl(v, src, GPU_WARP);
#else
    return __shfl_sync(GPU_FULL_MASK, v, src, GPU_WARP);
#endif
}

// Adds 1 to bins[bin] for each lane with `on`: one shared-memory atomic per distinct bin
// of the warp, not one per lane (same-address atomics serialise; similar keys crowd
// into one bin). Every lane of the warp must call it.
GPU_DEV void gpu_warp_hist_add(unsigned int* bins, unsigned int bin, bool on) {
    const int lane = threadIdx.x & 31;
    unsigned int todo = gpu_ballot(on);
    while (todo) {
        const int leader = __popc((todo & (0u - todo)) - 1u);
        const float lbf = gpu_shfl(__int_as_float((int)bin), leader);
        const unsigned int lb = (unsigned int)__float_as_int(lbf);
        const unsigned int same = gpu_ballot(on && bin == lb);
        if (lane == leader) atomicAdd(bins + lb, (unsigned int)__popc(same));
        todo &= ~same;
    }
}

// Orders a warp's shared-memory writes before its lanes' reads of them.
GPU_DEV void gpu_syncwarp() {
#if defined(GPU_HIP)
    // A wave runs in lockstep; the barrier keeps the compiler from reordering.
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
    __builtin_amdgcn_wave_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
#else
    __syncwarp();
#endif
}

// Makes v's value unknown to the compiler without an instruction, so work on it is not
// hoisted out of a loop (hoisting a run's decode out of a loop over columns held ~150
// more registers and spilled on AMD).
GPU_DEV void gpu_opaque(unsigned int& v) {
#if defined(GPU_HIP)
    asm volatile("" : "+v"(v));
#else
    asm volatile("" : "+r"(v));
#endif
}

GPU_DEV float gpu_warp_sum(float v) {
#pragma unroll
    for (int m = GPU_WARP / 2; m > 0; m >>= 1) v += gpu_shfl_xor(v, m);
    return v;
}

GPU_DEV float gpu_warp_max(float v) {
#pragma unroll
    for (int m = GPU_WARP / 2; m > 0; m >>= 1) v = fmaxf(v, gpu_shfl_xor(v, m));
    return v;
}

// The greater of two magnitudes (fabsf results), keeping a NaN: for floats with the sign
// clear the integer order is the float order and a NaN's bits lie above +inf, so the q8
// quantisers' scale becomes NaN (as the CPU's BlockQ8_1) where fmaxf would drop the NaN
// and quietly give a finite product. The same bits as fmaxf for every other input.
GPU_DEV float gpu_absmax(float a, float b) {
    const int ia = __float_as_int(a), ib = __float_as_int(b);
    return __int_as_float(ia > ib ? ia : ib);
}

GPU_DEV float gpu_warp_absmax(float v) {
#pragma unroll
    for (int m = GPU_WARP / 2; m > 0; m >>= 1) v = gpu_absmax(v, gpu_shfl_xor(v, m));
    return v;
}

// DeepSeek-V4's clamped SwiGLU of one gate / up pair: silu(min(g, lim)) * clamp(u, -lim,
// lim) (no clamp when lim <= 0). One definition for ds4_swiglu and the products that
// compute it from their inputs (the same bits either way).
GPU_DEV float gpu_swiglu(float a, float b, float lim) {
    if (lim > 0.0f) {
        a = fminf(a, lim);
        b = fminf(fmaxf(b, -lim), lim);
    }
    return a * (1.0f / (1.0f + expf(-a))) * b;
}

// Float multiply/add that the compiler never fuses into an FMA: kernels that must
// agree bit for bit (grouped vs per-pair mat-vec) use these for their sums.
#if defined(GPU_HIP)
GPU_DEV float gpu_mul(float a, float b) {
#pragma clang fp contract(off)
    return a * b;
}
GPU_DEV float gpu_add(float a, float b) {
#pragma clang fp contract(off)
    return a + b;
}
GPU_DEV float gpu_sub(float a, float b) {
#pragma clang fp contract(off)
    return a - b;
}
#else
GPU_DEV float gpu_mul(float a, float b) { return __fmul_rn(a, b); }
GPU_DEV float gpu_add(float a, float b) { return __fadd_rn(a, b); }
GPU_DEV float gpu_sub(float a, float b) { return __fsub_rn(a, b); }
#endif

// (float)v for |v| < 2^22, exactly, from two full-rate operations: v added to the bits of
// 1.5 * 2^23 lands in its mantissa, and subtracting 1.5 * 2^23 leaves v. For the integer
// sums of the quantised kernels, whose conversions are otherwise a slower unit's work.
// GPU_PLAIN_I2F (a compile option, for A/B runs): the plain conversion; the same bits.
GPU_DEV float gpu_i2f_small(int v) {
#if defined(GPU_PLAIN_I2F)
    return (float)v;
#else
    return __int_as_float(0x4b400000 + v) - 12582912.0f;
#endif
}

// Counts one launch of kernel `id`: the first thread of the first block adds 1.
// Programmatic dependent launch (CUDA, sm_90 on): the CUDA backend lets a kernel's
// blocks start while its predecessor drains, and every kernel waits here, first thing,
// for the predecessor to complete with its memory visible, so no read or write of its
// data can race (and, by induction, of any earlier kernel's). Elsewhere: nothing.
// GPU_PDL_EARLY (a compile option): each block also lets the next kernel launch as soon
// as it starts, so that kernel's blocks are resident (and read their weights) while this
// one runs; its wait still orders every access to data this kernel writes.
// GPU_PDL_EARLY_SMALL: the same for grids of at most GPU_PDL_SMALL_GRID blocks only (a
// decode step's glue, on a few SMs: the next product's blocks fit beside it and load
// their weights before their wait; a prefill pass's large grids keep the default).
// (MOE_GPU_PDL_SMALL_GRID sets another bound, for A/B runs.) `early`: this launch lets
// its successor go as it starts whatever its grid (the host asks for it per kernel:
// MOE_GPU_PDL_EARLY_KERNELS, see gpu_count_launch).
#if !defined(GPU_PDL_SMALL_GRID)
#define GPU_PDL_SMALL_GRID 64
#endif
GPU_DEV void gpu_grid_wait(bool early = false) {
#if defined(GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#if defined(GPU_PDL_EARLY)
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#elif defined(GPU_PDL_EARLY_SMALL)
    if (early || gridDim.x * gridDim.y * gridDim.z <= GPU_PDL_SMALL_GRID)
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#else
    if (early) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    asm volatile("griddepcontrol.wait;" ::: "memory");
#else
    (void)early;
#endif
}

// Device-scope release + acquire fence: a block publishes its results before it counts
// itself done, and the block that counts last orders its reads of theirs after it.
GPU_DEV void gpu_fence() {
#if defined(GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
#else
    __threadfence();
#endif
}

// Loads of data other blocks of the running kernel wrote (after gpu_fence): from L2,
// past this SM's L1, which other SMs' stores do not update. p 16-byte aligned (f4).
GPU_DEV float gpu_load_l2(const float* p) {
#if defined(GPU_CUDA)
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
#else
    return *(const volatile float*)p;
#endif
}
GPU_DEV gpu_f4 gpu_load_l2_f4(const float* p) {
#if defined(GPU_CUDA)
    gpu_f4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p));
    return v;
#else
    const volatile float* q = p;
    return gpu_f4{q[0], q[1], q[2], q[3]};
#endif
}

// A flag other blocks of the running kernel update (a grid barrier's spin): read from
// L2 with acquire order, so what they wrote before it is seen after.
GPU_DEV unsigned int gpu_load_acquire_u32(unsigned int* p) {
#if defined(GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    unsigned int v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
#elif defined(GPU_CUDA)
    const unsigned int v = *(volatile unsigned int*)p;
    __threadfence();
    return v;
#else
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

// Every block of a group of nb (all resident at once) waits here for the group's others.
// sync counts arrivals in its low 16 bits and a generation above them: the last block to
// arrive zeroes the count and starts the next generation, so launch after launch (graph
// replays) reuse the word with no reset. Each block's global writes before the barrier
// come ahead of the other blocks' reads after it (read those from L2: gpu_load_l2): on
// CUDA sm_70+ the arrival is an acquire-release add and the wait an acquire load (the
// block's threads' writes reach thread 0 through __syncthreads); elsewhere, or with
// GPU_BARRIER_FENCES (A/B runs), full fences around plain atomics.
#if defined(GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700 && !defined(GPU_BARRIER_FENCES)
#define GPU_BARRIER_ACQREL 1
#endif
GPU_DEV void gpu_group_barrier(unsigned int* sync, unsigned int nb) {
    __syncthreads();  // every thread's writes before thread 0's arrival
    if (threadIdx.x == 0) {
        const unsigned int next = 0x10000u - nb;  // the last one: count 0, next generation
        unsigned int old;
#if defined(GPU_BARRIER_ACQREL)
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(sync) : "memory");
        if ((old & 0xffffu) == nb - 1u)
            asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(sync), "r"(next) : "memory");
#else
        gpu_fence();
        old = atomicAdd(sync, 1u);
        if ((old & 0xffffu) == nb - 1u) atomicAdd(sync, next);
#endif
        if ((old & 0xffffu) != nb - 1u)
            while (((gpu_load_acquire_u32(sync) ^ old) >> 16) == 0u) {
            }
#if !defined(GPU_BARRIER_ACQREL)
        gpu_fence();
#endif
    }
    __syncthreads();
}

// Thread 0 of each of nb blocks counts its block done in *count once its block's writes
// are out (after __syncthreads); true in the last block, whose reads after it (from L2:
// gpu_load_l2) see every block's writes, and which puts the count back to zero for the
// next launch. CUDA sm_70+: one acquire-release add; elsewhere full fences around it.
GPU_DEV bool gpu_count_last(unsigned int* count, unsigned int nb) {
    unsigned int old;
#if defined(GPU_BARRIER_ACQREL)
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(count) : "memory");
#else
    gpu_fence();
    old = atomicAdd(count, 1u);
    gpu_fence();
#endif
    const bool last = old == nb - 1u;
    if (last) *(volatile unsigned int*)count = 0u;
    return last;
}

// Every kernel's first statement: the dependent-launch wait, then the launch counter.
// The counters' address (at least 4-byte aligned) carries one flag in its low bit: let
// the successor launch early (gpu_grid_wait's `early`).
GPU_DEV void gpu_count_launch(unsigned int* counters, int id) {
    const unsigned long long tagged = (unsigned long long)counters;
    gpu_grid_wait((tagged & 1ull) != 0);
    counters = (unsigned int*)(tagged & ~1ull);
    if (counters && threadIdx.x == 0 && threadIdx.y == 0 && blockIdx.x == 0 && blockIdx.y == 0 &&
        blockIdx.z == 0) {
        atomicAdd(counters + id, 1u);
    }
}

// Loads of the weights a decode step streams once (6.3 GB a V4-Flash token, ~130 times
// the H200's L2): marked evict-first in L2, so that they do not push out what the step
// reads again (activations, KV rows, kernel code). The hint changes no value. Weights
// only: the non-coherent loads carry no memory clobber, so the compiler may place them
// before the dependent-launch wait (gpu_grid_wait); nothing an earlier kernel of the
// stream writes may be read through them.
// GPU_NO_STREAM_HINT (a compile option): plain loads (A/B runs). Elsewhere: plain loads.
#if defined(GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(GPU_NO_STREAM_HINT)
#define GPU_STREAM_HINT 1
#endif
// GPU_POLICY_IMM (a compile option, the CUDA backend's default; `MOE_GPU_POLICY=0` off): the loads below name the
// policy as an immediate, the 64-bit value ptxas (12.9, sm_90) folds that createpolicy
// to: ptxas then keeps it in one uniform register pair for every load, where from a
// register operand it copies it into a fresh pair before each load (R2UR; 70 of the
// ~800 instructions of a routed-expert decode stage). The same loads, the same hint.
// (sm_90 only: the policy's encoding is opaque, and that value was checked for sm_90)
#define GPU_EF_POLICY "0x12F0000000000000"
#if defined(GPU_STREAM_HINT) && defined(GPU_POLICY_IMM) && __CUDA_ARCH__ >= 900 && __CUDA_ARCH__ < 1000
#define GPU_POL_OP(n) GPU_EF_POLICY
#define GPU_POL_ARG
#else
#define GPU_POL_OP(n) "%" #n
#define GPU_POL_ARG , "l"(gpu_stream_policy())
#endif
GPU_DEV unsigned long long gpu_stream_policy() {
#if defined(GPU_STREAM_HINT)
    unsigned long long p;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    return p;
#else
    return 0ull;
#endif
}
// 16 bytes (16-byte aligned), 4 bytes (4-byte aligned), 2 bytes (2-byte aligned); the
// _a2 form: 4 bytes, 2-byte aligned. HINT = false: plain loads (a kernel family's A/B
// switch).
template <bool HINT = true>
GPU_DEV gpu_u4 gpu_load_stream_u4(const void* p) {
#if defined(GPU_STREAM_HINT)
    if (HINT) {
        gpu_u4 v;
        asm("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], " GPU_POL_OP(5) ";"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
            : "l"(p) GPU_POL_ARG);
        return v;
    }
#endif
    return *(const gpu_u4*)p;
}
template <bool HINT = true>
GPU_DEV unsigned int gpu_load_stream_u32(const void* p) {
#if defined(GPU_STREAM_HINT)
    if (HINT) {
        unsigned int v;
        asm("ld.global.nc.L2::cache_hint.u32 %0, [%1], " GPU_POL_OP(2) ";" : "=r"(v) : "l"(p) GPU_POL_ARG);
        return v;
    }
#endif
    return *(const unsigned int*)p;
}
template <bool HINT = true>
GPU_DEV unsigned int gpu_load_stream_u16(const unsigned char* p) {
#if defined(GPU_STREAM_HINT)
    if (HINT) {
        unsigned short v;
        asm("ld.global.nc.L2::cache_hint.u16 %0, [%1], " GPU_POL_OP(2) ";" : "=h"(v) : "l"(p) GPU_POL_ARG);
        return (unsigned int)v;
    }
#endif
    return (unsigned int)*(const unsigned short*)p;
}
template <bool HINT = true>
GPU_DEV unsigned int gpu_load_stream_u32_a2(const unsigned char* p) {
    return gpu_load_stream_u16<HINT>(p) | (gpu_load_stream_u16<HINT>(p + 2) << 16);
}

// One float4 of a row (as the words gpu_load_stream_u4 returns) against x's: the term
// f32_wide_dots adds to a thread's sum. One definition for its two forms (1024 threads,
// and 256 threads each taking four threads' parts in ds4_router_mm): the same bits.
GPU_DEV float f32_wide_term(float acc, const gpu_u4 u, const gpu_f4 b) {
    return acc + (__int_as_float((int)u.x) * b.x + __int_as_float((int)u.y) * b.y +
                  __int_as_float((int)u.z) * b.z + __int_as_float((int)u.w) * b.w);
}

// Thread vt's part of R rows' dots in the 1024-thread layout: float4s 4 vt + 4096 j
// (+ 16384 a round), four in flight at a time, added in order.
template <int R>
GPU_DEV void f32_wide_part(const float* __restrict__ row, int k, const float* __restrict__ x,
                           int vt, float (&acc)[R]) {
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    for (int i0 = 4 * vt; i0 < k; i0 += 4 * 4096) {
        gpu_u4 u[R][4];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (i0 + 4096 * j < k) u[r][j] = gpu_load_stream_u4(row + (long long)r * k + i0 + 4096 * j);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = i0 + 4096 * j;
            if (i >= k) break;
            const gpu_f4 b = *(const gpu_f4*)(x + i);
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r] = f32_wide_term(acc[r], u[r][j], b);
        }
    }
}

// The dots of R consecutive f32 rows (k values each, from `row`) with x on a 1024-thread
// block: four float4s of each row in flight at a time (unrolled by hand: the loads'
// inline assembly stops the compiler's partial unrolling), added in order of i, then over
// the warps in order; every row's sum is the same whatever R. The sums are valid in
// thread 0 (v[r]). The rows are read as weights (gpu_load_stream_u4). For
// matvec_f32_wide (R = 1); ds4_router_mm gives the same bits on 256 threads. sh: 32 R
// floats.
template <int R>
GPU_DEV void f32_wide_dots(const float* __restrict__ row, int k, const float* __restrict__ x,
                           float* sh, float (&v)[R]) {
    float acc[R];
    f32_wide_part<R>(row, k, x, (int)threadIdx.x, acc);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        acc[r] = gpu_warp_sum(acc[r]);
        if (lane == 0) sh[32 * r + warp] = acc[r];
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < R; ++r) v[r] = warp == 0 ? gpu_warp_sum(sh[32 * r + lane]) : 0.0f;
}

// A shared-memory pointer as the 32-bit address the copy and barrier instructions take.
#if defined(GPU_CUDA) && defined(__CUDA_ARCH__)
GPU_DEV unsigned int gpu_smem_addr(const void* p) {
    unsigned int a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// ldmatrix.x4 (sm_75 on) at shared address addr (gpu_smem_addr): matrix i of 8 x 8 b16
// values from lanes 8 i .. 8 i + 7's row addresses; lane l gets row l / 4, 32-bit word
// l % 4 of each, in d_i.
#if __CUDA_ARCH__ >= 750
GPU_DEV void gpu_ldsm4(unsigned int addr, unsigned int& d0, unsigned int& d1, unsigned int& d2,
                       unsigned int& d3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(d0), "=r"(d1), "=r"(d2), "=r"(d3)
                 : "r"(addr)
                 : "memory");
}
#endif

// d += A B on the tensor cores, bf16 operands and f32 sums (mma m16n8k16, sm_80 on): A's
// fragment a0..a3 (16 x 16, row-major), B's b0, b1 (16 x 8, column-major), d the C
// fragment of 16 x 8.
#if __CUDA_ARCH__ >= 800
GPU_DEV void gpu_mma_bf16(float* d, unsigned int a0, unsigned int a1, unsigned int a2,
                          unsigned int a3, unsigned int b0, unsigned int b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#endif
#endif

// Two floats as bf16 (round to nearest even) in one word, lo in the low half (the lower
// k of an mma fragment's pair).
GPU_DEV unsigned int gpu_bf16x2(float lo, float hi) {
#if defined(GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    const unsigned int a = (unsigned int)__float_as_int(lo), b = (unsigned int)__float_as_int(hi);
    const unsigned int ra = (a + 0x7fffu + ((a >> 16) & 1u)) >> 16;
    const unsigned int rb = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    return ra | (rb << 16);
#endif
}

// Asynchronous 16-byte copies from global to shared memory (cp.async, CUDA sm_80+):
// dst as gpu_smem_addr gives it; with on = false 16 zero bytes (src unread). Copies
// land in groups: gpu_cp_commit closes one, gpu_cp_wait<N> waits until at most N of
// this thread's groups are in flight (a __syncthreads then shows every thread's).
#if defined(GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define GPU_CP_ASYNC 1
GPU_DEV void gpu_cp_async16(unsigned int dst, const void* src, bool on) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(on ? 16 : 0)
                 : "memory");
}
GPU_DEV void gpu_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
GPU_DEV void gpu_cp_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#endif

// Bulk copies from global to shared memory (sm_90's TMA engine, cp.async.bulk): one
// thread asks for a whole span of bytes, which lands in shared memory while every
// thread goes on, and an mbarrier counts the bytes in; threads wait on the barrier of the
// span they read next. A kernel reads the size of its dynamic shared memory
// (gpu_dyn_smem_bytes) to learn whether the host gave it room for that; elsewhere (HIP,
// older NVIDIA, CUDA toolkits before 12 (PTX 8.0), GPU_NO_BULK) GPU_BULK is undefined
// and the size reads as 0.
#if defined(GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(GPU_NO_BULK) && \
    (!defined(__CUDACC_VER_MAJOR__) || __CUDACC_VER_MAJOR__ >= 12)
#define GPU_BULK 1
extern __shared__ __attribute__((aligned(128))) unsigned char gpu_dyn_smem[];
GPU_DEV unsigned int gpu_dyn_smem_bytes() {
    unsigned int n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}
// One thread: barrier b counts one arrival a phase; the fence makes the initialised
// barrier visible to the copy engine.
GPU_DEV void gpu_mbar_init(unsigned long long* b) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(gpu_smem_addr(b)) : "memory");
}
GPU_DEV void gpu_mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// One thread: `bytes` (a multiple of 16, both addresses 16-byte aligned; 0: nothing) from
// src to dst; barrier b's phase 0 completes when they have all arrived. With HINT,
// evict-first in L2 like gpu_load_stream_*: weights only.
template <bool HINT = true>
GPU_DEV void gpu_bulk_load(void* dst, const void* src, unsigned int bytes, unsigned long long* b) {
    if (bytes == 0) {
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(gpu_smem_addr(b)) : "memory");
        return;
    }
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(gpu_smem_addr(b)), "r"(bytes)
                 : "memory");
#if defined(GPU_STREAM_HINT)
    if (HINT) {
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
            " [%0], [%1], %2, [%3], %4;" ::"r"(gpu_smem_addr(dst)),
            "l"(src), "r"(bytes), "r"(gpu_smem_addr(b)), "l"(gpu_stream_policy())
            : "memory");
        return;
    }
#endif
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     gpu_smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(gpu_smem_addr(b))
                 : "memory");
}
// Waits until barrier b's phase 0 has completed (its bytes are in shared memory).
GPU_DEV void gpu_mbar_wait(unsigned long long* b) {
    unsigned int done = 0;
    while (!done)
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(gpu_smem_addr(b))
            : "memory");
}
#else
GPU_DEV unsigned int gpu_dyn_smem_bytes() { return 0; }
#endif

// Unaligned little-endian loads from byte-packed blocks (2-byte alignment assumed).
GPU_DEV unsigned int gpu_load_u16(const unsigned char* p) {
    return (unsigned int)*(const unsigned short*)p;
}
GPU_DEV unsigned int gpu_load_u32_a2(const unsigned char* p) {
    const unsigned short* s = (const unsigned short*)p;
    return (unsigned int)s[0] | ((unsigned int)s[1] << 16);
}

// Asks L2 for `bytes` (a multiple of 16, from a 16-byte aligned p) of data no kernel of
// the step writes, so a later load finds it there; one thread's one instruction (the
// copy engine's bulk prefetch, sm_90 with GPU_BULK). Elsewhere nothing.
GPU_DEV void gpu_prefetch_l2(const void* p, unsigned int bytes) {
#if defined(GPU_BULK)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#else
    (void)p;
    (void)bytes;
#endif
}

// ---------------------------------------------------------------------------------
// hsum[h] = the sum of the 16 quantised values of half h. The mat-vec kernels of type
// 107 take qs with each half "plane-ordered" (position 4s + r holds value 4r + s, see
// rf2_half); the MMQ tiles take it in order (quantize_q8_1's `planes` picks).
struct q8_1_block {
    float d;
    short hsum[2];
    signed char qs[32];
};

// Activations: one warp per 32 values. d = amax/127, q = round(x/d), the halves' sums
// of q; planes = 1 stores each half plane-ordered (for the type-107 mat-vec kernels).
// q8_1_store: block b from its warp, lane l holding value l.
GPU_DEV void q8_1_store(float v, long long b, int lane, q8_1_block* __restrict__ out, int planes) {
    const float amax = gpu_warp_absmax(fabsf(v));
    const float d = amax / 127.0f;
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    const int q = (int)roundf(v * inv);
    // Value j = 4r + s of a half goes to position 4s + r.
    const int at = planes ? (lane & 16) | ((lane & 3) << 2) | ((lane >> 2) & 3) : lane;
    out[b].qs[at] = (signed char)q;
    int hs = q;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) hs += (int)gpu_shfl_xor((float)hs, o);
    if ((lane & 15) == 0) out[b].hsum[lane >> 4] = (short)hs;
    if (lane == 0) out[b].d = d;
}
