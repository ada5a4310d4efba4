// Host-side validation of canonical_store / canonical_load arguments and of plan
// words, shared by the CPU and CUDA dispatch code. Nothing is launched before
// every check here has passed. Every sum and product of values a caller can
// influence (plan words, strides, ids) is overflow-checked.
#include "canonical/validation.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <sstream>
#include <string>
#include <utility>

#include "canonical/checked.h"

namespace canonical {

constexpr int64_t kMaxWriters = int64_t{1} << 20;
namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

std::string device_str(const at::Device& device) { return device.str(); }

const char* header_name(int64_t word) {
  switch (word) {
    case kNumLayers:
      return "num_layers";
    case kNumFragments:
      return "num_fragments";
    case kPagesPerRow:
      return "pages_per_row";
    case kRowBytes:
      return "row_bytes";
    case kRequiredRowBytes:
      return "required_row_bytes";
    case kMaxFragmentBytes:
      return "max_fragment_bytes";
    case kCommonAlignment:
      return "common_alignment";
    case kBytesPerPair:
      return "bytes_per_pair";
    case kMinNumBlocks:
      return "min_num_blocks";
    default:
      return "reserved";
  }
}

const char* layer_field_name(int64_t field) {
  switch (field) {
    case kBlockStrideBytes:
      return "block_stride_bytes";
    case kNumBlocks:
      return "num_blocks";
    case kLocalPageBytes:
      return "local_page_size_bytes";
    case kCanonicalPageBytes:
      return "canonical_page_size_bytes";
    case kAreaOffsetBytes:
      return "area_offset_bytes";
    case kNumWriters:
      return "num_writers";
    case kWriterIndex:
      return "writer_index";
    default:
      return "first_fragment";
  }
}

const char* fragment_field_name(int64_t field) {
  switch (field) {
    case kLocalOffset:
      return "local_offset";
    case kCanonicalOffset:
      return "canonical_offset";
    case kFragmentBytes:
      return "size";
    default:
      return "layer";
  }
}

[[noreturn]] void corrupt_header(int64_t word, const std::string& why) {
  TORCH_CHECK_VALUE(false, "plan: corrupt header word ", word, " (", header_name(word), "): ", why,
                    "; build plans with canonical_ops.make_plan and do not edit them");
  __builtin_unreachable();
}

[[noreturn]] void corrupt_layer(int64_t layer, int64_t field, const std::string& why) {
  TORCH_CHECK_VALUE(false, "plan: corrupt record of layer ", layer, ", word ", field, " (",
                    layer_field_name(field), "): ", why);
  __builtin_unreachable();
}

[[noreturn]] void corrupt_fragment(int64_t fragment, int64_t layer, int64_t field,
                                   const std::string& why) {
  TORCH_CHECK_VALUE(false, "plan: corrupt fragment ", fragment, " of layer ", layer, ", word ",
                    field, " (", fragment_field_name(field), "): ", why);
  __builtin_unreachable();
}

[[noreturn]] void corrupt_tensor(int64_t layer, const std::string& why) {
  TORCH_CHECK_VALUE(false, "plan: corrupt tensor record of layer ", layer, ": ", why);
  __builtin_unreachable();
}

template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

// Largest power of two <= 16 dividing every value OR-ed into `combined`.
int64_t alignment_of(uint64_t combined) {
  int64_t align = 16;
  while (align > 1 && (combined % static_cast<uint64_t>(align)) != 0) align /= 2;
  return align;
}

// Element size of a recorded scalar type, or 0 when the code names none.
int64_t element_size_of(int64_t code) {
  if (code < 0 || code >= static_cast<int64_t>(c10::ScalarType::NumOptions)) return 0;
  const auto type = static_cast<c10::ScalarType>(code);
  if (type == c10::ScalarType::Undefined) return 0;
  try {
    return static_cast<int64_t>(c10::elementSize(type));
  } catch (const c10::Error&) {
    return 0;
  }
}

void verify_tensor_record(const PlanView& plan, int64_t layer) {
  const int64_t* rec = plan.tensor(layer);
  const int64_t element = element_size_of(rec[kTensorScalarType]);
  if (element <= 0) corrupt_tensor(layer, str("scalar type ", rec[kTensorScalarType]));
  const int64_t ndim = rec[kTensorDims];
  if (ndim < 1 || ndim > kMaxTensorDims) corrupt_tensor(layer, str("ndim ", ndim));
  for (int64_t d = 0; d < kMaxTensorDims; ++d) {
    const int64_t size = rec[kTensorSizes + d];
    const int64_t stride = rec[kTensorStrides + d];
    const bool ok = d < ndim ? size >= 0 && stride >= 0 : size == 0 && stride == 0;
    if (!ok) corrupt_tensor(layer, str("dim ", d, " has size ", size, " and stride ", stride));
  }
  const int64_t* layer_rec = plan.layer(layer);
  int64_t block_stride = 0;
  if (rec[kTensorSizes] != layer_rec[kNumBlocks] ||
      !checked_mul(rec[kTensorStrides], element, &block_stride) ||
      block_stride != layer_rec[kBlockStrideBytes]) {
    corrupt_tensor(layer, "its leading size / stride disagree with the layer record");
  }
}

// Checks one tensor's byte extent [offset, offset + extent) lies in its storage.
void check_storage_extent(const at::Tensor& t, int64_t last_byte_end, const std::string& name) {
  int64_t begin = 0;
  int64_t end = 0;
  const int64_t storage_bytes = static_cast<int64_t>(t.storage().nbytes());
  const bool ok = checked_mul(t.storage_offset(), static_cast<int64_t>(t.element_size()), &begin) &&
                  checked_add(begin, last_byte_end, &end) && end <= storage_bytes;
  TORCH_CHECK_VALUE(ok, name, ": the plan reaches byte ", begin, " + ", last_byte_end,
                    " of its storage, which holds only ", storage_bytes, " bytes");
}

void check_ids_tensor(const char* name, const at::Tensor& ids, const at::Device& kv_device,
                      bool capturing) {
  TORCH_CHECK_TYPE(ids.scalar_type() == at::kLong, name, ": expected dtype int64, got ",
                   ids.scalar_type());
  TORCH_CHECK_VALUE(ids.dim() == 1, name, ": expected a 1-D tensor, got ", ids.dim(), "-D");
  TORCH_CHECK_VALUE(ids.is_contiguous(), name, ": expected a contiguous tensor");
  if (kv_device.is_cpu()) {
    TORCH_CHECK_VALUE(ids.device().is_cpu(), name, ": expected a CPU tensor like kv_caches, got ",
                      device_str(ids.device()));
  } else if (capturing) {
    // Pinned host ids would be read at replay, after (and unlike) the host checks; and
    // is_pinned() asks the driver, which a captured call does not do.
    TORCH_CHECK_VALUE(ids.device() == kv_device, name, ": expected a tensor on ",
                      device_str(kv_device), " while capturing a CUDA graph, got ",
                      device_str(ids.device()));
  } else {
    const bool on_kv_device = ids.device() == kv_device;
    const bool pinned_host = ids.device().is_cpu() && ids.is_pinned();
    TORCH_CHECK_VALUE(on_kv_device || pinned_host, name, ": expected a tensor on ",
                      device_str(kv_device), " or a pinned CPU tensor, got ",
                      device_str(ids.device()), ids.device().is_cpu() ? " (not pinned)" : "");
  }
}

std::string shape_str(const int64_t* values, int64_t n) {
  std::ostringstream out;
  out << "[";
  for (int64_t i = 0; i < n; ++i) out << (i ? ", " : "") << values[i];
  out << "]";
  return out.str();
}

// The tensor kv_caches[l] must still be what the plan was built for.
void check_tensor_matches(const at::Tensor& kv, const int64_t* rec, const std::string& name) {
  const auto built_type = static_cast<c10::ScalarType>(rec[kTensorScalarType]);
  TORCH_CHECK_VALUE(kv.scalar_type() == built_type, name, ": plan built for a ", built_type,
                    " tensor, got ", kv.scalar_type(),
                    " (the plan records each layer's dtype, shape and strides: build a new plan "
                    "for other tensors)");
  const int64_t ndim = rec[kTensorDims];
  const auto sizes = kv.sizes();
  const auto strides = kv.strides();
  const bool same_shape =
      kv.dim() == ndim && std::equal(sizes.begin(), sizes.end(), rec + kTensorSizes);
  TORCH_CHECK_VALUE(same_shape, name, ": plan built for shape ",
                    shape_str(rec + kTensorSizes, ndim), ", got ", kv.sizes());
  const bool same_strides = std::equal(strides.begin(), strides.end(), rec + kTensorStrides);
  TORCH_CHECK_VALUE(same_strides, name, ": plan built for strides ",
                    shape_str(rec + kTensorStrides, ndim), ", got ", kv.strides(),
                    " (same shape, another memory layout: e.g. a .contiguous() copy of a permuted "
                    "cache)");
}

// Ids copied once from a host tensor (the copy is what gets validated and used).
std::vector<int64_t> copy_ids(const at::Tensor& ids) {
  const int64_t* data = ids.data_ptr<int64_t>();
  return std::vector<int64_t>(data, data + ids.numel());
}

// Refuses an id that appears twice: the destinations of one call must be distinct
// (two copies into one destination would leave an undefined mix of two sources).
// `ids` are already range-checked against [0, bound): a bitmap of the range finds a
// repeat in one pass when the range is not much larger than the call; otherwise (or
// to name the two positions once a repeat is seen) a sort.
void check_unique(const char* name, const std::vector<int64_t>& ids, int64_t bound,
                  const char* why) {
  if (ids.size() < 2) return;
  const int64_t bitmap_words = bound / 64 + 1;
  if (bitmap_words <= 4 * static_cast<int64_t>(ids.size()) + 4096) {
    std::vector<uint64_t> seen(static_cast<size_t>(bitmap_words), 0);
    bool repeated = false;
    for (const int64_t id : ids) {
      uint64_t& word = seen[static_cast<size_t>(id >> 6)];
      const uint64_t bit = uint64_t{1} << (id & 63);
      repeated |= (word & bit) != 0;
      word |= bit;
    }
    if (!repeated) return;
  }
  std::vector<std::pair<int64_t, int64_t>> sorted(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) sorted[i] = {ids[i], static_cast<int64_t>(i)};
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 1; i < sorted.size(); ++i) {
    TORCH_CHECK_VALUE(sorted[i].first != sorted[i - 1].first, name, "[", sorted[i - 1].second,
                      "] and ", name, "[", sorted[i].second, "] are both ", sorted[i].first,
                      ": expected distinct ", why);
  }
}

}  // namespace

std::vector<int64_t> tensor_record(const at::Tensor& tensor, const std::string& name) {
  TORCH_CHECK_VALUE(tensor.dim() >= 1 && tensor.dim() <= kMaxTensorDims, name,
                    ": expected a tensor of 1 to ", kMaxTensorDims,
                    " dims with a leading block dimension, got ", tensor.dim(), "-D");
  std::vector<int64_t> rec(kTensorWords, 0);
  rec[kTensorScalarType] = static_cast<int64_t>(tensor.scalar_type());
  rec[kTensorDims] = tensor.dim();
  for (int64_t d = 0; d < tensor.dim(); ++d) {
    rec[kTensorSizes + d] = tensor.size(d);
    rec[kTensorStrides + d] = tensor.stride(d);
  }
  return rec;
}

std::vector<int64_t> tensor_record_op(const at::Tensor& tensor) {
  return tensor_record(tensor, "tensor");
}

void verify_plan_words(const int64_t* w, int64_t num_words) {
  TORCH_CHECK_VALUE(
      num_words >= kHeaderWords && w[kMagic] == kPlanMagic,
      "plan: not a canonical plan (bad magic); build it with canonical_ops.make_plan");
  TORCH_CHECK_VALUE(w[kVersion] == kPlanVersion, "plan: expected plan version ", kPlanVersion,
                    ", got ", w[kVersion], "; build it with this canonical_ops.make_plan");
  const int64_t num_layers = w[kNumLayers];
  const int64_t num_fragments = w[kNumFragments];
  // Both tables fit in num_words, so every product below is bounded before it is formed.
  if (num_layers < 1 || num_layers > num_words) corrupt_header(kNumLayers, str(num_layers));
  if (num_fragments < 0 || num_fragments > num_words) {
    corrupt_header(kNumFragments, str(num_fragments));
  }
  int64_t expected_words = 0;
  const bool size_ok =
      checked_mul_add(num_layers, kLayerWords + kTensorWords, kHeaderWords, &expected_words) &&
      checked_mul_add(num_fragments, kFragmentWords, expected_words, &expected_words) &&
      expected_words == num_words;
  TORCH_CHECK_VALUE(size_ok, "plan: corrupt: header names ", num_layers, " layers and ",
                    num_fragments, " fragments, which take ", expected_words, " words; it has ",
                    num_words);
  for (int64_t word = kFirstReservedHeaderWord; word < kHeaderWords; ++word) {
    if (w[word] != 0) corrupt_header(word, str(w[word], " (reserved words are 0)"));
  }
  const PlanView plan{w};
  const int64_t pages_per_row = plan.header(kPagesPerRow);
  const int64_t row_bytes = plan.header(kRowBytes);
  const int64_t required_row_bytes = plan.header(kRequiredRowBytes);
  if (pages_per_row < 1) corrupt_header(kPagesPerRow, str(pages_per_row));
  if (row_bytes < 0) corrupt_header(kRowBytes, str(row_bytes));
  if (required_row_bytes < 0 || required_row_bytes > row_bytes) {
    corrupt_header(kRequiredRowBytes, str(required_row_bytes, " > row_bytes ", row_bytes));
  }

  int64_t bytes_per_pair = 0;
  int64_t min_blocks = kInt64Max;
  uint64_t alignment_bits = static_cast<uint64_t>(row_bytes);
  std::vector<std::pair<int64_t, int64_t>> areas;  // [begin, end) of non-empty layer areas
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* rec = plan.layer(l);
    const int64_t next_first =
        l + 1 < num_layers ? plan.layer(l + 1)[kFirstFragment] : num_fragments;
    if (rec[kBlockStrideBytes] < 0) corrupt_layer(l, kBlockStrideBytes, "negative");
    if (rec[kNumBlocks] < 0) corrupt_layer(l, kNumBlocks, "negative");
    if (rec[kLocalPageBytes] < 0 || rec[kLocalPageBytes] > rec[kBlockStrideBytes]) {
      corrupt_layer(l, kLocalPageBytes, "outside [0, block_stride_bytes]");
    }
    if (rec[kCanonicalPageBytes] < 0) corrupt_layer(l, kCanonicalPageBytes, "negative");
    int64_t area_end = 0;
    if (rec[kAreaOffsetBytes] < 0 ||
        !checked_mul_add(pages_per_row, rec[kCanonicalPageBytes], rec[kAreaOffsetBytes],
                         &area_end) ||
        area_end > required_row_bytes) {
      corrupt_layer(l, kAreaOffsetBytes,
                    "the layer's area (area_offset + pages_per_row * canonical_page_size) "
                    "leaves required_row_bytes");
    }
    if (area_end > rec[kAreaOffsetBytes]) areas.emplace_back(rec[kAreaOffsetBytes], area_end);
    // Ranks holding the same bytes: at most a whole group (no engine has 2**20 ranks).
    if (rec[kNumWriters] < 1 || rec[kNumWriters] > kMaxWriters) {
      corrupt_layer(l, kNumWriters, "outside [1, 2**20]");
    }
    if (rec[kWriterIndex] < 0 || rec[kWriterIndex] >= rec[kNumWriters]) {
      corrupt_layer(l, kWriterIndex, "outside [0, num_writers)");
    }
    const int64_t first = rec[kFirstFragment];
    if ((l == 0 && first != 0) || first < 0 || first > next_first || next_first > num_fragments) {
      corrupt_layer(l, kFirstFragment, "fragment ranges out of order");
    }
    if (!checked_add(bytes_per_pair, rec[kLocalPageBytes], &bytes_per_pair)) {
      corrupt_header(kBytesPerPair, "the layers' local pages overflow int64");
    }
    min_blocks = std::min(min_blocks, rec[kNumBlocks]);
    alignment_bits |= static_cast<uint64_t>(rec[kBlockStrideBytes]) |
                      static_cast<uint64_t>(rec[kCanonicalPageBytes]) |
                      static_cast<uint64_t>(rec[kAreaOffsetBytes]);
    verify_tensor_record(plan, l);
  }
  std::sort(areas.begin(), areas.end());
  for (size_t i = 1; i < areas.size(); ++i) {
    TORCH_CHECK_VALUE(areas[i].first >= areas[i - 1].second,
                      "plan: corrupt: two layer areas overlap at byte ", areas[i].first,
                      " of a row");
  }

  int64_t max_fragment = 0;
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* rec = plan.layer(l);
    const int64_t end = l + 1 < num_layers ? plan.layer(l + 1)[kFirstFragment] : num_fragments;
    for (int64_t f = rec[kFirstFragment]; f < end; ++f) {
      const int64_t* frag = plan.fragment(f);
      if (frag[kFragmentLayer] != l) corrupt_fragment(f, l, kFragmentLayer, "another layer's");
      const int64_t size = frag[kFragmentBytes];
      if (size <= 0 || size > rec[kLocalPageBytes] || size > rec[kCanonicalPageBytes]) {
        corrupt_fragment(f, l, kFragmentBytes, str(size, " (expected 0 < size <= both pages)"));
      }
      if (frag[kLocalOffset] < 0 || !sum_at_most(frag[kLocalOffset], size, rec[kLocalPageBytes])) {
        corrupt_fragment(f, l, kLocalOffset, "leaves the local page");
      }
      if (frag[kCanonicalOffset] < 0 ||
          !sum_at_most(frag[kCanonicalOffset], size, rec[kCanonicalPageBytes])) {
        corrupt_fragment(f, l, kCanonicalOffset, "leaves the canonical page");
      }
      max_fragment = std::max(max_fragment, size);
      alignment_bits |= static_cast<uint64_t>(frag[kLocalOffset]) |
                        static_cast<uint64_t>(frag[kCanonicalOffset]) | static_cast<uint64_t>(size);
    }
  }
  if (plan.header(kMaxFragmentBytes) != max_fragment) {
    corrupt_header(kMaxFragmentBytes,
                   str(plan.header(kMaxFragmentBytes), ", largest fragment ", max_fragment));
  }
  if (plan.header(kBytesPerPair) != bytes_per_pair) {
    corrupt_header(kBytesPerPair,
                   str(plan.header(kBytesPerPair), ", layers sum to ", bytes_per_pair));
  }
  if (plan.header(kMinNumBlocks) != min_blocks) {
    corrupt_header(kMinNumBlocks,
                   str(plan.header(kMinNumBlocks), ", smallest layer has ", min_blocks, " blocks"));
  }
  if (plan.header(kCommonAlignment) != alignment_of(alignment_bits)) {
    corrupt_header(kCommonAlignment, str(plan.header(kCommonAlignment), ", offsets give ",
                                         alignment_of(alignment_bits)));
  }
}

CallInfo validate_call(const char* op, at::TensorList kv_caches, const at::Tensor& cpu_pages,
                       const at::Tensor& plan, const at::Tensor& block_ids,
                       const at::Tensor& page_ids, const PlanView& host_plan, bool store,
                       bool capturing) {
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
    TORCH_CHECK_VALUE(kv.size(0) == rec[kNumBlocks], name, ": plan built for ", rec[kNumBlocks],
                      " blocks, got ", kv.size(0));
    int64_t block_stride = 0;
    TORCH_CHECK_VALUE(
        checked_mul(kv.stride(0), static_cast<int64_t>(kv.element_size()), &block_stride) &&
            block_stride == rec[kBlockStrideBytes],
        name, ": plan built for a block stride of ", rec[kBlockStrideBytes], " bytes, got ",
        kv.stride(0), " elements of ", kv.element_size(), " bytes");
    check_tensor_matches(kv, host_plan.tensor(l), name);
    if (kv.size(0) > 0) {
      int64_t extent = 0;
      TORCH_CHECK_VALUE(
          checked_mul_add(kv.size(0) - 1, block_stride, rec[kLocalPageBytes], &extent), name,
          ": its blocks span more than 2^63 bytes");
      check_storage_extent(kv, extent, name);
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
  const int64_t required_row_bytes = host_plan.header(kRequiredRowBytes);
  TORCH_CHECK_VALUE(cpu_pages.size(1) >= required_row_bytes,
                    "cpu_pages: plan needs rows of at least ", required_row_bytes, " bytes, got ",
                    cpu_pages.size(1));
  if (cpu_pages.size(0) > 0) {
    int64_t extent = 0;
    TORCH_CHECK_VALUE(
        checked_mul_add(cpu_pages.size(0) - 1, row_bytes, required_row_bytes, &extent),
        "cpu_pages: its rows span more than 2^63 bytes");
    check_storage_extent(cpu_pages, extent, "cpu_pages");
  }
  // (During capture the CUDA dispatch checks cpu_pages against the pinned range resolved
  // outside capture instead: is_pinned() asks the driver.)
  if (device.is_cuda() && !capturing) {
    TORCH_CHECK_VALUE(cpu_pages.is_pinned(),
                      "cpu_pages: expected pinned (or cudaHostRegister'ed) memory for CUDA "
                      "kv_caches");
  }

  check_ids_tensor("block_ids", block_ids, device, capturing);
  check_ids_tensor("page_ids", page_ids, device, capturing);
  TORCH_CHECK_VALUE(block_ids.numel() == page_ids.numel(),
                    "page_ids: expected as many ids as block_ids (", block_ids.numel(), "), got ",
                    page_ids.numel());

  CallInfo info;
  info.num_pairs = block_ids.numel();
  info.num_rows = cpu_pages.size(0);
  info.num_pages = pages_in_rows(info.num_rows, host_plan.header(kPagesPerRow));
  info.block_ids_on_host = block_ids.device().is_cpu();
  info.page_ids_on_host = page_ids.device().is_cpu();
  // Host ids are copied once, then checked (range, and distinct destinations);
  // device ids are range-checked by the kernel (no sync), see ops.py for duplicates.
  if (info.block_ids_on_host) {
    info.block_ids = copy_ids(block_ids);
    const int64_t min_blocks = host_plan.header(kMinNumBlocks);
    int64_t min_layer = 0;
    while (host_plan.layer(min_layer)[kNumBlocks] != min_blocks) ++min_layer;
    for (int64_t i = 0; i < info.num_pairs; ++i) {
      const int64_t id = info.block_ids[i];
      TORCH_CHECK_INDEX(id >= 0 && id < min_blocks, "block_ids[", i, "] = ", id,
                        ": expected 0 <= block id < ", min_blocks, " (blocks of kv_caches[",
                        min_layer, "])");
    }
    if (!store) {
      check_unique("block_ids", info.block_ids, min_blocks, "block ids in a load (destinations)");
    }
  }
  if (info.page_ids_on_host) {
    info.page_ids = copy_ids(page_ids);
    for (int64_t i = 0; i < info.num_pairs; ++i) {
      const int64_t id = info.page_ids[i];
      TORCH_CHECK_INDEX(id >= 0 && id < info.num_pages, "page_ids[", i, "] = ", id,
                        ": expected 0 <= page id < ", info.num_pages, " (", info.num_rows,
                        " cpu_pages rows x ", host_plan.header(kPagesPerRow), " pages per row)");
    }
    if (store) {
      check_unique("page_ids", info.page_ids, info.num_pages, "page ids in a store (destinations)");
    }
  }
  return info;
}

}  // namespace canonical
