// Host-side validation of canonical_store / canonical_load arguments and of plan
// words, shared by the CPU and CUDA dispatch code. Nothing is launched before
// every check here has passed.
#include "canonical/validation.h"

#include <ATen/ATen.h>

#include <string>

namespace canonical {
namespace {

std::string device_str(const at::Device& device) { return device.str(); }

// Checks one tensor's byte extent [offset, offset + extent) lies in its storage.
void check_storage_extent(const at::Tensor& t, int64_t last_byte_end, const std::string& name) {
  const int64_t begin = t.storage_offset() * static_cast<int64_t>(t.element_size());
  const int64_t storage_bytes = static_cast<int64_t>(t.storage().nbytes());
  TORCH_CHECK_VALUE(begin + last_byte_end <= storage_bytes, name, ": the plan reaches byte ",
                    begin + last_byte_end, " of its storage, which holds only ", storage_bytes,
                    " bytes");
}

void check_ids(const char* name, const at::Tensor& ids, const at::Device& kv_device) {
  TORCH_CHECK_TYPE(ids.scalar_type() == at::kLong, name, ": expected dtype int64, got ",
                   ids.scalar_type());
  TORCH_CHECK_VALUE(ids.dim() == 1, name, ": expected a 1-D tensor, got ", ids.dim(), "-D");
  TORCH_CHECK_VALUE(ids.is_contiguous(), name, ": expected a contiguous tensor");
  if (kv_device.is_cpu()) {
    TORCH_CHECK_VALUE(ids.device().is_cpu(), name, ": expected a CPU tensor like kv_caches, got ",
                      device_str(ids.device()));
  } else {
    const bool on_kv_device = ids.device() == kv_device;
    const bool pinned_host = ids.device().is_cpu() && ids.is_pinned();
    TORCH_CHECK_VALUE(on_kv_device || pinned_host, name, ": expected a tensor on ",
                      device_str(kv_device), " or a pinned CPU tensor, got ",
                      device_str(ids.device()), ids.device().is_cpu() ? " (not pinned)" : "");
  }
}

}  // namespace

void verify_plan_words(const int64_t* w, int64_t num_words) {
  TORCH_CHECK_VALUE(
      num_words >= kHeaderWords && w[kMagic] == kPlanMagic,
      "plan: not a canonical plan (bad magic); build it with canonical_ops.make_plan");
  TORCH_CHECK_VALUE(w[kVersion] == kPlanVersion, "plan: expected plan version ", kPlanVersion,
                    ", got ", w[kVersion]);
  const int64_t num_layers = w[kNumLayers];
  const int64_t num_fragments = w[kNumFragments];
  TORCH_CHECK_VALUE(
      num_layers >= 1 && num_fragments >= 0 && num_words == plan_words(num_layers, num_fragments),
      "plan: expected ", "plan_words(num_layers, num_fragments) words, got ", num_words);
  const PlanView plan{w};
  const int64_t pages_per_row = plan.header(kPagesPerRow);
  const int64_t required_row_bytes = plan.header(kRequiredRowBytes);
  TORCH_CHECK_VALUE(pages_per_row >= 1 && required_row_bytes <= plan.header(kRowBytes),
                    "plan: corrupt header (pages_per_row / row bytes)");
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* rec = plan.layer(l);
    const int64_t next_first =
        l + 1 < num_layers ? plan.layer(l + 1)[kFirstFragment] : num_fragments;
    const bool ok =
        rec[kLocalPageBytes] >= 0 && rec[kLocalPageBytes] <= rec[kBlockStrideBytes] &&
        rec[kNumBlocks] >= 0 && rec[kCanonicalPageBytes] >= 0 && rec[kAreaOffsetBytes] >= 0 &&
        rec[kAreaOffsetBytes] + pages_per_row * rec[kCanonicalPageBytes] <= required_row_bytes &&
        rec[kNumWriters] >= 1 && rec[kWriterIndex] >= 0 && rec[kWriterIndex] < rec[kNumWriters] &&
        rec[kFirstFragment] >= 0 && rec[kFirstFragment] <= next_first &&
        next_first <= num_fragments;
    TORCH_CHECK_VALUE(ok, "plan: corrupt record of layer ", l);
  }
  for (int64_t f = 0; f < num_fragments; ++f) {
    const int64_t* frag = plan.fragment(f);
    const int64_t layer = frag[kFragmentLayer];
    TORCH_CHECK_VALUE(layer >= 0 && layer < num_layers, "plan: fragment ", f, " names layer ",
                      layer);
    const int64_t* rec = plan.layer(layer);
    const bool ok = frag[kLocalOffset] >= 0 && frag[kCanonicalOffset] >= 0 &&
                    frag[kFragmentBytes] > 0 &&
                    frag[kLocalOffset] + frag[kFragmentBytes] <= rec[kLocalPageBytes] &&
                    frag[kCanonicalOffset] + frag[kFragmentBytes] <= rec[kCanonicalPageBytes] &&
                    frag[kFragmentBytes] <= plan.header(kMaxFragmentBytes);
    TORCH_CHECK_VALUE(ok, "plan: fragment ", f, " of layer ", layer, " leaves its pages");
  }
}

CallInfo validate_call(const char* op, at::TensorList kv_caches, const at::Tensor& cpu_pages,
                       const at::Tensor& plan, const at::Tensor& block_ids,
                       const at::Tensor& page_ids, const PlanView& host_plan) {
  TORCH_CHECK_VALUE(!kv_caches.empty(), op, ": kv_caches: expected one tensor per layer, got none");
  const at::Device device = kv_caches[0].device();
  TORCH_CHECK_VALUE(device.is_cpu() || device.is_cuda(),
                    "kv_caches[0]: expected a CPU or CUDA tensor, got ", device_str(device));
  TORCH_CHECK_VALUE(plan.device() == device, "plan: expected a tensor on ", device_str(device),
                    " (the kv_caches device), got ", device_str(plan.device()));

  const int64_t num_layers = host_plan.num_layers();
  TORCH_CHECK_VALUE(static_cast<int64_t>(kv_caches.size()) == num_layers, "plan: built for ",
                    num_layers, " layers, but kv_caches has ", kv_caches.size());
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor& kv = kv_caches[l];
    const std::string name = "kv_caches[" + std::to_string(l) + "]";
    TORCH_CHECK_VALUE(kv.device() == device, name, ": expected a tensor on ", device_str(device),
                      " like kv_caches[0], got ", device_str(kv.device()));
    TORCH_CHECK_VALUE(kv.dim() >= 1, name,
                      ": expected a leading block dimension, got a 0-D tensor");
    const int64_t* rec = host_plan.layer(l);
    const int64_t block_stride = kv.stride(0) * static_cast<int64_t>(kv.element_size());
    TORCH_CHECK_VALUE(kv.size(0) == rec[kNumBlocks], name, ": plan built for ", rec[kNumBlocks],
                      " blocks, got ", kv.size(0));
    TORCH_CHECK_VALUE(block_stride == rec[kBlockStrideBytes], name,
                      ": plan built for a block stride of ", rec[kBlockStrideBytes], " bytes, got ",
                      block_stride);
    if (kv.size(0) > 0) {
      check_storage_extent(kv, (kv.size(0) - 1) * block_stride + rec[kLocalPageBytes], name);
    }
  }

  TORCH_CHECK_VALUE(cpu_pages.device().is_cpu(), "cpu_pages: expected a CPU tensor, got ",
                    device_str(cpu_pages.device()));
  TORCH_CHECK_TYPE(cpu_pages.scalar_type() == at::kByte, "cpu_pages: expected dtype uint8, got ",
                   cpu_pages.scalar_type());
  TORCH_CHECK_VALUE(cpu_pages.dim() == 2,
                    "cpu_pages: expected a 2-D (rows, row_bytes) tensor, got ", cpu_pages.dim(),
                    "-D");
  TORCH_CHECK_VALUE(cpu_pages.stride(1) == 1 || cpu_pages.size(1) <= 1,
                    "cpu_pages: expected contiguous rows (stride(1) == 1), got stride(1) = ",
                    cpu_pages.stride(1));
  const int64_t row_bytes = host_plan.header(kRowBytes);
  TORCH_CHECK_VALUE(cpu_pages.stride(0) == row_bytes || cpu_pages.size(0) <= 1,
                    "cpu_pages: plan built for rows ", row_bytes,
                    " bytes apart, got stride(0) = ", cpu_pages.stride(0));
  TORCH_CHECK_VALUE(cpu_pages.size(1) >= host_plan.header(kRequiredRowBytes),
                    "cpu_pages: plan needs rows of at least ", host_plan.header(kRequiredRowBytes),
                    " bytes, got ", cpu_pages.size(1));
  if (cpu_pages.size(0) > 0) {
    check_storage_extent(cpu_pages,
                         (cpu_pages.size(0) - 1) * row_bytes + host_plan.header(kRequiredRowBytes),
                         "cpu_pages");
  }
  if (device.is_cuda()) {
    TORCH_CHECK_VALUE(cpu_pages.is_pinned(),
                      "cpu_pages: expected pinned (or cudaHostRegister'ed) memory for CUDA "
                      "kv_caches");
  }

  check_ids("block_ids", block_ids, device);
  check_ids("page_ids", page_ids, device);
  TORCH_CHECK_VALUE(block_ids.numel() == page_ids.numel(),
                    "page_ids: expected as many ids as block_ids (", block_ids.numel(), "), got ",
                    page_ids.numel());

  CallInfo info;
  info.num_pairs = block_ids.numel();
  info.num_rows = cpu_pages.size(0);
  info.ids_on_host = block_ids.device().is_cpu() && page_ids.device().is_cpu();
  // Host ids are checked here; device ids are checked by the kernel (no sync).
  if (block_ids.device().is_cpu()) {
    int64_t min_blocks = host_plan.layer(0)[kNumBlocks];
    int64_t min_layer = 0;
    for (int64_t l = 1; l < num_layers; ++l) {
      if (host_plan.layer(l)[kNumBlocks] < min_blocks) {
        min_blocks = host_plan.layer(l)[kNumBlocks];
        min_layer = l;
      }
    }
    const int64_t* ids = block_ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < info.num_pairs; ++i) {
      TORCH_CHECK_INDEX(ids[i] >= 0 && ids[i] < min_blocks, "block_ids[", i, "] = ", ids[i],
                        ": expected 0 <= block id < ", min_blocks, " (blocks of kv_caches[",
                        min_layer, "])");
    }
  }
  if (page_ids.device().is_cpu()) {
    const int64_t num_pages = info.num_rows * host_plan.header(kPagesPerRow);
    const int64_t* ids = page_ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < info.num_pairs; ++i) {
      TORCH_CHECK_INDEX(ids[i] >= 0 && ids[i] < num_pages, "page_ids[", i, "] = ", ids[i],
                        ": expected 0 <= page id < ", num_pages, " (", info.num_rows,
                        " cpu_pages rows x ", host_plan.header(kPagesPerRow), " pages per row)");
    }
  }
  return info;
}

}  // namespace canonical
