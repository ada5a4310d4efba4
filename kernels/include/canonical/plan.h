// Plan record and expansion index math, shared by the CPU kernel (g++) and the
// CUDA kernel (nvcc). Header-only, no torch or c10 headers (host/device through the
// project's own macros.h): the .cu file includes only this.
//
// A plan is ONE int64 tensor built once at init by canonical_ops.make_plan from
// the layers' CanonicalPageMappings. It lives on the KV device; the kernels
// read it, nothing writes it after it is built.
//
// Layout (all values int64, offsets in int64 words, sizes in bytes):
//
//   header   [kHeaderWords]
//     [0]  kPlanMagic
//     [1]  kPlanVersion
//     [2]  num_layers
//     [3]  num_fragments              (all layers, after chunking)
//     [4]  pages_per_row              canonical pages of each layer per cpu_pages row
//     [5]  row_bytes                  cpu_pages.stride(0): bytes between rows
//     [6]  required_row_bytes         bytes of a row the layer areas reach (<= cpu_pages.size(1))
//     [7]  max_fragment_bytes         largest fragment after chunking
//     [8]  common_alignment           largest power of two (<= 16) dividing every offset and size
//     [9]  bytes_per_pair             local bytes of one block over all layers (sum of page sizes)
//     [10] min_num_blocks             smallest kv_caches[l].size(0): a block id must be below it
//                                     (the device-side check skips a bad pair in every layer)
//     [11..15] reserved (0)
//   layers   [num_layers][kLayerWords], starting at word kHeaderWords
//     [0]  block_stride_bytes         kv_caches[l].stride(0) * element_size()
//     [1]  num_blocks                 kv_caches[l].size(0)
//     [2]  local_page_size_bytes
//     [3]  canonical_page_size_bytes
//     [4]  area_offset_bytes          where layer l's area starts in each row
//     [5]  num_writers
//     [6]  writer_index
//     [7]  first_fragment             index of the layer's first fragment record
//   fragments [num_fragments][kFragmentWords], after the layer table
//     [0]  local_offset               in the layer's local page (block)
//     [1]  canonical_offset           in the layer's canonical page
//     [2]  size
//     [3]  layer
//   tensors  [num_layers][kTensorWords], after the fragment table: what each kv_caches[l]
//            was when the plan was built (the calls refuse a tensor that differs)
//     [0]  scalar type                c10::ScalarType of the tensor
//     [1]  ndim                       1 .. kMaxTensorDims
//     [2 .. 2 + kMaxTensorDims)       sizes (unused dims 0)
//     [2 + kMaxTensorDims .. )        strides in elements (unused dims 0)
//
// Fragments are ordered by layer, then by local offset, and have a size > 0. Layer l's canonical
// page p lives at
//     row(p // pages_per_row) + area_offset[l] + (p % pages_per_row) * canonical_page_size[l].
// A transfer of n (block_id, page_id) pairs has n * num_fragments work items;
// item w is fragment (w % num_fragments) of pair (w / num_fragments), so
// consecutive items walk one block's local page in address order.
#pragma once

#include <stdint.h>

#include "canonical/macros.h"

namespace canonical {

constexpr int64_t kPlanMagic = 0x31564b4e4f4e4143LL;  // "CANONKV1" little-endian
constexpr int64_t kPlanVersion = 2;
constexpr int64_t kHeaderWords = 16;
constexpr int64_t kLayerWords = 8;
constexpr int64_t kFragmentWords = 4;
constexpr int64_t kMaxTensorDims = 8;
constexpr int64_t kTensorWords = 2 + 2 * kMaxTensorDims;

enum HeaderField : int64_t {
  kMagic = 0,
  kVersion = 1,
  kNumLayers = 2,
  kNumFragments = 3,
  kPagesPerRow = 4,
  kRowBytes = 5,
  kRequiredRowBytes = 6,
  kMaxFragmentBytes = 7,
  kCommonAlignment = 8,
  kBytesPerPair = 9,
  kMinNumBlocks = 10,
};
constexpr int64_t kFirstReservedHeaderWord = 11;

enum LayerField : int64_t {
  kBlockStrideBytes = 0,
  kNumBlocks = 1,
  kLocalPageBytes = 2,
  kCanonicalPageBytes = 3,
  kAreaOffsetBytes = 4,
  kNumWriters = 5,
  kWriterIndex = 6,
  kFirstFragment = 7,
};

enum FragmentField : int64_t {
  kLocalOffset = 0,      // in the layer's local page (block)
  kCanonicalOffset = 1,  // in the layer's canonical page
  kFragmentBytes = 2,    // size
  kFragmentLayer = 3,    // the layer it belongs to
};

enum TensorField : int64_t {
  kTensorScalarType = 0,
  kTensorDims = 1,
  kTensorSizes = 2,
  kTensorStrides = 2 + kMaxTensorDims,
};

// A CUDA kernel that refuses a pair (a device-resident id out of range) skips it in
// every layer (no byte is read or written for it) and records it in an error record
// of kErrorRecordWords int64 words, with plain stores only (no atomics: the record
// may live in mapped pinned host memory): the flag words are set to 1, the pair word
// to (index of a refused pair) + 1. Concurrent reporters store the same flag values;
// the pair word keeps one of the refused pairs (one aligned 8-byte store each).
enum ErrorRecordField : int64_t {
  kErrorBlockFlag = 0,  // 1: some block id was outside [0, min_num_blocks)
  kErrorPageFlag = 1,   // 1: some page id was outside [0, num_rows * pages_per_row)
  kErrorPair = 2,       // index + 1 of one refused pair (0: none)
};
constexpr int64_t kErrorRecordWords = 4;

// Total words of a plan with the given table sizes (callers bound the sizes first:
// see verify_plan_words, which checks this product without overflow).
CANONICAL_HOST_DEVICE inline int64_t plan_words(int64_t num_layers, int64_t num_fragments) {
  return kHeaderWords + num_layers * (kLayerWords + kTensorWords) + num_fragments * kFragmentWords;
}

// Read-only view over a plan's words (host or device memory).
struct PlanView {
  const int64_t* words;

  CANONICAL_HOST_DEVICE int64_t header(int64_t field) const { return words[field]; }
  CANONICAL_HOST_DEVICE int64_t num_layers() const { return words[kNumLayers]; }
  CANONICAL_HOST_DEVICE int64_t num_fragments() const { return words[kNumFragments]; }
  CANONICAL_HOST_DEVICE const int64_t* layer(int64_t l) const {
    return words + kHeaderWords + l * kLayerWords;
  }
  CANONICAL_HOST_DEVICE const int64_t* fragment(int64_t f) const {
    return words + kHeaderWords + num_layers() * kLayerWords + f * kFragmentWords;
  }
  CANONICAL_HOST_DEVICE const int64_t* tensor(int64_t l) const {
    return words + kHeaderWords + num_layers() * kLayerWords + num_fragments() * kFragmentWords +
           l * kTensorWords;
  }
};

// One work item, expanded: which layer, byte offsets from the layer's kv base
// and from cpu_pages' base, the size, and whether this rank stores it.
struct Expanded {
  int64_t layer;
  int64_t local_byte;      // from kv_caches[layer].data_ptr()
  int64_t canonical_byte;  // from cpu_pages.data_ptr()
  int64_t size;
  bool is_writer;  // page_id % num_writers == writer_index
};

// Where layer `layer`'s pages of the pair (block_id, page_id) start: the bases
// every fragment offset of that layer adds to, and whether this rank stores the
// page. The CPU kernel computes them once per pair and layer; expand() adds one
// fragment to them.
struct LayerBases {
  int64_t local_base;      // from kv_caches[layer].data_ptr()
  int64_t canonical_base;  // from cpu_pages.data_ptr()
  bool is_writer;          // page_id % num_writers == writer_index
};

CANONICAL_HOST_DEVICE inline LayerBases layer_bases(const PlanView& plan, int64_t layer,
                                                    int64_t block_id, int64_t page_id) {
  const int64_t* rec = plan.layer(layer);
  const int64_t pages_per_row = plan.header(kPagesPerRow);
  const int64_t row = page_id / pages_per_row;
  const int64_t slot = page_id - row * pages_per_row;
  LayerBases out;
  out.local_base = block_id * rec[kBlockStrideBytes];
  out.canonical_base =
      row * plan.header(kRowBytes) + rec[kAreaOffsetBytes] + slot * rec[kCanonicalPageBytes];
  out.is_writer = page_id % rec[kNumWriters] == rec[kWriterIndex];
  return out;
}

// Expands fragment `fragment` of the pair (block_id, page_id). Ids must already
// be in range (see ids_in_range) and the plan verified against the tensors
// (verify_plan_words, validate_call): every sum below is then bounded by a
// tensor's byte extent, so none overflows, and the result lies inside both tensors.
CANONICAL_HOST_DEVICE inline Expanded expand(const PlanView& plan, int64_t fragment,
                                             int64_t block_id, int64_t page_id) {
  const int64_t* frag = plan.fragment(fragment);
  const int64_t layer = frag[kFragmentLayer];
  const LayerBases bases = layer_bases(plan, layer, block_id, page_id);
  Expanded out;
  out.layer = layer;
  out.local_byte = bases.local_base + frag[kLocalOffset];
  out.canonical_byte = bases.canonical_base + frag[kCanonicalOffset];
  out.size = frag[kFragmentBytes];
  out.is_writer = bases.is_writer;
  return out;
}

// Whether a pair may be expanded: the block exists in EVERY layer's kv tensor
// (min_num_blocks, so a bad pair is skipped whole) and the page in cpu_pages.
// `num_pages` is num_rows * pages_per_row, computed by the host without overflow
// (saturated at INT64_MAX; see pages_in_rows).
CANONICAL_HOST_DEVICE inline bool ids_in_range(const PlanView& plan, int64_t block_id,
                                               int64_t page_id, int64_t num_pages) {
  return block_id >= 0 && block_id < plan.header(kMinNumBlocks) && page_id >= 0 &&
         page_id < num_pages;
}

}  // namespace canonical
