// CUDA baselines of bench_transfer.py: a descriptor-driven copy kernel through UVA and a
// per-fragment cudaMemcpyAsync loop (in C, so that Python overhead is not what is measured).
// Compiled at bench time with nvcc, no torch headers, by CudaShim (bench/_baselines.py).
#include <cuda_runtime.h>
#include <stdint.h>

#include "canonical/copy.cuh"  // the fused kernel's own fragment copy

namespace {
constexpr int kThreads = 512;
// kGroup lanes per descriptor; descriptors (src[], dst[], size[]) in device memory,
// data addresses device or pinned host (UVA).
template <int kGroup>
__global__ void __launch_bounds__(kThreads)
    descriptor_copy(const int64_t* __restrict__ desc, int64_t count) {
  const int lane = threadIdx.x % kGroup;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / kGroup;
  const int64_t groups = static_cast<int64_t>(gridDim.x) * kThreads / kGroup;
  for (int64_t i = first; i < count; i += groups) {
    const uint8_t* s = reinterpret_cast<const uint8_t*>(desc[i]);
    uint8_t* d = reinterpret_cast<uint8_t*>(desc[count + i]);
    const int64_t size = desc[2 * count + i];
    canonical::group_copy<kGroup>(d, s, size, lane);
  }
}

template <int kGroup>
int occupancy(int* blocks_per_sm) {
  return static_cast<int>(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      blocks_per_sm, descriptor_copy<kGroup>, kThreads, 0));
}
}  // namespace

extern "C" {
int shim_threads() { return kThreads; }

int shim_blocks_per_sm(int group, int* blocks_per_sm) {
  if (group == 8) return occupancy<8>(blocks_per_sm);
  if (group == 16) return occupancy<16>(blocks_per_sm);
  return occupancy<32>(blocks_per_sm);
}

int shim_descriptor_copy(const int64_t* desc, int64_t count, int grid, int group, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (count <= 0) return 0;
  if (group == 8) {
    descriptor_copy<8><<<grid, kThreads, 0, s>>>(desc, count);
  } else if (group == 16) {
    descriptor_copy<16><<<grid, kThreads, 0, s>>>(desc, count);
  } else {
    descriptor_copy<32><<<grid, kThreads, 0, s>>>(desc, count);
  }
  return static_cast<int>(cudaGetLastError());
}

int shim_memcpy_each(const int64_t* src, const int64_t* dst, const int64_t* sizes, int64_t count,
                     void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  for (int64_t i = 0; i < count; ++i) {
    const cudaError_t e =
        cudaMemcpyAsync(reinterpret_cast<void*>(dst[i]), reinterpret_cast<const void*>(src[i]),
                        static_cast<size_t>(sizes[i]), cudaMemcpyDefault, s);
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  return 0;
}

// The device-usable address of pinned host memory (UVA: normally the same address).
int shim_device_address(const void* host, void** device) {
  cudaPointerAttributes attributes{};
  const cudaError_t e = cudaPointerGetAttributes(&attributes, host);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return static_cast<int>(e);
  }
  *device = attributes.devicePointer;
  return attributes.type == cudaMemoryTypeHost ? 0 : -1;
}

const char* shim_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
}
