// CPU emulation of the CUDA subset the project's kernel uses, so that g++ compiles the
// REAL kernels/cuda/canonical_kernel.cu (with copy.cuh and plan.h) and runs it thread by
// thread (tests/test_cuda_emulation.py).
//
// Sequential emulation is exact only for kernels whose threads never wait on or
// communicate with each other: no barriers, no shared memory, no warp collectives. Every
// construct that would break that is a compile error here (with a message), and the
// test also scans the sources for them. Atomics are provided: one thread at a time
// makes them exact (a kernel spinning on another thread's atomic would hang, which
// the test would report as a timeout).
//
// A launch (cudaLaunchKernelEx, the kernel's only launch site) runs every thread of
// every block, one after the other, in forward or reverse order (cuda_emulation::order),
// with threadIdx / blockIdx / blockDim / gridDim set as thread-local variables.
#pragma once

#if defined(__CUDACC__)
#error "cuda_emulation.h emulates CUDA for g++; nvcc has the real thing"
#endif

#include <stddef.h>
#include <stdint.h>

#include <utility>

// ----------------------------------------------------------------- qualifiers
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __restrict__ __restrict

// ----------------------------------------------------------------- refused constructs
// Each expands to an expression whose lambda body fails to compile: using one anywhere
// in the kernel sources stops the emulation build with this message.
#define CANONICAL_EMULATION_UNSUPPORTED(what)                                            \
  (                                                                                      \
      [] {                                                                               \
        static_assert(sizeof(int) == 0, "tests/emulation: " what                         \
                                        " cannot be emulated thread by thread (threads " \
                                        "would need to run concurrently); extend the "   \
                                        "emulation before using it in the kernel");      \
      }(),                                                                               \
      0)
#define __shared__ static_assert(sizeof(int) == 0, "tests/emulation: __shared__ memory");
#define __syncthreads(...) CANONICAL_EMULATION_UNSUPPORTED("__syncthreads")
#define __syncthreads_count(...) CANONICAL_EMULATION_UNSUPPORTED("__syncthreads_count")
#define __syncthreads_and(...) CANONICAL_EMULATION_UNSUPPORTED("__syncthreads_and")
#define __syncthreads_or(...) CANONICAL_EMULATION_UNSUPPORTED("__syncthreads_or")
#define __syncwarp(...) CANONICAL_EMULATION_UNSUPPORTED("__syncwarp")
#define __barrier_sync(...) CANONICAL_EMULATION_UNSUPPORTED("__barrier_sync")
#define __shfl(...) CANONICAL_EMULATION_UNSUPPORTED("__shfl")
#define __shfl_sync(...) CANONICAL_EMULATION_UNSUPPORTED("__shfl_sync")
#define __shfl_up_sync(...) CANONICAL_EMULATION_UNSUPPORTED("__shfl_up_sync")
#define __shfl_down_sync(...) CANONICAL_EMULATION_UNSUPPORTED("__shfl_down_sync")
#define __shfl_xor_sync(...) CANONICAL_EMULATION_UNSUPPORTED("__shfl_xor_sync")
#define __ballot(...) CANONICAL_EMULATION_UNSUPPORTED("__ballot")
#define __ballot_sync(...) CANONICAL_EMULATION_UNSUPPORTED("__ballot_sync")
#define __any_sync(...) CANONICAL_EMULATION_UNSUPPORTED("__any_sync")
#define __all_sync(...) CANONICAL_EMULATION_UNSUPPORTED("__all_sync")
#define __uni_sync(...) CANONICAL_EMULATION_UNSUPPORTED("__uni_sync")
#define __activemask(...) CANONICAL_EMULATION_UNSUPPORTED("__activemask")
#define __match_any_sync(...) CANONICAL_EMULATION_UNSUPPORTED("__match_any_sync")
#define __match_all_sync(...) CANONICAL_EMULATION_UNSUPPORTED("__match_all_sync")
#define __reduce_add_sync(...) CANONICAL_EMULATION_UNSUPPORTED("__reduce_add_sync")
#define __reduce_min_sync(...) CANONICAL_EMULATION_UNSUPPORTED("__reduce_min_sync")
#define __reduce_max_sync(...) CANONICAL_EMULATION_UNSUPPORTED("__reduce_max_sync")
#define __reduce_and_sync(...) CANONICAL_EMULATION_UNSUPPORTED("__reduce_and_sync")
#define __reduce_or_sync(...) CANONICAL_EMULATION_UNSUPPORTED("__reduce_or_sync")
#define __reduce_xor_sync(...) CANONICAL_EMULATION_UNSUPPORTED("__reduce_xor_sync")
#define __threadfence(...) CANONICAL_EMULATION_UNSUPPORTED("__threadfence")
#define __threadfence_block(...) CANONICAL_EMULATION_UNSUPPORTED("__threadfence_block")
#define __threadfence_system(...) CANONICAL_EMULATION_UNSUPPORTED("__threadfence_system")
#define __nanosleep(...) CANONICAL_EMULATION_UNSUPPORTED("__nanosleep")
#define cooperative_groups CANONICAL_EMULATION_UNSUPPORTED_cooperative_groups_namespace
#define cudaLaunchCooperativeKernel(...) \
  CANONICAL_EMULATION_UNSUPPORTED("cudaLaunchCooperativeKernel")

// ----------------------------------------------------------------- vector types
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned int x, y;
};
struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
};

inline thread_local uint3 threadIdx{0, 0, 0};
inline thread_local uint3 blockIdx{0, 0, 0};
inline thread_local dim3 blockDim{1, 1, 1};
inline thread_local dim3 gridDim{1, 1, 1};

// ----------------------------------------------------------------- runtime API subset
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDeviceFunction = 98,
  cudaErrorNoKernelImageForDevice = 209,
};
typedef cudaError_t cudaError;

struct CUstream_st;
typedef CUstream_st* cudaStream_t;

struct cudaLaunchAttribute;
struct cudaLaunchConfig_t {
  dim3 gridDim;
  dim3 blockDim;
  size_t dynamicSmemBytes;
  cudaStream_t stream;
  cudaLaunchAttribute* attrs;
  unsigned int numAttrs;
};

struct cudaFuncAttributes {
  size_t sharedSizeBytes;
  size_t constSizeBytes;
  size_t localSizeBytes;
  int maxThreadsPerBlock;
  int numRegs;
  int ptxVersion;
  int binaryVersion;
};

namespace cuda_emulation {

// Knobs and observations of the emulated device, set and read by the test driver.
enum Order { kForward = 0, kReverse = 1 };
inline Order order = kForward;
inline int blocks_per_sm = 1;  // what the occupancy query answers
inline int64_t launches = 0;
inline unsigned last_grid = 0;
inline unsigned last_block = 0;

}  // namespace cuda_emulation

template <typename F>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, F*) {
  *attributes = cudaFuncAttributes{};
  attributes->maxThreadsPerBlock = 1024;
  attributes->binaryVersion = 90;
  return cudaSuccess;
}

template <typename F>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, F, int, size_t) {
  *blocks = cuda_emulation::blocks_per_sm;
  return cudaSuccess;
}

inline cudaError_t cudaGetLastError() { return cudaSuccess; }

// The launch: every thread of every block, one at a time. One-dimensional only (all the
// project's kernel uses); arguments are passed by value to each thread, as the device
// passes kernel parameters.
template <typename... ExpTypes, typename... ActTypes>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* config, void (*kernel)(ExpTypes...),
                               ActTypes&&... args) {
  const dim3 grid = config->gridDim;
  const dim3 block = config->blockDim;
  if (grid.x == 0 || block.x == 0 || block.x > 1024 || grid.y != 1 || grid.z != 1 || block.y != 1 ||
      block.z != 1 || config->dynamicSmemBytes != 0) {
    return cudaErrorInvalidConfiguration;
  }
  gridDim = grid;
  blockDim = block;
  for (unsigned b = 0; b < grid.x; ++b) {
    for (unsigned t = 0; t < block.x; ++t) {
      const bool reverse = cuda_emulation::order == cuda_emulation::kReverse;
      blockIdx = uint3{reverse ? grid.x - 1 - b : b, 0, 0};
      threadIdx = uint3{reverse ? block.x - 1 - t : t, 0, 0};
      kernel(args...);
    }
  }
  ++cuda_emulation::launches;
  cuda_emulation::last_grid = grid.x;
  cuda_emulation::last_block = block.x;
  return cudaSuccess;
}

// ----------------------------------------------------------------- atomics
// One thread runs at a time, so plain read-modify-write is atomic.
inline unsigned long long atomicOr(unsigned long long* address, unsigned long long value) {
  const unsigned long long old = *address;
  *address = old | value;
  return old;
}
inline unsigned int atomicOr(unsigned int* address, unsigned int value) {
  const unsigned int old = *address;
  *address = old | value;
  return old;
}
inline unsigned long long atomicCAS(unsigned long long* address, unsigned long long compare,
                                    unsigned long long value) {
  const unsigned long long old = *address;
  if (old == compare) *address = value;
  return old;
}
inline unsigned int atomicCAS(unsigned int* address, unsigned int compare, unsigned int value) {
  const unsigned int old = *address;
  if (old == compare) *address = value;
  return old;
}
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  const unsigned long long old = *address;
  *address = old + value;
  return old;
}
inline unsigned int atomicAdd(unsigned int* address, unsigned int value) {
  const unsigned int old = *address;
  *address = old + value;
  return old;
}
inline int atomicAdd(int* address, int value) {
  const int old = *address;
  *address = old + value;
  return old;
}
