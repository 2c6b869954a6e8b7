// Hopper's warpgroup MMA (wgmma, sm_90a only): a warpgroup of 4 consecutive warps computes a
// 64-row product asynchronously, B always from shared memory, A from shared memory or from
// registers. Operand tiles in shared memory use the 128-byte-swizzled canonical layout
// (paged_kv.cuh's wgmma_tile_offset): 64-element column blocks of 128-byte rows one after another, chunk c of
// row r of a block at 16 (c ^ r % 8); a descriptor gives the block's start, the stride between
// 8-row groups (1024 bytes) and, for an MN-major operand, the stride between column blocks.
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

// D[64 x 64] (+)= A[64 x 16] B[16 x 64]: A and B K-major in shared memory (descriptors a, b);
// d[4i + r] is n-tile i in the C layout of mma.m16n8k16 for the thread's warp's 16 rows.
#define RTC_WGMMA_SS_N64(TYPES) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32" TYPES " {" \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), \
        "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), \
        "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), \
        "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), \
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), \
        "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), \
        "+f"(d[7][2]), "+f"(d[7][3]) \
      : "l"(a), "l"(b), "r"(int(accumulate)))
template <typename MT>
RTC_DEVICE void wgmma_ss_n64(float (&d)[8][4], uint64_t a, uint64_t b, bool accumulate) {
  if constexpr (IsBf16<MT>::value) RTC_WGMMA_SS_N64(".bf16.bf16");
  else RTC_WGMMA_SS_N64(".f16.f16");
}

// D[64 x 64] += A[64 x 16] B[16 x 64]: A from registers (each warp's mma.m16n8k16 A fragment of
// its 16 rows), B MN-major in shared memory (descriptor b). lo / hi: rows g / g + 8 of the thread's
// warp, dims 8i + 2t and 8i + 2t + 1 at [2i] and [2i + 1].
#define RTC_WGMMA_RS_N64(TYPES) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32" TYPES " {" \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n" \
      : "+f"(lo[0]), "+f"(lo[1]), "+f"(hi[0]), "+f"(hi[1]), "+f"(lo[2]), "+f"(lo[3]), \
        "+f"(hi[2]), "+f"(hi[3]), "+f"(lo[4]), "+f"(lo[5]), "+f"(hi[4]), "+f"(hi[5]), \
        "+f"(lo[6]), "+f"(lo[7]), "+f"(hi[6]), "+f"(hi[7]), "+f"(lo[8]), "+f"(lo[9]), \
        "+f"(hi[8]), "+f"(hi[9]), "+f"(lo[10]), "+f"(lo[11]), "+f"(hi[10]), "+f"(hi[11]), \
        "+f"(lo[12]), "+f"(lo[13]), "+f"(hi[12]), "+f"(hi[13]), "+f"(lo[14]), "+f"(lo[15]), \
        "+f"(hi[14]), "+f"(hi[15]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1))
template <typename MT>
RTC_DEVICE void wgmma_rs_n64(float (&lo)[16], float (&hi)[16], const uint32_t (&a)[4],
                              uint64_t b) {
  if constexpr (IsBf16<MT>::value) RTC_WGMMA_RS_N64(".bf16.bf16");
  else RTC_WGMMA_RS_N64(".f16.f16");
}

// D[64 x 128] += A[64 x 16] B[16 x 128]: A from registers (each warp's mma.m16n8k16 A fragment of
// its 16 rows), B MN-major in shared memory (descriptor b). lo / hi: rows g / g + 8 of the thread's
// warp, dims 8i + 2t and 8i + 2t + 1 at [2i] and [2i + 1].
#define RTC_WGMMA_RS_N128(TYPES) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32" TYPES " {" \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, " \
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, " \
      "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
      : "+f"(lo[0]), "+f"(lo[1]), "+f"(hi[0]), "+f"(hi[1]), "+f"(lo[2]), "+f"(lo[3]), \
        "+f"(hi[2]), "+f"(hi[3]), "+f"(lo[4]), "+f"(lo[5]), "+f"(hi[4]), "+f"(hi[5]), \
        "+f"(lo[6]), "+f"(lo[7]), "+f"(hi[6]), "+f"(hi[7]), "+f"(lo[8]), "+f"(lo[9]), \
        "+f"(hi[8]), "+f"(hi[9]), "+f"(lo[10]), "+f"(lo[11]), "+f"(hi[10]), "+f"(hi[11]), \
        "+f"(lo[12]), "+f"(lo[13]), "+f"(hi[12]), "+f"(hi[13]), "+f"(lo[14]), "+f"(lo[15]), \
        "+f"(hi[14]), "+f"(hi[15]), "+f"(lo[16]), "+f"(lo[17]), "+f"(hi[16]), "+f"(hi[17]), \
        "+f"(lo[18]), "+f"(lo[19]), "+f"(hi[18]), "+f"(hi[19]), "+f"(lo[20]), "+f"(lo[21]), \
        "+f"(hi[20]), "+f"(hi[21]), "+f"(lo[22]), "+f"(lo[23]), "+f"(hi[22]), "+f"(hi[23]), \
        "+f"(lo[24]), "+f"(lo[25]), "+f"(hi[24]), "+f"(hi[25]), "+f"(lo[26]), "+f"(lo[27]), \
        "+f"(hi[26]), "+f"(hi[27]), "+f"(lo[28]), "+f"(lo[29]), "+f"(hi[28]), "+f"(hi[29]), \
        "+f"(lo[30]), "+f"(lo[31]), "+f"(hi[30]), "+f"(hi[31]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1))
template <typename MT>
RTC_DEVICE void wgmma_rs_n128(float (&lo)[32], float (&hi)[32], const uint32_t (&a)[4],
                              uint64_t b) {
  if constexpr (IsBf16<MT>::value) RTC_WGMMA_RS_N128(".bf16.bf16");
  else RTC_WGMMA_RS_N128(".f16.f16");
}

// D[64 x 256] += A[64 x 16] B[16 x 256]: A from registers (each warp's mma.m16n8k16 A fragment of
// its 16 rows), B MN-major in shared memory (descriptor b). lo / hi: rows g / g + 8 of the thread's
// warp, dims 8i + 2t and 8i + 2t + 1 at [2i] and [2i + 1].
#define RTC_WGMMA_RS_N256(TYPES) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32" TYPES " {" \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, " \
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, " \
      "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, " \
      "%70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, " \
      "%87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, " \
      "%103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, " \
      "%117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n" \
      : "+f"(lo[0]), "+f"(lo[1]), "+f"(hi[0]), "+f"(hi[1]), "+f"(lo[2]), "+f"(lo[3]), \
        "+f"(hi[2]), "+f"(hi[3]), "+f"(lo[4]), "+f"(lo[5]), "+f"(hi[4]), "+f"(hi[5]), \
        "+f"(lo[6]), "+f"(lo[7]), "+f"(hi[6]), "+f"(hi[7]), "+f"(lo[8]), "+f"(lo[9]), \
        "+f"(hi[8]), "+f"(hi[9]), "+f"(lo[10]), "+f"(lo[11]), "+f"(hi[10]), "+f"(hi[11]), \
        "+f"(lo[12]), "+f"(lo[13]), "+f"(hi[12]), "+f"(hi[13]), "+f"(lo[14]), "+f"(lo[15]), \
        "+f"(hi[14]), "+f"(hi[15]), "+f"(lo[16]), "+f"(lo[17]), "+f"(hi[16]), "+f"(hi[17]), \
        "+f"(lo[18]), "+f"(lo[19]), "+f"(hi[18]), "+f"(hi[19]), "+f"(lo[20]), "+f"(lo[21]), \
        "+f"(hi[20]), "+f"(hi[21]), "+f"(lo[22]), "+f"(lo[23]), "+f"(hi[22]), "+f"(hi[23]), \
        "+f"(lo[24]), "+f"(lo[25]), "+f"(hi[24]), "+f"(hi[25]), "+f"(lo[26]), "+f"(lo[27]), \
        "+f"(hi[26]), "+f"(hi[27]), "+f"(lo[28]), "+f"(lo[29]), "+f"(hi[28]), "+f"(hi[29]), \
        "+f"(lo[30]), "+f"(lo[31]), "+f"(hi[30]), "+f"(hi[31]), "+f"(lo[32]), "+f"(lo[33]), \
        "+f"(hi[32]), "+f"(hi[33]), "+f"(lo[34]), "+f"(lo[35]), "+f"(hi[34]), "+f"(hi[35]), \
        "+f"(lo[36]), "+f"(lo[37]), "+f"(hi[36]), "+f"(hi[37]), "+f"(lo[38]), "+f"(lo[39]), \
        "+f"(hi[38]), "+f"(hi[39]), "+f"(lo[40]), "+f"(lo[41]), "+f"(hi[40]), "+f"(hi[41]), \
        "+f"(lo[42]), "+f"(lo[43]), "+f"(hi[42]), "+f"(hi[43]), "+f"(lo[44]), "+f"(lo[45]), \
        "+f"(hi[44]), "+f"(hi[45]), "+f"(lo[46]), "+f"(lo[47]), "+f"(hi[46]), "+f"(hi[47]), \
        "+f"(lo[48]), "+f"(lo[49]), "+f"(hi[48]), "+f"(hi[49]), "+f"(lo[50]), "+f"(lo[51]), \
        "+f"(hi[50]), "+f"(hi[51]), "+f"(lo[52]), "+f"(lo[53]), "+f"(hi[52]), "+f"(hi[53]), \
        "+f"(lo[54]), "+f"(lo[55]), "+f"(hi[54]), "+f"(hi[55]), "+f"(lo[56]), "+f"(lo[57]), \
        "+f"(hi[56]), "+f"(hi[57]), "+f"(lo[58]), "+f"(lo[59]), "+f"(hi[58]), "+f"(hi[59]), \
        "+f"(lo[60]), "+f"(lo[61]), "+f"(hi[60]), "+f"(hi[61]), "+f"(lo[62]), "+f"(lo[63]), \
        "+f"(hi[62]), "+f"(hi[63]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1))
template <typename MT>
RTC_DEVICE void wgmma_rs_n256(float (&lo)[64], float (&hi)[64], const uint32_t (&a)[4],
                              uint64_t b) {
  if constexpr (IsBf16<MT>::value) RTC_WGMMA_RS_N256(".bf16.bf16");
  else RTC_WGMMA_RS_N256(".f16.f16");
}

template <int N>
RTC_DEVICE void wgmma_hold(float (&x)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) wgmma_hold(x[i]);
}

// O += A B over N = 64, 128 or 256 dims (wgmma_rs_n64/128/256).
template <typename MT, int N>
RTC_DEVICE void wgmma_rs(float (&lo)[N / 4], float (&hi)[N / 4], const uint32_t (&a)[4],
                         uint64_t b) {
  static_assert(N == 64 || N == 128 || N == 256, "n 64, 128 or 256");
  if constexpr (N == 64)
    wgmma_rs_n64<MT>(lo, hi, a, b);
  else if constexpr (N == 128)
    wgmma_rs_n128<MT>(lo, hi, a, b);
  else
    wgmma_rs_n256<MT>(lo, hi, a, b);
}
