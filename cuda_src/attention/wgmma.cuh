// Hopper's warpgroup MMA (wgmma, sm_90a only): a warpgroup of 4 consecutive warps computes a
// 64-row product asynchronously, B always from shared memory, A from shared memory or from
// registers. Operand tiles in shared memory use the 128-byte-swizzled canonical layout
// (paged_kv.cuh's wgmma_tile_offset): 64-element column blocks of 128-byte rows one after
// another, chunk c of row r of a block at 16 (c ^ r % 8); a descriptor gives the block's start,
// the stride between 8-row groups (1024 bytes) and, for an MN-major operand, the stride between
// column blocks.
// Ordering: wgmma_fence() before the first wgmma that reads registers other code wrote;
// commit, then wait before the accumulators are read (wgmma_hold keeps the compiler from
// moving their uses above the wait); cp.async and ordinary stores to a tile a wgmma reads need
// fence_proxy_async() in each writing thread before the barrier that publishes them.
#pragma once

// A shared-memory matrix descriptor, 128-byte swizzle: start address, leading byte offset
// (MN-major: between 64-element column blocks; K-major: unused), stride byte offset (between
// 8-row groups).
RTC_DEVICE uint64_t wgmma_desc(uint32_t addr, uint32_t leading_bytes, uint32_t stride_bytes) {
  return static_cast<uint64_t>((addr & 0x3ffff) >> 4) |
         static_cast<uint64_t>(leading_bytes >> 4) << 16 |
         static_cast<uint64_t>(stride_bytes >> 4) << 32 | 1ull << 62;
}

RTC_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
RTC_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
RTC_DEVICE void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
RTC_DEVICE void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// The registers x, as the compiler sees them, redefined here: their reads stay below a wait.
template <int N>
RTC_DEVICE void wgmma_hold(float (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(x[i])::"memory");
}

// wgmma's operand lists spelled out (PTX names every accumulator register): the accumulator
// registers %0.. of 32, 64 and 128-float products, and the accumulator operands of 8 n-tiles (64
// columns) from n-tile i: wgmma_ss's d[i][0..3]; wgmma_rs's rows g / g + 8 of dims 8i + 2t and
// 8i + 2t + 1, lo / hi [2i] and [2i + 1].
#define RTC_WG_REGS32 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
  ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define RTC_WG_REGS64 RTC_WG_REGS32 \
  ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47" \
  ", %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define RTC_WG_REGS128 RTC_WG_REGS64 \
  ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75" \
  ", %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87" \
  ", %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99" \
  ", %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111" \
  ", %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123" \
  ", %124, %125, %126, %127"
#define RTC_WG_D(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define RTC_WG_D8(i) RTC_WG_D(i), RTC_WG_D(i + 1), RTC_WG_D(i + 2), RTC_WG_D(i + 3), \
  RTC_WG_D(i + 4), RTC_WG_D(i + 5), RTC_WG_D(i + 6), RTC_WG_D(i + 7)
#define RTC_WG_O(i) \
  "+f"(lo[2 * (i)]), "+f"(lo[2 * (i) + 1]), "+f"(hi[2 * (i)]), "+f"(hi[2 * (i) + 1])
#define RTC_WG_O8(i) RTC_WG_O(i), RTC_WG_O(i + 1), RTC_WG_O(i + 2), RTC_WG_O(i + 3), \
  RTC_WG_O(i + 4), RTC_WG_O(i + 5), RTC_WG_O(i + 6), RTC_WG_O(i + 7)

// D[64 x 64] (+)= A[64 x 16] B[16 x 64]: A and B K-major in shared memory (descriptors a, b);
// d[n] is n-tile n in the C layout of mma.m16n8k16 for the thread's warp's 16 rows.
#define RTC_WGMMA_SS_N64(TYPES) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32" TYPES " {" RTC_WG_REGS32 \
               "}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
               : RTC_WG_D8(0) \
               : "l"(a), "l"(b), "r"(int(accumulate)))
template <typename MT>
RTC_DEVICE void wgmma_ss_n64(float (&d)[8][4], uint64_t a, uint64_t b, bool accumulate) {
  if constexpr (IsBf16<MT>::value)
    RTC_WGMMA_SS_N64(".bf16.bf16");
  else
    RTC_WGMMA_SS_N64(".f16.f16");
}

// D[64 x N] += A[64 x 16] B[16 x N], N = 64, 128 or 256: A from registers (each warp's
// mma.m16n8k16 A fragment of its 16 rows), B MN-major in shared memory (descriptor b). REGS,
// then the A registers, the descriptor and the predicate's operand numbers; the accumulators.
#define RTC_WGMMA_RS(N, TYPES, REGS, A, B, P, ...) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " P ", 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32" TYPES " {" REGS "}, {" A \
               "}, " B ", p, 1, 1, 1;\n}\n" \
               : __VA_ARGS__ \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1))
#define RTC_WGMMA_RS_N64(TYPES) \
  RTC_WGMMA_RS(64, TYPES, RTC_WG_REGS32, "%32, %33, %34, %35", "%36", "%37", RTC_WG_O8(0))
#define RTC_WGMMA_RS_N128(TYPES) \
  RTC_WGMMA_RS(128, TYPES, RTC_WG_REGS64, "%64, %65, %66, %67", "%68", "%69", RTC_WG_O8(0), \
               RTC_WG_O8(8))
#define RTC_WGMMA_RS_N256(TYPES) \
  RTC_WGMMA_RS(256, TYPES, RTC_WG_REGS128, "%128, %129, %130, %131", "%132", "%133", \
               RTC_WG_O8(0), RTC_WG_O8(8), RTC_WG_O8(16), RTC_WG_O8(24))

// O += A B over N = 64, 128 or 256 dims: lo / hi hold N / 4 floats each.
template <typename MT, int N>
RTC_DEVICE void wgmma_rs(float (&lo)[N / 4], float (&hi)[N / 4], const uint32_t (&a)[4],
                         uint64_t b) {
  static_assert(N == 64 || N == 128 || N == 256, "n 64, 128 or 256");
  constexpr bool BF16 = IsBf16<MT>::value;
  if constexpr (N == 64 && BF16)
    RTC_WGMMA_RS_N64(".bf16.bf16");
  else if constexpr (N == 64)
    RTC_WGMMA_RS_N64(".f16.f16");
  else if constexpr (N == 128 && BF16)
    RTC_WGMMA_RS_N128(".bf16.bf16");
  else if constexpr (N == 128)
    RTC_WGMMA_RS_N128(".f16.f16");
  else if constexpr (BF16)
    RTC_WGMMA_RS_N256(".bf16.bf16");
  else
    RTC_WGMMA_RS_N256(".f16.f16");
}

template <int N>
RTC_DEVICE void wgmma_hold(float (&x)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) wgmma_hold(x[i]);
}

