// Process-wide launch settings of CUDA transfers (see settings.h).
#include "canonical/settings.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>

namespace canonical {
namespace {

// The names launch.h documents; kept here too so a CPU-only build lists them.
const char* const kVariantNames[] = {"base", "2blk", "deep", "deep2blk"};
constexpr int kVariants = sizeof(kVariantNames) / sizeof(kVariantNames[0]);

std::atomic<int>& sm_budget_value() {
  static std::atomic<int> value{[] {
    const char* env = std::getenv("CANONICAL_KV_SM_BUDGET");
    const int parsed = env ? std::atoi(env) : 0;
    return parsed >= 1 && parsed <= 4096 ? parsed : 8;
  }()};
  return value;
}

int parse_variant(const char* text) {
  for (int v = 0; v < kVariants; ++v) {
    if (std::string(text) == kVariantNames[v] || std::string(text) == std::to_string(v)) return v;
  }
  return -1;
}

std::atomic<int>& variant_value() {
  static std::atomic<int> value{[] {
    const char* env = std::getenv("CANONICAL_KV_KERNEL_VARIANT");
    if (env == nullptr || *env == '\0') return 0;
    const int parsed = parse_variant(env);
    TORCH_CHECK_VALUE(parsed >= 0, "CANONICAL_KV_KERNEL_VARIANT: expected 0-", kVariants - 1,
                      " or one of base, 2blk, deep, deep2blk, got '", env, "'");
    return parsed;
  }()};
  return value;
}

}  // namespace

int sm_budget() { return sm_budget_value().load(std::memory_order_relaxed); }

int kernel_variant() { return variant_value().load(std::memory_order_relaxed); }

int64_t set_sm_budget(int64_t sms) {
  TORCH_CHECK_VALUE(sms >= 1 && sms <= 4096, "sms: expected 1 <= sms <= 4096, got ", sms);
  return sm_budget_value().exchange(static_cast<int>(sms));
}

int64_t set_kernel_variant(int64_t variant) {
  TORCH_CHECK_VALUE(variant >= 0 && variant < kVariants, "variant: expected 0 <= variant < ",
                    kVariants, ", got ", variant);
  return variant_value().exchange(static_cast<int>(variant));
}

std::vector<std::string> kernel_variant_names() {
  return std::vector<std::string>(kVariantNames, kVariantNames + kVariants);
}

}  // namespace canonical
