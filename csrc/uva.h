// Device address of a tensor's bytes for UVA loads and stores from a kernel (torch launchers only;
// kernels/ stays free of torch headers).
#pragma once
#include <cuda_runtime.h>
#include <torch/all.h>

#include <cstdint>

namespace hisparse {

// A CUDA tensor's own pointer, or the device alias of pinned host memory. Pinned memory from torch's
// host allocator is mapped under UVA (alias == host pointer); ask for the alias anyway. Unpinned CPU
// memory fails the check, naming the op and the argument.
inline uint8_t* device_address(const torch::Tensor& t, const char* op, const char* name) {
  if (t.is_cuda()) return static_cast<uint8_t*>(t.data_ptr());
  TORCH_CHECK(t.is_pinned(), op, ": ", name, " must be pinned CPU memory (or a CUDA tensor)");
  void* dptr = nullptr;
  if (cudaHostGetDevicePointer(&dptr, t.data_ptr(), 0) != cudaSuccess) {
    (void)cudaGetLastError();
    dptr = t.data_ptr();
  }
  return static_cast<uint8_t*>(dptr);
}

}  // namespace hisparse
