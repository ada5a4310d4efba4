// CPU kernels of canonical_store / canonical_load: at::parallel_for over work
// items (pair, fragment), one vector copy per fragment, expansion from plan.h
// (layer_bases once per pair and layer). Built with -fopenmp: at::parallel_for
// is inline OpenMP and runs serially without it (cpu_threads_used checks). A
// forked child splits the same way over std::threads (see forked_child).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <pthread.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <system_error>
#include <thread>
#include <tuple>
#include <vector>

#include "canonical/checked.h"
#include "canonical/cpu_copy.h"
#include "canonical/plan.h"
#include "canonical/validation.h"

namespace canonical {
namespace {

// Work items per parallel chunk: enough bytes that thread hand-off is noise.
constexpr int64_t kBytesPerChunk = 256 * 1024;
// Work items expanded per batch (two batches of descriptors: 3 KiB of stack).
constexpr int64_t kBatchItems = 64;
static_assert(kPrefetchMaxItems <= kBatchItems, "a load prefetches at most one batch ahead");

// libgomp cannot run a parallel region in a child forked from a process that
// has already run one: its pool threads did not survive the fork and the region
// waits for them forever (torch's own CPU ops hang there the same way). libgomp
// cannot say whether its pool exists, so in any forked child the kernel splits
// its work over threads of its own, started for the call and joined before it
// returns: same split, no OpenMP.
std::atomic<bool> forked_child{false};

void mark_forked_child() { forked_child.store(true); }

[[maybe_unused]] const bool fork_handler_registered = [] {
  return pthread_atfork(nullptr, nullptr, &mark_forked_child) == 0;
}();

// at::parallel_for's split of [begin, end) (at most get_num_threads() chunks of
// at least `grain` items), run by OpenMP, or by std::threads in a forked child.
// `body` must not throw.
template <typename F>
void parallel_range(int64_t begin, int64_t end, int64_t grain, const F& body) {
  if (!forked_child.load()) {
    at::parallel_for(begin, end, grain, body);
    return;
  }
  if (begin >= end) return;
  const int64_t range = end - begin;
  const int64_t chunks = std::max<int64_t>(
      1,
      std::min<int64_t>(at::get_num_threads(), (range + grain - 1) / std::max<int64_t>(1, grain)));
  const int64_t chunk = (range + chunks - 1) / chunks;
  std::vector<std::thread> helpers;
  int64_t first = begin + chunk;
  for (; first < end; first += chunk) {
    try {
      helpers.emplace_back(
          [&body, first, end, chunk] { body(first, std::min(end, first + chunk)); });
    } catch (const std::system_error&) {
      break;  // no more threads to be had: the chunks left run on this one
    }
  }
  body(begin, std::min(end, begin + chunk));
  for (; first < end; first += chunk) body(first, std::min(end, first + chunk));
  for (auto& helper : helpers) helper.join();
}

// Verified private copies of CPU plans, by plan identity (storage, offset, length),
// so that verification runs once per plan rather than once per call. The words a
// call follows are always the cached copy, and a call uses it only if the plan
// tensor still holds exactly those words (one memcmp, a small fraction of the
// verification it saves): a plan edited in place, with or without a version bump,
// is copied and verified again. The weak reference to the storage keeps its
// address from being reused by another tensor while the entry exists.
struct VerifiedPlan {
  std::shared_ptr<const std::vector<int64_t>> words;
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
};
using PlanIdentity = std::tuple<const void*, int64_t, int64_t>;  // storage impl, offset, numel
constexpr size_t kMaxCachedPlans = 256;

std::mutex& plan_cache_mutex() {
  static std::mutex m;
  return m;
}
std::map<PlanIdentity, VerifiedPlan>& plan_cache() {
  static std::map<PlanIdentity, VerifiedPlan> cache;
  return cache;
}

std::shared_ptr<const std::vector<int64_t>> verified_cpu_plan(const at::Tensor& plan) {
  const int64_t* user_words = plan.data_ptr<int64_t>();
  const int64_t num_words = plan.numel();
  const size_t num_bytes = static_cast<size_t>(num_words) * sizeof(int64_t);
  const PlanIdentity identity{plan.storage().unsafeGetStorageImpl(), plan.storage_offset(),
                              num_words};
  {
    const std::lock_guard<std::mutex> lock(plan_cache_mutex());
    const auto found = plan_cache().find(identity);
    if (found != plan_cache().end() && !found->second.storage.expired() &&
        std::memcmp(found->second.words->data(), user_words, num_bytes) == 0) {
      return found->second.words;
    }
  }
  auto words = std::make_shared<const std::vector<int64_t>>(user_words, user_words + num_words);
  verify_plan_words(words->data(), num_words);  // throws: nothing is cached
  const std::lock_guard<std::mutex> lock(plan_cache_mutex());
  auto& cache = plan_cache();
  if (cache.size() >= kMaxCachedPlans) {
    for (auto it = cache.begin(); it != cache.end();) {
      it = it->second.storage.expired() ? cache.erase(it) : std::next(it);
    }
    if (cache.size() >= kMaxCachedPlans) cache.erase(cache.begin());
  }
  cache.insert_or_assign(identity, VerifiedPlan{words, plan.storage().getWeakStorageImpl()});
  return words;
}

struct CopyDescriptor {
  uint8_t* dst;
  const uint8_t* src;
  int64_t size;  // 0: skip (a store's page this rank does not write)
};

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

  const int64_t* fragment_record() const { return record_; }
  const LayerBases& bases() const { return bases_; }

  void advance(int64_t num_fragments) {
    if (++fragment_ == num_fragments) {
      fragment_ = 0;
      ++pair_;
      layer_ = -1;
    }
  }

  // Reads the current item's fragment record and, on a new pair or layer,
  // its bases. Only called for items inside the call; the ids and plan words are
  // private copies checked by validate_call, so they stay in range.
  void seek() {
    record_ = view_.fragment(fragment_);
    if (record_[kFragmentLayer] != layer_) {
      layer_ = record_[kFragmentLayer];
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
  // A CPU plan is host memory the caller can change at any time: the kernel follows
  // a private, verified copy, found again by the plan's identity and contents.
  const std::shared_ptr<const std::vector<int64_t>> words = verified_cpu_plan(plan);
  const PlanView view{words->data()};
  // The ids the kernel follows are validate_call's private, checked copies.
  const CallInfo info =
      validate_call(op, kv_caches, cpu_pages, plan, block_ids, page_ids, view, store);
  const int64_t num_fragments = view.num_fragments();
  int64_t total = 0;
  TORCH_CHECK_VALUE(checked_mul(info.num_pairs, num_fragments, &total),
                    "block_ids: too many pairs for this plan (pairs x fragments overflows int64)");
  if (total == 0) return;

  std::vector<uint8_t*> layer_base(kv_caches.size());
  for (size_t l = 0; l < kv_caches.size(); ++l) {
    layer_base[l] = static_cast<uint8_t*>(kv_caches[l].data_ptr());
  }
  uint8_t* pages = cpu_pages.data_ptr<uint8_t>();
  const int64_t* blocks = info.block_ids.data();
  const int64_t* page_list = info.page_ids.data();
  const int64_t bytes_per_pair = std::max<int64_t>(1, view.header(kBytesPerPair));
  const int64_t grain = std::max<int64_t>(1, kBytesPerChunk * num_fragments / bytes_per_pair);

  int64_t call_bytes = 0;
  const bool streaming = !checked_mul(info.num_pairs, bytes_per_pair, &call_bytes) ||
                         call_bytes >= streaming_call_bytes(store);
  const int64_t lookahead = prefetch_items(bytes_per_pair, num_fragments, store);

  parallel_range(0, total, grain, [&](int64_t begin, int64_t end) {
    // Expansion runs one batch ahead of the copy (two batches of descriptors
    // used in turn), so the copy loop is as tight as one over pre-expanded
    // descriptors and the copy can prefetch `lookahead` items ahead across the
    // batch boundary.
    Cursor cursor{view, blocks, page_list, begin, num_fragments};
    CopyDescriptor batches[2][kBatchItems];
    auto expand_batch = [&](CopyDescriptor* out, int64_t count) {
      for (int64_t i = 0; i < count; ++i) {
        cursor.seek();
        const int64_t* frag = cursor.fragment_record();
        const LayerBases& bases = cursor.bases();
        uint8_t* kv = layer_base[frag[kFragmentLayer]] + bases.local_base + frag[kLocalOffset];
        uint8_t* canonical = pages + bases.canonical_base + frag[kCanonicalOffset];
        const int64_t size = frag[kFragmentBytes];
        if (store) {
          out[i] = {canonical, kv, bases.is_writer ? size : 0};
        } else {
          out[i] = {kv, canonical, size};
        }
        cursor.advance(num_fragments);
      }
    };
    int64_t current_count = std::min(kBatchItems, end - begin);
    expand_batch(batches[0], current_count);
    int64_t next_start = begin + current_count;
    for (int which = 0; current_count > 0; which ^= 1) {
      const CopyDescriptor* current = batches[which];
      CopyDescriptor* next = batches[which ^ 1];
      const int64_t next_count = std::min(kBatchItems, end - next_start);
      expand_batch(next, next_count);
      for (int64_t i = 0; i < current_count; ++i) {
        if (lookahead > 0) {
          const int64_t j = i + lookahead;
          const CopyDescriptor* ahead = j < current_count ? current + j
                                        : j - current_count < next_count
                                            ? next + (j - current_count)
                                            : nullptr;
          if (ahead != nullptr) prefetch_fragment(ahead->src, ahead->size);
        }
        const CopyDescriptor& d = current[i];
        if (d.size > 0) copy_fragment(d.dst, d.src, d.size, streaming);
      }
      current_count = next_count;
      next_start += next_count;
    }
    if (streaming) publish_streaming_stores();
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

void check_error_record(const at::Tensor& record) {
  TORCH_CHECK_TYPE(record.scalar_type() == at::kLong, "error_record: expected dtype int64, got ",
                   record.scalar_type());
  TORCH_CHECK_VALUE(record.device().is_cpu() && record.numel() == kErrorRecordWords,
                    "error_record: expected a CPU tensor of ", kErrorRecordWords, " int64 words");
}

// On CPU every id is checked before the copy, so the record is never written.
void canonical_store_reporting_cpu(at::TensorList kv_caches, const at::Tensor& cpu_pages,
                                   const at::Tensor& plan, const at::Tensor& block_ids,
                                   const at::Tensor& page_ids, const at::Tensor& error_record) {
  check_error_record(error_record);
  copy_cpu("canonical_store", kv_caches, cpu_pages, plan, block_ids, page_ids, /*store=*/true);
}

void canonical_load_reporting_cpu(at::TensorList kv_caches, const at::Tensor& cpu_pages,
                                  const at::Tensor& plan, const at::Tensor& block_ids,
                                  const at::Tensor& page_ids, const at::Tensor& error_record) {
  check_error_record(error_record);
  copy_cpu("canonical_load", kv_caches, cpu_pages, plan, block_ids, page_ids, /*store=*/false);
}

void register_plan_cpu(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK_VALUE(false,
                    "plan: only CUDA plans are registered (a CPU plan is verified at each call)");
}

// CPU plans have no device-side errors: their ids are checked before the copy.
std::vector<int64_t> plan_error_cpu(const at::Tensor&) {
  return std::vector<int64_t>(kErrorRecordWords, 0);
}

}  // namespace

int64_t cpu_threads_used(int64_t work_items) {
  TORCH_CHECK_VALUE(work_items >= 1, "work_items: expected >= 1, got ", work_items);
  std::mutex mutex;
  std::set<std::thread::id> seen;
  parallel_range(0, work_items, 1, [&](int64_t, int64_t) {
    const std::lock_guard<std::mutex> lock(mutex);
    seen.insert(std::this_thread::get_id());
  });
  return static_cast<int64_t>(seen.size());
}

}  // namespace canonical

TORCH_LIBRARY_IMPL(canonical, CPU, m) {
  m.impl("canonical_store", &canonical::canonical_store_cpu);
  m.impl("canonical_load", &canonical::canonical_load_cpu);
  m.impl("_canonical_store_reporting", &canonical::canonical_store_reporting_cpu);
  m.impl("_canonical_load_reporting", &canonical::canonical_load_reporting_cpu);
  m.impl("_register_plan", &canonical::register_plan_cpu);
  m.impl("_plan_error", &canonical::plan_error_cpu);
}
