// Registry of device plans and the CUDA launch budget. A CUDA call validates
// against the host copy of its plan kept here since make_plan (no device sync).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace canonical {

// Host copy of a device plan plus its device error word, kept from make_plan
// (register_plan) so that CUDA calls validate without a device sync.
struct PlanEntry {
  std::vector<int64_t> words;
  at::Tensor error;  // int64[4] on the plan's device
};

// Registry of device plans (keyed by data pointer and size). remember_plan
// verifies the words first. find_plan returns nullptr for an unknown plan.
const PlanEntry* find_plan(const at::Tensor& plan);
const PlanEntry& remember_plan(const at::Tensor& plan, std::vector<int64_t> words);

// Private ops behind canonical_ops (registered in registration.cpp).
void register_plan(const at::Tensor& plan, const at::Tensor& host_plan);
std::vector<int64_t> plan_error(const at::Tensor& plan);
int64_t set_sm_budget(int64_t sms);

// SMs' worth of thread blocks a CUDA transfer may use.
int sm_budget();

}  // namespace canonical
