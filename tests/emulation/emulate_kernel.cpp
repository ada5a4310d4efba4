// Test driver of the CUDA kernel emulation: a C entry point (ctypes) that fills the real
// LaunchArgs / LaunchConfig and calls the real launch_canonical_copy of
// kernels/cuda/canonical_kernel.cu, compiled for the CPU with cuda_emulation.h.
#include <stdint.h>

#include "canonical/launch.h"
#include "canonical/plan.h"

extern "C" {

// Runs one transfer on the emulated device; returns the cudaError_t of the launch.
// `launch_info` receives: launches so far, grid size, block size, lanes per fragment.
int canonical_emulate(const int64_t* plan, const int64_t* block_ids, const int64_t* page_ids,
                      int64_t num_pairs, int64_t num_pages, uint8_t* cpu_pages,
                      uint8_t* const* layer_bases, int32_t num_layers, int32_t store,
                      int64_t* error_record, int32_t sm_budget, int32_t variant,
                      int32_t blocks_per_sm, int32_t reverse_order, int64_t* launch_info) {
  using namespace canonical;
  if (num_layers < 1 || num_layers > kMaxLayers) return cudaErrorInvalidValue;
  const PlanView view{plan};
  LaunchArgs args{};
  args.plan = plan;
  args.block_ids = block_ids;
  args.page_ids = page_ids;
  args.num_pairs = num_pairs;
  args.num_fragments = view.num_fragments();
  args.num_pages = num_pages;
  args.cpu_pages = cpu_pages;
  args.error = error_record;
  args.num_layers = num_layers;
  args.store = store;
  for (int32_t l = 0; l < num_layers; ++l) args.layer_base[l] = layer_bases[l];

  cuda_emulation::order = reverse_order ? cuda_emulation::kReverse : cuda_emulation::kForward;
  cuda_emulation::blocks_per_sm = blocks_per_sm;
  // The occupancy the host code would read from query_kernel_properties.
  const int kernel = kernel_index(variant, view.header(kMaxFragmentBytes));
  KernelProperties properties{};
  const cudaError_t queried = query_kernel_properties(kernel, &properties);
  if (queried != cudaSuccess) return queried;

  LaunchConfig config{};
  config.sm_budget = sm_budget;
  config.max_fragment_bytes = view.header(kMaxFragmentBytes);
  config.variant = variant;
  config.blocks_per_sm = properties.blocks_per_sm;
  const int64_t launches_before = cuda_emulation::launches;
  const cudaError_t status = launch_canonical_copy(args, config, nullptr);
  launch_info[0] = cuda_emulation::launches - launches_before;
  launch_info[1] = cuda_emulation::last_grid;
  launch_info[2] = cuda_emulation::last_block;
  launch_info[3] = kernel_group_width(kernel);
  return status;
}

}  // extern "C"
