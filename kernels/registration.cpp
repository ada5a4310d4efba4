// The one TORCH_LIBRARY(canonical, ...) block: the two public schemas and the
// private helpers of the Python package. Also the module init that makes the
// built library importable as `canonical_ops._C` (pytorch/extension-cpp style).
#include <Python.h>
#include <torch/library.h>

#include "canonical/settings.h"
#include "canonical/validation.h"

#ifdef CANONICAL_WITH_CUDA
#include "canonical/plan_registry.h"
#endif

namespace canonical {
namespace {

bool built_with_cuda() {
#ifdef CANONICAL_WITH_CUDA
  return true;
#else
  return false;
#endif
}

#ifndef CANONICAL_WITH_CUDA
[[noreturn]] void no_cuda_kernels() {
  TORCH_CHECK(false,
              "canonical_ops was built without its CUDA kernels (no nvcc at build time, or "
              "CANONICAL_KV_BUILD_CUDA=0): rebuild it with nvcc available");
  __builtin_unreachable();
}
void check_cuda_kernels(int64_t) { no_cuda_kernels(); }
std::vector<int64_t> kernel_properties(int64_t) { no_cuda_kernels(); }
#endif

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
  // The public ops with a per-call error record (int64[4], pinned host memory that the
  // kernel writes through its mapping; see plan.h): the offload workers give each job
  // its own record, read after the job's event without any CUDA call.
  m.def(
      "_canonical_store_reporting(Tensor[] kv_caches, Tensor(a!) cpu_pages, Tensor plan, "
      "Tensor block_ids, Tensor page_ids, Tensor(b!) error_record) -> ()");
  m.def(
      "_canonical_load_reporting(Tensor(a!)[] kv_caches, Tensor cpu_pages, Tensor plan, "
      "Tensor block_ids, Tensor page_ids, Tensor(b!) error_record) -> ()");
  // CUDA plans: verified once, kept with the registry's own device copy (kernels per
  // device key: plan_registry.cpp; CPU: canonical_cpu.cpp).
  m.def("_register_plan(Tensor plan, Tensor host_plan, Tensor cpu_pages) -> ()");
  m.def("_plan_error(Tensor plan) -> int[]");
  m.def("_tensor_record(Tensor tensor) -> int[]", &canonical::tensor_record_op);
  m.def("_set_sm_budget(int sms) -> int", &canonical::set_sm_budget);
  m.def("_set_kernel_variant(int variant) -> int", &canonical::set_kernel_variant);
  m.def("_kernel_variants() -> str[]", &canonical::kernel_variant_names);
  m.def("_check_cuda_kernels(int device) -> ()", &canonical::check_cuda_kernels);
  m.def("_kernel_properties(int device) -> int[]", &canonical::kernel_properties);
  m.def("_built_with_cuda() -> bool", &canonical::built_with_cuda);
  m.def("_cpu_threads_used(int work_items) -> int", &canonical::cpu_threads_used);
}
