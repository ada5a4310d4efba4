// The fused CUDA copy kernel: one launch moves every fragment of every layer
// of every (block, page) pair. Expansion and writer filtering happen on the
// device with the same plan.h math the CPU kernel uses. Includes no torch
// headers, so it compiles quickly.
#include <cuda_runtime.h>

#include <algorithm>

#include "canonical/copy.cuh"
#include "canonical/launch.h"
#include "canonical/plan.h"

namespace canonical {
namespace {

constexpr int kThreads = 512;

__device__ void report_error(int64_t* error, int64_t code, int64_t pair, int64_t block_id,
                             int64_t page_id) {
  atomicOr(reinterpret_cast<unsigned long long*>(&error[0]), static_cast<unsigned long long>(code));
  // The first reporter records which pair it was.
  if (atomicCAS(reinterpret_cast<unsigned long long*>(&error[1]), 0ULL,
                static_cast<unsigned long long>(pair + 1)) == 0ULL) {
    error[2] = block_id;
    error[3] = page_id;
  }
}

template <int kGroup>
__global__ void __launch_bounds__(kThreads)
    canonical_copy_kernel(const __grid_constant__ LaunchArgs args) {
  const PlanView plan{args.plan};
  const int lane = threadIdx.x % kGroup;
  const int64_t first_group = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / kGroup;
  const int64_t num_groups = static_cast<int64_t>(gridDim.x) * kThreads / kGroup;
  const int64_t total = args.num_pairs * args.num_fragments;
  for (int64_t w = first_group; w < total; w += num_groups) {
    const int64_t pair = w / args.num_fragments;
    const int64_t fragment = w - pair * args.num_fragments;
    const int64_t block_id = args.block_ids[pair];
    const int64_t page_id = args.page_ids[pair];
    const int64_t layer = plan.fragment(fragment)[kFragmentLayer];
    if (!ids_in_range(plan, layer, block_id, page_id, args.num_rows)) {
      // Skip the item, touch nothing; the host raises at the next check.
      if (lane == 0) {
        const bool block_ok = block_id >= 0 && block_id < plan.layer(layer)[kNumBlocks];
        report_error(args.error, block_ok ? kErrorPageId : kErrorBlockId, pair, block_id, page_id);
      }
      continue;
    }
    const Expanded e = expand(plan, fragment, block_id, page_id);
    if (args.store && !e.is_writer) continue;
    uint8_t* kv = args.layer_base[e.layer] + e.local_byte;
    uint8_t* host = args.cpu_pages + e.canonical_byte;
    if (args.store) {
      canonical::group_copy<kGroup>(host, kv, e.size, lane);
    } else {
      canonical::group_copy<kGroup>(kv, host, e.size, lane);
    }
  }
}

template <int kGroup>
cudaError_t launch_group(const LaunchArgs& args, const LaunchConfig& config, cudaStream_t stream) {
  static int blocks_per_sm = 0;  // occupancy of this instantiation, computed once
  if (blocks_per_sm == 0) {
    const cudaError_t status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &blocks_per_sm, canonical_copy_kernel<kGroup>, kThreads, 0);
    if (status != cudaSuccess) return status;
    blocks_per_sm = std::max(blocks_per_sm, 1);
  }
  const int64_t total = args.num_pairs * args.num_fragments;
  const int64_t groups_per_block = kThreads / kGroup;
  const int64_t needed = (total + groups_per_block - 1) / groups_per_block;
  const int64_t budget = static_cast<int64_t>(config.sm_budget) * blocks_per_sm;
  const unsigned grid = static_cast<unsigned>(std::max<int64_t>(1, std::min(needed, budget)));
  canonical_copy_kernel<kGroup><<<grid, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_canonical_copy(const LaunchArgs& args, const LaunchConfig& config,
                                  cudaStream_t stream) {
  if (args.num_pairs == 0 || args.num_fragments == 0) return cudaSuccess;
  // Lanes per fragment: a 16-byte vector per lane covers the largest fragment
  // in few steps without leaving most lanes idle on small fragments.
  if (config.max_fragment_bytes <= 128) return launch_group<8>(args, config, stream);
  if (config.max_fragment_bytes <= 256) return launch_group<16>(args, config, stream);
  return launch_group<32>(args, config, stream);
}

}  // namespace canonical
