// WRITE-THROUGH: the step's new K/V rows go from the GPU straight into one layer of the pinned host
// pool with UVA stores: no staging copy, no host sync, no allocation (capturable in a CUDA graph).
//
// One flat index space over (entry, K|V, vector): consecutive threads store consecutive vectors of a
// row, so a warp's stores are contiguous bytes and rows of any size (12 bytes to several KB) keep all
// threads busy. A row is an opaque byte string (row_bytes = Hkv * D * element size); V is the widest
// vector type (16 bytes down to 1) dividing row_bytes, the source pointers and token strides and the
// host pointer, chosen by the launcher.
//
// Header-only, raw pointers, no torch headers.
#pragma once
#include <cstdint>

namespace hisparse {

constexpr int kWriteThroughThreads = 256;

// host: (pages, 2, P) rows of nvec * sizeof(V) bytes (K rows at [:, 0], V rows at [:, 1]);
// k, v: token t's row at k + t * k_stride, v + t * v_stride (bytes), t < T;
// tok, page, off: (n,) int64. Entry e copies k row tok[e] -> host[page[e], 0, off[e]] and v row
// tok[e] -> host[page[e], 1, off[e]]. page[e] < 0 is padding (a no-op). An entry whose tok, page or
// off is out of range is invalid and skipped, so a bad index never stores outside the pool.
// I: the flat index type (uint32_t when n * 2 * nvec plus one grid stride fits, else uint64_t).
template <typename V, typename I>
__global__ void __launch_bounds__(kWriteThroughThreads) write_through_kernel(
    const uint8_t* __restrict__ k, const uint8_t* __restrict__ v, int64_t k_stride, int64_t v_stride,
    int64_t T, const int64_t* __restrict__ tok, const int64_t* __restrict__ page,
    const int64_t* __restrict__ off, I n, uint8_t* __restrict__ host, int64_t pages, int64_t P, I nvec) {
  const I per_entry = 2 * nvec;
  const I total = n * per_entry;
  const I stride = (I)gridDim.x * blockDim.x;
  const int64_t row_bytes = (int64_t)nvec * sizeof(V);
  for (I idx = (I)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
    const I e = idx / per_entry;
    I j = idx - e * per_entry;
    const int kv = j >= nvec;
    j -= kv ? nvec : 0;
    // (the warp's lanes mostly share e: these loads are one broadcast each)
    const int64_t t = tok[e], p = page[e], o = off[e];
    if (t < 0 || t >= T || p < 0 || p >= pages || o < 0 || o >= P) continue;
    const uint8_t* src = kv ? v + t * v_stride : k + t * k_stride;
    const V x = reinterpret_cast<const V*>(src)[j];
    reinterpret_cast<V*>(host + ((p * 2 + kv) * P + o) * row_bytes)[j] = x;
  }
}

}  // namespace hisparse
