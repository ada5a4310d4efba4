// Registry of device plans (host copy + device error word, kept from make_plan)
// and the SM budget of CUDA launches.
#include "canonical/plan_registry.h"

#include <ATen/ATen.h>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "canonical/validation.h"

namespace canonical {
namespace {

struct PlanKey {
  const void* data;
  int64_t numel;
  bool operator==(const PlanKey& o) const { return data == o.data && numel == o.numel; }
};
struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    return std::hash<const void*>()(k.data) ^ (std::hash<int64_t>()(k.numel) << 1);
  }
};

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
// Entries are never erased: plans are built once per engine, and a reference
// handed out must stay valid while a call uses it.
std::unordered_map<PlanKey, std::unique_ptr<PlanEntry>, PlanKeyHash>& registry() {
  static std::unordered_map<PlanKey, std::unique_ptr<PlanEntry>, PlanKeyHash> r;
  return r;
}

int& sm_budget_value() {
  static int value = [] {
    const char* env = std::getenv("CANONICAL_KV_SM_BUDGET");
    const int parsed = env ? std::atoi(env) : 0;
    return parsed > 0 ? parsed : 8;
  }();
  return value;
}

}  // namespace

const PlanEntry* find_plan(const at::Tensor& plan) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(PlanKey{plan.data_ptr(), plan.numel()});
  return it == registry().end() ? nullptr : it->second.get();
}

const PlanEntry& remember_plan(const at::Tensor& plan, std::vector<int64_t> words) {
  verify_plan_words(words.data(), static_cast<int64_t>(words.size()));
  TORCH_CHECK_VALUE(static_cast<int64_t>(words.size()) == plan.numel(), "plan: host copy has ",
                    words.size(), " words, the plan ", plan.numel());
  auto entry = std::make_unique<PlanEntry>();
  entry->words = std::move(words);
  entry->error = at::zeros({4}, plan.options().dtype(at::kLong));
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& slot = registry()[PlanKey{plan.data_ptr(), plan.numel()}];
  slot = std::move(entry);
  return *slot;
}

int sm_budget() { return sm_budget_value(); }

void register_plan(const at::Tensor& plan, const at::Tensor& host_plan) {
  TORCH_CHECK_TYPE(plan.scalar_type() == at::kLong && host_plan.scalar_type() == at::kLong,
                   "plan: expected dtype int64");
  TORCH_CHECK_VALUE(host_plan.device().is_cpu() && host_plan.is_contiguous() &&
                        plan.is_contiguous() && plan.dim() == 1,
                    "plan: expected a contiguous 1-D plan and a contiguous CPU host copy");
  const int64_t* w = host_plan.data_ptr<int64_t>();
  remember_plan(plan, std::vector<int64_t>(w, w + host_plan.numel()));
}

std::vector<int64_t> plan_error(const at::Tensor& plan) {
  const PlanEntry* entry = find_plan(plan);
  if (entry == nullptr || plan.device().is_cpu()) return {0, 0, 0, 0};
  at::Tensor host = entry->error.to(at::kCPU);  // synchronises with the error word's writers
  entry->error.zero_();
  const int64_t* e = host.data_ptr<int64_t>();
  return {e[0], e[1], e[2], e[3]};
}

int64_t set_sm_budget(int64_t sms) {
  TORCH_CHECK_VALUE(sms >= 1 && sms <= 4096, "sms: expected 1 <= sms <= 4096, got ", sms);
  const int previous = sm_budget_value();
  sm_budget_value() = static_cast<int>(sms);
  return previous;
}

}  // namespace canonical
