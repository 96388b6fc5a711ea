// Torch launcher of WRITE-THROUGH: checks every input, picks the current stream, one launch.
// No host synchronisation and no allocation: capturable in a CUDA graph. max_blocks > 0 caps the grid
// (the prefill's write-behind on a side stream: PCIe-bound, so a few CTAs beside the compute stream's).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/all.h>

#include <algorithm>
#include <string>

#include "kernels/write_through.cuh"
#include "uva.h"

namespace {

// "(a, b, c)" built by hand: streaming t.strides() into TORCH_CHECK's message crashed the process on
// the H200 (segfault instead of the RuntimeError, 2026-11-30), so no IntArrayRef goes to c10::str here.
std::string dims(c10::IntArrayRef a) {
  std::string s = "(";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  return s + ")";
}

// (T, Hkv, D) on dev, dtype dt, the (Hkv, D) block of each token contiguous; any token stride.
void check_rows(const torch::Tensor& t, const char* name, const torch::Device& dev, at::ScalarType dt,
                int64_t Hkv, int64_t D) {
  TORCH_CHECK(t.is_cuda() && t.device() == dev, "write_through: ", name, " must be on ", dev, ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == dt, "write_through: ", name, " must have host's dtype ", dt, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 3 && t.size(1) == Hkv && t.size(2) == D, "write_through: ", name, " must be (T, Hkv=", Hkv,
              ", D=", D, "), got ", dims(t.sizes()));
  TORCH_CHECK((D <= 1 || t.stride(2) == 1) && (Hkv <= 1 || t.stride(1) == D), "write_through: ", name,
              "'s (Hkv, D) block must be contiguous (only the token stride may be wider), got strides ", dims(t.strides()));
}

void check_index(const torch::Tensor& t, const char* name, int64_t n, const torch::Device& dev) {
  TORCH_CHECK(t.is_cuda() && t.device() == dev, "write_through: ", name, " must be on ", dev, ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == torch::kInt64, "write_through: ", name, " must be int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, "write_through: ", name, " must be (n=", n, ",), got ", dims(t.sizes()));
  TORCH_CHECK(t.is_contiguous(), "write_through: ", name, " must be contiguous");
}

template <typename V>
void launch(cudaStream_t st, int64_t cap, const uint8_t* k, const uint8_t* v, int64_t ks, int64_t vs, int64_t T,
            const int64_t* tok, const int64_t* page, const int64_t* off, int64_t n, uint8_t* host,
            int64_t pages, int64_t P, int64_t row_bytes) {
  const int64_t nvec = row_bytes / (int64_t)sizeof(V);
  const int64_t total = n * 2 * nvec;
  const int threads = hisparse::kWriteThroughThreads;
  // Enough blocks to cover the rows once, capped (the loop strides over the rest).
  const int64_t blocks = std::min<int64_t>((total + threads - 1) / threads, cap);
  if (total + blocks * threads <= (int64_t)UINT32_MAX) {
    hisparse::write_through_kernel<V, uint32_t><<<(unsigned)blocks, threads, 0, st>>>(
        k, v, ks, vs, T, tok, page, off, (uint32_t)n, host, pages, P, (uint32_t)nvec);
  } else {
    hisparse::write_through_kernel<V, uint64_t><<<(unsigned)blocks, threads, 0, st>>>(
        k, v, ks, vs, T, tok, page, off, (uint64_t)n, host, pages, P, (uint64_t)nvec);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void write_through(torch::Tensor& host, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& tok,
                   const torch::Tensor& page, const torch::Tensor& off, int64_t max_blocks) {
  TORCH_CHECK(k.is_cuda(), "write_through: k must be a CUDA tensor, got ", k.device());
  const auto dev = k.device();
  const c10::cuda::CUDAGuard guard(dev);
  TORCH_CHECK(host.dim() == 5 && host.size(1) == 2, "write_through: host must be (pages, 2, P, Hkv, D), got ",
              dims(host.sizes()));
  TORCH_CHECK(host.is_contiguous(), "write_through: host must be contiguous");
  TORCH_CHECK(!host.is_cuda() || host.device() == dev, "write_through: host must be pinned CPU memory or on ", dev,
              ", got ", host.device());
  const int64_t Hkv = host.size(3), D = host.size(4);
  check_rows(k, "k", dev, host.scalar_type(), Hkv, D);
  check_rows(v, "v", dev, host.scalar_type(), Hkv, D);
  TORCH_CHECK(v.size(0) == k.size(0), "write_through: k and v must have the same tokens, got ", k.size(0), " and ",
              v.size(0));
  const int64_t n = tok.numel();
  check_index(tok, "tok", n, dev);
  check_index(page, "page", n, dev);
  check_index(off, "off", n, dev);
  TORCH_CHECK(max_blocks >= 0, "write_through: max_blocks must be >= 0 (0 = 8 per SM), got ", max_blocks);
  uint8_t* hptr = hisparse::device_address(host, "write_through", "host");
  const int64_t es = host.element_size(), row_bytes = Hkv * D * es, T = k.size(0);
  if (n == 0 || row_bytes == 0 || T == 0 || host.size(0) == 0) return;

  cudaStream_t st = at::cuda::getCurrentCUDAStream();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t cap = max_blocks > 0 ? std::min<int64_t>(max_blocks, (int64_t)sms * 8) : (int64_t)sms * 8;
  const auto* kptr = static_cast<const uint8_t*>(k.data_ptr());
  const auto* vptr = static_cast<const uint8_t*>(v.data_ptr());
  const int64_t ks = k.stride(0) * es, vs = v.stride(0) * es;
  // The widest vector dividing every row start: host rows start at multiples of row_bytes from hptr,
  // source rows at multiples of the token strides (irrelevant with one token) from kptr / vptr.
  const uintptr_t align = reinterpret_cast<uintptr_t>(hptr) | reinterpret_cast<uintptr_t>(kptr) |
                          reinterpret_cast<uintptr_t>(vptr) | (uintptr_t)row_bytes |
                          (uintptr_t)(T > 1 ? ks | vs : 0);
  int vec = 16;
  while (vec > 1 && (align % vec) != 0) vec /= 2;
  const int64_t pages = host.size(0), P = host.size(2);
  const int64_t* tp = tok.data_ptr<int64_t>();
  const int64_t* pp = page.data_ptr<int64_t>();
  const int64_t* op = off.data_ptr<int64_t>();
  switch (vec) {
    case 16: launch<int4>(st, cap, kptr, vptr, ks, vs, T, tp, pp, op, n, hptr, pages, P, row_bytes); break;
    case 8: launch<int2>(st, cap, kptr, vptr, ks, vs, T, tp, pp, op, n, hptr, pages, P, row_bytes); break;
    case 4: launch<int32_t>(st, cap, kptr, vptr, ks, vs, T, tp, pp, op, n, hptr, pages, P, row_bytes); break;
    case 2: launch<int16_t>(st, cap, kptr, vptr, ks, vs, T, tp, pp, op, n, hptr, pages, P, row_bytes); break;
    default: launch<int8_t>(st, cap, kptr, vptr, ks, vs, T, tp, pp, op, n, hptr, pages, P, row_bytes); break;
  }
}
