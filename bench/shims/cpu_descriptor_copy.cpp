// CPU descriptor-driven copy of bench_transfer.py, compiled at bench time with the host C++
// compiler by CpuShim (bench/_baselines.py): the canonical CPU kernel's own fragment copy and
// prefetcher (kernels/include/canonical/cpu_copy.h) over host-expanded (src, dst, size)
// descriptors, split over OpenMP threads in contiguous ranges as at::parallel_for splits the
// kernel's work.
#include <omp.h>
#include <stdint.h>

#include "canonical/cpu_copy.h"

// `bytes_per_pair` and `fragments_per_pair` choose the prefetching as the kernel's plan does.
extern "C" void shim_cpu_descriptor_copy(const int64_t* src, const int64_t* dst,
                                         const int64_t* size, int64_t count, int64_t total_bytes,
                                         int64_t bytes_per_pair, int64_t fragments_per_pair,
                                         int threads, int store) {
  const bool streaming = total_bytes >= canonical::streaming_call_bytes(store != 0);
#pragma omp parallel num_threads(threads)
  {
    const int64_t id = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t begin = count * id / n, end = count * (id + 1) / n;
    canonical::Prefetcher prefetcher{store != 0, bytes_per_pair, fragments_per_pair};
    const int64_t lines = prefetcher.lines_ahead(), page = prefetcher.page_ahead();
    for (int64_t i = begin; i < end; ++i) {
      if (page > 0 && i + page < end) {
        prefetcher.page(reinterpret_cast<const uint8_t*>(src[i + page]),
                        reinterpret_cast<const uint8_t*>(dst[i + page]), size[i + page]);
      }
      if (lines > 0 && i + lines < end) {
        prefetcher.lines(reinterpret_cast<const uint8_t*>(src[i + lines]), size[i + lines]);
      }
      canonical::copy_fragment(reinterpret_cast<uint8_t*>(dst[i]),
                               reinterpret_cast<const uint8_t*>(src[i]), size[i], streaming);
    }
    if (streaming) canonical::publish_streaming_stores();
  }
}
