// Warp-level tensor-core, shared-memory matrix and async-copy primitives (sm_80+), each a thin
// inline-PTX wrapper. Fragment layouts are those of mma.m16n8k16 (lane = 4 * g + t):
//   A (16 x 16, row): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16 x 8, col):  b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C (16 x 8):       c0, c1 = (g, 2t), (g, 2t+1);  c2, c3 = (g+8, 2t), (g+8, 2t+1)
#pragma once

RTC_DEVICE uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// ---------------------------------------------------------------------------------------------
// cp.async: 16 bytes global -> shared, bypassing L1. `valid == false` writes 16 zero bytes and
// reads nothing (src must still be a valid address expression).

RTC_DEVICE void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}

RTC_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
RTC_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---------------------------------------------------------------------------------------------
// ldmatrix: four 8x8 matrices of 16-bit units; lane l gives the row address for row l % 8 of
// matrix l / 8. Without .trans, register i of lane (g, t) holds units (g, 2t), (g, 2t+1) of
// matrix i; with .trans it holds units (2t, g), (2t+1, g) (row, column of the stored matrix).

RTC_DEVICE void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

RTC_DEVICE void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {  // lanes 0-15 give the rows
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

RTC_DEVICE void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}

RTC_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Transpose an 8x8 matrix of 16-bit units held in the ldmatrix (non-trans) fragment layout.
RTC_DEVICE uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// ---------------------------------------------------------------------------------------------
// mma.sync m16n8k16 with fp32 accumulation; T is half or __nv_bfloat16.

template <typename T>
struct IsBf16 {
  static constexpr bool value = false;
};
template <>
struct IsBf16<__nv_bfloat16> {
  static constexpr bool value = true;
};

template <typename T>
RTC_DEVICE void mma_16816(float& c0, float& c1, float& c2, float& c3, const uint32_t (&a)[4],
                          uint32_t b0, uint32_t b1) {
  if constexpr (IsBf16<T>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// ---------------------------------------------------------------------------------------------
// Packing: two floats -> two 16-bit values in one register (lo in the low half), and back.

template <typename T>
RTC_DEVICE uint32_t pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (IsBf16<T>::value)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

template <typename T>
RTC_DEVICE float2 unpack2(uint32_t bits) {
  if constexpr (IsBf16<T>::value)
    return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xffff0000u));
  else
    return make_float2(__half2float(__ushort_as_half(static_cast<unsigned short>(bits))),
                       __half2float(__ushort_as_half(static_cast<unsigned short>(bits >> 16))));
}

// Two fp8 values (low byte first) -> two halves (exact: fp16 holds every e4m3/e5m2 value).
template <__nv_fp8_interpretation_t KIND>
RTC_DEVICE uint32_t fp8x2_to_half2_bits(uint32_t bits16) {
  __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bits16), KIND);
  return *reinterpret_cast<uint32_t*>(&raw);
}

// Two fp8 values (low byte first) -> two T (half or bf16; exact: both hold every fp8 value).
template <typename T, __nv_fp8_interpretation_t KIND>
RTC_DEVICE uint32_t fp8x2_to_pair(uint32_t bits16) {
  const uint32_t half2 = fp8x2_to_half2_bits<KIND>(bits16);
  if constexpr (IsBf16<T>::value) {
    const float2 f = unpack2<half>(half2);
    return pack2<T>(f.x, f.y);
  } else {
    return half2;
  }
}
