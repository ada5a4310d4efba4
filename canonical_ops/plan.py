"""Plan building: per-layer canonical mappings -> one int64 plan tensor on the kv device, built
once; transfers pass only block and page ids. Layout: kernels/include/canonical/plan.h."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch

from layouts import CanonicalPageMapping, LayerSpec
from layouts.spec import dtype_name

from ._extension import BUILT_WITH_CUDA
from .checks import check_int

PLAN_MAGIC = 0x31564B4E4F4E4143  # "CANONKV1", as in plan.h
PLAN_VERSION = 2
HEADER_WORDS, LAYER_WORDS, FRAGMENT_WORDS = 16, 8, 4
MAX_TENSOR_DIMS = 8
TENSOR_WORDS = 2 + 2 * MAX_TENSOR_DIMS  # scalar type, ndim, sizes, strides
# CUDA plans split fragments so one group of lanes moves at most this many bytes
# per work item: big pages spread over many warps, small ones stay whole.
CUDA_MAX_FRAGMENT_BYTES = 2048


def _alignment(values: np.ndarray) -> int:
    """Largest power of two <= 16 dividing every value."""
    combined = int(np.bitwise_or.reduce(values.astype(np.int64))) if values.size else 0
    return min(16, combined & -combined) if combined else 16  # its lowest set bit


def _split(frags: np.ndarray, limit: int | None) -> np.ndarray:
    """Cut fragments (local, canonical, size) into pieces of at most ``limit`` bytes."""
    if not limit or frags.size == 0 or frags[:, 2].max() <= limit:
        return frags
    pieces = -(-frags[:, 2] // limit)
    rows = np.repeat(frags, pieces, axis=0)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)  # each piece's fragment's first
    start = (np.arange(len(rows), dtype=np.int64) - first) * limit  # a piece's offset in it
    sizes = np.minimum(limit, rows[:, 2] - start)
    return np.column_stack([rows[:, 0] + start, rows[:, 1] + start, sizes])


def default_area_offsets(mappings: Sequence[CanonicalPageMapping], pages_per_row: int) -> list[int]:
    """Layer areas carved consecutively in each row, layer 0 first (as vLLM's views do)."""
    sizes = [pages_per_row * m.canonical_page_size_bytes for m in mappings]
    return list(itertools.accumulate(sizes[:-1], initial=0)) if sizes else []


def canonical_row_bytes(mappings: Sequence[CanonicalPageMapping], pages_per_row: int = 1) -> int:
    """Bytes of one row holding ``pages_per_row`` canonical pages of every layer."""
    return sum(pages_per_row * m.canonical_page_size_bytes for m in mappings)


def spec_geometry(spec: LayerSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and strides (in elements) of one block of a cache laid out as ``spec`` says: the
    layouts :meth:`LayerSpec.from_tensor` recognises, without the leading block dimension."""
    bs, heads, hs = spec.block_size, spec.num_kv_heads, spec.head_size
    if spec.attention == "mla":
        return (bs, hs), (hs, 1)
    if spec.packing == "packed":
        if spec.order == "NHD":
            return (heads, bs, 2 * hs), (2 * hs, heads * 2 * hs, 1)
        return (heads, bs, 2 * hs), (bs * 2 * hs, 2 * hs, 1)
    half = bs * heads * hs
    if spec.order == "NHD":
        return (2, bs, heads, hs), (half, heads * hs, hs, 1)
    return (2, bs, heads, hs), (half, hs, bs * hs, 1)


def _dtype_problem(kv: torch.Tensor, spec: LayerSpec) -> str | None:
    """How ``kv``'s dtype differs from ``spec``'s, or None if it is the spec's."""
    try:
        dtype = dtype_name(kv.dtype)
    except ValueError:  # a dtype no KV cache is stored in
        dtype = str(kv.dtype).removeprefix("torch.")
    if dtype == spec.dtype:
        return None
    return (
        f"dtype {spec.dtype} ({spec.element_size} bytes per element), got {dtype} "
        f"({kv.element_size()} bytes per element)"
    )


# What LayerSpec.from_tensor is told about a tensor; it finds the dtype, packing and order.
_GIVEN = ("attention", "block_size", "num_kv_heads", "head_size")
_GIVEN += ("per_token_head_scales", "tokens_per_state")


def spec_mismatch(kv: torch.Tensor, spec: LayerSpec) -> str | None:
    """What differs between ``kv`` and the layout ``spec`` describes, or None if nothing:
    :meth:`LayerSpec.from_tensor`, given the spec's sizes, must recognise exactly ``spec``
    (dtype, packing, order). The stride of a size-1 dimension addresses nothing and is not
    compared (a contiguous 1-head cache is both NHD and HND)."""
    shape, strides = spec_geometry(spec)
    view = kv
    if tuple(kv.shape[1:]) == shape:
        # Put the expected stride on size-1 dims: the same elements, unambiguous strides.
        normalized = [kv.stride(0)] + [
            want if size == 1 else got for size, got, want in zip(shape, kv.stride()[1:], strides)
        ]
        view = kv.as_strided(kv.shape, normalized, kv.storage_offset())
    try:
        found = LayerSpec.from_tensor(view, **{name: getattr(spec, name) for name in _GIVEN})
    except ValueError:  # a dtype no KV cache is stored in: reported below
        found = None
    if found == spec:
        return None
    dtype_problem = _dtype_problem(kv, spec)
    if found is not None and dtype_problem is None and tuple(view.stride()[1:]) == strides:
        # Both layouts address the same bytes (e.g. one token and one head per block:
        # NHD is HND); from_tensor names the first, the tensor is exactly the spec's too.
        return None
    problems = [dtype_problem] if dtype_problem is not None else []
    layout = "MLA latent rows" if spec.attention == "mla" else f"{spec.packing} {spec.order}"
    if tuple(kv.shape[1:]) != shape:
        problems.append(f"shape (num_blocks, {', '.join(map(str, shape))}), got {tuple(kv.shape)}")
    elif tuple(view.stride()[1:]) != strides:
        seen = f", which is {found.packing} {found.order}" if found is not None else ""
        problems.append(
            f"strides (block, {', '.join(map(str, strides))}) in elements ({layout}), got "
            f"{tuple(kv.stride())}{seen}"
        )
    if not problems:
        problems.append(f"{spec}, got a tensor that LayerSpec.from_tensor reads as {found}")
    return "; ".join(problems)


def whole_page_mismatch(kv: torch.Tensor, spec: LayerSpec) -> str | None:
    """What differs between ``kv`` and ``spec``'s page taken whole (an opaque layer's
    check): ``spec``'s dtype and exactly one page per block, whatever the layout inside."""
    dtype_problem = _dtype_problem(kv, spec)
    if dtype_problem is not None:
        return dtype_problem
    block_bytes = math.prod(kv.shape[1:]) * kv.element_size()
    if block_bytes != spec.page_size_bytes:
        return (
            f"{spec.page_size_bytes} bytes per block ({spec.num_kv_heads} heads x "
            f"{spec.num_states} tokens x {spec.state_bytes} bytes), got shape "
            f"{tuple(kv.shape)}: {block_bytes} bytes per block"
        )
    return None


def _check_layer_tensor(
    layer: int, mapping: CanonicalPageMapping, kv: torch.Tensor, spec: LayerSpec | None
) -> None:
    """``kv_caches[layer]`` is the tensor ``mapping`` was derived for (and ``spec``, when
    given): see :func:`make_plan`'s ``specs``."""
    name = f"kv_caches[{layer}]"
    block_stride = kv.stride(0) * kv.element_size()
    if mapping.local_page_size_bytes > block_stride:
        raise ValueError(
            f"mappings[{layer}]: local page of {mapping.local_page_size_bytes} bytes does "
            f"not fit {name}'s block stride of {block_stride} bytes"
        )
    derived = mapping.derived_for
    if spec is not None and derived is not None and spec != derived:
        raise ValueError(
            f"specs[{layer}]: expected the page mappings[{layer}] was derived for ({derived}), "
            f"got {spec}"
        )
    if spec is None and derived is None:
        return
    described = spec if spec is not None else derived
    source = f"specs[{layer}]" if spec is not None else f"mappings[{layer}] (derived for it)"
    if mapping.local_page_size_bytes != described.page_size_bytes:
        raise ValueError(
            f"mappings[{layer}]: local page of {mapping.local_page_size_bytes} bytes, but "
            f"{source} describes pages of {described.page_size_bytes} bytes"
        )
    if spec is None and mapping.fallback_reason is not None:
        problem = whole_page_mismatch(kv, described)
    else:
        problem = spec_mismatch(kv, described)
    if problem is not None:
        raise ValueError(f"{name}: does not match {source}: expected {problem}")


def check_layer_lists(kv_caches: Sequence[torch.Tensor], specs=None) -> None:
    """``kv_caches`` a non-empty sequence of tensors with a leading block dimension (one per
    layer), ``specs`` (when given) one LayerSpec or None per layer; else ValueError (TypeError
    for a spec of another type) naming the argument."""
    if isinstance(kv_caches, torch.Tensor) or not len(kv_caches):
        raise ValueError("kv_caches: expected a non-empty list of tensors, one per layer")
    if specs is not None and (isinstance(specs, (str, LayerSpec)) or len(specs) != len(kv_caches)):
        count = "one" if isinstance(specs, LayerSpec) else len(specs)
        raise ValueError(
            f"specs: expected one LayerSpec (or None) per layer ({len(kv_caches)}), got {count}"
        )
    for layer, kv in enumerate(kv_caches):
        if not isinstance(kv, torch.Tensor) or not 1 <= kv.dim() <= MAX_TENSOR_DIMS:
            got = f"a {kv.dim()}-D tensor" if isinstance(kv, torch.Tensor) else type(kv).__name__
            raise ValueError(
                f"kv_caches[{layer}]: expected a tensor of 1 to {MAX_TENSOR_DIMS} dims with a "
                f"leading block dimension, got {got}"
            )
    for layer, spec in enumerate(specs or ()):
        if spec is not None and not isinstance(spec, LayerSpec):
            got = type(spec).__name__
            raise TypeError(f"specs[{layer}]: expected a LayerSpec or None, got {got}")


def _plan_words(
    mappings, kv_caches, cpu_pages, pages_per_row, area_offsets, max_fragment_bytes, specs
) -> np.ndarray:
    """The plan's int64 words (host numpy array); see :func:`make_plan`."""
    check_layer_lists(kv_caches, specs)
    if len(mappings) != len(kv_caches):
        raise ValueError(
            f"mappings: expected one CanonicalPageMapping per layer ({len(kv_caches)}), "
            f"got {len(mappings)}"
        )
    pages_per_row = check_int("pages_per_row", pages_per_row, minimum=1)
    if not isinstance(cpu_pages, torch.Tensor) or cpu_pages.dtype != torch.uint8:
        raise TypeError("cpu_pages: expected a uint8 tensor")
    if cpu_pages.dim() != 2 or (cpu_pages.size(1) > 1 and cpu_pages.stride(1) != 1):
        raise ValueError("cpu_pages: expected a 2-D (rows, row_bytes) tensor with contiguous rows")
    if max_fragment_bytes is not None:
        max_fragment_bytes = check_int("max_fragment_bytes", max_fragment_bytes, minimum=16)
        if max_fragment_bytes % 16:
            raise ValueError(
                f"max_fragment_bytes: expected a multiple of 16, got {max_fragment_bytes}"
            )
    device = kv_caches[0].device
    if max_fragment_bytes is None and device.type == "cuda":
        max_fragment_bytes = CUDA_MAX_FRAGMENT_BYTES

    for layer, mapping in enumerate(mappings):
        if not isinstance(mapping, CanonicalPageMapping):
            raise TypeError(
                f"mappings[{layer}]: expected a CanonicalPageMapping (use "
                f"layouts.opaque_fallback_mapping for uncertified layers), got "
                f"{type(mapping).__name__}"
            )
    if area_offsets is None:
        area_offsets = default_area_offsets(mappings, pages_per_row)
    elif len(area_offsets) != len(mappings):
        raise ValueError(
            f"area_offsets: expected {len(mappings)} offsets (one per layer), "
            f"got {len(area_offsets)}"
        )
    area_offsets = [
        check_int(f"area_offsets[{layer}]", offset, minimum=0)
        for layer, offset in enumerate(area_offsets)
    ]
    areas = sorted(
        (offset, offset + pages_per_row * m.canonical_page_size_bytes, layer)
        for layer, (offset, m) in enumerate(zip(area_offsets, mappings))
    )
    for (begin, end, layer), nxt in itertools.pairwise(areas):
        if end > nxt[0] and end > begin and nxt[1] > nxt[0]:
            raise ValueError(
                f"area_offsets[{layer}]: its area [{begin}, {end}) overlaps layer {nxt[2]}'s "
                f"at {nxt[0]}"
            )
    required_row_bytes = max(end for _, end, _ in areas)
    if cpu_pages.size(1) < required_row_bytes:
        raise ValueError(
            f"cpu_pages: expected rows of at least {required_row_bytes} bytes "
            f"(layer areas x pages_per_row={pages_per_row}), got {cpu_pages.size(1)}"
        )

    layer_table = np.zeros((len(mappings), LAYER_WORDS), dtype=np.int64)
    tensor_table = np.zeros((len(mappings), TENSOR_WORDS), dtype=np.int64)
    fragment_tables = []
    first = 0
    for layer, (mapping, kv) in enumerate(zip(mappings, kv_caches)):
        if kv.device != device:
            raise ValueError(
                f"kv_caches[{layer}]: expected a tensor on {device} like kv_caches[0], got {kv.device}"
            )
        _check_layer_tensor(layer, mapping, kv, None if specs is None else specs[layer])
        block_stride = kv.stride(0) * kv.element_size()
        # The calls refuse a tensor whose dtype, shape or strides differ from these.
        tensor_table[layer] = torch.ops.canonical._tensor_record(kv)
        frags = _split(mapping.fragments(), max_fragment_bytes)
        frags = frags[frags[:, 2] > 0]  # a 0-byte page (e.g. an empty opaque layer) moves nothing
        fragment_tables.append(np.column_stack([frags, np.full(len(frags), layer)]))
        layer_table[layer] = (
            block_stride,
            kv.size(0),
            mapping.local_page_size_bytes,
            mapping.canonical_page_size_bytes,
            int(area_offsets[layer]),
            mapping.num_writers,
            mapping.writer_index,
            first,
        )
        first += frags.shape[0]
    fragments = np.concatenate(fragment_tables)
    header = np.zeros(HEADER_WORDS, dtype=np.int64)
    row_bytes = cpu_pages.stride(0)
    alignment = _alignment(
        np.concatenate([fragments[:, :3].ravel(), layer_table[:, [0, 3, 4]].ravel(), [row_bytes]])
    )
    header[:11] = (
        PLAN_MAGIC,
        PLAN_VERSION,
        len(mappings),
        fragments.shape[0],
        pages_per_row,
        row_bytes,
        required_row_bytes,
        int(fragments[:, 2].max()) if fragments.size else 0,
        alignment,
        sum(m.local_page_size_bytes for m in mappings),
        int(layer_table[:, 1].min()),  # min_num_blocks: a block id must exist in every layer
    )
    return np.concatenate([header, layer_table.ravel(), fragments.ravel(), tensor_table.ravel()])


def check_kernels(device: torch.device, who: str) -> None:
    """Raise RuntimeError (``who`` first, then the reason and the fix) unless this build
    runs on ``device``: CPU, or CUDA (not ROCm) with the CUDA kernels built and a kernel
    image for that GPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return
    if device.type != "cuda" or torch.version.hip is not None:
        raise RuntimeError(
            f"{who}: canonical_ops has kernels for CUDA and CPU tensors, not {device}"
            f"{' (ROCm)' if torch.version.hip is not None else ''}"
        )
    if not BUILT_WITH_CUDA:
        raise RuntimeError(
            f"{who}: the tensors are on CUDA but canonical_ops was built without its CUDA "
            f"kernels (CANONICAL_KV_BUILD_CUDA=0 or no nvcc at install time); reinstall "
            f"canonical-kv with nvcc available"
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        torch.ops.canonical._check_cuda_kernels(index)  # a GPU the build has no image for
    except RuntimeError as error:
        raise RuntimeError(f"{who}: {error}") from error


def make_plan(
    mappings: Sequence[CanonicalPageMapping],
    kv_caches: Sequence[torch.Tensor],
    cpu_pages: torch.Tensor,
    *,
    pages_per_row: int = 1,
    area_offsets: Sequence[int] | None = None,
    max_fragment_bytes: int | None = None,
    specs: Sequence[LayerSpec | None] | None = None,
) -> torch.Tensor:
    """Build the transfer plan of a set of layers, once: an int64 tensor on the kv device.

    One mapping (this rank's) and kv tensor (leading dim = blocks) per layer; ``cpu_pages``:
    uint8 ``(num_rows, row_bytes)``, contiguous rows of ``pages_per_row`` canonical pages of
    every layer at ``area_offsets`` (default: consecutive, layer 0 first); ``max_fragment_bytes``
    (a multiple of 16) splits work items (default 2048 on CUDA). ``specs``: each tensor's page,
    for mappings that do not carry one (``derived_for``). A tensor must be exactly its page
    (opaque: its dtype, one whole page per block); with no page, the mapping must fit the block
    stride. The plan records each tensor and the row stride (the ops refuse others); on CUDA the
    kernel reads the extension's own verified copy: keep the plan alive while a CUDA graph uses
    it. TypeError / ValueError name the bad argument; RuntimeError: no kernels for the device.
    """
    args = (mappings, kv_caches, cpu_pages, pages_per_row, area_offsets, max_fragment_bytes, specs)
    host = torch.from_numpy(_plan_words(*args))
    device = kv_caches[0].device
    check_kernels(device, "kv_caches")
    if device.type == "cpu":
        return host.clone()
    plan = host.to(device)
    # The extension verifies the words, keeps them (CUDA calls validate without a
    # sync) with its own device copy for the kernel, and refuses a GPU without an image.
    torch.ops.canonical._register_plan(plan, host, cpu_pages)
    return plan
