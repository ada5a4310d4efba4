// CUDA dispatch of canonical_store / canonical_load: validates on the host (plan
// words from the registry: no device sync), then one kernel launch on the current
// stream, reading the registry's own device copy of the plan. No allocation and no
// sync. Everything a launch needs besides the launch itself (kernel occupancy, the
// device address of cpu_pages and of the error record) is resolved when the plan is
// registered or by a call outside stream capture, so a captured call only launches.
// Only c10/cuda headers: ATen/cuda ones pull in cuBLAS/cuSPARSE headers that a
// bare nvcc toolkit lacks.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <mutex>

#include "canonical/checked.h"
#include "canonical/launch.h"
#include "canonical/plan.h"
#include "canonical/plan_registry.h"
#include "canonical/settings.h"
#include "canonical/validation.h"

namespace canonical {
namespace {

PlanHandle cuda_plan_entry(const at::Tensor& plan, bool capturing) {
  if (PlanHandle entry = find_plan(plan)) return entry;
  // Built by hand rather than by make_plan (or a copy of a plan): read it back once,
  // verify and remember it (the registry keeps its own device copy from now on).
  TORCH_CHECK_VALUE(!capturing,
                    "plan: not registered; build it with canonical_ops.make_plan (or make one "
                    "call with it) before capturing a CUDA graph");
  at::Tensor host = plan.to(at::kCPU);
  const int64_t* w = host.data_ptr<int64_t>();
  return remember_plan(plan, std::vector<int64_t>(w, w + host.numel()), nullptr);
}

const int64_t* ids_address(const char* name, const at::Tensor& ids, bool capturing) {
  if (ids.is_cuda()) return ids.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(!capturing, name, ": expected a CUDA tensor while capturing a CUDA graph");
  return reinterpret_cast<const int64_t*>(device_address(name, ids.data_ptr<int64_t>()));
}

// The device address of cpu_pages: asked of the driver outside capture (and
// remembered in the plan's entry), taken from the entry during capture.
uint8_t* pages_address(const PlanEntry& entry, const at::Tensor& cpu_pages, int64_t num_rows,
                       bool capturing) {
  if (num_rows == 0) return nullptr;  // no page id is in range: nothing is dereferenced
  const auto* begin = static_cast<const uint8_t*>(cpu_pages.data_ptr());
  // Validated: the rows lie in cpu_pages' storage, so this extent does not overflow.
  const int64_t bytes = (num_rows - 1) * cpu_pages.stride(0) + cpu_pages.size(1);
  std::lock_guard<std::mutex> lock(entry.pages_mutex);
  if (capturing) {
    uint8_t* device = entry.pages.translate(begin, bytes);
    TORCH_CHECK_VALUE(device != nullptr,
                      "cpu_pages: not the pages of make_plan or of an earlier call with this "
                      "plan; make one call with them outside the capture first");
    return device;
  }
  uint8_t* device = device_address("cpu_pages", begin);
  // A region pinned in several cudaHostRegister chunks must still be one contiguous
  // range for the device (true where UVA maps host pointers 1:1).
  uint8_t* last_device = device_address("cpu_pages", begin + bytes - 1);
  TORCH_CHECK_VALUE(last_device == device + bytes - 1,
                    "cpu_pages: its pinned pieces are not contiguous in the device's address "
                    "space; register it in one piece");
  entry.pages = PinnedRange{begin, begin + bytes, device};
  return device;
}

int64_t* error_address(const PlanEntry& entry, const at::Tensor* error_record, bool capturing) {
  if (error_record == nullptr) return entry.error_device;
  const at::Tensor& record = *error_record;
  TORCH_CHECK_TYPE(record.scalar_type() == at::kLong, "error_record: expected dtype int64, got ",
                   record.scalar_type());
  TORCH_CHECK_VALUE(record.device().is_cpu() && record.is_pinned() && record.is_contiguous() &&
                        record.numel() == kErrorRecordWords,
                    "error_record: expected a contiguous pinned CPU tensor of ", kErrorRecordWords,
                    " int64 words");
  TORCH_CHECK_VALUE(!capturing, "error_record: per-call error records are not for CUDA graphs");
  return reinterpret_cast<int64_t*>(device_address("error_record", record.data_ptr()));
}

void copy_cuda(const char* op, at::TensorList kv_caches, const at::Tensor& cpu_pages,
               const at::Tensor& plan, const at::Tensor& block_ids, const at::Tensor& page_ids,
               bool store, const at::Tensor* error_record) {
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
  // The calls below ask the driver nothing while the stream captures: a guard on the
  // current device, cudaStreamIsCapturing, then (outside capture only) pointer queries.
  const c10::cuda::CUDAGuard guard(plan.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const bool capturing = stream_is_capturing(stream);
  const PlanHandle entry = cuda_plan_entry(plan, capturing);
  const KernelProperties* kernels = device_kernels(entry->device, /*may_query=*/!capturing);
  TORCH_CHECK_VALUE(kernels != nullptr, "plan: register it (make_plan) before capturing");
  const PlanView host_view{entry->words.data()};
  const CallInfo info = validate_call(op, kv_caches, cpu_pages, plan, block_ids, page_ids,
                                      host_view, store, capturing);
  int64_t total = 0;
  TORCH_CHECK_VALUE(checked_mul(info.num_pairs, host_view.num_fragments(), &total),
                    "block_ids: too many pairs for this plan (pairs x fragments overflows int64)");
  if (total == 0) return;

  LaunchArgs args{};
  args.plan = entry->device_words.data_ptr<int64_t>();
  args.block_ids = ids_address("block_ids", block_ids, capturing);
  args.page_ids = ids_address("page_ids", page_ids, capturing);
  args.num_pairs = info.num_pairs;
  args.num_fragments = host_view.num_fragments();
  args.num_pages = info.num_pages;
  args.cpu_pages = pages_address(*entry, cpu_pages, info.num_rows, capturing);
  args.error = error_address(*entry, error_record, capturing);
  args.num_layers = static_cast<int32_t>(kv_caches.size());
  args.store = store ? 1 : 0;
  for (size_t l = 0; l < kv_caches.size(); ++l) {
    args.layer_base[l] = static_cast<uint8_t*>(kv_caches[l].data_ptr());
  }
  LaunchConfig config{};
  config.sm_budget = sm_budget();
  config.max_fragment_bytes = host_view.header(kMaxFragmentBytes);
  config.variant = kernel_variant();
  config.blocks_per_sm =
      kernels[kernel_index(config.variant, config.max_fragment_bytes)].blocks_per_sm;
  C10_CUDA_CHECK(launch_canonical_copy(args, config, stream));
}

void canonical_store_cuda(at::TensorList kv_caches, const at::Tensor& cpu_pages,
                          const at::Tensor& plan, const at::Tensor& block_ids,
                          const at::Tensor& page_ids) {
  copy_cuda("canonical_store", kv_caches, cpu_pages, plan, block_ids, page_ids, /*store=*/true,
            nullptr);
}

void canonical_load_cuda(at::TensorList kv_caches, const at::Tensor& cpu_pages,
                         const at::Tensor& plan, const at::Tensor& block_ids,
                         const at::Tensor& page_ids) {
  copy_cuda("canonical_load", kv_caches, cpu_pages, plan, block_ids, page_ids, /*store=*/false,
            nullptr);
}

void canonical_store_reporting_cuda(at::TensorList kv_caches, const at::Tensor& cpu_pages,
                                    const at::Tensor& plan, const at::Tensor& block_ids,
                                    const at::Tensor& page_ids, const at::Tensor& error_record) {
  copy_cuda("canonical_store", kv_caches, cpu_pages, plan, block_ids, page_ids, /*store=*/true,
            &error_record);
}

void canonical_load_reporting_cuda(at::TensorList kv_caches, const at::Tensor& cpu_pages,
                                   const at::Tensor& plan, const at::Tensor& block_ids,
                                   const at::Tensor& page_ids, const at::Tensor& error_record) {
  copy_cuda("canonical_load", kv_caches, cpu_pages, plan, block_ids, page_ids, /*store=*/false,
            &error_record);
}

}  // namespace
}  // namespace canonical

TORCH_LIBRARY_IMPL(canonical, CUDA, m) {
  m.impl("canonical_store", &canonical::canonical_store_cuda);
  m.impl("canonical_load", &canonical::canonical_load_cuda);
  m.impl("_canonical_store_reporting", &canonical::canonical_store_reporting_cuda);
  m.impl("_canonical_load_reporting", &canonical::canonical_load_reporting_cuda);
  m.impl("_register_plan", &canonical::register_plan);
  m.impl("_plan_error", &canonical::plan_error);
}
