// Host-side argument validation shared by the CPU and CUDA dispatch code: every
// check happens before a kernel starts, so bad input writes nothing.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "canonical/plan.h"

namespace canonical {

// What validation learnt about a call.
struct CallInfo {
  int64_t num_pairs = 0;
  int64_t num_rows = 0;
  bool ids_on_host = false;
};

// Checks a plan's words are self-consistent (magic, version, size, every
// fragment inside its layer's pages, areas inside a row), so that a kernel
// following it cannot leave the tensors validate_call then checks it against.
void verify_plan_words(const int64_t* words, int64_t num_words);

// Checks every argument of canonical_store / canonical_load against the plan
// (whose words must be readable on the host). Throws ValueError / TypeError /
// IndexError naming the argument and the expected value.
CallInfo validate_call(const char* op, at::TensorList kv_caches, const at::Tensor& cpu_pages,
                       const at::Tensor& plan, const at::Tensor& block_ids,
                       const at::Tensor& page_ids, const PlanView& host_plan);

// How many threads the CPU kernel's parallel loop spreads `work_items` single
// items over: a test's guard against a build without OpenMP (where
// at::parallel_for silently runs serially) and a check that a forked child
// copies on one thread.
int64_t cpu_threads_used(int64_t work_items);

}  // namespace canonical
