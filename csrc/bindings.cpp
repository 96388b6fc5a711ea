// The one bindings file: op schemas (mutated tensors marked) and CUDA implementations.
#include <torch/all.h>
#include <torch/library.h>

void add_one(const torch::Tensor& x, torch::Tensor& out);
void resolve_lru(const torch::Tensor& selection, torch::Tensor& slot_unit, torch::Tensor& unit_slot,
                 torch::Tensor& lru_order, const torch::Tensor& slot_map, torch::Tensor& buffer,
                 const torch::Tensor& host, const torch::Tensor& host_page_table,
                 torch::Tensor& device_locs, int64_t io_chunk_bytes);
void write_through(torch::Tensor& host, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& tok,
                   const torch::Tensor& page, const torch::Tensor& off, int64_t max_blocks);
torch::Tensor uva_view(const torch::Tensor& host);
void select_resolve(const torch::Tensor& scores, const torch::Tensor& seq, const torch::Tensor& num_full,
                    const torch::Tensor& hot, const torch::Tensor& rows, const torch::Tensor& block_table,
                    torch::Tensor& slot_unit, torch::Tensor& unit_slot, torch::Tensor& pol, torch::Tensor& counts,
                    torch::Tensor& sel, torch::Tensor& locs, torch::Tensor& missed, int64_t k, bool has_hot,
                    int64_t policy, int64_t shift, int64_t hit, int64_t threads);

TORCH_LIBRARY(hisparse, m) {
  m.def("add_one(Tensor x, Tensor(a!) out) -> ()");
  m.def(
      "resolve_lru(Tensor selection, Tensor(a!) slot_unit, Tensor(b!) unit_slot, Tensor(c!) lru_order, "
      "Tensor slot_map, Tensor(d!) buffer, Tensor host, Tensor host_page_table, Tensor(e!) device_locs, "
      "int io_chunk_bytes=64) -> ()");
  m.def("write_through(Tensor(a!) host, Tensor k, Tensor v, Tensor tok, Tensor page, Tensor off, int max_blocks=0) -> ()");
  m.def("uva_view(Tensor(a) host) -> Tensor(a)");
  m.def(
      "select_resolve(Tensor scores, Tensor seq, Tensor num_full, Tensor hot, Tensor rows, Tensor block_table, "
      "Tensor(a!) slot_unit, Tensor(b!) unit_slot, Tensor(c!) pol, Tensor(d!) counts, Tensor(e!) sel, "
      "Tensor(f!) locs, Tensor(g!) missed, int k, bool has_hot, int policy, int shift, int hit, int threads) -> ()");
}

TORCH_LIBRARY_IMPL(hisparse, CUDA, m) {
  m.impl("add_one", &add_one);
  m.impl("resolve_lru", &resolve_lru);
  m.impl("write_through", &write_through);
  m.impl("select_resolve", &select_resolve);
}

TORCH_LIBRARY_IMPL(hisparse, CPU, m) { m.impl("uva_view", &uva_view); }

// Importing the module registers the ops above; pybind11 module has no functions of its own.
#include <Python.h>
static struct PyModuleDef hisparse_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&hisparse_module); }
