// The one bindings file: op schemas (mutated tensors marked) and CUDA implementations.
#include <torch/all.h>
#include <torch/library.h>

void add_one(const torch::Tensor& x, torch::Tensor& out);

TORCH_LIBRARY(hisparse, m) {
  m.def("add_one(Tensor x, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(hisparse, CUDA, m) {
  m.impl("add_one", &add_one);
}

// Importing the module registers the ops above; pybind11 module has no functions of its own.
#include <Python.h>
static struct PyModuleDef hisparse_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&hisparse_module); }
