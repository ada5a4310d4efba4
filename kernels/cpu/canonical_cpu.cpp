// CPU kernels of canonical_store / canonical_load: at::parallel_for over work
// items (pair, fragment), one vector copy per fragment, expansion from plan.h
// (layer_bases once per pair and layer). Built with -fopenmp: at::parallel_for
// is inline OpenMP and runs serially without it (cpu_threads_used checks).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

#include "canonical/host.h"
#include "canonical/plan.h"

namespace canonical {
namespace {

// Work items per parallel chunk: enough bytes that thread hand-off is noise.
constexpr int64_t kBytesPerChunk = 256 * 1024;
// Calls moving at least this much use streaming (non-temporal) stores into
// their destination, which is then far larger than the caches: write-allocate
// reads would add a third memory pass next to the read and the write-back.
// Stores: cpu_pages, where a TP rank's fragments are also sparse (2x faster
// for 256 B - 4 KiB fragments here). Loads: the kv blocks, which consecutive
// fragments fill densely, so the write-combining buffers drain whole lines
// (1.2-1.3x for sparse 256 B loads here, measured with 2 threads).
constexpr int64_t kStreamingCallBytes = 4 << 20;

// Loads prefetch the canonical source about this many bytes of work ahead:
// a TP rank's fragments are scattered over pages in random order, which no
// hardware prefetcher follows, so without it each fragment waits a full miss.
// ~1.4x for 256 B - 1 KiB fragments on 2 threads here; from 4 KiB on, the
// hardware prefetcher streams inside the fragment and this is not used.
constexpr int64_t kPrefetchAheadBytes = 2048;
constexpr int64_t kPrefetchMaxItems = 16;
constexpr int64_t kPrefetchMaxFragmentBytes = 4096;  // average fragment below which it is used
constexpr int64_t kPrefetchBytesPerFragment = 512;   // lines asked for per fragment

// Work items a load prefetches ahead (0: none).
int64_t prefetch_items(int64_t bytes_per_pair, int64_t num_fragments) {
  const int64_t average = std::max<int64_t>(1, bytes_per_pair / num_fragments);
  if (average >= kPrefetchMaxFragmentBytes) return 0;
  return std::clamp<int64_t>(kPrefetchAheadBytes / average, 2, kPrefetchMaxItems);
}

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

// Walks work items (pair, fragment) in order, keeping the current layer's
// bases so that only a layer change or a new pair recomputes them.
class Cursor {
 public:
  Cursor(const PlanView& view, const int64_t* blocks, const int64_t* pages, int64_t item,
         int64_t num_fragments)
      : view_(view),
        blocks_(blocks),
        pages_(pages),
        pair_(item / num_fragments),
        fragment_(item % num_fragments) {}

  int64_t item(int64_t num_fragments) const { return pair_ * num_fragments + fragment_; }
  const int64_t* fragment_record() const { return record_; }
  const LayerBases& bases() const { return bases_; }

  void advance(int64_t num_fragments) {
    if (++fragment_ == num_fragments) {
      fragment_ = 0;
      ++pair_;
      layer_ = -1;
    }
  }

  // Asks for the first lines of this item's canonical bytes (a load's source).
  void prefetch_source(const uint8_t* pages) {
    seek();
#if defined(__SSE__)
    const uint8_t* src = pages + bases_.canonical_base + record_[1];
    const int64_t reach = std::min<int64_t>(record_[2], kPrefetchBytesPerFragment);
    for (int64_t offset = 0; offset < reach; offset += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(src + offset), _MM_HINT_T0);
    }
#else
    (void)pages;
#endif
  }

  // Reads the current item's fragment record and, on a new pair or layer,
  // its bases. Only called for items inside the call, so ids stay in range.
  void seek() {
    record_ = view_.fragment(fragment_);
    if (record_[3] != layer_) {
      layer_ = record_[3];
      bases_ = layer_bases(view_, layer_, blocks_[pair_], pages_[pair_]);
    }
  }

 private:
  PlanView view_;
  const int64_t* blocks_;
  const int64_t* pages_;
  int64_t pair_;
  int64_t fragment_;
  int64_t layer_ = -1;
  const int64_t* record_ = nullptr;
  LayerBases bases_{};
};

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

  const bool streaming = info.num_pairs * bytes_per_pair >= kStreamingCallBytes;
  const int64_t lookahead = store ? 0 : prefetch_items(bytes_per_pair, num_fragments);

  at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    Cursor ahead{view, blocks, page_list, begin, num_fragments};
    for (int64_t i = 0; i < lookahead && ahead.item(num_fragments) < end; ++i) {
      ahead.prefetch_source(pages);
      ahead.advance(num_fragments);
    }
    Cursor cursor{view, blocks, page_list, begin, num_fragments};
    for (int64_t w = begin; w < end; ++w) {
      if (lookahead > 0 && ahead.item(num_fragments) < end) {
        ahead.prefetch_source(pages);
        ahead.advance(num_fragments);
      }
      cursor.seek();
      const int64_t* frag = cursor.fragment_record();
      const LayerBases& bases = cursor.bases();
      uint8_t* kv = layer_base[frag[3]] + bases.local_base + frag[0];
      uint8_t* canonical = pages + bases.canonical_base + frag[1];
      if (!store) {
        copy_fragment(kv, canonical, frag[2], streaming);
      } else if (bases.is_writer) {
        copy_fragment(canonical, kv, frag[2], streaming);
      }
      cursor.advance(num_fragments);
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

int64_t cpu_threads_used(int64_t work_items) {
  TORCH_CHECK_VALUE(work_items >= 1, "work_items: expected >= 1, got ", work_items);
  std::vector<std::atomic<bool>> seen(static_cast<size_t>(at::get_num_threads()));
  at::parallel_for(0, work_items, 1, [&](int64_t, int64_t) {
    const auto id = static_cast<size_t>(at::get_thread_num());
    if (id < seen.size()) seen[id].store(true);
  });
  int64_t used = 0;
  for (const auto& flag : seen) used += flag.load() ? 1 : 0;
  return used;
}

}  // namespace canonical

TORCH_LIBRARY_IMPL(canonical, CPU, m) {
  m.impl("canonical_store", &canonical::canonical_store_cpu);
  m.impl("canonical_load", &canonical::canonical_load_cpu);
}
