// The fused CUDA copy kernel: one launch moves every fragment of every layer
// of every (block, page) pair. Expansion and writer filtering happen on the
// device with the same plan.h math the CPU kernel uses. Includes no torch
// headers, so it compiles quickly.
//
// tests/emulation compiles this file for the CPU (g++ -x c++) and runs it thread by
// thread against the CPU op: keep it free of what sequential emulation cannot honour
// (__syncthreads, __shared__, warp shuffles / votes, cooperative groups, atomics on
// shared state, inline PTX); the emulation refuses to build if any appears.
#include <cuda_runtime.h>

#include <algorithm>

#include "canonical/copy.cuh"
#include "canonical/launch.h"
#include "canonical/plan.h"

namespace canonical {
namespace {

// Records a refused pair with plain stores (the record may be mapped pinned host
// memory, where device atomics are not guaranteed): the flags get the same value
// from every reporter; the pair word keeps one refused pair (an aligned 8-byte store).
__device__ void report_error(int64_t* error, bool block_bad, bool page_bad, int64_t pair) {
  volatile int64_t* record = error;
  if (block_bad) record[kErrorBlockFlag] = 1;
  if (page_bad) record[kErrorPageFlag] = 1;
  record[kErrorPair] = pair + 1;
}

template <int kGroup, int kMinBlocks>
__global__ void __launch_bounds__(kThreadsPerBlock, kMinBlocks)
    canonical_copy_kernel(const __grid_constant__ LaunchArgs args) {
  const PlanView plan{args.plan};
  const int lane = threadIdx.x % kGroup;
  const int64_t first_group =
      (static_cast<int64_t>(blockIdx.x) * kThreadsPerBlock + threadIdx.x) / kGroup;
  const int64_t num_groups = static_cast<int64_t>(gridDim.x) * kThreadsPerBlock / kGroup;
  const int64_t total = args.num_pairs * args.num_fragments;
  for (int64_t w = first_group; w < total; w += num_groups) {
    const int64_t pair = w / args.num_fragments;
    const int64_t fragment = w - pair * args.num_fragments;
    const int64_t block_id = args.block_ids[pair];
    const int64_t page_id = args.page_ids[pair];
    if (!ids_in_range(plan, block_id, page_id, args.num_pages)) {
      // Skip the pair in every layer, touch nothing; one group per pair reports it.
      if (lane == 0 && fragment == 0) {
        const bool block_bad = block_id < 0 || block_id >= plan.header(kMinNumBlocks);
        const bool page_bad = page_id < 0 || page_id >= args.num_pages;
        report_error(args.error, block_bad, page_bad, pair);
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

using KernelFn = void (*)(const LaunchArgs);

// Kernel k: lanes kernel_group_width(k), min blocks kernel_min_blocks(k).
constexpr KernelFn kKernels[kNumKernels] = {
    canonical_copy_kernel<8, 1>, canonical_copy_kernel<16, 1>, canonical_copy_kernel<32, 1>,
    canonical_copy_kernel<8, 2>, canonical_copy_kernel<16, 2>, canonical_copy_kernel<32, 2>,
};

}  // namespace

const char* kernel_variant_name(int variant) {
  static const char* const kNames[kNumKernelVariants] = {"base", "2blk", "deep", "deep2blk"};
  return variant >= 0 && variant < kNumKernelVariants ? kNames[variant] : "unknown";
}

int kernel_index(int variant, int64_t max_fragment_bytes) {
  const bool deep = variant == 2 || variant == 3;
  const bool two_blocks = variant == 1 || variant == 3;
  // Lanes per fragment. base: a 16-byte vector per lane covers the largest fragment in
  // few steps without leaving most lanes idle on small fragments. deep: up to
  // kCopyUnroll vectors per lane, so each lane has more bytes in flight.
  const int64_t per_lane = deep ? 16 * kCopyUnroll : 16;
  int group = 2;  // 32 lanes
  if (max_fragment_bytes <= 8 * per_lane) {
    group = 0;  // 8 lanes
  } else if (max_fragment_bytes <= 16 * per_lane) {
    group = 1;  // 16 lanes
  }
  return (two_blocks ? kNumGroupWidths : 0) + group;
}

int kernel_group_width(int kernel) { return 8 << (kernel % kNumGroupWidths); }

int kernel_min_blocks(int kernel) { return 1 + kernel / kNumGroupWidths; }

cudaError_t query_kernel_properties(int kernel, KernelProperties* out) {
  if (kernel < 0 || kernel >= kNumKernels) return cudaErrorInvalidValue;
  cudaFuncAttributes attributes{};
  cudaError_t status = cudaFuncGetAttributes(&attributes, kKernels[kernel]);
  if (status != cudaSuccess) return status;
  out->num_regs = attributes.numRegs;
  out->max_threads_per_block = attributes.maxThreadsPerBlock;
  out->binary_version = attributes.binaryVersion;
  out->ptx_version = attributes.ptxVersion;
  int blocks = 0;
  status =
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kKernels[kernel], kThreadsPerBlock, 0);
  if (status != cudaSuccess) return status;
  out->blocks_per_sm = std::max(blocks, 1);
  return cudaSuccess;
}

cudaError_t launch_canonical_copy(const LaunchArgs& args, const LaunchConfig& config,
                                  cudaStream_t stream) {
  if (args.num_pairs == 0 || args.num_fragments == 0) return cudaSuccess;
  if (config.variant < 0 || config.variant >= kNumKernelVariants || config.blocks_per_sm < 1 ||
      config.sm_budget < 1) {
    return cudaErrorInvalidValue;
  }
  const int kernel = kernel_index(config.variant, config.max_fragment_bytes);
  const int64_t total = args.num_pairs * args.num_fragments;
  const int64_t groups_per_block = kThreadsPerBlock / kernel_group_width(kernel);
  const int64_t needed = (total + groups_per_block - 1) / groups_per_block;
  const int64_t budget = static_cast<int64_t>(config.sm_budget) * config.blocks_per_sm;
  cudaLaunchConfig_t launch{};
  launch.gridDim = dim3(static_cast<unsigned>(std::max<int64_t>(1, std::min(needed, budget))));
  launch.blockDim = dim3(kThreadsPerBlock);
  launch.dynamicSmemBytes = 0;
  launch.stream = stream;
  // cudaLaunchKernelEx rather than <<<>>>: one launch site that the CPU emulation of
  // this file (tests/emulation) provides too.
  return cudaLaunchKernelEx(&launch, kKernels[kernel], args);
}

}  // namespace canonical
