// The CPU kernel's fragment copy and load prefetch. Header-only and free of
// torch so that the benchmark's descriptor-driven CPU baseline
// (bench/shims/cpu_descriptor_copy.cpp) runs exactly this copy: that baseline then
// differs from canonical_store / canonical_load only by having no expansion.
#pragma once

#include <stdint.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <string>

#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

namespace canonical {

// Calls moving at least streaming_call_bytes() use streaming (non-temporal)
// stores into their destination, which is then larger than the caches: write-
// allocate reads would add a third memory pass next to the read and the write-back.
// Stores: cpu_pages, where a TP rank's fragments are also sparse (2x faster
// for 256 B - 4 KiB fragments here) and sit at the same offsets of pages whose
// size is a power of two, so they fall into a few cache sets: plain stores there
// thrash the cache even when the call is smaller than it (a 4 MiB TP=8 store:
// 4 ms plain, 0.17 ms streamed), hence streaming from kMinStreamingCallBytes.
// Loads: the kv blocks, which consecutive fragments fill densely, so the write-
// combining buffers drain whole lines (1.2-1.3x for sparse 256 B loads here,
// measured with 2 threads); but a load's destination that fits the last-level
// cache is better left there (a 4 MiB load: 2.2x faster with plain stores), so
// loads stream from the cache's size on, as sysfs reports it (glibc's sysconf
// reads cpuid, which some VMs fill with the host's figure: 320 MiB here),
// within [kMinStreamingCallBytes, kMaxStreamingCallBytes].
constexpr int64_t kMinStreamingCallBytes = 4 << 20;
constexpr int64_t kMaxStreamingCallBytes = 64 << 20;

// Size in bytes of the largest cache level sysfs lists for cpu0 (0 if none).
inline int64_t last_level_cache_bytes() {
  int64_t best_level = 0, best_bytes = 0;
  for (int index = 0; index < 8; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index);
    std::ifstream level_file(dir + "/level"), size_file(dir + "/size");
    int64_t level = 0, size = 0;
    char unit = 0;
    if (!(level_file >> level) || !(size_file >> size)) continue;
    size_file >> unit;  // "32768K", "32M"
    size *= unit == 'K' ? 1024 : unit == 'M' ? 1024 * 1024 : 1;
    if (level > best_level) best_level = level, best_bytes = size;
  }
  return best_bytes;
}

inline int64_t streaming_call_bytes(bool store) {
  static const int64_t load_bytes =
      std::clamp<int64_t>(last_level_cache_bytes(), kMinStreamingCallBytes, kMaxStreamingCallBytes);
  return store ? kMinStreamingCallBytes : load_bytes;
}

// Prefetching ahead of the copy. A TP rank's fragments are scattered over the
// canonical pages (a load's source, a store's destination), which no hardware
// prefetcher follows: each fragment would wait a full miss, and a page walk,
// since at 1/8 of a page per rank and 4 KiB OS pages nearly every fragment or
// pair of fragments is on a page of its own. Two distances, in work items:
// * lines (`Prefetcher::lines_ahead`): loads ask for the first lines of the
//   canonical source fragment about kLoadPrefetchAheadBytes of work ahead (~1.4x
//   for 256 B - 1 KiB fragments on 2 threads here). Fragments of 4 KiB and more
//   (both directions) ask for the first lines of the source of the fragment after
//   next: the hardware prefetcher then streams inside a fragment that has already
//   started arriving (TP=8 4 KiB: loads 0.92x -> 1.09x, stores 0.87x -> 0.93x of
//   a torch copy here; more lines, or further ahead, was slower).
// * page (`Prefetcher::page_ahead`): once per 4 KiB page of the scattered side,
//   its first line, non-temporally: the point is the page walk, done ahead and
//   off the copy's path. Stores (whose streaming stores then overwrite the line),
//   about kStorePrefetchAheadBytes ahead: sparse TP=8 vs a pre-expanded copy
//   without it, 256 B 0.88x -> 0.97-1.00x, 512 B 0.84x -> 0.92-0.95x, 4 KiB 0.94x
//   -> 0.98-1.01x of a torch copy here. Loads of fragments under 4 KiB,
//   kLoadPagePrefetchFactor times further than their lines, so that the walk is
//   done when the lines are asked for: sparse TP=8 256 B loads 0.81-0.83x ->
//   0.89x (same loop, shuffled A/B); 4 KiB loads lost up to 10% with it, so none.
constexpr int64_t kLoadPrefetchAheadBytes = 2048;
constexpr int64_t kStorePrefetchAheadBytes = 4096;
constexpr int64_t kLoadPagePrefetchFactor = 4;
constexpr int64_t kPrefetchMaxItems = 16;
constexpr int64_t kPrefetchMaxFragmentBytes = 4096;  // average fragment from which ...
constexpr int64_t kPrefetchLargeFragmentItems = 2;   // ... this many items ahead are used
constexpr int64_t kPrefetchBytesPerFragment = 512;   // source lines asked for per fragment
constexpr int kPageShift = 12;                       // the OS page a walk is for

// The average fragment of a plan (at least 1 byte), which sets the prefetching.
inline int64_t average_fragment_bytes(int64_t bytes_per_pair, int64_t num_fragments) {
  return std::max<int64_t>(1, bytes_per_pair / std::max<int64_t>(1, num_fragments));
}

// Work items a store (`store`) or a load asks for lines ahead (always >= 2).
inline int64_t prefetch_items(int64_t bytes_per_pair, int64_t num_fragments, bool store) {
  const int64_t average = average_fragment_bytes(bytes_per_pair, num_fragments);
  if (average >= kPrefetchMaxFragmentBytes) return kPrefetchLargeFragmentItems;
  const int64_t ahead_bytes = store ? kStorePrefetchAheadBytes : kLoadPrefetchAheadBytes;
  return std::clamp<int64_t>(ahead_bytes / average, 2, kPrefetchMaxItems);
}

// What one copying thread asks for ahead of its copy: see above. Feed `lines` the
// fragment `lines_ahead()` items ahead of the one being copied and `page` the one
// `page_ahead()` items ahead, in order.
class Prefetcher {
 public:
  Prefetcher(bool store, int64_t bytes_per_pair, int64_t num_fragments)
      : store_(store),
        large_(average_fragment_bytes(bytes_per_pair, num_fragments) >= kPrefetchMaxFragmentBytes),
        source_lines_(!store || large_),
        items_(prefetch_items(bytes_per_pair, num_fragments, store)),
        lines_ahead_(source_lines_ ? items_ : 0),
        page_ahead_(store    ? items_
                    : large_ ? 0
                             : kLoadPagePrefetchFactor * items_) {}

  // Items ahead of the copy to feed lines() and page(); 0: none.
  int64_t lines_ahead() const { return lines_ahead_; }
  int64_t page_ahead() const { return page_ahead_; }

  // The first lines of a fragment's source (loads, and large fragments).
  void lines(const uint8_t* src, int64_t size) const {
    if (size <= 0) return;
#if defined(__SSE__)
    const int64_t reach = std::min<int64_t>(size, kPrefetchBytesPerFragment);
    for (int64_t offset = 0; offset < reach; offset += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(src + offset), _MM_HINT_T0);
    }
#else
    (void)src;
#endif
  }

  // The page of a fragment's scattered side (a load's source, a store's
  // destination), once per page. `size` 0: a store's page this rank does not write.
  void page(const uint8_t* src, const uint8_t* dst, int64_t size) {
    if (size <= 0) return;
    const uint8_t* scattered = store_ ? dst : src;
    const uintptr_t page = reinterpret_cast<uintptr_t>(scattered) >> kPageShift;
    if (page == last_page_) return;
    last_page_ = page;
#if defined(__SSE__)
    _mm_prefetch(reinterpret_cast<const char*>(scattered), _MM_HINT_NTA);
#endif
  }

 private:
  bool store_;
  bool large_;
  bool source_lines_;
  int64_t items_;
  int64_t lines_ahead_;
  int64_t page_ahead_;
  uintptr_t last_page_ = 0;
};

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

// Streaming stores are weakly ordered: each thread publishes its own.
inline void publish_streaming_stores() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace canonical
