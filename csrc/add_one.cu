// Torch launcher for the pipeline probe op: checks inputs, picks the current stream.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/all.h>

#include "kernels/add_one.cuh"

void add_one(const torch::Tensor& x, torch::Tensor& out) {
  TORCH_CHECK(x.is_cuda() && out.is_cuda(), "add_one: tensors must be on CUDA");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "add_one: tensors must be contiguous");
  TORCH_CHECK(x.sizes() == out.sizes() && x.scalar_type() == out.scalar_type(), "add_one: x/out mismatch");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "add_one: float32 only");
  const c10::cuda::CUDAGuard guard(x.device());
  int64_t n = x.numel();
  if (n == 0) return;
  int threads = 256;
  int64_t blocks = (n + threads - 1) / threads;
  hisparse::add_one_kernel<float><<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), out.data_ptr<float>(), n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
