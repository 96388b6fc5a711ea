// SELECT + RESOLVE of a decode batch, one CTA per row: top-k of the row's page scores by 8-bit radix
// passes with shared-memory histograms, then (hot rows) the hit/victim/miss plan of the row's hot
// slots under the served policy (0 = lru, 1 = crf), written in place. The contract, decision for
// decision, is ops/triton_select.py's (and so reference.select_resolve / slots.engine.resolve):
// the same pages, slots, state and counts, bit for bit. Raw pointers only (no torch headers).
//
// Why a CUDA kernel beside the Triton one: the select is latency, not bytes (a 32K row reads 8 KB of
// scores), and Triton spends its ~20 us of one row on ~30 block-wide reductions each going through
// shared memory with its own barriers; here a radix pass is a shared-memory histogram by atomics,
// one block scan and one barrier to publish the chosen bin.
#pragma once
#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "smem_copy.cuh"

namespace hisparse {

struct SelectArgs {
  const float* scores;      // (N, >= U) row stride s_sc
  const int64_t* seq;       // (N,) > 0: a live sparse row
  const int64_t* num_full;  // (N,) complete pages of the row (the selectable ones)
  const int64_t* hot;       // (N,) pages [0, hot) RESOLVE through the hot slots, [hot, n) through
                            // the block table (0: a resident row; nullptr: every row resident)
  const int64_t* rows;      // (N,) the row's state row
  const int32_t* bt;        // (N, W) row stride s_bt: slot s of row r is block bt[r, s]
  int32_t* su;              // (M, S) slot -> unit, -1 empty
  int32_t* us;              // (M, max units) unit -> slot, -1 not resident
  int32_t* pol;             // (M, S) lru: order (slot at recency p, MRU first); crf: value per slot
  unsigned long long* counts;  // (3,) hits, misses, pages through the block table (added)
  int32_t* sel;             // (N, K) selected pages ascending, -1 after them
  int32_t* locs;            // (N, K) blocks; a miss is marked -2 - block for the IO launch
  int32_t* missed;          // (N,) 1: the row has a miss (a marked entry), else 0 (hot launches)
  int64_t s_sc, s_bt, s_su, s_us, s_pol;
  int K, S, shift, hit;       // (the policy: the kernel's template argument)
  int W;                    // block_table's width
  int pre_us;               // > 0: unit_slot's width, each row's [0, min(hot, n)) of it copied into
                            // shared memory (0: probed in global memory)
};

__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

constexpr int kKeyRegs = 8;  // keys a thread keeps in registers across the radix passes

// f(page, key) over a thread's pages [lo, hi) in order: from registers when they hold them (the
// loop unrolled so kr stays in registers), else loaded again (L1 hits after the first pass).
template <class F>
__device__ __forceinline__ void each_key(bool in_regs, const uint32_t (&kr)[kKeyRegs], const float* sc,
                                         int lo, int hi, F f) {
  if (in_regs) {
#pragma unroll
    for (int c = 0; c < kKeyRegs; ++c)
      if (lo + c < hi) f(lo + c, kr[c]);
  } else {
    for (int i = lo; i < hi; ++i) f(i, order_key(sc[i]));
  }
}

// The shared-memory layout of one CTA: sel[K], vic[K], cur[K] (a hot entry's slot before this
// step), flag[S] (int32), then the four copies of the row's state, each at a 16-byte boundary with
// kCopySlack words of slack (a bulk copy moves whole 16-byte lines: the copy starts at the line that
// holds the first word, so a row's data begins 0-3 words into its area): su[S], pol[S], bt[S] (the
// hot slots' blocks), us[pre_us] (the row's page table).
constexpr int kCopySlack = 8;
__host__ __device__ inline int copy_words(int n) { return ((n + 3) & ~3) + kCopySlack; }
__host__ __device__ inline int select_fixed_words(int K, int S) {
  return (((3 * K + S) + 3) & ~3) + 3 * copy_words(S);
}
inline size_t select_smem_bytes(int K, int S, int pre_us) {
  return sizeof(int32_t) * ((size_t)select_fixed_words(K, S) + (pre_us > 0 ? copy_words(pre_us) : 0));
}

template <int T>
struct SelectShared {
  typename cub::BlockScan<uint32_t, T, cub::BLOCK_SCAN_WARP_SCANS>::TempStorage scan;
  unsigned long long bar;    // the mbarrier of the state's bulk copies
  int32_t hist[256];
  uint32_t pick[3];          // the chosen bin, entries above it, entries in it
};

// Exclusive scan of one value per thread; *total = the block's sum (after the call, all threads).
// Warp scans (shuffles) and one exchange of the warps' totals: a raking scan (cub's default) runs
// a serial chain of T / 32 shared-memory adds in one warp, which Nsight Compute showed on the
// critical path of every scan (docs/kernels.md).
template <int T>
__device__ __forceinline__ uint32_t block_excl(SelectShared<T>& sh, uint32_t v, uint32_t* total) {
  uint32_t out, agg;
  cub::BlockScan<uint32_t, T, cub::BLOCK_SCAN_WARP_SCANS>(sh.scan).ExclusiveSum(v, out, agg);
  __syncthreads();  // the temp storage is reused by the next scan
  *total = agg;
  return out;
}

// Latency, not bytes: the row's scalars (seq, num_full, hot, rows) are loaded in one round trip,
// the row's scores next, and while they are in flight a hot row's state (slot_unit, policy state),
// its slots' blocks and (when it fits) its page table are copied into shared memory by bulk copies
// (sm_90; no register holds them, so nothing waits on them) while the top-k runs, awaited only
// before RESOLVE, which then probes and publishes from shared memory. Nsight Compute on the H200
// (docs/kernels.md, 2026-12-04 fourth session): the kernel is issue-latency bound (a warp issues
// every ~16 cycles), so its time follows the instructions a warp runs; the per-word cp.async loop
// that this replaced was ~140 of them a warp, ahead of the scores' loads.
// POLICY (0 = lru, 1 = crf) is a template argument and RESOLVE's loops are not unrolled: RESOLVE's
// code runs once a launch, cold in the SM's instruction cache (Nsight Compute: half of a hot row's
// RESOLVE samples were "no instruction", at the targets of branches over unrolled loop bodies and
// the other policy's code), so its time follows the code it spans.
template <int T, int POLICY>
__global__ void __launch_bounds__(T) select_resolve_kernel(SelectArgs a) {
  static_assert(T % 32 == 0 && T >= 256, "one thread per histogram bin, whole warps");
  __shared__ SelectShared<T> sh;
  extern __shared__ __align__(16) int32_t dyn[];
  const int K = a.K, S = a.S, tid = threadIdx.x;
  int32_t* s_sel = dyn;
  int32_t* s_vic = dyn + K;
  int32_t* s_cur = dyn + 2 * K;
  int32_t* s_flag = dyn + 3 * K;
  int32_t* area = dyn + select_fixed_words(K, S) - 3 * copy_words(S);  // 16-byte aligned
  const int64_t r = blockIdx.x;
  const int64_t seq_r = ld_now(a.seq + r);
  const int64_t n_full = ld_now(a.num_full + r);  // (rows and hot hold >= N entries)
  const int64_t hot_end = a.hot != nullptr ? ld_now(a.hot + r) : 0;  // pages below: the hot slots'
  const int64_t row = ld_now(a.rows + r);
  if (a.hot != nullptr && tid == 0) a.missed[r] = 0;  // (set to 1 below by a row that misses)
  // the exit tests all four (a negative page count or hot boundary, or a state row below -1, is no
  // row's), so ptxas issues their loads together instead of sinking three past it
  if (seq_r <= 0 || (n_full | hot_end) < 0 || row < -1) return;
  const int n = (int)n_full;
  int32_t* sel = a.sel + r * K;
  int32_t* locs = a.locs + r * K;
  if (n == 0) {  // no complete page yet: nothing selected
    for (int j = tid; j < K; j += T) sel[j] = locs[j] = -1;
    return;
  }
  const bool hot = hot_end != 0;
  // ---- top-k: the pages [0, n) among the K best keys, ascending in s_sel[0, min(n, K)); the
  // scores' loads are issued first, the state's copies while they are in flight
  const float* sc = a.scores + r * a.s_sc;
  const int nk = n < K ? n : K;
  const int chunk = (n + T - 1) / T;  // pages [tid * chunk, ...) are this thread's, in order
  const int lo = tid * chunk, hi = min(n, lo + chunk);
  const bool in_regs = chunk <= kKeyRegs;  // rows of up to kKeyRegs * T pages: keys in registers
  uint32_t kr[kKeyRegs];  // the scores' bits here; their keys once the state's copies are issued
  if (n > K && in_regs) {  // (a key computed here would wait on its load before the copies)
#pragma unroll
    for (int c = 0; c < kKeyRegs; ++c) kr[c] = lo + c < hi ? __float_as_uint(sc[lo + c]) : 0u;
  }
  int32_t *s_su = area, *s_pol = area, *s_bt = area, *s_us = area;
  if (hot) {  // the row's state into shared memory, asynchronously: awaited before RESOLVE
    uint32_t tx = 0;
    if (tid == 0) bulk_barrier_init(&sh.bar);
    const int cw = copy_words(S);
    s_su = words_to_smem(area, a.su + row * a.s_su, S, &sh.bar, &tx);
    s_pol = words_to_smem(area + cw, a.pol + row * a.s_pol, S, &sh.bar, &tx);
    s_bt = words_to_smem(area + 2 * cw, a.bt + r * a.s_bt, min(S, a.W), &sh.bar, &tx);
    if (a.pre_us > 0)  // the pages a probe can ask for: [0, min(hot, n))
      s_us = words_to_smem(area + 3 * cw, a.us + row * a.s_us,
                        (int)min(min(hot_end, (int64_t)n), (int64_t)a.pre_us), &sh.bar, &tx);
    words_to_smem_commit(&sh.bar, tx);
    for (int s = tid; s < S; s += T) s_flag[s] = 0;
  }
  if (n <= K) {
    for (int i = tid; i < n; i += T) s_sel[i] = i;
  } else {
    if (in_regs) {
#pragma unroll
      for (int c = 0; c < kKeyRegs; ++c) kr[c] = lo + c < hi ? order_key(__uint_as_float(kr[c])) : 0u;
    }
    uint32_t need = K, prefix = 0;
    int used = 0;
    for (int p = 0; p < 4; ++p) {
      const int sh_ = 24 - 8 * p;
      for (int b = tid; b < 256; b += T) sh.hist[b] = 0;
      __syncthreads();
      // one atomic per distinct bin per warp (scores of a row share their top bits: lane-by-lane
      // atomics on one bin would serialise 32-fold); every lane runs the same iterations
      auto add = [&](uint32_t key, bool live) {
        const bool m = live && (p == 0 || (key >> (sh_ + 8)) == prefix);
        const uint32_t bin = m ? (key >> sh_) & 0xFFu : 256u;
        const unsigned peers = __match_any_sync(0xFFFFFFFFu, bin);
        if (bin < 256u && (tid & 31) == __ffs(peers) - 1) atomicAdd(&sh.hist[bin], __popc(peers));
      };
      if (in_regs) {
#pragma unroll
        for (int c = 0; c < kKeyRegs; ++c) add(kr[c], lo + c < hi);
      } else {
        for (int c = 0; c < chunk; ++c) add(lo + c < hi ? order_key(sc[lo + c]) : 0u, lo + c < hi);
      }
      __syncthreads();
      // thread t holds bin 255 - t: its inclusive scan = entries with digit >= that bin
      const uint32_t h = tid < 256 ? (uint32_t)sh.hist[255 - tid] : 0u;
      uint32_t tot;
      const uint32_t ge = block_excl<T>(sh, h, &tot) + h;
      if (tid < 256 && ge >= need && ge - h < need) {  // the bin holding the need-th largest key
        sh.pick[0] = 255 - tid;
        sh.pick[1] = ge - h;
        sh.pick[2] = h;
      }
      __syncthreads();
      const uint32_t d = sh.pick[0], above = sh.pick[1], in_bin = sh.pick[2];
      need -= above;
      prefix = (prefix << 8) | d;
      used += 8;
      if (in_bin == need) break;  // the bin is taken whole: the prefix alone decides
      __syncthreads();            // pick[] is rewritten by the next pass
    }
    // every key above the prefix, then the first `need` equal to it in page order
    const int shift = 32 - used;
    uint32_t gt = 0, eq = 0;
    each_key(in_regs, kr, sc, lo, hi, [&](int, uint32_t key) {
      gt += (key >> shift) > prefix;
      eq += (key >> shift) == prefix;
    });
    uint32_t tot;
    const uint32_t before = block_excl<T>(sh, gt | (eq << 16), &tot);
    uint32_t g = before & 0xFFFF, e = before >> 16;
    each_key(in_regs, kr, sc, lo, hi, [&](int i, uint32_t key) {
      const uint32_t kp = key >> shift;
      if (kp > prefix) {
        s_sel[g + min(e, need)] = i;
        ++g;
      } else if (kp == prefix) {
        if (e < need) s_sel[g + e] = i;
        ++e;
      }
    });
  }
  __syncthreads();
#pragma unroll 1
  for (int j = tid; j < K; j += T) sel[j] = j < nk ? s_sel[j] : -1;
  const int32_t* bt = a.bt + r * a.s_bt;
  if (!hot) {  // every page of the row on the GPU: through the block table, no RESOLVE (a resident
               // row under a hot launch skips its scan: 0.4 us of one row's select on the H200)
#pragma unroll 1
    for (int j = tid; j < K; j += T) locs[j] = j < nk ? bt[s_sel[j]] : -1;
    if (a.hot != nullptr && tid == 0) atomicAdd(a.counts + 2, (unsigned long long)nk);
    return;
  }
#pragma unroll 1
  for (int j = nk + tid; j < K; j += T) locs[j] = -1;
  // a hot row from here on: the state's copies, issued before the top-k, seen by every thread
  words_to_smem_wait(&sh.bar);
#pragma unroll 1
  for (int s = a.W + tid; s < S; s += T) s_bt[s] = -1;  // slots past the block table's width
  __syncthreads();
  // ---- RESOLVE: entries j (selection order) in contiguous chunks, like the pages above; pages
  // >= hot_end through the block table, the others through the hot slots
  int32_t* su = a.su + row * a.s_su;
  int32_t* us = a.us + row * a.s_us;
  int32_t* pol = a.pol + row * a.s_pol;
  const int kc = (nk + T - 1) / T;
  const int jlo = tid * kc, jhi = min(nk, jlo + kc);
  uint32_t cnt = 0;  // hits | misses << 16 (k <= S < 65536)
#pragma unroll 1
  for (int j = jlo; j < jhi; ++j) {  // s_cur: a hot entry's slot before this step, until publish
    const int32_t u = s_sel[j];
    if (u >= hot_end) {
      locs[j] = bt[u];
      continue;
    }
    const int32_t cur = a.pre_us > 0 ? s_us[u] : us[u];
    s_cur[j] = cur;
    if (cur >= 0) s_flag[cur] = 1;
    cnt += cur >= 0 ? 1u : 1u << 16;
  }
  uint32_t tot_hm;
  const uint32_t rk = block_excl<T>(sh, cnt, &tot_hm);
  const uint32_t H = tot_hm & 0xFFFFu, M = tot_hm >> 16;
  if (tid == 0) {  // the pages through the block table: the rest of the selection
    if (M > 0) a.missed[r] = 1;  // the attention's split skips its miss check on a row without
    atomicAdd(a.counts, (unsigned long long)H);
    atomicAdd(a.counts + 1, (unsigned long long)M);
    atomicAdd(a.counts + 2, (unsigned long long)(nk - H - M));
  }
  if (H + M == 0) return;  // nothing through the slots: the row's state is left alone
  uint32_t tot;
  const int sc_ = (S + T - 1) / T;  // slots (or recency positions) [slo, shi) are this thread's
  const int slo = tid * sc_, shi = min(S, slo + sc_);
  // (the probe's s_flag writes are visible: the scan above ended on a barrier)
  if (M > 0) {  // victims, in the policy's eviction order: empty slots before unhit occupied ones
    if (POLICY == 0) {  // LRU: from the LRU end of the order
      uint32_t ne = 0, no = 0;
#pragma unroll 1
      for (int p = slo; p < shi; ++p) {
        const int32_t s = s_pol[S - 1 - p];
        const bool empty = s_su[s] < 0;
        ne += empty;
        no += !empty && s_flag[s] != 1;
      }
      const uint32_t eb = block_excl<T>(sh, ne | (no << 16), &tot);
      const uint32_t n_empty = tot & 0xFFFF;
      uint32_t e = eb & 0xFFFF, o = eb >> 16;
#pragma unroll 1
      for (int p = slo; p < shi; ++p) {
        const int32_t s = s_pol[S - 1 - p];
        const int32_t old = s_su[s];
        uint32_t rank = 0xFFFFFFFFu;
        if (old < 0) {
          rank = e++;
        } else if (s_flag[s] != 1) {
          rank = n_empty + o++;
        }
        if (rank < M) {
          s_vic[rank] = s;  // victims occupy s_vic[0, M)
          if (old >= 0) us[old] = -1;  // a victim forgets its old page
          s_flag[s] = 2;
        }
      }
    } else {  // crf: ascending ((value + 1) << 16 | slot), hit slots never
      auto key = [&](int t) { return s_flag[t] == 1 ? 0x7FFFFFFF : ((s_pol[t] + 1) << 16) | t; };
#pragma unroll 1
      for (int s = slo; s < shi; ++s) {
        const int32_t ks = key(s);
        uint32_t rank = 0;  // its place in the eviction order (keys distinct but the hits')
        for (int t = 0; t < S; ++t) rank += key(t) < ks;
        if (rank < M && s_flag[s] != 1) {
          const int32_t old = s_su[s];
          if (old >= 0) us[old] = -1;
          s_vic[rank] = s;
        }
      }
      __syncthreads();
#pragma unroll 1
      for (int i = tid; i < (int)M; i += T) s_flag[s_vic[i]] = 2;
    }
    __syncthreads();  // s_vic and the victims' flags, for the publish and the rest
  }
  // publish: hits keep their slot, the i-th miss takes the i-th victim
  uint32_t hr = rk & 0xFFFFu, mr = rk >> 16;
#pragma unroll 1
  for (int j = jlo; j < jhi; ++j) {
    const int32_t u = s_sel[j];
    if (u >= hot_end) continue;
    const int32_t cur = s_cur[j];
    int32_t slot;
    if (cur >= 0) {
      slot = cur;
      if (POLICY == 0) pol[H - 1 - hr] = cur;  // later selection entries are more recent
      ++hr;
    } else {
      slot = s_vic[mr];
      su[slot] = u;
      us[u] = slot;
      if (POLICY == 0) pol[H + M - 1 - mr] = slot;
      ++mr;
    }
    const int32_t phys = s_bt[slot];
    locs[j] = cur >= 0 ? phys : -2 - phys;
  }
  if (POLICY == 0) {  // the rest of the order: slots neither hit nor victim, in their old order
    // A step with no miss whose hit slots are the old order's first H (it selected what the last
    // step did) leaves the rest where it was: one barrier's vote instead of a block scan and stores
    bool moved = M > 0;  // (M is the block's: every thread takes the same branch)
    if (!moved) {
      int stay = 1;
#pragma unroll 1
      for (int p = slo; p < shi; ++p) stay &= (p < (int)H) == (s_flag[s_pol[p]] == 1);
      moved = !__syncthreads_and(stay);
    }
    if (moved) {
      uint32_t ns = 0;
#pragma unroll 1
      for (int p = slo; p < shi; ++p) ns += s_flag[s_pol[p]] == 0;
      uint32_t b = block_excl<T>(sh, ns, &tot);
#pragma unroll 1
      for (int p = slo; p < shi; ++p)
        if (s_flag[s_pol[p]] == 0) pol[H + M + b++] = s_pol[p];
    }
  } else {  // crf: every occupied value decays; hits add HIT, misses start at HIT / 2
#pragma unroll 1
    for (int s = tid; s < S; s += T) {
      const int32_t v = s_pol[s];
      const int32_t dec = v - (v >> a.shift);
      pol[s] = s_flag[s] == 1 ? dec + a.hit : s_flag[s] == 2 ? a.hit / 2 : (v >= 0 ? dec : v);
    }
  }
}

}  // namespace hisparse
