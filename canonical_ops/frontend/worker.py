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
    LayerSpec,
    RankContext,
    canonical_format_id,
    certification_failure,
    derive_group_mappings,
    opaque_fallback_mapping,
)
from layouts.spec import dtype_name

from ..checks import check_ids, check_int
from ..ops import check_device_errors
from ..plan import default_area_offsets, make_plan

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


def canonical_row_bytes(mappings: Sequence[CanonicalPageMapping], pages_per_row: int = 1) -> int:
    """Bytes of one region row holding ``pages_per_row`` canonical pages of every layer."""
    return sum(pages_per_row * m.canonical_page_size_bytes for m in mappings)


def spec_geometry(spec: LayerSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and strides (in elements) of one block of a cache laid out as ``spec`` says.

    These are the layouts :meth:`LayerSpec.from_tensor` recognises, without the
    leading block dimension (whose stride may include padding).
    """
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


def _describe_tensor(kv: torch.Tensor) -> str:
    return f"{kv.dtype} shape {tuple(kv.shape)} strides {tuple(kv.stride())}"


def spec_mismatch(kv: torch.Tensor, spec: LayerSpec) -> str | None:
    """What differs between ``kv`` and the layout ``spec`` describes, or None if nothing.

    ``kv`` matches when :meth:`LayerSpec.from_tensor`, given the spec's
    attention kind, block size, head count and head size, recognises exactly
    ``spec`` in it (same dtype, packing and order). The stride of a dimension
    of size 1 (one head per rank, say) addresses nothing, so it is not compared:
    a contiguous 1-head cache is both NHD and HND.
    """
    shape, strides = spec_geometry(spec)
    view = kv
    if tuple(kv.shape[1:]) == shape and kv.dim() == len(shape) + 1:
        # Put the expected stride on size-1 dims: the same elements, unambiguous strides.
        normalized = [kv.stride(0)] + [
            want if size == 1 else got for size, got, want in zip(shape, kv.stride()[1:], strides)
        ]
        view = kv.as_strided(kv.shape, normalized, kv.storage_offset())
    try:
        found = LayerSpec.from_tensor(
            view,
            attention=spec.attention,
            block_size=spec.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            per_token_head_scales=spec.per_token_head_scales,
            tokens_per_state=spec.tokens_per_state,
        )
    except ValueError:  # a dtype no KV cache is stored in: reported below
        found = None
    if found == spec:
        return None
    problems = []
    try:
        dtype = dtype_name(kv.dtype)
    except ValueError:
        dtype = str(kv.dtype).removeprefix("torch.")
    if dtype != spec.dtype:
        problems.append(
            f"dtype {spec.dtype} ({spec.element_size} bytes per element), got {dtype} "
            f"({kv.element_size()} bytes per element)"
        )
    layout = "MLA latent rows" if spec.attention == "mla" else f"{spec.packing} {spec.order}"
    if tuple(kv.shape[1:]) != shape:
        problems.append(f"shape (num_blocks, {', '.join(map(str, shape))}), got {tuple(kv.shape)}")
    elif tuple(view.stride()[1:]) != strides:
        seen = f", which is {found.packing} {found.order}" if found is not None else ""
        problems.append(
            f"strides (block, {', '.join(map(str, strides))}) in elements ({layout}), got "
            f"{tuple(kv.stride())}{seen}"
        )
    if spec.attention == "mla" and (spec.packing, spec.order) != ("packed", "NHD"):
        problems.append(
            f"packing 'packed' and order 'NHD' for an MLA latent cache (one row per token, "
            f"as LayerSpec.from_tensor reports it), got {spec.packing!r} and {spec.order!r}"
        )
    if not problems:
        problems.append(f"{spec}, got a tensor that LayerSpec.from_tensor reads as {found}")
    return "; ".join(problems)


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
        Byte offset of each layer's area within a row, for rows laid out by
        someone else (e.g. another topology whose opaque pages have other
        sizes); the areas must fit the rows without overlapping.

    Raises
    ------
    ValueError
        A kv tensor that does not match its spec (naming ``kv_caches[l]`` and
        ``specs[l]``), rows of the wrong length, or areas that do not fit.

    Attributes
    ----------
    mappings : list of CanonicalPageMapping
        This rank's mapping of each layer.
    group_mappings : list of tuple of CanonicalPageMapping
        Every rank's mapping of each layer.
    fallback_reasons : dict of int to str
        Layers stored opaquely, with the reason (see :attr:`opaque_layers`).
    format_id : str or None
        Canonical page encoding of the layers with a spec (``"v1-nhd"`` /
        ``"v1-hnd"``); None when they mix orders or no layer has a spec. Not a
        storage namespace when a layer is opaque: use :attr:`storage_namespace`.
    row_bytes : int
        Bytes of this worker's layer areas in a row (``canonical_row_bytes``).
    area_offsets : list of int
        Where each layer's area starts in a row.
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
        self.kv_caches = list(kv_caches)
        # What every call checks: the very tensors (and layouts) the plan was built for.
        self._held = tuple(self.kv_caches)
        self._held_layout = [(kv.dtype, kv.shape, kv.stride()) for kv in self._held]
        self.ctx = ctx
        self.region = cpu_pages if not isinstance(cpu_pages, torch.Tensor) else None
        self.cpu_pages = cpu_pages if isinstance(cpu_pages, torch.Tensor) else cpu_pages.tensor
        self.pages_per_row = pages_per_row = check_int("pages_per_row", pages_per_row, minimum=1)
        block_bytes = [kv.stride(0) * kv.element_size() for kv in self.kv_caches]
        self.group_mappings = group_layer_mappings(
            specs, ctx, fallback_page_sizes=block_bytes, layer_names=layer_names
        )
        self.mappings = [group[ctx.rank] for group in self.group_mappings]
        self.fallback_reasons = _fallback_reasons(specs, ctx)
        orders = {spec.order for spec in specs if spec is not None}
        self.format_id = canonical_format_id(orders.pop()) if len(orders) == 1 else None
        self.storage_namespace = _storage_namespace(
            self.format_id,
            len(orders) > 1,
            ctx,
            specs,
            self._held,
            self.mappings,
            self.fallback_reasons,
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
        self.plan = make_plan(
            self.mappings,
            self.kv_caches,
            self.cpu_pages,
            pages_per_row=pages_per_row,
            area_offsets=area_offsets,
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
                        f"{stride} (as at construction), got {_describe_tensor(kv)}; the "
                        f"tensor was changed in place since the plan was built"
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
            self.kv_caches, self.cpu_pages, self.plan, block_ids, page_ids
        )

    def _launch_load(self, *, block_ids: torch.Tensor, page_ids: torch.Tensor) -> None:
        torch.ops.canonical.canonical_load(
            self.kv_caches, self.cpu_pages, self.plan, block_ids, page_ids
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
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # KV written by queued compute is complete
        with torch.cuda.stream(self._stream):
            blocks, pages = self._ids("block_ids", block_ids), self._ids("page_ids", page_ids)
            launch(block_ids=blocks, page_ids=pages)
            job._done_event = torch.cuda.Event()
            job._done_event.record(self._stream)
        job._keep_alive = (blocks, pages)  # ids must outlive the kernel
        self._in_flight.append(job)
        return job

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
        job.finished_at = time.perf_counter()
        job._keep_alive = ()
        try:
            check_device_errors(self.plan)
        except Exception as error:
            job.error = error

    def poll(self) -> list[TransferJob]:
        """Jobs finished since the last poll/wait (without blocking)."""
        finished = [j for j in self._in_flight if j._done_event is None or j._done_event.query()]
        for job in finished:
            self._in_flight.remove(job)
            self._finish(job)
        return finished

    def wait(self, job: TransferJob) -> TransferJob:
        """Block until ``job`` is done; raises its device-side error, if any."""
        if job in self._in_flight:
            job._done_event.synchronize()
            self._in_flight.remove(job)
            self._finish(job)
        if job.error is not None:
            raise job.error
        return job
