// Registry of CUDA plans (verified host words, the registry's own device copy, the
// plan's default error record in mapped pinned memory) and the per-device table of
// kernel properties. CUDA builds only.
#include "canonical/plan_registry.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "canonical/plan.h"
#include "canonical/validation.h"

// setup.py passes TORCH_CUDA_ARCH_LIST as bare tokens (e.g. 8.0+PTX,9.0).
#define CANONICAL_STRINGIFY(...) #__VA_ARGS__
#define CANONICAL_EXPAND_STRINGIFY(...) CANONICAL_STRINGIFY(__VA_ARGS__)
#ifdef CANONICAL_CUDA_ARCH_TOKENS
#define CANONICAL_CUDA_ARCH_LIST CANONICAL_EXPAND_STRINGIFY(CANONICAL_CUDA_ARCH_TOKENS)
#else
#define CANONICAL_CUDA_ARCH_LIST "unknown"
#endif

namespace canonical {
namespace {

using PlanKey = std::tuple<const void*, int64_t, int64_t>;  // storage impl, offset, numel

struct Registered {
  std::shared_ptr<PlanEntry> entry;
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
};

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::map<PlanKey, Registered>& registry() {
  static std::map<PlanKey, Registered> r;
  return r;
}
// Device buffers of dropped entries: never freed, since a kernel or a captured graph
// may still read them (see find_plan).
std::vector<std::shared_ptr<PlanEntry>>& retired() {
  static std::vector<std::shared_ptr<PlanEntry>> r;
  return r;
}

PlanKey key_of(const at::Tensor& plan) {
  return {plan.storage().unsafeGetStorageImpl(), plan.storage_offset(), plan.numel()};
}

struct DeviceKernels {
  std::string error;  // empty: every kernel has an image for the device
  KernelProperties properties[kNumKernels]{};
};

std::mutex& kernels_mutex() {
  static std::mutex m;
  return m;
}
std::map<c10::DeviceIndex, std::unique_ptr<DeviceKernels>>& kernels_table() {
  static std::map<c10::DeviceIndex, std::unique_ptr<DeviceKernels>> t;
  return t;
}

std::unique_ptr<DeviceKernels> probe_kernels(c10::DeviceIndex device) {
  const c10::cuda::CUDAGuard guard(device);
  auto table = std::make_unique<DeviceKernels>();
  for (int k = 0; k < kNumKernels; ++k) {
    const cudaError_t status = query_kernel_properties(k, &table->properties[k]);
    if (status == cudaSuccess) continue;
    (void)cudaGetLastError();  // not sticky: do not leave it for an unrelated later call
    cudaDeviceProp prop{};
    const bool named = cudaGetDeviceProperties(&prop, device) == cudaSuccess;
    table->error = std::string("canonical-kv cannot run on cuda:") + std::to_string(device) +
                   (named ? std::string(" (") + prop.name + ", compute capability " +
                                std::to_string(prop.major) + "." + std::to_string(prop.minor) + ")"
                          : std::string()) +
                   ": " + cudaGetErrorString(status) +
                   ". The extension was built with TORCH_CUDA_ARCH_LIST=\"" +
                   CANONICAL_CUDA_ARCH_LIST +
                   "\"; rebuild it with that GPU's compute capability in TORCH_CUDA_ARCH_LIST "
                   "(e.g. \"8.0+PTX;9.0\" runs on every GPU from sm_80 up)";
    break;
  }
  return table;
}

}  // namespace

uint8_t* PinnedRange::translate(const uint8_t* host, int64_t bytes) const {
  if (host_begin == nullptr || host < host_begin || host > host_end || bytes > host_end - host) {
    return nullptr;
  }
  return device_begin + (host - host_begin);
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  return capture != cudaStreamCaptureStatusNone;
}

uint8_t* device_address(const char* name, const void* host_ptr) {
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
  return static_cast<uint8_t*>(attributes.devicePointer);
}

const KernelProperties* device_kernels(c10::DeviceIndex device, bool may_query) {
  std::lock_guard<std::mutex> lock(kernels_mutex());
  auto& slot = kernels_table()[device];
  if (!slot) {
    if (!may_query) return nullptr;
    slot = probe_kernels(device);
  }
  TORCH_CHECK(slot->error.empty(), slot->error);
  return slot->properties;
}

PlanHandle find_plan(const at::Tensor& plan) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(key_of(plan));
  if (it == registry().end() || it->second.storage.expired()) return nullptr;
  return it->second.entry;
}

PlanHandle remember_plan(const at::Tensor& plan, std::vector<int64_t> words,
                         const at::Tensor* cpu_pages) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(words.size()) == plan.numel(), "plan: host copy has ",
                    words.size(), " words, the plan ", plan.numel());
  verify_plan_words(words.data(), static_cast<int64_t>(words.size()));
  const c10::DeviceIndex device = plan.device().index();
  const c10::cuda::CUDAGuard guard(device);
  device_kernels(device, /*may_query=*/true);  // refuses a GPU the build cannot run on

  auto entry = std::make_shared<PlanEntry>();
  entry->words = std::move(words);
  const at::Tensor host =
      at::from_blob(entry->words.data(), {static_cast<int64_t>(entry->words.size())},
                    at::TensorOptions().dtype(at::kLong));
  entry->device_words = host.to(plan.device(), /*non_blocking=*/false, /*copy=*/true);
  entry->error =
      at::zeros({kErrorRecordWords}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  entry->error_device =
      reinterpret_cast<int64_t*>(device_address("error record", entry->error.data_ptr()));
  entry->storage_offset = plan.storage_offset();
  entry->numel = plan.numel();
  entry->device = device;
  if (cpu_pages != nullptr && cpu_pages->defined() && cpu_pages->is_pinned() &&
      cpu_pages->numel() > 0) {
    const auto* begin = static_cast<const uint8_t*>(cpu_pages->data_ptr());
    const int64_t last = (cpu_pages->size(0) - 1) * cpu_pages->stride(0) + cpu_pages->size(1) - 1;
    uint8_t* device_begin = device_address("cpu_pages", begin);
    if (device_address("cpu_pages", begin + last) == device_begin + last) {
      entry->pages = PinnedRange{begin, begin + last + 1, device_begin};
    }
  }

  std::lock_guard<std::mutex> lock(registry_mutex());
  // Drop entries whose plan died (their buffers are retired, never freed).
  for (auto it = registry().begin(); it != registry().end();) {
    if (it->second.storage.expired()) {
      retired().push_back(std::move(it->second.entry));
      it = registry().erase(it);
    } else {
      ++it;
    }
  }
  const PlanKey key = key_of(plan);
  auto it = registry().find(key);
  if (it != registry().end()) {
    TORCH_CHECK_VALUE(it->second.entry->words == entry->words,
                      "plan: this tensor is already registered as another plan");
    return it->second.entry;
  }
  registry().emplace(key, Registered{entry, plan.storage().getWeakStorageImpl()});
  return entry;
}

void register_plan(const at::Tensor& plan, const at::Tensor& host_plan,
                   const at::Tensor& cpu_pages) {
  TORCH_CHECK_TYPE(plan.scalar_type() == at::kLong && host_plan.scalar_type() == at::kLong,
                   "plan: expected dtype int64");
  TORCH_CHECK_VALUE(plan.is_cuda() && plan.dim() == 1 && plan.is_contiguous(),
                    "plan: expected a contiguous 1-D CUDA tensor");
  TORCH_CHECK_VALUE(host_plan.device().is_cpu() && host_plan.is_contiguous(),
                    "plan: expected a contiguous CPU host copy");
  const int64_t* w = host_plan.data_ptr<int64_t>();
  remember_plan(plan, std::vector<int64_t>(w, w + host_plan.numel()), &cpu_pages);
}

std::vector<int64_t> plan_error(const at::Tensor& plan) {
  std::vector<int64_t> out(kErrorRecordWords, 0);
  const PlanHandle entry = find_plan(plan);
  if (entry == nullptr) return out;
  // Mapped pinned memory: a plain host read, no CUDA call. The caller has synchronised
  // with the transfers (the record is complete once their kernels are).
  volatile int64_t* record = entry->error.data_ptr<int64_t>();
  for (int64_t i = 0; i < kErrorRecordWords; ++i) {
    out[i] = record[i];
    record[i] = 0;
  }
  return out;
}

void check_cuda_kernels(int64_t device) {
  TORCH_CHECK_VALUE(device >= 0 && device < c10::cuda::device_count(),
                    "device: expected 0 <= ", "device < ",
                    static_cast<int>(c10::cuda::device_count()), ", got ", device);
  device_kernels(static_cast<c10::DeviceIndex>(device), /*may_query=*/true);
}

std::vector<int64_t> kernel_properties(int64_t device) {
  check_cuda_kernels(device);
  const KernelProperties* props =
      device_kernels(static_cast<c10::DeviceIndex>(device), /*may_query=*/false);
  std::vector<int64_t> out;
  for (int k = 0; k < kNumKernels; ++k) {
    const KernelProperties& p = props[k];
    out.insert(out.end(), {kernel_group_width(k), kernel_min_blocks(k), p.num_regs, p.blocks_per_sm,
                           p.binary_version, p.ptx_version});
  }
  return out;
}

}  // namespace canonical
