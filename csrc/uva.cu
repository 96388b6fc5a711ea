// uva_view(host): a CUDA tensor aliasing a pinned (mapped) CPU tensor's memory, for the Triton
// kernels: loads and stores go over PCIe. It must not outlive the host tensor.
#include <ATen/cuda/CUDAContext.h>
#include <torch/all.h>

#include "uva.h"

torch::Tensor uva_view(const torch::Tensor& host) {
  TORCH_CHECK(host.is_contiguous(), "uva_view: host must be contiguous");
  uint8_t* p = hisparse::device_address(host, "uva_view", "host");
  const int dev = at::cuda::current_device();
  return torch::from_blob(p, host.sizes(), host.strides(),
                          torch::TensorOptions().dtype(host.dtype()).device(torch::kCUDA, dev));
}
