// Torch launcher of SELECT + RESOLVE (kernels/select_resolve.cuh): checks every input, picks the
// current stream, one launch. No host synchronisation and no allocation: capturable in a CUDA graph.
// The miss copies stay a second launch (ops/triton_select.py's IO kernel), as with the Triton select.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/all.h>

#include "kernels/select_resolve.cuh"

namespace {

constexpr size_t kPreloadSmem = 96 * 1024;  // dynamic shared memory up to which a row's page table
                                            // is held in it

void check(const torch::Tensor& t, const char* name, at::ScalarType dt, int64_t dim, const torch::Device& dev) {
  TORCH_CHECK(t.is_cuda() && t.device() == dev, "select_resolve: ", name, " must be on ", dev);
  TORCH_CHECK(t.scalar_type() == dt, "select_resolve: ", name, " must be ", dt, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, "select_resolve: ", name, " must have ", dim, " dims, got ", t.dim());
  TORCH_CHECK(t.stride(dim - 1) == 1, "select_resolve: ", name, "'s last dim must be contiguous");
}

template <int T, int POLICY>
void launch(const hisparse::SelectArgs& a, int64_t N, size_t smem, cudaStream_t st) {
  auto kern = hisparse::select_resolve_kernel<T, POLICY>;
  // static + dynamic shared memory past 48 KiB needs the opt-in (per device: set for the largest
  // size this process asked for so far)
  static int opted = 0;
  if (smem + sizeof(hisparse::SelectShared<T>) > 48 * 1024 && (int)smem > opted) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    opted = (int)smem;
  }
  kern<<<(unsigned)N, T, smem, st>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int POLICY>
void launch_threads(int64_t threads, const hisparse::SelectArgs& a, int64_t N, size_t smem,
                    cudaStream_t st) {
  switch (threads) {
    case 256: launch<256, POLICY>(a, N, smem, st); break;
    case 512: launch<512, POLICY>(a, N, smem, st); break;
    case 1024: launch<1024, POLICY>(a, N, smem, st); break;
    default: TORCH_CHECK(false, "select_resolve: threads must be 256, 512 or 1024, got ", threads);
  }
}

}  // namespace

// scores (N, U) f32; seq, num_full, hot, rows (N,) int64; block_table (N, W) int32; slot_unit,
// policy state (M, S) int32; unit_slot (M, units) int32; counts (3,) int64; sel, locs (N, k) int32.
// hot[r]: pages [0, hot[r]) of row r through its hot slots, the rest through its block table.
// has_hot false: every row resolves through its block table (slot_unit / unit_slot / pol / hot /
// rows / counts / missed are not read). policy 0 = lru, 1 = crf (shift, hit: crf's constants).
// missed (>= N,) int32: 1 for a row with a miss this step (marked in locs), else 0.
void select_resolve(const torch::Tensor& scores, const torch::Tensor& seq, const torch::Tensor& num_full,
                    const torch::Tensor& hot, const torch::Tensor& rows, const torch::Tensor& block_table,
                    torch::Tensor& slot_unit, torch::Tensor& unit_slot, torch::Tensor& pol, torch::Tensor& counts,
                    torch::Tensor& sel, torch::Tensor& locs, torch::Tensor& missed, int64_t k, bool has_hot,
                    int64_t policy, int64_t shift, int64_t hit, int64_t threads) {
  const auto dev = scores.device();
  check(scores, "scores", torch::kFloat32, 2, dev);
  const int64_t N = scores.size(0), U = scores.size(1);
  for (auto [t, name] : {std::pair{&seq, "seq"}, {&num_full, "num_full"}, {&hot, "hot"}, {&rows, "rows"}}) {
    check(*t, name, torch::kInt64, 1, dev);
    TORCH_CHECK(t->size(0) >= N, "select_resolve: ", name, " must have >= ", N, " rows");
  }
  check(block_table, "block_table", torch::kInt32, 2, dev);
  check(sel, "sel", torch::kInt32, 2, dev);
  check(locs, "locs", torch::kInt32, 2, dev);
  TORCH_CHECK(sel.size(0) == N && sel.size(1) == k && sel.is_contiguous() && locs.sizes() == sel.sizes() &&
                  locs.is_contiguous(),
              "select_resolve: sel and locs must be contiguous (N, k)");
  TORCH_CHECK(U < (1 << 16), "select_resolve: rows of < 65536 pages (counts are packed in 16 bits)");
  TORCH_CHECK(policy == 0 || policy == 1, "select_resolve: policy must be 0 (lru) or 1 (crf), got ", policy);
  int64_t S = 1;
  if (has_hot) {
    check(slot_unit, "slot_unit", torch::kInt32, 2, dev);
    check(unit_slot, "unit_slot", torch::kInt32, 2, dev);
    check(pol, "pol", torch::kInt32, 2, dev);
    check(counts, "counts", torch::kInt64, 1, dev);
    check(missed, "missed", torch::kInt32, 1, dev);
    TORCH_CHECK(missed.size(0) >= N, "select_resolve: missed must have >= ", N, " rows");
    TORCH_CHECK(counts.size(0) >= 3, "select_resolve: counts must hold (hits, misses, block-table pages)");
    S = slot_unit.size(1);
    TORCH_CHECK(pol.size(1) == S && pol.size(0) == slot_unit.size(0), "select_resolve: pol must be (M, S)");
    TORCH_CHECK(S < (1 << 16) && k <= S, "select_resolve: need k <= S < 65536, got k=", k, " S=", S);
  }
  if (N == 0 || k == 0) return;
  hisparse::SelectArgs a{};
  a.scores = scores.data_ptr<float>();
  a.seq = seq.data_ptr<int64_t>();
  a.num_full = num_full.data_ptr<int64_t>();
  a.hot = has_hot ? hot.data_ptr<int64_t>() : nullptr;
  a.rows = rows.data_ptr<int64_t>();
  a.bt = block_table.data_ptr<int32_t>();
  a.sel = sel.data_ptr<int32_t>();
  a.locs = locs.data_ptr<int32_t>();
  a.s_sc = scores.stride(0);
  a.s_bt = block_table.stride(0);
  if (has_hot) {
    a.su = slot_unit.data_ptr<int32_t>();
    a.us = unit_slot.data_ptr<int32_t>();
    a.pol = pol.data_ptr<int32_t>();
    a.counts = reinterpret_cast<unsigned long long*>(counts.data_ptr<int64_t>());
    a.missed = missed.data_ptr<int32_t>();
    a.s_su = slot_unit.stride(0);
    a.s_us = unit_slot.stride(0);
    a.s_pol = pol.stride(0);
  }
  a.K = (int)k;
  a.S = (int)S;
  a.W = (int)block_table.size(1);
  // each row's page table in shared memory when it fits beside the rest (a 40K-token row of
  // 16-token pages: 10 KB); else the kernel probes it in global memory
  a.pre_us = 0;
  if (has_hot && hisparse::select_smem_bytes(a.K, a.S, (int)unit_slot.size(1)) <= kPreloadSmem)
    a.pre_us = (int)unit_slot.size(1);
  a.shift = (int)shift;
  a.hit = (int)hit;
  const size_t smem = hisparse::select_smem_bytes(a.K, a.S, a.pre_us);
  TORCH_CHECK(smem <= 190 * 1024, "select_resolve: k=", k, " and S=", S, " need ", smem,
              " B of shared memory (at most 190 KiB)");
  const at::cuda::OptionalCUDAGuard guard(dev);
  cudaStream_t st = at::cuda::getCurrentCUDAStream();
  // the policy is a template argument (the kernel's RESOLVE code for one policy only)
  if (policy == 0)
    launch_threads<0>(threads, a, N, smem, st);
  else
    launch_threads<1>(threads, a, N, smem, st);
}
