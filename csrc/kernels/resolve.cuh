// RESOLVE: one LRU hot-buffer step for a batch of rows, in two launches (no host sync, no allocation).
//
//  1. resolve_plan_kernel (one block per row): marks this step's hit slots in shared memory through
//     the page table, ranks the victims (empty slots first, then from the LRU end, never a slot hit
//     this step) with block scans, gives the i-th miss the i-th victim, updates slot_unit / unit_slot
//     and lru_order in place, and writes device_locs (physical slots). Misses are written encoded as
//     -2 - phys so that the IO kernel can find them without a separate miss list.
//  2. resolve_io_kernel (blocks over the flattened selection): compacts the encoded misses of its
//     range into shared memory, decodes them in device_locs, and copies their host pages into the
//     buffer with 16-byte loads straight from pinned host memory (UVA), all threads of the block over
//     one flat (row, vector) index space so that small rows keep as many loads in flight as big ones.
//
// Header-only, raw pointers, no torch headers. int32 indices; S <= 32768 (16-bit counters).
#pragma once
#include <cstdint>

namespace hisparse {

constexpr int kPlanThreads = 1024;
constexpr int kIoThreads = 256;
constexpr int kMaxSlots = 32768;           // slots fit the uint16 order copy and 16-bit scan halves
constexpr uint8_t kHit = 1, kVictim = 2, kEmpty = 4;

// Exclusive block-wide scan of one uint32 per thread; *total gets the block sum. scratch: 33 words.
__device__ __forceinline__ uint32_t block_exclusive_scan(uint32_t v, uint32_t* scratch, uint32_t* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  uint32_t x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    uint32_t y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) scratch[warp] = x;
  __syncthreads();
  if (warp == 0) {
    uint32_t w = lane < nwarps ? scratch[lane] : 0u;
    uint32_t s = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      uint32_t y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    scratch[lane] = s - w;
    if (lane == 31) scratch[32] = s;
  }
  __syncthreads();
  uint32_t res = scratch[warp] + x - v;
  *total = scratch[32];
  __syncthreads();  // scratch is reused by the next scan
  return res;
}

// Dynamic shared memory of the plan kernel for k selected units and S slots.
__host__ __device__ inline size_t resolve_plan_smem_bytes(int k, int S) {
  return (size_t)k * 8 + (size_t)S * 2 + (size_t)k * 2 + (size_t)S;
}

// Per row r (blockIdx.x): selection (R, k); slot_unit, lru_order, slot_map (R, S); unit_slot (R, U);
// device_locs (R, k) out. Rows whose selection is all -1 are left untouched (device_locs = -1).
__global__ void __launch_bounds__(kPlanThreads) resolve_plan_kernel(
    const int32_t* __restrict__ selection, int k, int32_t* __restrict__ slot_unit,
    int32_t* __restrict__ unit_slot, int U, int32_t* __restrict__ lru_order,
    const int32_t* __restrict__ slot_map, int S, int32_t* __restrict__ device_locs) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ uint32_t scan_scratch[33];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // PDL: the IO kernel may be scheduled now; it still waits for this grid's completion.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const int r = blockIdx.x, t = threadIdx.x, T = blockDim.x;
  const int32_t* sel = selection + (int64_t)r * k;
  int32_t* su = slot_unit + (int64_t)r * S;
  int32_t* us = unit_slot + (int64_t)r * U;
  int32_t* lo = lru_order + (int64_t)r * S;
  const int32_t* sm = slot_map + (int64_t)r * S;
  int32_t* dl = device_locs + (int64_t)r * k;

  int32_t* jslot = reinterpret_cast<int32_t*>(smem);          // k: hit slot, -2 miss, -1 padding
  int32_t* ju = jslot + k;                                     // k: the selection row
  uint16_t* ord = reinterpret_cast<uint16_t*>(ju + k);         // S: previous lru_order
  uint16_t* vict = ord + S;                                    // k: victim slot by rank
  uint8_t* flag = reinterpret_cast<uint8_t*>(vict + k);        // S: kHit | kVictim | kEmpty

  // All independent global reads first, coalesced, so their latencies overlap.
  for (int p = t; p < S; p += T) {
    ord[p] = (uint16_t)lo[p];
    flag[p] = su[p] < 0 ? kEmpty : 0;
  }
  for (int j = t; j < k; j += T) ju[j] = sel[j];
  __syncthreads();

  // A: hits through the page table; per-thread contiguous chunks keep selection order for the scans.
  const int cj = (k + T - 1) / T, j0 = min(k, t * cj), j1 = min(k, j0 + cj);
  uint32_t cnt = 0;  // hits in the low half, misses in the high half
  for (int j = j0; j < j1; ++j) {
    const int32_t u = ju[j];
    int32_t s = -1;
    if (u >= 0) {
      s = us[u];
      if (s >= 0) {
        flag[s] = kHit;  // a resident slot: kEmpty was not set
        cnt += 1u;
      } else {
        s = -2;
        cnt += 1u << 16;
      }
    }
    jslot[j] = s;
  }
  uint32_t tot;
  const uint32_t pre_j = block_exclusive_scan(cnt, scan_scratch, &tot);  // (syncs: flags visible)
  const int h = (int)(tot & 0xffffu), m = (int)(tot >> 16);
  if (h + m == 0) {  // an all-padding row: a no-op
    for (int j = t; j < k; j += T) dl[j] = -1;
    return;
  }

  // B: victims in eviction order q (q = 0 is the LRU end): empty slots first, then occupied slots
  // that are not hit this step. The i-th miss takes the candidate of rank i.
  const int cs = (S + T - 1) / T, q0 = min(S, t * cs), q1 = min(S, q0 + cs);
  if (m > 0) {
    cnt = 0;
    for (int q = q0; q < q1; ++q) {
      const uint8_t f = flag[ord[S - 1 - q]];
      if (f & kEmpty) cnt += 1u;
      else if (!(f & kHit)) cnt += 1u << 16;
    }
    const uint32_t pre_q = block_exclusive_scan(cnt, scan_scratch, &tot);
    const int n_empty = (int)(tot & 0xffffu);
    int e_rank = (int)(pre_q & 0xffffu), o_rank = n_empty + (int)(pre_q >> 16);
    for (int q = q0; q < q1; ++q) {
      const int s = ord[S - 1 - q];
      const uint8_t f = flag[s];
      int rank;
      if (f & kEmpty) rank = e_rank++;
      else if (!(f & kHit)) rank = o_rank++;
      else continue;
      if (rank < m) {
        vict[rank] = (uint16_t)s;
        flag[s] = kVictim;
        if (!(f & kEmpty)) us[su[s]] = -1;  // the victim forgets its unit (never one selected now)
      }
    }
    __syncthreads();
  }

  // C: outputs of the selection. New order: [hits][misses][rest], later entries more recent.
  int hit_i = (int)(pre_j & 0xffffu), miss_i = (int)(pre_j >> 16);
  for (int j = j0; j < j1; ++j) {
    int32_t s = jslot[j];
    if (s == -1) {
      dl[j] = -1;
    } else if (s >= 0) {
      lo[h - 1 - hit_i++] = s;
      dl[j] = sm[s];
    } else {
      s = vict[miss_i];
      lo[h + m - 1 - miss_i++] = s;
      const int32_t u = ju[j];
      su[s] = u;
      us[u] = s;
      dl[j] = -2 - sm[s];
    }
  }

  // D: the rest keep their previous relative order after the h + m touched slots.
  cnt = 0;
  for (int p = q0; p < q1; ++p) cnt += (flag[ord[p]] & (kHit | kVictim)) == 0;
  const uint32_t pre_p = block_exclusive_scan(cnt, scan_scratch, &tot);
  int pos = h + m + (int)pre_p;
  for (int p = q0; p < q1; ++p) {
    const int s = ord[p];
    if ((flag[s] & (kHit | kVictim)) == 0) lo[pos++] = s;
  }
}

// Blocks over the flattened selection (R * k entries, `ent` per block). Decodes the plan kernel's
// miss marks in device_locs and copies host[host_page_table[r, unit]] -> buffer[phys] (row_bytes each).
// V is the vector type (16-byte int4 when rows and pointers allow); UNROLL loads in flight per thread.
template <typename V, int UNROLL>
__global__ void __launch_bounds__(kIoThreads) resolve_io_kernel(
    const int32_t* __restrict__ selection, int32_t* __restrict__ device_locs, int64_t n_entries, int k,
    const int32_t* __restrict__ host_page_table, int Umax, const uint8_t* __restrict__ host,
    uint8_t* __restrict__ buffer, int64_t row_bytes, int ent) {
  extern __shared__ int64_t io_smem[];
  int64_t* src = io_smem;          // ent: host byte offsets
  int64_t* dst = io_smem + ent;    // ent: buffer byte offsets
  __shared__ int n_miss;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // PDL: wait for the plan kernel's writes (a no-op when launched without the PDL attribute).
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const int64_t e0 = (int64_t)blockIdx.x * ent;
  if (threadIdx.x == 0) n_miss = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < ent; i += blockDim.x) {
    const int64_t e = e0 + i;
    if (e >= n_entries) break;
    const int32_t loc = device_locs[e];
    if (loc <= -2) {
      const int32_t phys = -2 - loc;
      const int64_t r = e / k;
      const int32_t page = host_page_table[r * Umax + selection[e]];
      const int slot = atomicAdd(&n_miss, 1);  // copy order does not matter
      src[slot] = (int64_t)page * row_bytes;
      dst[slot] = (int64_t)phys * row_bytes;
      device_locs[e] = phys;
    }
  }
  __syncthreads();
  const uint32_t nvec = (uint32_t)(row_bytes / sizeof(V));
  const uint32_t total = (uint32_t)n_miss * nvec;
  const uint32_t stride = blockDim.x * UNROLL;
  for (uint32_t base = threadIdx.x; base < total; base += stride) {
    V v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const uint32_t idx = base + u * blockDim.x;
      if (idx < total) {
        const uint32_t row = idx / nvec, off = idx - row * nvec;
        v[u] = reinterpret_cast<const V*>(host + src[row])[off];
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const uint32_t idx = base + u * blockDim.x;
      if (idx < total) {
        const uint32_t row = idx / nvec, off = idx - row * nvec;
        reinterpret_cast<V*>(buffer + dst[row])[off] = v[u];
      }
    }
  }
}

}  // namespace hisparse
