// Pipeline probe: out[i] = in[i] + 1. Header-only kernel over raw pointers (no torch headers).
#pragma once
#include <cstdint>

namespace hisparse {

template <typename T>
__global__ void add_one_kernel(const T* __restrict__ in, T* __restrict__ out, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i] + T(1);
}

}  // namespace hisparse
