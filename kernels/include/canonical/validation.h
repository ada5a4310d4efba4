// Host-side argument validation shared by the CPU and CUDA dispatch code: every
// check happens before a kernel starts, so bad input writes nothing.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "canonical/plan.h"

namespace canonical {

// What validation learnt about a call.
struct CallInfo {
  int64_t num_pairs = 0;
  int64_t num_rows = 0;
  int64_t num_pages = 0;  // num_rows * pages_per_row, saturated at INT64_MAX
  bool block_ids_on_host = false;
  bool page_ids_on_host = false;
  // Private copies of host-resident ids, taken once and then validated: the CPU
  // kernel copies from these, so a caller changing its id tensors during the call
  // cannot make it use an id that was not checked. Empty for device-resident ids.
  std::vector<int64_t> block_ids;
  std::vector<int64_t> page_ids;
};

// Checks a plan's words are self-consistent (magic, version, size, header, every
// layer record, fragment and tensor record), with overflow-proof arithmetic, so
// that a kernel following it cannot leave the tensors validate_call then checks it
// against. Throws ValueError "plan: corrupt ..." naming the word.
void verify_plan_words(const int64_t* words, int64_t num_words);

// Checks every argument of canonical_store / canonical_load against the plan
// (whose words must be verified and readable on the host). `store` picks which
// ids must be unique (the destinations: page ids of a store, block ids of a load).
// `capturing` (CUDA stream capture): ids must be on the device and no check asks the
// driver (cpu_pages' pinning is then checked by the caller against a range resolved
// outside capture). Throws ValueError / TypeError / IndexError naming the argument and
// the expected value.
CallInfo validate_call(const char* op, at::TensorList kv_caches, const at::Tensor& cpu_pages,
                       const at::Tensor& plan, const at::Tensor& block_ids,
                       const at::Tensor& page_ids, const PlanView& host_plan, bool store,
                       bool capturing = false);

// The tensor record (kTensorWords words: scalar type, ndim, sizes, strides) the plan
// keeps of a kv cache tensor; `name` is used in errors (too many dims).
std::vector<int64_t> tensor_record(const at::Tensor& tensor, const std::string& name);

// Private op: the tensor record of `tensor` (make_plan fills the plan's tensor table
// with it, so plan and calls compare records built by one function).
std::vector<int64_t> tensor_record_op(const at::Tensor& tensor);

// How many threads the CPU kernel's parallel loop spreads `work_items` single
// items over: a test's guard against a build without OpenMP (where
// at::parallel_for silently runs serially) and a check that a forked child
// copies on one thread.
int64_t cpu_threads_used(int64_t work_items);

}  // namespace canonical
