// CUDA dispatch of canonical_store / canonical_load: validates on the host
// (plan words from the registry: no device sync), then one kernel launch on
// the current stream. No allocation and no sync, so calls can be captured in
// a CUDA graph.
// Only c10/cuda headers: ATen/cuda ones pull in cuBLAS/cuSPARSE headers that a
// bare nvcc toolkit lacks.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "canonical/launch.h"
#include "canonical/plan.h"
#include "canonical/plan_registry.h"
#include "canonical/validation.h"

namespace canonical {
namespace {

const PlanEntry& cuda_plan_entry(const at::Tensor& plan) {
  if (const PlanEntry* entry = find_plan(plan)) return *entry;
  // Built by hand rather than by make_plan: read it back once and remember it.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream().stream(), &capture));
  TORCH_CHECK_VALUE(capture == cudaStreamCaptureStatusNone,
                    "plan: not registered; build it with canonical_ops.make_plan before "
                    "capturing a CUDA graph");
  at::Tensor host = plan.to(at::kCPU);
  const int64_t* w = host.data_ptr<int64_t>();
  return remember_plan(plan, std::vector<int64_t>(w, w + host.numel()));
}

// The device-usable address of pinned or cudaHostRegister'ed host memory
// (interior pointers included, which is why this asks the driver rather than
// assuming UVA identity).
template <typename T>
T* device_address(const char* name, T* host_ptr) {
  cudaPointerAttributes attributes{};
  const cudaError_t status = cudaPointerGetAttributes(&attributes, host_ptr);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it so later calls are not blamed
  }
  TORCH_CHECK_VALUE(status == cudaSuccess && attributes.type == cudaMemoryTypeHost &&
                        attributes.devicePointer != nullptr,
                    name,
                    ": host memory is not pinned or registered for the device; use "
                    "pin_memory() or cudaHostRegister");
  return static_cast<T*>(attributes.devicePointer);
}

void copy_cuda(const char* op, at::TensorList kv_caches, const at::Tensor& cpu_pages,
               const at::Tensor& plan, const at::Tensor& block_ids, const at::Tensor& page_ids,
               bool store) {
  TORCH_CHECK_VALUE(!kv_caches.empty(), op, ": kv_caches: expected one tensor per layer, got none");
  TORCH_CHECK_VALUE(kv_caches[0].is_cuda(), "kv_caches[0]: expected a CUDA tensor like plan, got ",
                    kv_caches[0].device().str());
  TORCH_CHECK_TYPE(plan.scalar_type() == at::kLong, "plan: expected dtype int64, got ",
                   plan.scalar_type());
  TORCH_CHECK_VALUE(plan.dim() == 1 && plan.is_contiguous() && plan.is_cuda(),
                    "plan: expected a contiguous 1-D CUDA tensor from canonical_ops.make_plan");
  TORCH_CHECK_VALUE(plan.device() == kv_caches[0].device(), "plan: expected a tensor on ",
                    kv_caches[0].device().str(), " (the kv_caches device), got ",
                    plan.device().str());
  TORCH_CHECK_VALUE(static_cast<int64_t>(kv_caches.size()) <= kMaxLayers, "kv_caches: at most ",
                    kMaxLayers, " layers per plan on CUDA, got ", kv_caches.size());
  const c10::cuda::CUDAGuard guard(plan.device());
  const PlanEntry& entry = cuda_plan_entry(plan);
  const PlanView host_view{entry.words.data()};
  const CallInfo info =
      validate_call(op, kv_caches, cpu_pages, plan, block_ids, page_ids, host_view);
  if (info.num_pairs == 0 || host_view.num_fragments() == 0) return;

  LaunchArgs args{};
  args.plan = plan.data_ptr<int64_t>();
  args.block_ids = block_ids.is_cuda() ? block_ids.data_ptr<int64_t>()
                                       : device_address("block_ids", block_ids.data_ptr<int64_t>());
  args.page_ids = page_ids.is_cuda() ? page_ids.data_ptr<int64_t>()
                                     : device_address("page_ids", page_ids.data_ptr<int64_t>());
  args.num_pairs = info.num_pairs;
  args.num_fragments = host_view.num_fragments();
  args.num_rows = info.num_rows;
  args.cpu_pages = device_address("cpu_pages", cpu_pages.data_ptr<uint8_t>());
  if (info.num_rows > 0) {
    // A region pinned in several cudaHostRegister chunks must still be one
    // contiguous range for the device (true where UVA maps host pointers 1:1).
    const int64_t last = (info.num_rows - 1) * cpu_pages.stride(0) + cpu_pages.size(1) - 1;
    uint8_t* last_device = device_address("cpu_pages", cpu_pages.data_ptr<uint8_t>() + last);
    TORCH_CHECK_VALUE(last_device == args.cpu_pages + last,
                      "cpu_pages: its pinned pieces are not contiguous in the device's address "
                      "space; register it in one piece");
  }
  args.error = entry.error.data_ptr<int64_t>();
  args.num_layers = static_cast<int32_t>(kv_caches.size());
  args.store = store ? 1 : 0;
  for (size_t l = 0; l < kv_caches.size(); ++l) {
    args.layer_base[l] = static_cast<uint8_t*>(kv_caches[l].data_ptr());
  }
  LaunchConfig config{sm_budget(), host_view.header(kMaxFragmentBytes)};
  C10_CUDA_CHECK(launch_canonical_copy(args, config, c10::cuda::getCurrentCUDAStream().stream()));
}

void canonical_store_cuda(at::TensorList kv_caches, const at::Tensor& cpu_pages,
                          const at::Tensor& plan, const at::Tensor& block_ids,
                          const at::Tensor& page_ids) {
  copy_cuda("canonical_store", kv_caches, cpu_pages, plan, block_ids, page_ids, /*store=*/true);
}

void canonical_load_cuda(at::TensorList kv_caches, const at::Tensor& cpu_pages,
                         const at::Tensor& plan, const at::Tensor& block_ids,
                         const at::Tensor& page_ids) {
  copy_cuda("canonical_load", kv_caches, cpu_pages, plan, block_ids, page_ids, /*store=*/false);
}

}  // namespace
}  // namespace canonical

TORCH_LIBRARY_IMPL(canonical, CUDA, m) {
  m.impl("canonical_store", &canonical::canonical_store_cuda);
  m.impl("canonical_load", &canonical::canonical_load_cuda);
}
