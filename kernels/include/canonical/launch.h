// Arguments of one CUDA transfer, in plain C types so the .cu file needs no
// torch headers (it compiles in seconds instead of minutes).
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

namespace canonical {

// Layer base pointers travel by value in the kernel parameters; 496 of them
// keep the whole struct under the classic 4 KiB parameter limit.
constexpr int kMaxLayers = 496;

struct LaunchArgs {
  const int64_t* plan;       // device
  const int64_t* block_ids;  // device, or pinned host (read through UVA)
  const int64_t* page_ids;   // device, or pinned host (read through UVA)
  int64_t num_pairs;
  int64_t num_fragments;
  int64_t num_rows;    // cpu_pages.size(0), for the device-side page id check
  uint8_t* cpu_pages;  // device-usable address of pinned / registered host memory
  int64_t* error;      // device int64[4]: code bits, first bad pair + 1, its block, its page
  int32_t num_layers;
  int32_t store;  // 1: kv -> cpu_pages (writers only); 0: cpu_pages -> kv
  uint8_t* layer_base[kMaxLayers];
};

static_assert(sizeof(LaunchArgs) <= 4096, "kernel parameters must fit the classic 4 KiB limit");

struct LaunchConfig {
  int sm_budget;               // SMs' worth of thread blocks to launch at most
  int64_t max_fragment_bytes;  // from the plan header: picks the lanes per fragment
};

// Launches the single fused copy kernel on `stream`; returns the launch status.
// Nothing is launched when there is no work.
cudaError_t launch_canonical_copy(const LaunchArgs& args, const LaunchConfig& config,
                                  cudaStream_t stream);

}  // namespace canonical
