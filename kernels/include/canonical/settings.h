// Process-wide launch settings of CUDA transfers: the SM budget and the kernel
// variant. Plain atomics: read on every launch, written rarely (tests, benchmarks).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace canonical {

// SMs' worth of thread blocks a CUDA transfer may use (CANONICAL_KV_SM_BUDGET, default 8).
int sm_budget();

// The compiled-in kernel variant CUDA transfers use (CANONICAL_KV_KERNEL_VARIANT: an index
// or a name of kernel_variant_names(); default 0, "base"). See launch.h.
int kernel_variant();

// Private ops behind canonical_ops (registered in registration.cpp).
int64_t set_sm_budget(int64_t sms);
int64_t set_kernel_variant(int64_t variant);
std::vector<std::string> kernel_variant_names();

}  // namespace canonical
