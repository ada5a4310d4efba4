"""The per-rank offload worker: mappings and plan built once, async stores and loads.

One ``OffloadWorker`` per rank. At construction it checks every layer's KV cache
tensor against its ``LayerSpec`` (dtype, shape and strides must be exactly the
layout the spec describes), derives and verifies every layer's canonical
mappings for the whole TP x PCP group (layers that cannot be certified get the
opaque fallback, for every rank alike), checks that the CPU rows hold exactly
this worker's layer areas, builds the transfer plan once, and from then on each
``store`` / ``load`` is ONE op call: one kernel launch on CUDA, one parallel
loop on CPU. Every call first checks that the kv tensors are still the ones the
plan was built for (same objects, dtype, shape and strides).

On CUDA, transfers run on the worker's side stream, ordered after the work
already queued on the caller's (compute) stream by an event, and complete in
the background; ``poll`` / ``wait`` report them. On CPU they run synchronously
and the returned job is already finished.

Identity of the stored bytes
----------------------------
``format_id`` names the canonical page encoding of the layers that have a spec
(``"v1-nhd"`` or ``"v1-hnd"``; None when they mix orders or no layer has a
spec). It says how certified pages are encoded, not who can read the store: an
opaque layer's pages (see ``opaque_layers``) hold each rank's page whole and are
readable only by the same topology and physical layout. ``storage_namespace``
is what to key persisted or shared pages by: it equals the format id when
``is_topology_independent`` (every layer certified: the bytes are the same
under any TP / DCP / PCP with the same tokens per canonical page), and
otherwise appends the group topology and a digest of the opaque layers'
physical pages, so two topologies never share a namespace. Neither includes
the model: combine it with the model's identity (name, revision, KV dtype)
as you would for any KV store.

Quantised KV
------------
A quantised layer (``float8_e4m3fn``, ``float8_e5m2``, ``int8``) is a layer of
that dtype; ``scales[l]`` (``layouts.KVScales``) says how it is scaled. With
per-token-head scales, ``scale_caches[l]`` is the layer's scale tensor
(``KVScales.page_spec``): the plan moves it right after the layer's data, so
a layer's area in a row is its data page, then its scale page (what a store
namespace built with the same scales expects of a unit). Per-tensor scales
move no bytes: they belong in the store namespace.
"""

from __future__ import annotations

import hashlib
import itertools
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from layouts import (
    CANONICAL_FORMAT_VERSION,
    CanonicalPageMapping,
    KVScales,
    LayerSpec,
    RankContext,
    canonical_format_id,
    certification_failure,
    derive_group_mappings,
    derive_scaled_group_mappings,
    opaque_fallback_mapping,
)
from layouts.quant import scales_mismatch

from ..checks import check_ids, check_int
from ..ops import CudaJobPools, check_unique_ids
from ..plan import default_area_offsets, describe_tensor, make_plan, spec_mismatch

__all__ = [
    "OffloadWorker",
    "TransferJob",
    "canonical_row_bytes",
    "group_layer_mappings",
    "spec_mismatch",
]


def group_layer_mappings(
    specs: Sequence[LayerSpec | None],
    ctx: RankContext,
    *,
    fallback_page_sizes: Sequence[int] | None = None,
    layer_names: Sequence[str] | None = None,
) -> list[tuple[CanonicalPageMapping, ...]]:
    """Every layer's verified mappings for every rank of ``ctx``'s group.

    A layer whose spec is None (layout not recognised) gets the opaque fallback
    with ``fallback_page_sizes[l]`` bytes per page (its block size in bytes).
    """
    out = []
    for layer, spec in enumerate(specs):
        name = layer_names[layer] if layer_names else f"layer {layer}"
        if spec is None:
            if fallback_page_sizes is None:
                raise ValueError(f"specs[{layer}]: None needs fallback_page_sizes[{layer}]")
            ranks = ctx.group_size
            page = int(fallback_page_sizes[layer])
            out.append(tuple(opaque_fallback_mapping(page, ranks, r) for r in range(ranks)))
            continue
        out.append(
            derive_group_mappings(
                spec,
                ctx.tp_size,
                ctx.total_kv_heads,
                ctx.dcp_size,
                ctx.pcp_size,
                ctx.interleave,
                layer_name=name,
            )
        )
    return out


def _fallback_reasons(specs: Sequence[LayerSpec | None], ctx: RankContext) -> dict[int, str]:
    """Why each opaque layer is not certified, checked at every rank of the group.

    ``derive_group_mappings`` falls back for the whole group when any rank
    fails, so the first failing rank's reason is the layer's.
    """
    contexts = [
        RankContext(ctx.tp_size, ctx.total_kv_heads, r, ctx.dcp_size, ctx.pcp_size, ctx.interleave)
        for r in range(ctx.group_size)
    ]
    by_spec: dict[LayerSpec | None, str | None] = {}
    reasons = {}
    for layer, spec in enumerate(specs):
        if spec not in by_spec:
            failures = (certification_failure(spec, c) for c in contexts)
            by_spec[spec] = next((f for f in failures if f is not None), None)
        if by_spec[spec] is not None:
            reasons[layer] = by_spec[spec]
    return reasons


def _storage_namespace(
    format_id: str | None,
    mixed_orders: bool,
    ctx: RankContext,
    specs: Sequence[LayerSpec | None],
    kv_caches: Sequence[torch.Tensor],
    mappings: Sequence[CanonicalPageMapping],
    fallback_reasons: dict[int, str],
) -> str:
    """The format id, plus the topology and opaque layers' pages when any layer is opaque."""
    if format_id is not None:
        base = format_id
    else:
        base = f"v{CANONICAL_FORMAT_VERSION}-{'mixed' if mixed_orders else 'opaque'}"
    if not fallback_reasons:
        return base
    # An opaque page is a rank's physical page verbatim: readable only by a group with
    # the same ranks and the same physical pages, so both go into the namespace.
    pages = tuple(
        (
            layer,
            repr(specs[layer]) if specs[layer] is not None else None,
            str(kv_caches[layer].dtype),
            tuple(kv_caches[layer].shape[1:]),
            tuple(kv_caches[layer].stride()),
            mappings[layer].canonical_page_size_bytes,
        )
        for layer in sorted(fallback_reasons)
    )
    topology = (ctx.tp_size, ctx.pcp_size, ctx.dcp_size, ctx.interleave, ctx.total_kv_heads)
    digest = hashlib.sha256(repr((topology, pages)).encode()).hexdigest()[:12]
    return (
        f"{base}-topo-tp{ctx.tp_size}-pcp{ctx.pcp_size}-dcp{ctx.dcp_size}-"
        f"il{ctx.interleave}-{digest}"
    )


def _check_scales(
    kv_caches: Sequence[torch.Tensor],
    specs: Sequence[LayerSpec | None],
    scales: Sequence[KVScales | None] | None,
    scale_caches: Sequence[torch.Tensor | None] | None,
) -> tuple[list[KVScales | None], list[torch.Tensor | None], list[LayerSpec | None]]:
    """Each layer's scales, scale tensor and scale page spec (None where it has none), checked."""
    count = len(kv_caches)
    for name, given in (("scales", scales), ("scale_caches", scale_caches)):
        if given is not None and (
            isinstance(given, (torch.Tensor, KVScales, str)) or len(given) != count
        ):
            raise ValueError(
                f"{name}: expected one entry (or None) per kv cache ({count}), got "
                f"{'one' if isinstance(given, (torch.Tensor, KVScales)) else len(given)}"
            )
    scales = [None] * count if scales is None else list(scales)
    caches = [None] * count if scale_caches is None else list(scale_caches)
    pages: list[LayerSpec | None] = []
    for layer, (kv, spec, scale, cache) in enumerate(zip(kv_caches, specs, scales, caches)):
        if scale is not None and not isinstance(scale, KVScales):
            raise TypeError(
                f"scales[{layer}]: expected layouts.KVScales or None, got {type(scale).__name__}"
            )
        if scale is not None:
            if spec is None:
                raise ValueError(
                    f"scales[{layer}]: specs[{layer}] is None (layout not recognised); a "
                    f"scaled layer needs its LayerSpec"
                )
            problem = scales_mismatch(spec, scale)
            if problem is not None:
                raise ValueError(f"scales[{layer}]: cannot scale specs[{layer}]: {problem}")
        page = scale.page_spec(spec) if scale is not None and scale.has_page else None
        pages.append(page)
        if page is None:
            if cache is not None:
                raise ValueError(
                    f"scale_caches[{layer}]: expected None (layer {layer} has no per-token-head "
                    f"scales in scales[{layer}]), got {type(cache).__name__}"
                )
            continue
        if not isinstance(cache, torch.Tensor) or cache.dim() < 1:
            raise ValueError(
                f"scale_caches[{layer}]: expected the layer's per-token-head scale tensor "
                f"({page}), got {type(cache).__name__}"
            )
        problem = spec_mismatch(cache, page)
        if problem is not None:
            raise ValueError(
                f"scale_caches[{layer}]: does not match scales[{layer}].page_spec(specs[{layer}]): "
                f"expected {problem}"
            )
        if cache.size(0) != kv.size(0) or cache.device != kv.device:
            raise ValueError(
                f"scale_caches[{layer}]: expected {kv.size(0)} blocks on {kv.device} like "
                f"kv_caches[{layer}], got {cache.size(0)} on {cache.device}"
            )
    return scales, caches, pages


def canonical_row_bytes(mappings: Sequence[CanonicalPageMapping], pages_per_row: int = 1) -> int:
    """Bytes of one region row holding ``pages_per_row`` canonical pages of every layer."""
    return sum(pages_per_row * m.canonical_page_size_bytes for m in mappings)


@dataclass
class TransferJob:
    """One submitted store or load.

    Attributes
    ----------
    job_id : int
    kind : {"store", "load"}
    num_blocks : int
        (block, page) pairs moved.
    num_bytes : int
        Local bytes this rank moved (stores count only the pages it writes).
    submitted_at, finished_at : float
        ``time.perf_counter()`` stamps; finished_at is None while in flight.
    """

    job_id: int
    kind: str
    num_blocks: int
    num_bytes: int
    submitted_at: float
    finished_at: float | None = None
    error: BaseException | None = None
    _done_event: torch.cuda.Event | None = field(default=None, repr=False)
    _keep_alive: tuple = field(default=(), repr=False)
    # CUDA: the job's own device-error record (pinned, written by its kernel), the host
    # ids it was given (to name a refused pair) and the pooled staging buffer, all handed
    # back to the worker's pools when the job's event has completed.
    _error_record: torch.Tensor | None = field(default=None, repr=False)
    _host_ids: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)
    _staging: torch.Tensor | None = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    @property
    def seconds(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.submitted_at

    def make_stream_wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Order ``stream`` (default: current) after this job without blocking the host."""
        if self._done_event is not None:
            (stream or torch.cuda.current_stream()).wait_event(self._done_event)


class OffloadWorker:
    """Stores and loads this rank's KV blocks to/from canonical pages.

    Parameters
    ----------
    kv_caches : sequence of torch.Tensor
        One per layer, leading dim = blocks (CPU or one CUDA device). A layer
        with a spec must be laid out exactly as the spec says (see
        :func:`spec_mismatch`). The worker keeps these tensor objects: every
        call refuses a replaced entry of :attr:`kv_caches` or a tensor whose
        dtype, shape or strides changed in place.
    specs : sequence of LayerSpec or None
        This rank's page description of each layer; None (an unrecognised
        layout) stores that layer opaquely, its whole block as one page.
    ctx : RankContext
        This rank's place in the TP x PCP group.
    cpu_pages : torch.Tensor or SharedOffloadRegion
        uint8 (num_rows, row_bytes) region shared by the group (pinned for
        CUDA), or a region object exposing ``.tensor``. Without
        ``area_offsets`` its rows must be exactly :attr:`row_bytes` long (this
        worker's layer areas, consecutive).
    pages_per_row : int
        Canonical pages of each layer per row.
    layer_names : sequence of str, optional
        Named in tiling errors.
    area_offsets : sequence of int, optional
        Byte offset of each plan tensor's area within a row (see
        :attr:`plan_entries`), for rows laid out by someone else (e.g. another
        topology whose opaque pages have other sizes); the areas must fit the
        rows without overlapping.
    scales : sequence of layouts.KVScales or None, optional
        Each layer's quantisation scales (None: the layer has none).
    scale_caches : sequence of torch.Tensor or None, optional
        Per-token-head scale tensor of each layer that has them (exactly the
        layout ``scales[l].page_spec(specs[l])`` describes, as many blocks as
        the data), None for every other layer. The worker keeps and checks
        these as it does ``kv_caches``.

    Raises
    ------
    ValueError
        A kv tensor that does not match its spec (naming ``kv_caches[l]`` and
        ``specs[l]``), rows of the wrong length, or areas that do not fit.

    Attributes
    ----------
    plan_entries : list of tuple[int, str]
        What the plan moves, in row order: ``(layer, "kv")`` for each layer's
        data, followed by ``(layer, "scales")`` for a layer with per-token-head
        scales. Without such scales, entry ``i`` is layer ``i``.
    mappings : list of CanonicalPageMapping
        This rank's mapping of each plan entry.
    group_mappings : list of tuple of CanonicalPageMapping
        Every rank's mapping of each plan entry.
    fallback_reasons : dict of int to str
        Layers stored opaquely, with the reason (see :attr:`opaque_layers`).
    format_id : str or None
        Canonical page encoding of the layers with a spec (``"v1-nhd"`` /
        ``"v1-hnd"``); None when they mix orders or no layer has a spec. Not a
        storage namespace when a layer is opaque: use :attr:`storage_namespace`.
    row_bytes : int
        Bytes of this worker's layer areas in a row (``canonical_row_bytes``).
    area_offsets : list of int
        Where each plan entry's area starts in a row.
    """

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        specs: Sequence[LayerSpec | None],
        ctx: RankContext,
        cpu_pages,
        *,
        pages_per_row: int = 1,
        layer_names: Sequence[str] | None = None,
        area_offsets: Sequence[int] | None = None,
        scales: Sequence[KVScales | None] | None = None,
        scale_caches: Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        if isinstance(kv_caches, torch.Tensor) or not len(kv_caches):
            raise ValueError("kv_caches: expected a non-empty list of tensors, one per layer")
        if len(specs) != len(kv_caches):
            raise ValueError(
                f"specs: expected one LayerSpec (or None) per kv cache ({len(kv_caches)}), "
                f"got {len(specs)}"
            )
        for layer, (kv, spec) in enumerate(zip(kv_caches, specs)):
            if not isinstance(kv, torch.Tensor) or kv.dim() < 1:
                raise ValueError(
                    f"kv_caches[{layer}]: expected a tensor with a leading block dimension, "
                    f"got {type(kv).__name__}"
                )
            if spec is not None and not isinstance(spec, LayerSpec):
                raise TypeError(
                    f"specs[{layer}]: expected a LayerSpec or None, got {type(spec).__name__}"
                )
            problem = None if spec is None else spec_mismatch(kv, spec)
            if problem is not None:
                raise ValueError(
                    f"kv_caches[{layer}]: does not match specs[{layer}]: expected {problem}"
                )
        self.scales, self.scale_caches, scale_pages = _check_scales(
            kv_caches, specs, scales, scale_caches
        )
        self.kv_caches = list(kv_caches)
        # What every call checks: the very tensors (and layouts) the plan was built for.
        self._held = tuple(self.kv_caches)
        self._held_layout = [(kv.dtype, kv.shape, kv.stride()) for kv in self._held]
        self._held_scales = tuple(self.scale_caches)
        self._held_scale_layout = [
            None if t is None else (t.dtype, t.shape, t.stride()) for t in self._held_scales
        ]
        self.plan_entries: list[tuple[int, str]] = []
        entry_specs: list[LayerSpec | None] = []
        self._plan_tensors: list[torch.Tensor] = []
        for layer, (kv, spec) in enumerate(zip(self.kv_caches, specs)):
            self.plan_entries.append((layer, "kv"))
            entry_specs.append(spec)
            self._plan_tensors.append(kv)
            if scale_pages[layer] is not None:
                self.plan_entries.append((layer, "scales"))
                entry_specs.append(scale_pages[layer])
                self._plan_tensors.append(self.scale_caches[layer])
        self.ctx = ctx
        self.region = cpu_pages if not isinstance(cpu_pages, torch.Tensor) else None
        self.cpu_pages = cpu_pages if isinstance(cpu_pages, torch.Tensor) else cpu_pages.tensor
        self.pages_per_row = pages_per_row = check_int("pages_per_row", pages_per_row, minimum=1)
        block_bytes = [kv.stride(0) * kv.element_size() for kv in self.kv_caches]
        self.group_mappings = []
        for layer, group in enumerate(
            group_layer_mappings(
                specs, ctx, fallback_page_sizes=block_bytes, layer_names=layer_names
            )
        ):
            if scale_pages[layer] is None:
                self.group_mappings.append(group)
                continue
            # Data and scales certify together (or are both opaque): layouts decides.
            self.group_mappings.extend(
                derive_scaled_group_mappings(
                    specs[layer],
                    self.scales[layer],
                    ctx.tp_size,
                    ctx.total_kv_heads,
                    ctx.dcp_size,
                    ctx.pcp_size,
                    ctx.interleave,
                    layer_name=layer_names[layer] if layer_names else f"layer {layer}",
                )
            )
        self.mappings = [group[ctx.rank] for group in self.group_mappings]
        self.fallback_reasons = _fallback_reasons(specs, ctx)
        for (layer, _), group in zip(self.plan_entries, self.group_mappings):
            if group[0].fallback_reason is not None and layer not in self.fallback_reasons:
                self.fallback_reasons[layer] = group[0].fallback_reason
        opaque_entries = {
            entry: self.fallback_reasons[layer]
            for entry, (layer, _) in enumerate(self.plan_entries)
            if layer in self.fallback_reasons
        }
        orders = {spec.order for spec in specs if spec is not None}
        self.format_id = canonical_format_id(orders.pop()) if len(orders) == 1 else None
        self.storage_namespace = _storage_namespace(
            self.format_id,
            len(orders) > 1,
            ctx,
            entry_specs,
            self._plan_tensors,
            self.mappings,
            opaque_entries,
        )
        self.row_bytes = canonical_row_bytes(self.mappings, pages_per_row)
        if area_offsets is None:
            if self.cpu_pages.dim() == 2 and self.cpu_pages.size(1) != self.row_bytes:
                sizes = [m.canonical_page_size_bytes for m in self.mappings]
                raise ValueError(
                    f"cpu_pages: expected rows of exactly {self.row_bytes} bytes "
                    f"({pages_per_row} page(s) per row of each layer's canonical page, "
                    f"{sizes} bytes), got rows of {self.cpu_pages.size(1)} bytes; rows laid "
                    f"out for other layer areas (e.g. another topology's opaque pages) need "
                    f"explicit area_offsets="
                )
            area_offsets = default_area_offsets(self.mappings, pages_per_row)
        # The plan records (and every call re-checks) each certified layer's tensor against
        # its spec; opaque layers move whole blocks, whatever their layout.
        self.plan = make_plan(
            self.mappings,
            self._plan_tensors,
            self.cpu_pages,
            pages_per_row=pages_per_row,
            area_offsets=area_offsets,
            specs=[
                None if entry in opaque_entries else spec for entry, spec in enumerate(entry_specs)
            ],
        )
        self.area_offsets = [int(offset) for offset in area_offsets]
        self.device = self.kv_caches[0].device
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._job_ids = itertools.count()
        self._in_flight: list[TransferJob] = []
        # Bytes this rank writes per page id, by page id modulo the writer rotation.
        self._rotation = int(np.lcm.reduce([m.num_writers for m in self.mappings]))
        self._store_bytes = [
            sum(m.local_page_size_bytes for m in self.mappings if m.is_writer(p))
            for p in range(self._rotation)
        ]
        self._load_bytes = sum(m.local_page_size_bytes for m in self.mappings)

    @property
    def opaque_layers(self) -> list[int]:
        """Layers stored with the opaque fallback (readable by this topology only)."""
        return sorted(self.fallback_reasons)

    @property
    def is_topology_independent(self) -> bool:
        """Whether every layer is certified, so the canonical bytes do not depend on TP/DCP/PCP."""
        return not self.fallback_reasons

    def _check_kv_caches(self) -> None:
        """Refuse kv tensors replaced or changed in place since the plan was built."""
        caches = self.kv_caches
        if len(caches) != len(self._held) or any(map(operator.is_not, caches, self._held)):
            layer = next(
                (i for i, (a, b) in enumerate(zip(caches, self._held)) if a is not b),
                min(len(caches), len(self._held)),
            )
            raise ValueError(
                f"kv_caches[{layer}]: expected the tensor this worker was built for (its plan "
                f"and layout checks describe that tensor), got a replaced entry; build a new "
                f"OffloadWorker for new caches"
            )
        if [(kv.dtype, kv.shape, kv.stride()) for kv in caches] != self._held_layout:
            for layer, (kv, (dtype, shape, stride)) in enumerate(zip(caches, self._held_layout)):
                if (kv.dtype, kv.shape, kv.stride()) != (dtype, shape, stride):
                    raise ValueError(
                        f"kv_caches[{layer}]: expected {dtype} shape {tuple(shape)} strides "
                        f"{stride} (as at construction), got {describe_tensor(kv)}; the "
                        f"tensor was changed in place since the plan was built"
                    )
        if self._held_scales:
            self._check_scale_caches()

    def _check_scale_caches(self) -> None:
        """Refuse scale tensors replaced or changed in place since the plan was built."""
        caches = self.scale_caches
        if len(caches) != len(self._held_scales):
            raise ValueError(
                f"scale_caches: expected {len(self._held_scales)} entries (as at construction), "
                f"got {len(caches)}"
            )
        for layer, (now, held, layout) in enumerate(
            zip(caches, self._held_scales, self._held_scale_layout)
        ):
            if now is not held:
                raise ValueError(
                    f"scale_caches[{layer}]: expected the tensor this worker was built for, "
                    f"got a replaced entry; build a new OffloadWorker for new caches"
                )
            if now is not None and (now.dtype, now.shape, now.stride()) != layout:
                dtype, shape, stride = layout
                raise ValueError(
                    f"scale_caches[{layer}]: expected {dtype} shape {tuple(shape)} strides "
                    f"{stride} (as at construction), got {describe_tensor(now)}; the tensor "
                    f"was changed in place since the plan was built"
                )

    # Tensor-level calls: what a model step would call; traceable by torch.compile.
    def store_tensors(self, *, block_ids: torch.Tensor, page_ids: torch.Tensor) -> None:
        """Launch the store of blocks ``block_ids`` into pages ``page_ids`` on the current stream.

        Keyword-only, like :meth:`store`: ``block_ids[i]`` is stored into ``page_ids[i]``.
        """
        self._check_kv_caches()
        self._launch_store(block_ids=block_ids, page_ids=page_ids)

    def load_tensors(self, *, block_ids: torch.Tensor, page_ids: torch.Tensor) -> None:
        """Launch the load of pages ``page_ids`` into blocks ``block_ids`` on the current stream.

        Keyword-only, like :meth:`load`: ``page_ids[i]`` is loaded into ``block_ids[i]``.
        """
        self._check_kv_caches()
        self._launch_load(block_ids=block_ids, page_ids=page_ids)

    # The launches proper, for callers that just checked the tensors.
    def _launch_store(self, *, block_ids: torch.Tensor, page_ids: torch.Tensor) -> None:
        torch.ops.canonical.canonical_store(
            self._plan_tensors, self.cpu_pages, self.plan, block_ids, page_ids
        )

    def _launch_load(self, *, block_ids: torch.Tensor, page_ids: torch.Tensor) -> None:
        torch.ops.canonical.canonical_load(
            self._plan_tensors, self.cpu_pages, self.plan, block_ids, page_ids
        )

    def _ids(self, name: str, ids) -> torch.Tensor:
        checked = check_ids(name, ids)  # integers only: never rounds 1.9 to 1
        if isinstance(checked, torch.Tensor) and checked.device == self.device:
            return checked
        host = checked.cpu() if isinstance(checked, torch.Tensor) else torch.from_numpy(checked)
        if self.device.type == "cpu":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _submit(self, kind: str, block_ids, page_ids) -> TransferJob:
        self._check_kv_caches()
        block_ids, page_ids = check_ids("block_ids", block_ids), check_ids("page_ids", page_ids)
        pages_np = page_ids.cpu().numpy() if isinstance(page_ids, torch.Tensor) else page_ids
        if kind == "store":
            counts = np.bincount(pages_np % self._rotation, minlength=self._rotation)
            num_bytes = int(sum(c * b for c, b in zip(counts, self._store_bytes)))
        else:
            num_bytes = len(pages_np) * self._load_bytes
        job = TransferJob(next(self._job_ids), kind, len(pages_np), num_bytes, time.perf_counter())
        launch = self._launch_store if kind == "store" else self._launch_load
        if self._stream is None:
            try:
                launch(
                    block_ids=self._ids("block_ids", block_ids),
                    page_ids=self._ids("page_ids", page_ids),
                )
            finally:
                job.finished_at = time.perf_counter()
            return job
        pools = self._cuda_pools()
        reporting = (
            torch.ops.canonical._canonical_store_reporting
            if kind == "store"
            else torch.ops.canonical._canonical_load_reporting
        )
        on_device = [isinstance(ids, torch.Tensor) and ids.is_cuda for ids in (block_ids, page_ids)]
        staging = host_ids = None
        if not any(on_device):
            # Host ids: checked here (range, distinct destinations) as the op checks host
            # ids, then one H2D copy from a pooled pinned buffer on the transfer stream.
            host_ids = self._checked_host_ids(kind, block_ids, page_ids)
            count = len(host_ids[0])
            staging = pools.staging(2 * count)
            staging[:count] = torch.from_numpy(host_ids[0])
            staging[count : 2 * count] = torch.from_numpy(host_ids[1])
        record = pools.errors.acquire()
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # KV written by queued compute is complete
        with torch.cuda.stream(self._stream):
            if staging is not None:
                ids = staging[: 2 * count].to(self.device, non_blocking=True)
                blocks, pages = ids[:count], ids[count:]
            else:
                # Device ids cannot be checked on the host without a sync: the kernel
                # refuses out-of-range ones (the job's error); repeated destinations are
                # the caller's responsibility (documented).
                blocks, pages = self._ids("block_ids", block_ids), self._ids("page_ids", page_ids)
            try:
                reporting(self._plan_tensors, self.cpu_pages, self.plan, blocks, pages, record)
            except BaseException:
                # Refused before any launch: the record was never handed to a kernel. The
                # staging buffer may feed a queued copy: left to torch's pinned allocator.
                pools.errors.release(record)
                raise
            job._done_event = pools.event()
            job._done_event.record(self._stream)
        job._error_record, job._host_ids, job._staging = record, host_ids, staging
        job._keep_alive = (blocks, pages)  # ids must outlive the kernel
        self._in_flight.append(job)
        return job

    def _cuda_pools(self) -> CudaJobPools:
        """The worker's reusable per-job CUDA resources (created on the first CUDA job)."""
        pools = self.__dict__.get("_cuda_job_pools")
        if pools is None:
            pools = self.__dict__["_cuda_job_pools"] = CudaJobPools()
        return pools

    def _checked_host_ids(self, kind: str, block_ids, page_ids) -> tuple[np.ndarray, np.ndarray]:
        """Host ids as int64 arrays, checked as the op checks host ids (IndexError for a
        block or page that does not exist, ValueError for a repeated destination)."""
        blocks, pages = (
            np.ascontiguousarray(ids.cpu().numpy() if isinstance(ids, torch.Tensor) else ids)
            for ids in (block_ids, page_ids)
        )
        if len(blocks) != len(pages):
            raise ValueError(
                f"page_ids: expected as many ids as block_ids ({len(blocks)}), got {len(pages)}"
            )
        num_blocks = min(int(kv.size(0)) for kv in self.kv_caches)
        num_pages = int(self.cpu_pages.size(0)) * self.pages_per_row
        for name, ids, limit in (("block_ids", blocks, num_blocks), ("page_ids", pages, num_pages)):
            bad = np.flatnonzero((ids < 0) | (ids >= limit))
            if bad.size:
                raise IndexError(
                    f"{name}[{int(bad[0])}] = {int(ids[bad[0]])}: expected 0 <= id < {limit}"
                )
        if kind == "store":
            check_unique_ids("page_ids", pages, "page ids in a store (destinations)")
        else:
            check_unique_ids("block_ids", blocks, "block ids in a load (destinations)")
        return blocks, pages

    def store(self, *, block_ids, page_ids) -> TransferJob:
        """Store blocks into canonical pages (this rank's elected bytes only).

        Parameters
        ----------
        block_ids, page_ids : 1-D integer ids (tensor, array or sequence), keyword-only
            ``block_ids[i]`` is stored into page ``page_ids[i]``. Keyword-only so
            that a store and a load can never be called with the ids swapped.
        """
        return self._submit("store", block_ids, page_ids)

    def load(self, *, block_ids, page_ids) -> TransferJob:
        """Load canonical pages into blocks (every byte of each local page).

        Parameters
        ----------
        block_ids, page_ids : 1-D integer ids (tensor, array or sequence), keyword-only
            Page ``page_ids[i]`` is loaded into block ``block_ids[i]``.
        """
        return self._submit("load", block_ids, page_ids)

    def _finish(self, job: TransferJob) -> None:
        """Book a completed job: read its own error record (a host read of pinned memory,
        no CUDA call) and hand its pooled resources back."""
        job.finished_at = time.perf_counter()
        job._keep_alive = ()
        if job._error_record is None:
            return
        pools = self._cuda_pools()
        blocks, pages = job._host_ids if job._host_ids is not None else (None, None)
        job.error = pools.errors.release(job._error_record, blocks, pages)
        if job._staging is not None:
            pools.release_staging(job._staging)
        pools.release_event(job._done_event)
        job._error_record = job._staging = job._host_ids = job._done_event = None

    def poll(self) -> list[TransferJob]:
        """Jobs finished since the last poll/wait, without blocking: one event query per
        job in flight, nothing queued on (or waiting for) the compute stream."""
        finished = [j for j in self._in_flight if j._done_event is None or j._done_event.query()]
        for job in finished:
            self._in_flight.remove(job)
            self._finish(job)
        return finished

    def wait(self, job: TransferJob) -> TransferJob:
        """Block until ``job`` is done (its own event only); raises its device-side error."""
        if job in self._in_flight:
            job._done_event.synchronize()
            self._in_flight.remove(job)
            self._finish(job)
        if job.error is not None:
            raise job.error
        return job
