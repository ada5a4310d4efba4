// Device-side fragment copy shared by the fused kernel and the benchmark's
// descriptor-driven baseline kernel (bench/shims/cuda_baselines.cu), so the two differ
// only in where their addresses come from. Header-only, CUDA only.
#pragma once

#include <stdint.h>
#include <vector_types.h>

namespace canonical {

// Vectors each lane loads before it stores: bytes in flight hide PCIe latency.
constexpr int kCopyUnroll = 4;

template <int kGroup, typename Vec>
__device__ __forceinline__ void copy_vectors(uint8_t* dst, const uint8_t* src, int64_t size,
                                             int lane) {
  const Vec* s = reinterpret_cast<const Vec*>(src);
  Vec* d = reinterpret_cast<Vec*>(dst);
  const int64_t n = size / static_cast<int64_t>(sizeof(Vec));
  for (int64_t base = lane; base < n; base += kGroup * kCopyUnroll) {
    Vec r[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t k = base + u * kGroup;
      if (k < n) r[u] = s[k];
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t k = base + u * kGroup;
      if (k < n) d[k] = r[u];
    }
  }
}

// A group of kGroup lanes copies one fragment, with the widest vector that
// the addresses and the size allow (16 B for head-aligned fragments).
template <int kGroup>
__device__ __forceinline__ void group_copy(uint8_t* dst, const uint8_t* src, int64_t size,
                                           int lane) {
  const uint64_t align = reinterpret_cast<uint64_t>(dst) | reinterpret_cast<uint64_t>(src) |
                         static_cast<uint64_t>(size);
  if ((align & 15) == 0) {
    copy_vectors<kGroup, uint4>(dst, src, size, lane);
  } else if ((align & 7) == 0) {
    copy_vectors<kGroup, uint2>(dst, src, size, lane);
  } else if ((align & 3) == 0) {
    copy_vectors<kGroup, uint32_t>(dst, src, size, lane);
  } else if ((align & 1) == 0) {
    copy_vectors<kGroup, uint16_t>(dst, src, size, lane);
  } else {
    copy_vectors<kGroup, uint8_t>(dst, src, size, lane);
  }
}

}  // namespace canonical
