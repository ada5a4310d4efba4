// Registry of CUDA plans (CUDA builds only). A CUDA call validates against the
// verified host words kept here since make_plan (no device sync), and its kernel
// reads the registry's OWN device copy of those words: nothing the caller can reach
// (editing the plan tensor in place after make_plan changes nothing a kernel follows).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Storage.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "canonical/launch.h"

namespace canonical {

// Host memory the device reaches through its mapping: [host_begin, host_end) is at
// device_begin for the device (resolved outside stream capture).
struct PinnedRange {
  const uint8_t* host_begin = nullptr;
  const uint8_t* host_end = nullptr;
  uint8_t* device_begin = nullptr;

  // The device address of [host, host + bytes), or nullptr when not inside this range.
  uint8_t* translate(const uint8_t* host, int64_t bytes) const;
};

struct PlanEntry {
  std::vector<int64_t> words;       // verified host copy: what validation reads
  at::Tensor device_words;          // the registry's device copy: what the kernel reads
  at::Tensor error;                 // pinned host int64[kErrorRecordWords]: the plan's default
                                    // error record (check_device_errors)
  int64_t* error_device = nullptr;  // its device-usable address
  // Identity (kept by the registry with a weak reference to the plan tensor's storage,
  // which keeps the StorageImpl's address from being reused while the entry exists: a
  // tensor allocated where a freed plan was is never taken for it): storage, offset, length.
  int64_t storage_offset = 0;
  int64_t numel = 0;
  c10::DeviceIndex device = 0;

  // cpu_pages of the last call made outside capture (or of make_plan): a captured
  // call must use these pages (it may not ask the driver for their address).
  mutable std::mutex pages_mutex;
  mutable PinnedRange pages;
};

using PlanHandle = std::shared_ptr<const PlanEntry>;

// The entry of `plan` (same storage, offset and length as a registered plan), or
// nullptr. Entries of plans whose storage died are dropped at the next registration;
// their device copy and error record are kept for the life of the process (a kernel
// or a captured graph may still use them; a few KiB per plan).
PlanHandle find_plan(const at::Tensor& plan);

// Verifies `words` and registers them for `plan` (a CUDA tensor of the same length);
// resolves cpu_pages' device address when given pinned pages. Refuses a plan tensor
// already registered with other words.
PlanHandle remember_plan(const at::Tensor& plan, std::vector<int64_t> words,
                         const at::Tensor* cpu_pages);

// The compiled kernels' properties on `device`, probed once per device (under a lock)
// the first time `may_query` is true; nullptr if not probed yet and !may_query. Throws
// RuntimeError, with the reason, when the build has no kernel image the device runs.
const KernelProperties* device_kernels(c10::DeviceIndex device, bool may_query);

// Whether `stream` is capturing a CUDA graph.
bool stream_is_capturing(cudaStream_t stream);

// The device-usable address of pinned or cudaHostRegister'ed host memory (asks the
// driver: interior pointers included). Throws ValueError naming `name` otherwise. Not
// for use during capture.
uint8_t* device_address(const char* name, const void* host_ptr);

// Private ops behind canonical_ops (declared in registration.cpp).
void register_plan(const at::Tensor& plan, const at::Tensor& host_plan,
                   const at::Tensor& cpu_pages);
std::vector<int64_t> plan_error(const at::Tensor& plan);
void check_cuda_kernels(int64_t device);
std::vector<int64_t> kernel_properties(int64_t device);

}  // namespace canonical
