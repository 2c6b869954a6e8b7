// Basics shared by every kernel: fixed-width ints, 16-byte vectors, dtype conversions,
// warp and block reductions. NVRTC-clean: only the CUDA runtime's fp16/bf16/fp8 headers.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;

#define RTC_DEVICE __device__ __forceinline__

// A TMA descriptor (cuda.h's CUtensorMap, which NVRTC does not see): 128 opaque bytes, passed
// by value in a kernel's __grid_constant__ parameter struct and built on the host.
struct alignas(64) CUtensorMap {
  unsigned long long opaque[16];
};

// Conditional<B, T, F> is T when B holds, else F (no <type_traits> under NVRTC).
template <bool B, typename T, typename F>
struct ConditionalType {
  using type = T;
};
template <typename T, typename F>
struct ConditionalType<false, T, F> {
  using type = F;
};
template <bool B, typename T, typename F>
using Conditional = typename ConditionalType<B, T, F>::type;

// Bool<B>: a compile-time flag as a type (a generic lambda's `if constexpr (decltype(f)::value)`).
template <bool B>
struct Bool {
  static constexpr bool value = B;
};

// IsSame<A, B>::value: whether A and B are the same type.
template <typename A, typename B>
struct IsSame {
  static constexpr bool value = false;
};
template <typename A>
struct IsSame<A, A> {
  static constexpr bool value = true;
};

// Whether T is one of the fp8 types, and its conversion kind.
template <typename T>
constexpr bool is_fp8() {
  return IsSame<T, __nv_fp8_e4m3>::value || IsSame<T, __nv_fp8_e5m2>::value;
}
template <typename T>
constexpr __nv_fp8_interpretation_t fp8_kind() {
  return IsSame<T, __nv_fp8_e5m2>::value ? __NV_E5M2 : __NV_E4M3;
}

// ---------------------------------------------------------------------------------------------
// dtype conversions (compute is fp32)

RTC_DEVICE float to_float(float x) { return x; }
RTC_DEVICE float to_float(half x) { return __half2float(x); }
RTC_DEVICE float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
RTC_DEVICE float to_float(__nv_fp8_e4m3 x) { return float(x); }
RTC_DEVICE float to_float(__nv_fp8_e5m2 x) { return float(x); }

template <typename T>
RTC_DEVICE T from_float(float x);
template <>
RTC_DEVICE float from_float<float>(float x) { return x; }
template <>
RTC_DEVICE half from_float<half>(float x) { return __float2half_rn(x); }
template <>
RTC_DEVICE __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
RTC_DEVICE __nv_fp8_e4m3 from_float<__nv_fp8_e4m3>(float x) { return __nv_fp8_e4m3(x); }
template <>
RTC_DEVICE __nv_fp8_e5m2 from_float<__nv_fp8_e5m2>(float x) { return __nv_fp8_e5m2(x); }

// Two fp8 values (packed in 16 bits, low byte first) to two halves in one instruction.
RTC_DEVICE __half2 fp8x2_to_half2(uint16_t bits, __nv_fp8_interpretation_t kind) {
  __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(bits, kind);
  return *reinterpret_cast<__half2*>(&raw);
}

// ---------------------------------------------------------------------------------------------
// N elements of T as one register bundle, loaded with 16-byte (or narrower) accesses: its
// alignment is min(16, sizeof(T) * N) bytes.

template <typename T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Vec {
  T v[N];
  RTC_DEVICE T& operator[](int i) { return v[i]; }
  RTC_DEVICE const T& operator[](int i) const { return v[i]; }

  RTC_DEVICE void load(const T* ptr) { *this = *reinterpret_cast<const Vec*>(ptr); }
  RTC_DEVICE void store(T* ptr) const { *reinterpret_cast<Vec*>(ptr) = *this; }

  // Loads that skip L1 allocation: for data read exactly once (streaming ops).
  RTC_DEVICE void load_stream(const T* ptr) {
    if constexpr (sizeof(Vec) == 16) {
      uint32_t* r = reinterpret_cast<uint32_t*>(v);
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                   : "l"(ptr));
    } else {
      load(ptr);
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Reductions

RTC_DEVICE float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

RTC_DEVICE float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// Sums N values over a block of THREADS threads in place: every thread gets the N totals.
// `scratch` holds N x 32 floats and may be reused after the call returns.
template <int THREADS, int N = 1>
RTC_DEVICE void block_sum(float (&x)[N], float (*scratch)[32]) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "block of whole warps");
  constexpr int WARPS = THREADS / 32;
#pragma unroll
  for (int n = 0; n < N; ++n) x[n] = warp_sum(x[n]);
  if constexpr (WARPS == 1) return;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0)
#pragma unroll
    for (int n = 0; n < N; ++n) scratch[n][warp] = x[n];
  __syncthreads();
#pragma unroll
  for (int n = 0; n < N; ++n) x[n] = warp_sum(lane < WARPS ? scratch[n][lane] : 0.f);
  __syncthreads();
}

// One value summed over the block (see above).
template <int THREADS>
RTC_DEVICE float block_sum(float x, float (*scratch)[32]) {
  float v[1] = {x};
  block_sum<THREADS, 1>(v, scratch);
  return v[0];
}

// ---------------------------------------------------------------------------------------------
// Math

RTC_DEVICE float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

RTC_DEVICE float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

constexpr float LOG2E = 1.4426950408889634f;

// ---------------------------------------------------------------------------------------------
// Synchronization

// Programmatic dependent launch (sm_90+). Every kernel calls this first, before it touches
// global memory: it waits until the grids this launch depends on (the kernel before it on the
// stream, when the host launched it as dependent: rtcinfer/launch.py) have finished and their
// writes are visible, then lets the kernel after it be scheduled while this grid runs, so that
// kernel's launch and its wait overlap this one's last CTAs instead of following them. A
// launch made without the dependency attribute, or before sm_90, does not wait here.
RTC_DEVICE void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// atomicAdd with acquire-release semantics at GPU scope: one instruction in place of a fence on
// each side of a relaxed atomic. Returns the old value.
RTC_DEVICE int atomic_add_acq_rel(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// ---------------------------------------------------------------------------------------------
// Asynchronous global -> shared copies (sm_80+): data in flight costs no registers.

// Copies one Vec from global to shared memory: cp.async for 4, 8 or 16 bytes, else a plain
// load and store. The copying thread may read it back after cp_async_wait_all().
template <typename V>
RTC_DEVICE void copy_async(V* smem_dst, const V* gmem_src) {
  constexpr int BYTES = sizeof(V);
  if constexpr (BYTES == 16) {
    const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem_src));
  } else if constexpr (BYTES == 8 || BYTES == 4) {
    const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(dst), "l"(gmem_src),
                 "n"(BYTES));
  } else {
    *smem_dst = *gmem_src;
  }
}

RTC_DEVICE void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
}
