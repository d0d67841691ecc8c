// Stand-in for the device half of cuda_runtime.h / hip_runtime.h, so that
// kernels/check.sh can compile kernels/gpu with a bare clang (-nocudainc / -nogpuinc,
// no CUDA or ROCm installed). It declares only what the kernels use; the real
// toolchains (NVRTC, nvcc, hiprtc, hipcc) never see this file.
#pragma once

#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __host__ __attribute__((host))
#define __shared__ __attribute__((shared))
#define __constant__ __attribute__((constant))
#define __forceinline__ __inline__ __attribute__((always_inline))
#if defined(__HIP__)
// As hip_runtime.h defines it: the block size bounds the flat work-group size (without
// it clang assumes 1024 threads and caps a kernel at 192 VGPRs on gfx11, spilling
// kernels the real hiprtc build does not), and a second argument is the least waves
// per execution unit (not CUDA's blocks per multiprocessor).
#define RF_SHIM_LB1(t) __attribute__((amdgpu_flat_work_group_size(1, t)))
#define RF_SHIM_LB2(t, w) __attribute__((amdgpu_flat_work_group_size(1, t), amdgpu_waves_per_eu(w)))
#define RF_SHIM_LB_PICK(_1, _2, name, ...) name
#define __launch_bounds__(...) RF_SHIM_LB_PICK(__VA_ARGS__, RF_SHIM_LB2, RF_SHIM_LB1, )(__VA_ARGS__)
#else
#define __launch_bounds__(...) __attribute__((launch_bounds(__VA_ARGS__)))
#endif

#if defined(__HIP__)
struct rf_shim_tid {
    __device__ unsigned int get_x() const { return __builtin_amdgcn_workitem_id_x(); }
    __device__ unsigned int get_y() const { return __builtin_amdgcn_workitem_id_y(); }
    __declspec(property(get = get_x)) unsigned int x;
    __declspec(property(get = get_y)) unsigned int y;
};
struct rf_shim_bid {
    __device__ unsigned int get_x() const { return __builtin_amdgcn_workgroup_id_x(); }
    __device__ unsigned int get_y() const { return __builtin_amdgcn_workgroup_id_y(); }
    __device__ unsigned int get_z() const { return __builtin_amdgcn_workgroup_id_z(); }
    __declspec(property(get = get_x)) unsigned int x;
    __declspec(property(get = get_y)) unsigned int y;
    __declspec(property(get = get_z)) unsigned int z;
};
static __device__ const rf_shim_tid threadIdx;
static __device__ const rf_shim_bid blockIdx;
struct rf_shim_bdim {
    __device__ unsigned int get_x() const { return __builtin_amdgcn_workgroup_size_x(); }
    __declspec(property(get = get_x)) unsigned int x;
};
static __device__ const rf_shim_bdim blockDim;
struct rf_shim_gdim {
    __device__ unsigned int get_x() const { return __builtin_amdgcn_grid_size_x() / __builtin_amdgcn_workgroup_size_x(); }
    __device__ unsigned int get_y() const { return __builtin_amdgcn_grid_size_y() / __builtin_amdgcn_workgroup_size_y(); }
    __device__ unsigned int get_z() const { return __builtin_amdgcn_grid_size_z() / __builtin_amdgcn_workgroup_size_z(); }
    __declspec(property(get = get_x)) unsigned int x;
    __declspec(property(get = get_y)) unsigned int y;
    __declspec(property(get = get_z)) unsigned int z;
};
static __device__ const rf_shim_gdim gridDim;

static __device__ inline void __syncthreads() {
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
    __builtin_amdgcn_s_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}
static __device__ inline float __shfl_xor(float v, int mask, int width) {
    const int lane = (int)__builtin_amdgcn_mbcnt_lo(~0u, 0u);
    const int src = ((lane ^ mask) & (width - 1)) | (lane & ~(width - 1));
    return __builtin_bit_cast(float, __builtin_amdgcn_ds_bpermute(src << 2, __builtin_bit_cast(int, v)));
}
static __device__ inline float __shfl(float v, int src, int width) {
    const int lane = (int)__builtin_amdgcn_mbcnt_lo(~0u, 0u);
    const int from = (src & (width - 1)) | (lane & ~(width - 1));
    return __builtin_bit_cast(float, __builtin_amdgcn_ds_bpermute(from << 2, __builtin_bit_cast(int, v)));
}
static __device__ inline unsigned long long __ballot(int p) { return __builtin_amdgcn_ballot_w32(p != 0); }
static __device__ inline int __popc(unsigned int x) { return __builtin_popcount(x); }
#else
#include <__clang_cuda_builtin_vars.h>
// __syncthreads is a clang builtin for NVPTX.
static __device__ inline float __shfl_xor_sync(unsigned int mask, float v, int lane, int width) {
    return __nvvm_shfl_sync_bfly_f32(mask, v, lane, ((32 - width) << 8) | 0x1f);
}
static __device__ inline float __shfl_sync(unsigned int mask, float v, int src, int width) {
    return __nvvm_shfl_sync_idx_f32(mask, v, src, ((32 - width) << 8) | 0x1f);
}
static __device__ inline int __dp4a(int a, int b, int c) {
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
static __device__ inline unsigned int __ballot_sync(unsigned int mask, int p) {
    return __nvvm_vote_ballot_sync(mask, p);
}
static __device__ inline int __popc(unsigned int x) { return __builtin_popcount(x); }
static __device__ inline void __syncwarp() { __nvvm_bar_warp_sync(0xffffffffu); }
static __device__ inline float __fmul_rn(float a, float b) { return __nvvm_mul_rn_f(a, b); }
static __device__ inline float __fadd_rn(float a, float b) { return __nvvm_add_rn_f(a, b); }
static __device__ inline float __fsub_rn(float a, float b) { return __nvvm_add_rn_f(a, -b); }
#endif

#if defined(__HIP__)
static __device__ inline void __threadfence() { __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "agent"); }
static __device__ inline void __threadfence_block() {
    __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "workgroup");
}
#else
static __device__ inline void __threadfence() { __nvvm_membar_gl(); }
static __device__ inline void __threadfence_block() { __nvvm_membar_cta(); }
#endif
static __device__ inline unsigned int atomicAdd(unsigned int* p, unsigned int v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
static __device__ inline int atomicAdd(int* p, int v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
static __device__ inline unsigned int atomicMin(unsigned int* p, unsigned int v) {
    return __atomic_fetch_min(p, v, __ATOMIC_RELAXED);
}
static __device__ inline unsigned int atomicMax(unsigned int* p, unsigned int v) {
    return __atomic_fetch_max(p, v, __ATOMIC_RELAXED);
}
static __device__ inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned int)x); }
static __device__ inline int __ffs(int x) { return __builtin_ffs(x); }
static __device__ inline float __int_as_float(int v) { return __builtin_bit_cast(float, v); }
static __device__ inline float roundf(float x) { return __builtin_roundf(x); }
static __device__ inline float fabsf(float x) { return __builtin_fabsf(x); }
static __device__ inline float fmaxf(float a, float b) { return __builtin_fmaxf(a, b); }
static __device__ inline float fmaf(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
static __device__ inline int __float_as_int(float v) { return __builtin_bit_cast(int, v); }
static __device__ inline float fminf(float a, float b) { return __builtin_fminf(a, b); }
// Libm-style device functions (the real toolchains supply exact ones): AMD objects are
// linked, so they get builtins; NVPTX only needs declarations.
#if defined(__HIP__)
static __device__ inline float expf(float x) { return __builtin_expf(x); }
static __device__ inline float sqrtf(float x) { return __builtin_sqrtf(x); }
static __device__ inline float cosf(float x) { return __builtin_cosf(x); }
static __device__ inline float sinf(float x) { return __builtin_sinf(x); }
static __device__ inline float log1pf(float x) { return __builtin_logf(1.0f + x); }
#else
extern "C" __device__ float expf(float);
extern "C" __device__ float sqrtf(float);
extern "C" __device__ float cosf(float);
extern "C" __device__ float sinf(float);
extern "C" __device__ float log1pf(float);
#endif
