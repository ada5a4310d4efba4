// CPU kernels of canonical_store / canonical_load: at::parallel_for over work
// items (pair, fragment), one vector copy per fragment. A walker over strided runs
// of fragments (derived once per plan; layer_bases from plan.h once per pair and
// run) expands the items into a small ring of descriptors ahead of the copy and
// its prefetches. Built with -fopenmp: at::parallel_for
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
// Descriptors a copying thread keeps expanded ahead (a power of two, more than the
// furthest prefetch: 6 KiB of stack).
constexpr int64_t kRingItems = 256;
constexpr int64_t kRingMask = kRingItems - 1;
static_assert(kLoadPagePrefetchFactor * kPrefetchMaxItems < kRingItems,
              "the ring holds every item a prefetch looks at");

struct CopyDescriptor {
  uint8_t* dst;
  const uint8_t* src;
  int64_t size;  // 0: skip (a store's page this rank does not write)
};

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

// A run of `count` consecutive fragments of one layer and one size whose local
// and canonical offsets each advance by a constant step: e.g. a TP rank's head in
// each token of an NHD page, 16 records that become one run. Fragment
// first_fragment + k lies at local_offset + k * local_step and canonical_offset +
// k * canonical_step: exactly its record's offsets, so every bound that
// verify_plan_words checked for the records holds for the run. Walking runs, the
// kernel adds two steps per fragment instead of reading a record and recomputing
// addresses (the cost that separated it from a copy over pre-expanded
// descriptors at 256 B fragments).
struct FragmentRun {
  int64_t layer;
  int64_t local_offset;
  int64_t canonical_offset;
  int64_t size;
  int64_t count;
  int64_t local_step;
  int64_t canonical_step;
  int64_t first_fragment;
};

// A verified private copy of a CPU plan's words, and the runs derived from them.
struct CpuPlan {
  std::vector<int64_t> words;
  std::vector<FragmentRun> runs;
  std::vector<int64_t> run_of_fragment;  // runs[run_of_fragment[f]] holds fragment f
};

// Greedy: a fragment joins the run before it when it has the run's layer and size
// and continues both its steps from the run's last fragment (the second fragment of
// a run sets them). A verified plan's offsets are non-negative int64, so their
// differences cannot overflow, and no product is formed.
void derive_runs(CpuPlan* plan) {
  const PlanView view{plan->words.data()};
  const int64_t num_fragments = view.num_fragments();
  auto& runs = plan->runs;
  plan->run_of_fragment.resize(static_cast<size_t>(num_fragments));
  int64_t last_local = 0, last_canonical = 0;  // offsets of the last run's last fragment
  for (int64_t f = 0; f < num_fragments; ++f) {
    const int64_t* rec = view.fragment(f);
    const int64_t local = rec[kLocalOffset], canonical = rec[kCanonicalOffset];
    bool joins = false;
    if (!runs.empty()) {
      FragmentRun& run = runs.back();
      const int64_t local_step = local - last_local;
      const int64_t canonical_step = canonical - last_canonical;
      joins = run.layer == rec[kFragmentLayer] && run.size == rec[kFragmentBytes] &&
              (run.count == 1 ||
               (local_step == run.local_step && canonical_step == run.canonical_step));
      if (joins) {
        run.local_step = local_step;
        run.canonical_step = canonical_step;
        ++run.count;
      }
    }
    if (!joins) {
      runs.push_back(
          FragmentRun{rec[kFragmentLayer], local, canonical, rec[kFragmentBytes], 1, 0, 0, f});
    }
    last_local = local;
    last_canonical = canonical;
    plan->run_of_fragment[static_cast<size_t>(f)] = static_cast<int64_t>(runs.size()) - 1;
  }
}

// Verified private copies of CPU plans, by plan identity (storage, offset, length),
// so that verification runs once per plan rather than once per call. The words a
// call follows are always the cached copy, and a call uses it only if the plan
// tensor still holds exactly those words (one memcmp, a small fraction of the
// verification it saves): a plan edited in place, with or without a version bump,
// is copied and verified again. The weak reference to the storage keeps its
// address from being reused by another tensor while the entry exists.
struct VerifiedPlan {
  std::shared_ptr<const CpuPlan> plan;
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

std::shared_ptr<const CpuPlan> verified_cpu_plan(const at::Tensor& plan) {
  const int64_t* user_words = plan.data_ptr<int64_t>();
  const int64_t num_words = plan.numel();
  const size_t num_bytes = static_cast<size_t>(num_words) * sizeof(int64_t);
  const PlanIdentity identity{plan.storage().unsafeGetStorageImpl(), plan.storage_offset(),
                              num_words};
  {
    const std::lock_guard<std::mutex> lock(plan_cache_mutex());
    const auto found = plan_cache().find(identity);
    if (found != plan_cache().end() && !found->second.storage.expired() &&
        std::memcmp(found->second.plan->words.data(), user_words, num_bytes) == 0) {
      return found->second.plan;
    }
  }
  auto verified = std::make_shared<CpuPlan>();
  verified->words.assign(user_words, user_words + num_words);
  verify_plan_words(verified->words.data(), num_words);  // throws: nothing is cached
  derive_runs(verified.get());
  const std::lock_guard<std::mutex> lock(plan_cache_mutex());
  auto& cache = plan_cache();
  if (cache.size() >= kMaxCachedPlans) {
    for (auto it = cache.begin(); it != cache.end();) {
      it = it->second.storage.expired() ? cache.erase(it) : std::next(it);
    }
    if (cache.size() >= kMaxCachedPlans) cache.erase(cache.begin());
  }
  cache.insert_or_assign(identity, VerifiedPlan{verified, plan.storage().getWeakStorageImpl()});
  return verified;
}

// Walks work items (pair, fragment) in order, run by run: the next fragment of a
// run is two additions away; a new run reads its record and, on a new pair or
// layer, the layer's bases. The ids and plan are private copies checked by
// validate_call, and a walker is only moved to items inside the call.
class RunWalker {
 public:
  RunWalker(const CpuPlan& plan, uint8_t* const* layer_base, uint8_t* pages, const int64_t* blocks,
            const int64_t* page_ids, bool store)
      : plan_(plan),
        view_{plan.words.data()},
        layer_base_(layer_base),
        pages_(pages),
        blocks_(blocks),
        page_ids_(page_ids),
        num_fragments_(view_.num_fragments()),
        num_runs_(static_cast<int64_t>(plan.runs.size())),
        store_(store) {}

  void seek(int64_t item) {
    pair_ = item / num_fragments_;
    const int64_t fragment = item % num_fragments_;
    run_index_ = plan_.run_of_fragment[static_cast<size_t>(fragment)];
    const FragmentRun& run = plan_.runs[static_cast<size_t>(run_index_)];
    layer_ = -1;
    enter(run, fragment - run.first_fragment);
  }

  void next() {
    if (left_in_run_ < 0) {
      ++left_in_run_;
      src_ += src_step_;
      dst_ += dst_step_;
      return;
    }
    if (++run_index_ == num_runs_) {
      run_index_ = 0;
      ++pair_;
      layer_ = -1;
    }
    enter(plan_.runs[static_cast<size_t>(run_index_)], 0);
  }

  uint8_t* dst() const { return dst_; }
  const uint8_t* src() const { return src_; }
  int64_t size() const { return size_; }  // 0: a store's page this rank does not write

 private:
  void enter(const FragmentRun& run, int64_t k) {
    if (run.layer != layer_) {
      layer_ = run.layer;
      bases_ = layer_bases(view_, layer_, blocks_[pair_], page_ids_[pair_]);
    }
    uint8_t* kv = layer_base_[run.layer] + bases_.local_base + run.local_offset;
    uint8_t* canonical = pages_ + bases_.canonical_base + run.canonical_offset;
    // k < run.count: both products are offset differences of verified records.
    kv += k * run.local_step;
    canonical += k * run.canonical_step;
    left_in_run_ = k + 1 - run.count;  // -(fragments after this one in the run)
    if (store_) {
      src_ = kv, dst_ = canonical;
      src_step_ = run.local_step, dst_step_ = run.canonical_step;
      size_ = bases_.is_writer ? run.size : 0;
    } else {
      src_ = canonical, dst_ = kv;
      src_step_ = run.canonical_step, dst_step_ = run.local_step;
      size_ = run.size;
    }
  }

  const CpuPlan& plan_;
  PlanView view_;
  uint8_t* const* layer_base_;
  uint8_t* pages_;
  const int64_t* blocks_;
  const int64_t* page_ids_;
  int64_t num_fragments_;
  int64_t num_runs_;
  bool store_;
  int64_t pair_ = 0;
  int64_t run_index_ = 0;
  int64_t layer_ = -1;
  int64_t left_in_run_ = 0;
  LayerBases bases_{};
  const uint8_t* src_ = nullptr;
  uint8_t* dst_ = nullptr;
  int64_t src_step_ = 0;
  int64_t dst_step_ = 0;
  int64_t size_ = 0;
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
  const std::shared_ptr<const CpuPlan> cpu_plan = verified_cpu_plan(plan);
  const PlanView view{cpu_plan->words.data()};
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

  parallel_range(0, total, grain, [&](int64_t begin, int64_t end) {
    // One walker expands the items `lead` ahead of the copy into a ring of
    // descriptors; the copy and the prefetcher read the ring (one walker's state
    // in registers, the descriptors in L1).
    Prefetcher prefetcher{store, bytes_per_pair, num_fragments};
    const int64_t lines = prefetcher.lines_ahead(), page = prefetcher.page_ahead();
    const int64_t lead = std::max<int64_t>({lines, page, 1});
    CopyDescriptor ring[kRingItems];
    RunWalker walker{*cpu_plan, layer_base.data(), pages, blocks, page_list, store};
    walker.seek(begin);
    int64_t walked = begin;  // the next item the walker records
    auto record = [&] {
      ring[walked & kRingMask] = {walker.dst(), walker.src(), walker.size()};
      if (++walked < end) walker.next();
    };
    while (walked < end && walked < begin + lead) record();
    for (int64_t item = begin; item < end; ++item) {
      if (walked < end) record();  // item + lead
      if (page > 0 && item + page < end) {
        const CopyDescriptor& ahead = ring[(item + page) & kRingMask];
        prefetcher.page(ahead.src, ahead.dst, ahead.size);
      }
      if (lines > 0 && item + lines < end) {
        const CopyDescriptor& ahead = ring[(item + lines) & kRingMask];
        prefetcher.lines(ahead.src, ahead.size);
      }
      const CopyDescriptor& d = ring[item & kRingMask];
      if (d.size > 0) copy_fragment(d.dst, d.src, d.size, streaming);
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
