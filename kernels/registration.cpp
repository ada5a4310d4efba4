// The one TORCH_LIBRARY(canonical, ...) block: the two public schemas and the
// private helpers of the Python package. Also the module init that makes the
// built library importable as `canonical_ops._C` (pytorch/extension-cpp style).
#include <Python.h>
#include <torch/library.h>

#include "canonical/plan_registry.h"
#include "canonical/validation.h"

namespace canonical {
namespace {

bool built_with_cuda() {
#ifdef CANONICAL_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace canonical

extern "C" {
// `import canonical_ops._C` loads this library (its static initialisers register
// the ops); the module itself is empty.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(canonical, m) {
  m.def(
      "canonical_store(Tensor[] kv_caches, Tensor(a!) cpu_pages, Tensor plan, Tensor block_ids, "
      "Tensor page_ids) -> ()");
  m.def(
      "canonical_load(Tensor(a!)[] kv_caches, Tensor cpu_pages, Tensor plan, Tensor block_ids, "
      "Tensor page_ids) -> ()");
  // Private helpers of the Python package (not part of the public contract).
  m.def("_register_plan(Tensor plan, Tensor host_plan) -> ()", &canonical::register_plan);
  m.def("_plan_error(Tensor plan) -> int[]", &canonical::plan_error);
  m.def("_set_sm_budget(int sms) -> int", &canonical::set_sm_budget);
  m.def("_built_with_cuda() -> bool", &canonical::built_with_cuda);
  m.def("_cpu_threads_used(int work_items) -> int", &canonical::cpu_threads_used);
}
