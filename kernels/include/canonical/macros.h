// The project's own host/device macros (as CUTLASS's detail/helper_macros.hpp): shared
// headers compile unchanged with g++ (CPU kernel, host validation) and nvcc (CUDA
// kernel) without pulling in any torch or c10 header.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define CANONICAL_HOST_DEVICE __host__ __device__
#define CANONICAL_DEVICE __device__
#else
#define CANONICAL_HOST_DEVICE
#define CANONICAL_DEVICE
#endif
