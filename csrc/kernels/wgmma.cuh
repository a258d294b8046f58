// Hopper's warpgroup MMA (wgmma, sm_90a): D (64 x N, fp32) = A (64 x 16) B (16 x N) (+ D), bf16 or fp16 inputs, A
// from a shared-memory matrix descriptor or from registers, B from a descriptor, asynchronous: issued between
// wgmma_fence() and wgmma_commit(), done at wgmma_wait<n>(). Under DCP_SIMT the executor emulates it (simt/wgmma.h:
// the shared-memory layouts, and what it checks), reading the operands and writing the accumulators at the wait, so
// a kernel that breaks the rules below gets a wrong answer (or an error) in the tests too.
//
// Fragments (PTX ISA, wgmma .m64nNk16), for thread 32 w + 4 g + t of the warpgroup (w its warp, g, t as in mma.cuh):
//   D (fp32), j < N / 8:  d[4j], d[4j+1] = D[16w+g][8j+2t, 8j+2t+1]   d[4j+2], d[4j+3] = D[16w+g+8][8j+2t, 8j+2t+1]
//   A in registers:       a[0] = A[16w+g][2t, 2t+1]    a[1] = A[16w+g+8][2t, 2t+1]
//                         a[2] = A[16w+g][2t+8, 2t+9]  a[3] = A[16w+g+8][2t+8, 2t+9]   (the lower k in the low half)
// (warp w holds rows 16w .. 16w + 15 as mma.m16n8k16's A and C fragments).
// What a kernel must keep (the GPU's rules):
//   - all 128 threads of the warpgroup run each call, with the same descriptors, N, T, transposes and scale_d;
//   - wgmma_fence before the first wgmma, and again after touching the accumulators or A registers (the executor:
//     after every wait); pass the accumulators to wgmma_fence / wgmma_wait so the compiler does not move their
//     reads and writes across the fence or the wait;
//   - the accumulator and A register arrays stay in scope and untouched, and the shared-memory operands unchanged,
//     from the issue until the wait that retires it (a read before it sees poison under the executor);
//   - shared memory written by the threads' own stores needs fence_proxy_async() (then a barrier) before a wgmma
//     reads it (not checked by the executor); dynamic shared memory 1024-byte aligned for swizzled operands.
// On the GPU: N in {8, 16, 32, 64, 96, 128, 192, 256} (the PTX operand lists are spelled out below; other N do not
// compile); sm_90a only, other architectures trap.
#pragma once

#include <type_traits>

#include "kernels/common.cuh"

#if !defined(DCP_SIMT) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DCP_WGMMA_PTX 1
#else
#define DCP_WGMMA_PTX 0
#endif

namespace dcp_ops::kernels {

// The descriptor's swizzle modes (bits 62-63).
enum WgmmaSwizzle : int { kSwizzleNone = 0, kSwizzle128B = 1, kSwizzle64B = 2, kSwizzle32B = 3 };

// The shared-memory matrix descriptor of the operand at p: start address, leading and stride dimension byte offsets
// (lbo, sbo: 16-byte multiples, meaning per layout in simt/wgmma.h), swizzle mode; matrix base offset 0 (the swizzle
// patterns start on their 8 W-byte boundaries).
__device__ __forceinline__ uint64_t make_smem_desc(const void* p, int swizzle, uint32_t lbo, uint32_t sbo) {
#ifdef DCP_SIMT
  return simt::wgmma_desc(p, swizzle, lbo, sbo);
#else
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return static_cast<uint64_t>((a & 0x3FFFF) >> 4) | static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16 |
         static_cast<uint64_t>((sbo & 0x3FFFF) >> 4) << 32 | static_cast<uint64_t>(swizzle & 3) << 62;
#endif
}

// The compiler's fence on registers the wgmmas use (CUTLASS's warpgroup_fence_operand): an empty asm that reads and
// writes each one. The wgmma asm names the accumulators, but the fence, commit and wait do not, so without it the
// compiler may move a read of d after the wait to before it, or a write of d (an initialisation, a rescale) from
// before the fence to between it and the wgmma. Nothing under the executor, whose calls are ordinary code.
template <int R>
__device__ __forceinline__ void wgmma_fence_operand(float (&d)[R]) {
#if !defined(DCP_SIMT) && defined(__CUDA_ARCH__)
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
#endif
}
template <int R>
__device__ __forceinline__ void wgmma_fence_operand(uint32_t (&a)[R]) {
#if !defined(DCP_SIMT) && defined(__CUDA_ARCH__)
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+r"(a[i])::"memory");
#endif
}

// wgmma.fence: orders the warpgroup's earlier register (and shared-memory) accesses before the wgmmas after it.
__device__ __forceinline__ void wgmma_fence() {
#ifdef DCP_SIMT
  simt::wgmma_fence();
#elif DCP_WGMMA_PTX
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#elif defined(__CUDA_ARCH__)
  __trap();  // the launchers choose wgmma kernels on sm_90a only
#endif
}
template <int R>
__device__ __forceinline__ void wgmma_fence(float (&d)[R]) {
  wgmma_fence_operand(d);
  wgmma_fence();
}

// wgmma.commit_group: the wgmmas issued since the last commit become one group.
__device__ __forceinline__ void wgmma_commit() {
#ifdef DCP_SIMT
  simt::wgmma_commit();
#elif DCP_WGMMA_PTX
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// wgmma.wait_group N: waits until at most N groups are in flight (the older ones done).
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  static_assert(N >= 0 && N <= 7, "wgmma.wait_group takes 0 to 7");
#ifdef DCP_SIMT
  simt::wgmma_wait(N);
#elif DCP_WGMMA_PTX
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}
template <int N, int R>
__device__ __forceinline__ void wgmma_wait(float (&d)[R]) {
  wgmma_wait<N>();
  wgmma_fence_operand(d);
}

// fence.proxy.async: makes this thread's ordinary stores to shared memory visible to wgmma's (async proxy) reads.
__device__ __forceinline__ void fence_proxy_async() {
#ifdef DCP_SIMT
  // the executor's wgmma reads shared memory directly
#elif DCP_WGMMA_PTX
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

#if !defined(DCP_SIMT)
// The PTX of wgmma.mma_async m64nNk16 with fp32 accumulators, one specialisation per N: inline asm needs the operand
// numbers spelled out. ss: A and B from descriptors (imm-trans-a TA, imm-trans-b TB); rs: A from 4 registers.
// scale-d is a predicate (setp from the int); imm-scale-a and imm-scale-b are 1.
template <int N>
struct WgmmaPtx {
  static_assert(N != N, "wgmma on the GPU: N in {8, 16, 32, 64, 96, 128, 192, 256} (add its operand list)");
};

#define DCP_WG_F4AT(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define DCP_WG_F16AT(d, i) DCP_WG_F4AT(d, i), DCP_WG_F4AT(d, i + 4), DCP_WG_F4AT(d, i + 8), DCP_WG_F4AT(d, i + 12)
#define DCP_WG_F4(d) DCP_WG_F4AT(d, 0)
#define DCP_WG_F8(d) DCP_WG_F4(d), DCP_WG_F4AT(d, 4)
#define DCP_WG_F16(d) DCP_WG_F8(d), DCP_WG_F4AT(d, 8), DCP_WG_F4AT(d, 12)
#define DCP_WG_F32(d) DCP_WG_F16(d), DCP_WG_F16AT(d, 16)
#define DCP_WG_F48(d) DCP_WG_F32(d), DCP_WG_F16AT(d, 32)
#define DCP_WG_F64(d) DCP_WG_F48(d), DCP_WG_F16AT(d, 48)
#define DCP_WG_F96(d) DCP_WG_F64(d), DCP_WG_F16AT(d, 64), DCP_WG_F16AT(d, 80)
#define DCP_WG_F128(d) DCP_WG_F96(d), DCP_WG_F16AT(d, 96), DCP_WG_F16AT(d, 112)

#define DCP_WG_REGS4 "%0, %1, %2, %3"
#define DCP_WG_REGS8 DCP_WG_REGS4 ", %4, %5, %6, %7"
#define DCP_WG_REGS16 DCP_WG_REGS8 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define DCP_WG_REGS32 DCP_WG_REGS16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define DCP_WG_REGS48 DCP_WG_REGS32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define DCP_WG_REGS64 DCP_WG_REGS48 ", %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define DCP_WG_REGS96                                                                                              \
  DCP_WG_REGS64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, " \
                "%83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define DCP_WG_REGS128                                                                                                \
  DCP_WG_REGS96 ", %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, " \
                "%113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// R accumulators are operands 0 .. R - 1; P0 .. P6 spell R .. R + 6, the operands after them.
#define DCP_WG_SS(N, R, TY, P0, P1, P2, P3, P4)                                                                     \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" P2 ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY \
               "." TY " {" DCP_WG_REGS##R "}, %" P0 ", %" P1 ", p, 1, 1, %" P3 ", %" P4 ";\n}\n"                  \
               : DCP_WG_F##R(d)                                                                                    \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TA), "n"(TB))
#define DCP_WG_RS(N, R, TY, P0, P1, P2, P3, P4, P5, P6)                                                             \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" P5 ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY \
               "." TY " {" DCP_WG_REGS##R "}, {%" P0 ", %" P1 ", %" P2 ", %" P3 "}, %" P4 ", p, 1, 1, %" P6       \
               ";\n}\n"                                                                                            \
               : DCP_WG_F##R(d)                                                                                    \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(TB))
#define DCP_WG_PTX(N, R, P0, P1, P2, P3, P4, P5, P6)                                                               \
  template <>                                                                                                     \
  struct WgmmaPtx<N> {                                                                                            \
    template <bool BF16, int TA, int TB>                                                                          \
    __device__ __forceinline__ static void ss(float (&d)[R], uint64_t desc_a, uint64_t desc_b, int scale_d) {     \
      if constexpr (BF16)                                                                                         \
        DCP_WG_SS(N, R, "bf16", P0, P1, P2, P3, P4);                                                              \
      else                                                                                                        \
        DCP_WG_SS(N, R, "f16", P0, P1, P2, P3, P4);                                                               \
    }                                                                                                             \
    template <bool BF16, int TB>                                                                                  \
    __device__ __forceinline__ static void rs(float (&d)[R], const uint32_t (&a)[4], uint64_t desc_b,            \
                                              int scale_d) {                                                      \
      if constexpr (BF16)                                                                                         \
        DCP_WG_RS(N, R, "bf16", P0, P1, P2, P3, P4, P5, P6);                                                      \
      else                                                                                                        \
        DCP_WG_RS(N, R, "f16", P0, P1, P2, P3, P4, P5, P6);                                                       \
    }                                                                                                             \
  };

DCP_WG_PTX(8, 4, "4", "5", "6", "7", "8", "9", "10")
DCP_WG_PTX(16, 8, "8", "9", "10", "11", "12", "13", "14")
DCP_WG_PTX(32, 16, "16", "17", "18", "19", "20", "21", "22")
DCP_WG_PTX(64, 32, "32", "33", "34", "35", "36", "37", "38")
DCP_WG_PTX(96, 48, "48", "49", "50", "51", "52", "53", "54")
DCP_WG_PTX(128, 64, "64", "65", "66", "67", "68", "69", "70")
DCP_WG_PTX(192, 96, "96", "97", "98", "99", "100", "101", "102")
DCP_WG_PTX(256, 128, "128", "129", "130", "131", "132", "133", "134")
#endif

// D = A B (+ D when scale_d != 0) over k16, A (64 x 16) and B (16 x N) from descriptors: K-major, or MN-major with
// TRANS_A / TRANS_B (imm-trans-a / -b). Asynchronous: d is written at the wgmma_wait that retires it.
template <int N, typename T, bool TRANS_B, bool TRANS_A = false>
__device__ __forceinline__ void wgmma_m64nNk16(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  static_assert(N >= 8 && N <= 256 && N % 8 == 0, "wgmma m64nNk16: N is a multiple of 8 from 8 to 256");
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "wgmma: bf16 or fp16 inputs");
#ifdef DCP_SIMT
  simt::wgmma_issue({desc_a, desc_b, N, scale_d, std::is_same_v<T, __nv_bfloat16>, false, TRANS_A, TRANS_B, d,
                     nullptr});
#elif DCP_WGMMA_PTX
  WgmmaPtx<N>::template ss<std::is_same_v<T, __nv_bfloat16>, TRANS_A, TRANS_B>(d, desc_a, desc_b, scale_d);
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// The same with A from registers (the fragment above, K-major): a stays untouched until the wait.
template <int N, typename T, bool TRANS_B>
__device__ __forceinline__ void wgmma_m64nNk16(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b,
                                               int scale_d) {
  static_assert(N >= 8 && N <= 256 && N % 8 == 0, "wgmma m64nNk16: N is a multiple of 8 from 8 to 256");
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "wgmma: bf16 or fp16 inputs");
#ifdef DCP_SIMT
  simt::wgmma_issue({0, desc_b, N, scale_d, std::is_same_v<T, __nv_bfloat16>, true, false, TRANS_B, d, a});
#elif DCP_WGMMA_PTX
  WgmmaPtx<N>::template rs<std::is_same_v<T, __nv_bfloat16>, TRANS_B>(d, a, desc_b, scale_d);
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

}  // namespace dcp_ops::kernels
