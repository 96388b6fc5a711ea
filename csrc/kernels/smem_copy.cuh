// Global words into shared memory without holding a register, for kernels whose time is latency:
// the copies are issued early and awaited only where their data is needed. On sm_90 one thread
// issues a bulk copy (cp.async.bulk) per array, completing on an mbarrier; elsewhere every thread
// copies words with cp.async. Raw pointers only (no torch headers).
#pragma once
#include <cuda_pipeline.h>

#include <cstdint>

namespace hisparse {

// A load of a read-only input (.nc) through inline PTX: with an exit test that uses every such
// value (select_resolve_kernel's), its load is issued with the others, not after the exit.
__device__ __forceinline__ int64_t ld_now(const int64_t* p) {
  int64_t v;
  asm volatile("ld.global.nc.s64 %0, [%1];" : "=l"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define HISPARSE_BULK_STATE 1
#else
#define HISPARSE_BULK_STATE 0
#endif

// src[0, n) into the shared-memory area dst_area (n rounded up to 4, plus 8 words): on sm_90
// thread 0 issues a bulk copy of the 16-byte lines that hold src[0, n) and adds its bytes to *tx;
// the data then starts (src's word offset within its line) words into dst_area, the pointer
// returned. Reads stay within src's 16-byte lines (torch's allocations are 512-byte aligned).
// Nsight Compute showed the per-word cp.async loop of every thread that this replaced costing ~140
// instructions a warp (docs/kernels.md).
__device__ __forceinline__ int32_t* words_to_smem(int32_t* dst_area, const int32_t* src, int n,
                                                  unsigned long long* bar, uint32_t* tx) {
#if HISPARSE_BULK_STATE
  const int head = (int)((reinterpret_cast<uintptr_t>(src) >> 2) & 3);
  if (threadIdx.x == 0 && n > 0) {
    const uint32_t bytes = (uint32_t)(((head + n + 3) & ~3) * 4);
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(smem_addr(dst_area)), "l"(src - head), "r"(bytes), "r"(smem_addr(bar))
        : "memory");
    *tx += bytes;
  }
  return dst_area + head;
#else
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    __pipeline_memcpy_async(dst_area + i, src + i, sizeof(int32_t));
  return dst_area;
#endif
}

// Thread 0, before its first words_to_smem: the mbarrier the bulk copies complete on.
__device__ __forceinline__ void bulk_barrier_init(unsigned long long* bar) {
#if HISPARSE_BULK_STATE
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// Every thread, after its last words_to_smem: thread 0 arrives on the barrier expecting tx bytes
// (its copies' total); elsewhere the thread's cp.async group is committed.
__device__ __forceinline__ void words_to_smem_commit(unsigned long long* bar, uint32_t tx) {
#if HISPARSE_BULK_STATE
  if (threadIdx.x == 0)
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
                 "r"(tx) : "memory");
#else
  __pipeline_commit();
#endif
}

// Every thread that reads the copies: wait until they have landed (then a CTA barrier, for the
// words other threads copied, where cp.async is used).
__device__ __forceinline__ void words_to_smem_wait(unsigned long long* bar) {
#if HISPARSE_BULK_STATE
  asm volatile(
      "{\n .reg .pred done;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], 0;\n @!done bra WAIT_%=;\n}"
      ::"r"(smem_addr(bar)) : "memory");
#else
  __pipeline_wait_prior(0);
#endif
}

}  // namespace hisparse
