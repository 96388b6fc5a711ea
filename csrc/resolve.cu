// Torch launcher of RESOLVE (LRU): checks every input, picks the stream, launches plan + IO kernels.
// No host synchronisation and no allocation: capturable in a CUDA graph.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/all.h>

#include <cstdlib>

#include "kernels/resolve.cuh"
#include "uva.h"

namespace {

void check_i32(const torch::Tensor& t, const char* name, int64_t rows, const torch::Device& dev) {
  TORCH_CHECK(t.is_cuda() && t.device() == dev, "resolve_lru: ", name, " must be on ", dev);
  TORCH_CHECK(t.scalar_type() == torch::kInt32, "resolve_lru: ", name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows, "resolve_lru: ", name, " must be (", rows, ", *), got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), "resolve_lru: ", name, " must be contiguous");
}

// Programmatic dependent launch of the IO kernel (its launch overlaps the plan kernel's run);
// HISPARSE_PDL=0 turns it off (for comparison in the benchmark).
bool use_pdl() {
  static const bool on = [] {
    const char* e = std::getenv("HISPARSE_PDL");
    return !(e && e[0] == '0');
  }();
  return on;
}

template <typename V>
void launch_io(int unroll, dim3 grid, size_t smem, cudaStream_t st, const int32_t* sel, int32_t* dl,
               int64_t n, int k, const int32_t* hpt, int umax, const uint8_t* host, uint8_t* buf,
               int64_t row_bytes, int ent) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(hisparse::kIoThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = use_pdl() ? 1 : 0;
#define HS_IO(U)                                                                               \
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, hisparse::resolve_io_kernel<V, U>, sel, dl, n, k, hpt, \
                                    umax, host, buf, row_bytes, ent))
  switch (unroll) {
    case 1: HS_IO(1); break;
    case 2: HS_IO(2); break;
    case 4: HS_IO(4); break;
    case 8: HS_IO(8); break;
    default: HS_IO(16); break;
  }
#undef HS_IO
}

}  // namespace

void resolve_lru(const torch::Tensor& selection, torch::Tensor& slot_unit, torch::Tensor& unit_slot,
                 torch::Tensor& lru_order, const torch::Tensor& slot_map, torch::Tensor& buffer,
                 const torch::Tensor& host, const torch::Tensor& host_page_table,
                 torch::Tensor& device_locs, int64_t io_chunk_bytes) {
  const auto dev = selection.device();
  const int64_t R = selection.size(0), k = selection.size(1), S = slot_unit.size(1);
  check_i32(selection, "selection", R, dev);
  check_i32(slot_unit, "slot_unit", R, dev);
  check_i32(unit_slot, "unit_slot", R, dev);
  check_i32(lru_order, "lru_order", R, dev);
  check_i32(slot_map, "slot_map", R, dev);
  check_i32(host_page_table, "host_page_table", R, dev);
  check_i32(device_locs, "device_locs", R, dev);
  TORCH_CHECK(lru_order.size(1) == S && slot_map.size(1) == S, "resolve_lru: lru_order/slot_map must be (R, S=", S, ")");
  TORCH_CHECK(device_locs.size(1) == k, "resolve_lru: device_locs must be (R, k=", k, ")");
  TORCH_CHECK(k <= S, "resolve_lru: k=", k, " selected units exceed the S=", S, " hot-buffer slots");
  TORCH_CHECK(S <= hisparse::kMaxSlots, "resolve_lru: S=", S, " slots > ", hisparse::kMaxSlots, " supported");
  TORCH_CHECK(buffer.is_cuda() && buffer.device() == dev && buffer.is_contiguous(),
              "resolve_lru: buffer must be a contiguous tensor on ", dev);
  TORCH_CHECK(host.is_contiguous() && host.dim() == buffer.dim() && host.size(0) > 0,
              "resolve_lru: host must be contiguous with buffer's number of dims");
  TORCH_CHECK(host.scalar_type() == buffer.scalar_type(), "resolve_lru: host/buffer dtypes differ");
  for (int d = 1; d < buffer.dim(); ++d)
    TORCH_CHECK(host.size(d) == buffer.size(d), "resolve_lru: host unit shape ", host.sizes(),
                " != buffer unit shape ", buffer.sizes());
  TORCH_CHECK(io_chunk_bytes >= 16 && io_chunk_bytes <= 256, "resolve_lru: io_chunk_bytes=", io_chunk_bytes,
              " must be in [16, 256] (bytes per thread per step; 64 is a good start)");
  if (R == 0 || k == 0) return;
  const int64_t row_bytes = buffer.numel() / buffer.size(0) * buffer.element_size();
  TORCH_CHECK(row_bytes > 0, "resolve_lru: empty unit rows");

  const c10::cuda::CUDAGuard guard(dev);
  cudaStream_t st = at::cuda::getCurrentCUDAStream();

  const size_t smem = hisparse::resolve_plan_smem_bytes((int)k, (int)S);
  if (smem > 40 * 1024) {  // (the static scan scratch counts against 48 KB too)
    C10_CUDA_CHECK(cudaFuncSetAttribute(hisparse::resolve_plan_kernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  }
  hisparse::resolve_plan_kernel<<<(unsigned)R, hisparse::kPlanThreads, smem, st>>>(
      selection.data_ptr<int32_t>(), (int)k, slot_unit.data_ptr<int32_t>(), unit_slot.data_ptr<int32_t>(),
      (int)unit_slot.size(1), lru_order.data_ptr<int32_t>(), slot_map.data_ptr<int32_t>(), (int)S,
      device_locs.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  // IO: entries per block halve (from 1024) until the grid has ~2 blocks per SM, so small batches
  // still keep enough host loads in flight; the widest vector the rows and pointers allow. Down to
  // 1 entry per block: with one request (k = 128 pages, ~7 misses of 64 KB per layer) a floor of 8
  // gave 16 blocks, so a block copied 1-2 pages in 4-8 serial rounds of host loads: 29.5 us per
  // layer on the H200 (docs/gpu-results.md). With 1, each miss gets a block of its own (blocks
  // without a miss return after one load).
  const int64_t n = R * k;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int ent = 1024;
  while (ent > 1 && (n + ent - 1) / ent < 2 * sms) ent /= 2;
  const uint8_t* hptr = hisparse::device_address(host, "resolve_lru", "host");
  uint8_t* bptr = static_cast<uint8_t*>(buffer.data_ptr());
  const uintptr_t align = reinterpret_cast<uintptr_t>(hptr) | reinterpret_cast<uintptr_t>(bptr) | (uintptr_t)row_bytes;
  int vec = 16;
  while (vec > 1 && (align % vec) != 0) vec /= 2;
  TORCH_CHECK((int64_t)ent * (row_bytes / vec) < (int64_t)UINT32_MAX, "resolve_lru: rows of ", row_bytes,
              " bytes too large for the IO kernel's 32-bit index");
  int unroll = (int)std::max<int64_t>(1, io_chunk_bytes / vec);
  unroll = unroll >= 16 ? 16 : unroll >= 8 ? 8 : unroll >= 4 ? 4 : unroll >= 2 ? 2 : 1;
  const dim3 grid((unsigned)((n + ent - 1) / ent));
  const size_t io_smem = (size_t)ent * 2 * sizeof(int64_t);
  const int32_t* sel = selection.data_ptr<int32_t>();
  int32_t* dl = device_locs.data_ptr<int32_t>();
  const int32_t* hpt = host_page_table.data_ptr<int32_t>();
  const int umax = (int)host_page_table.size(1);
  switch (vec) {
    case 16: launch_io<int4>(unroll, grid, io_smem, st, sel, dl, n, (int)k, hpt, umax, hptr, bptr, row_bytes, ent); break;
    case 8: launch_io<int2>(unroll, grid, io_smem, st, sel, dl, n, (int)k, hpt, umax, hptr, bptr, row_bytes, ent); break;
    case 4: launch_io<int32_t>(unroll, grid, io_smem, st, sel, dl, n, (int)k, hpt, umax, hptr, bptr, row_bytes, ent); break;
    case 2: launch_io<int16_t>(unroll, grid, io_smem, st, sel, dl, n, (int)k, hpt, umax, hptr, bptr, row_bytes, ent); break;
    default: launch_io<int8_t>(unroll, grid, io_smem, st, sel, dl, n, (int)k, hpt, umax, hptr, bptr, row_bytes, ent); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
