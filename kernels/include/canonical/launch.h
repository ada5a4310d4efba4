// Arguments of one CUDA transfer and the kernel's host-side entry points, in plain C
// types so the .cu file needs no torch headers (it compiles in seconds instead of
// minutes), and so tests/emulation can compile the same .cu for the CPU.
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

namespace canonical {

// Layer base pointers travel by value in the kernel parameters; 496 of them
// keep the whole struct under the classic 4 KiB parameter limit.
constexpr int kMaxLayers = 496;

struct LaunchArgs {
  const int64_t* plan;       // device: the registry's own copy of the verified words
  const int64_t* block_ids;  // device, or pinned host (read through UVA)
  const int64_t* page_ids;   // device, or pinned host (read through UVA)
  int64_t num_pairs;
  int64_t num_fragments;
  int64_t num_pages;   // cpu_pages rows x pages_per_row (saturated), for the page id check
  uint8_t* cpu_pages;  // device-usable address of pinned / registered host memory
  int64_t* error;      // device-usable error record (kErrorRecordWords, see plan.h)
  int32_t num_layers;
  int32_t store;  // 1: kv -> cpu_pages (writers only); 0: cpu_pages -> kv
  uint8_t* layer_base[kMaxLayers];
};

static_assert(sizeof(LaunchArgs) <= 4096, "kernel parameters must fit the classic 4 KiB limit");

// Compiled-in kernel variants, selectable at run time (CANONICAL_KV_KERNEL_VARIANT or
// canonical_ops' _set_kernel_variant) so that a device run can compare them:
//   0 base     __launch_bounds__(512): lanes per fragment from the largest fragment
//              (<= 128 B: 8, <= 256 B: 16, else 32), one 16-byte vector per lane up to 512 B
//   1 2blk     as base with __launch_bounds__(512, 2): at most 64 registers, 2 blocks per SM
//   2 deep     narrower groups (<= 512 B: 8 lanes, <= 1 KiB: 16, else 32), so each lane
//              keeps up to kCopyUnroll vectors in flight
//   3 deep2blk deep with __launch_bounds__(512, 2)
constexpr int kNumKernelVariants = 4;
constexpr int kDefaultKernelVariant = 0;
constexpr int kNumGroupWidths = 3;                          // 8, 16, 32 lanes per fragment
constexpr int kNumKernels = 2 * kNumGroupWidths;            // x min blocks per SM (1, 2)
const char* kernel_variant_name(int variant);               // "base", "2blk", "deep", "deep2blk"
int kernel_index(int variant, int64_t max_fragment_bytes);  // which of the kNumKernels
int kernel_group_width(int kernel);                         // lanes per fragment of a kernel
int kernel_min_blocks(int kernel);                          // its __launch_bounds__ min blocks

// What the driver says about one compiled kernel on the current device.
struct KernelProperties {
  int num_regs;
  int max_threads_per_block;
  int binary_version;  // SASS the device runs (10 * major + minor; 0: none)
  int ptx_version;     // PTX it was JIT-compiled from (0: SASS)
  int blocks_per_sm;   // occupancy at kThreadsPerBlock threads, no shared memory
};
constexpr int kThreadsPerBlock = 512;

// Fills `out` for kernel `kernel` on the current device; cudaErrorNoKernelImageForDevice
// (or cudaErrorInvalidDeviceFunction) when the build has no image this device can run.
// Not for use during stream capture: call it when a plan is registered.
cudaError_t query_kernel_properties(int kernel, KernelProperties* out);

struct LaunchConfig {
  int sm_budget;               // SMs' worth of thread blocks to launch at most
  int64_t max_fragment_bytes;  // from the plan header: picks the lanes per fragment
  int variant;                 // 0 .. kNumKernelVariants - 1
  int blocks_per_sm;           // occupancy of the kernel kernel_index(variant, ...) picks
};

// Launches the single fused copy kernel on `stream` (only a launch: no query, no
// allocation, so it can be captured in a CUDA graph); returns the launch status.
// Nothing is launched when there is no work.
cudaError_t launch_canonical_copy(const LaunchArgs& args, const LaunchConfig& config,
                                  cudaStream_t stream);

}  // namespace canonical
