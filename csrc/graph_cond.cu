// Conditional (IF) nodes inside a CUDA graph being captured by torch / vLLM, and a CUDA alias of
// pinned host memory for the Triton kernels.
//
// graph_cond_set(preds): on the current stream (which must be capturing) create one conditional
//   handle per entry of preds (int64 on the device) and one kernel that sets handle i to
//   (preds[i] != 0) at replay; returns the handles (an int64 CPU tensor).
// graph_cond_begin(handle, body_stream): add an IF node on that handle after the stream's capture
//   frontier, make it the frontier, and start capturing body_stream into its body graph; work
//   launched on body_stream until graph_cond_end(body_stream) runs only when the handle is set.
//   The body must not allocate (the caching allocator does not know the body's capture).
// uva_view(host): a CUDA tensor aliasing a pinned (mapped) CPU tensor's memory: loads and stores go
//   over PCIe. It must not outlive the host tensor.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/all.h>

#include "uva.h"

namespace {

constexpr int kMaxConds = 8;

struct Handles {
  cudaGraphConditionalHandle h[kMaxConds];
};

__global__ void set_conds_kernel(Handles handles, const int64_t* preds, int n) {
  for (int i = 0; i < n; ++i) cudaGraphSetConditional(handles.h[i], preds[i] != 0 ? 1u : 0u);
}

// The graph a stream is capturing into and the stream's current frontier (the nodes new work
// depends on).
struct Frontier {
  cudaGraph_t graph = nullptr;
  const cudaGraphNode_t* deps = nullptr;
  const cudaGraphEdgeData* edges = nullptr;
  size_t n = 0;

  explicit Frontier(cudaStream_t s) {
    cudaStreamCaptureStatus status;
    unsigned long long id = 0;
    C10_CUDA_CHECK(cudaStreamGetCaptureInfo(s, &status, &id, &graph, &deps, &edges, &n));
    TORCH_CHECK(status == cudaStreamCaptureStatusActive,
                "graph_cond: the current CUDA stream is not being captured");
  }
};

}  // namespace

torch::Tensor graph_cond_set(const torch::Tensor& preds) {
  TORCH_CHECK(preds.is_cuda() && preds.scalar_type() == torch::kInt64 && preds.is_contiguous(),
              "graph_cond_set: preds must be a contiguous int64 CUDA tensor");
  const int n = (int)preds.numel();
  TORCH_CHECK(n >= 1 && n <= kMaxConds, "graph_cond_set: 1 to ", kMaxConds, " conditions, got ", n);
  const c10::cuda::CUDAGuard guard(preds.device());
  cudaStream_t s = at::cuda::getCurrentCUDAStream();
  const Frontier f(s);
  Handles hs = {};
  auto out = torch::empty({n}, torch::TensorOptions().dtype(torch::kInt64));
  int64_t* o = out.data_ptr<int64_t>();
  for (int i = 0; i < n; ++i) {
    C10_CUDA_CHECK(cudaGraphConditionalHandleCreate(&hs.h[i], f.graph, 0, 0));
    o[i] = (int64_t)hs.h[i];
  }
  set_conds_kernel<<<1, 1, 0, s>>>(hs, preds.data_ptr<int64_t>(), n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

void graph_cond_begin(const torch::Tensor& like, int64_t handle, int64_t body_stream) {
  const c10::cuda::CUDAGuard guard(like.device());
  cudaStream_t s = at::cuda::getCurrentCUDAStream();
  const Frontier f(s);
  cudaGraphNodeParams params = {};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = (cudaGraphConditionalHandle)handle;
  params.conditional.type = cudaGraphCondTypeIf;
  params.conditional.size = 1;
  cudaGraphNode_t node;
  C10_CUDA_CHECK(cudaGraphAddNode(&node, f.graph, f.deps, f.edges, f.n, &params));
  cudaGraph_t body = params.conditional.phGraph_out[0];
  C10_CUDA_CHECK(cudaStreamUpdateCaptureDependencies(s, &node, nullptr, 1, cudaStreamSetCaptureDependencies));
  C10_CUDA_CHECK(cudaStreamBeginCaptureToGraph(reinterpret_cast<cudaStream_t>(body_stream), body, nullptr,
                                               nullptr, 0, cudaStreamCaptureModeThreadLocal));
}

void graph_cond_end(const torch::Tensor& like, int64_t body_stream) {
  const c10::cuda::CUDAGuard guard(like.device());
  cudaGraph_t body = nullptr;
  C10_CUDA_CHECK(cudaStreamEndCapture(reinterpret_cast<cudaStream_t>(body_stream), &body));
}

torch::Tensor uva_view(const torch::Tensor& host) {
  TORCH_CHECK(host.is_contiguous(), "uva_view: host must be contiguous");
  uint8_t* p = hisparse::device_address(host, "uva_view", "host");
  const int dev = at::cuda::current_device();
  return torch::from_blob(p, host.sizes(), host.strides(),
                          torch::TensorOptions().dtype(host.dtype()).device(torch::kCUDA, dev));
}
