// CPU kernels of canonical_store / canonical_load: at::parallel_for over work
// items (pair, fragment), one memcpy per fragment, expansion from plan.h.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "canonical/host.h"
#include "canonical/plan.h"

namespace canonical {
namespace {

// Work items per parallel chunk: enough bytes that thread hand-off is noise.
constexpr int64_t kBytesPerChunk = 256 * 1024;
// Stores moving at least this much use streaming (non-temporal) stores into
// cpu_pages: the destination is far larger than the caches, and a TP rank's
// fragments are sparse in the canonical page, where write-allocate reads
// double the memory traffic (1.5-1.7x faster for 256 B - 4 KiB fragments in a
// C microbenchmark here). Loads keep memcpy: streaming into the dense kv
// block measured slower (sparse reads then stall the write-combining buffers).
constexpr int64_t kStreamingCallBytes = 4 << 20;

// Copies one fragment. Multiples of 64 bytes go through a 16-byte vector loop
// (streaming stores when asked): glibc's memcpy takes `rep movsb` for 1-2 KiB
// copies, which is slow on some AMD cores; the loop is never slower here.
inline void copy_fragment(uint8_t* dst, const uint8_t* src, int64_t size, bool streaming) {
#if defined(__SSE2__)
  if ((size & 63) == 0) {
    const bool stream = streaming && (reinterpret_cast<uintptr_t>(dst) & 15) == 0;
    for (int64_t i = 0; i < size; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      if (stream) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), a);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
      }
    }
    return;
  }
#endif
  (void)streaming;
  std::memcpy(dst, src, static_cast<size_t>(size));
}

void copy_cpu(const char* op, at::TensorList kv_caches, const at::Tensor& cpu_pages,
              const at::Tensor& plan, const at::Tensor& block_ids, const at::Tensor& page_ids,
              bool store) {
  TORCH_CHECK_TYPE(plan.scalar_type() == at::kLong, "plan: expected dtype int64, got ",
                   plan.scalar_type());
  TORCH_CHECK_VALUE(plan.dim() == 1 && plan.is_contiguous(),
                    "plan: expected a contiguous 1-D tensor from canonical_ops.make_plan");
  TORCH_CHECK_VALUE(plan.device().is_cpu(), "plan: expected a CPU tensor like kv_caches, got ",
                    plan.device().str());
  // A CPU plan is host memory: verify it each call (cheap next to the copy).
  verify_plan_words(plan.data_ptr<int64_t>(), plan.numel());
  const PlanView view{plan.data_ptr<int64_t>()};
  const CallInfo info =
      validate_call(op, kv_caches, cpu_pages, plan, block_ids, page_ids, view);
  const int64_t num_fragments = view.num_fragments();
  const int64_t total = info.num_pairs * num_fragments;
  if (total == 0) return;

  std::vector<uint8_t*> layer_base(kv_caches.size());
  for (size_t l = 0; l < kv_caches.size(); ++l) {
    layer_base[l] = static_cast<uint8_t*>(kv_caches[l].data_ptr());
  }
  uint8_t* pages = cpu_pages.data_ptr<uint8_t>();
  const int64_t* blocks = block_ids.data_ptr<int64_t>();
  const int64_t* page_list = page_ids.data_ptr<int64_t>();
  const int64_t bytes_per_pair = std::max<int64_t>(1, view.header(kBytesPerPair));
  const int64_t grain = std::max<int64_t>(
      1, kBytesPerChunk * num_fragments / bytes_per_pair);

  const bool streaming = store && info.num_pairs * bytes_per_pair >= kStreamingCallBytes;

  at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    int64_t pair = begin / num_fragments;
    int64_t fragment = begin - pair * num_fragments;
    for (int64_t w = begin; w < end; ++w) {
      const Expanded e = expand(view, fragment, blocks[pair], page_list[pair]);
      if (!store) {
        copy_fragment(layer_base[e.layer] + e.local_byte, pages + e.canonical_byte, e.size,
                      streaming);
      } else if (e.is_writer) {
        copy_fragment(pages + e.canonical_byte, layer_base[e.layer] + e.local_byte, e.size,
                      streaming);
      }
      if (++fragment == num_fragments) {
        fragment = 0;
        ++pair;
      }
    }
#if defined(__SSE2__)
    if (streaming) _mm_sfence();  // streaming stores are weakly ordered: publish them
#endif
  });
}

void canonical_store_cpu(at::TensorList kv_caches, const at::Tensor& cpu_pages,
                         const at::Tensor& plan, const at::Tensor& block_ids,
                         const at::Tensor& page_ids) {
  copy_cpu("canonical_store", kv_caches, cpu_pages, plan, block_ids, page_ids, /*store=*/true);
}

void canonical_load_cpu(at::TensorList kv_caches, const at::Tensor& cpu_pages,
                        const at::Tensor& plan, const at::Tensor& block_ids,
                        const at::Tensor& page_ids) {
  copy_cpu("canonical_load", kv_caches, cpu_pages, plan, block_ids, page_ids, /*store=*/false);
}

}  // namespace
}  // namespace canonical

TORCH_LIBRARY_IMPL(canonical, CPU, m) {
  m.impl("canonical_store", &canonical::canonical_store_cpu);
  m.impl("canonical_load", &canonical::canonical_load_cpu);
}
