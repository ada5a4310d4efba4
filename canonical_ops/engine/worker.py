"""The standalone engine's per-rank offload worker: mappings and plan built once (every
layer's tensor checked against its ``LayerSpec``, opaque fallback where a layer cannot be
certified), then each ``store`` / ``load`` is one op call run as a job by the ops core's
:class:`~canonical_ops.transfer.TransferQueue`; every call re-checks the tensors."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from layouts import (
    CANONICAL_FORMAT_VERSION,
    KVScales,
    LayerSpec,
    RankContext,
    RankShare,
    canonical_format_id,
    derive_scaled_group_mappings,
    group_layer_mappings,
)
from layouts.quant import scales_mismatch

from ..checks import check_ids, check_int
from ..plan import (
    canonical_row_bytes,
    check_layer_lists,
    default_area_offsets,
    make_plan,
    spec_mismatch,
)
from ..transfer import PlanCall, QueuedTransfer, TransferQueue
from .region import RegionTopologyError, RowArea, SharedOffloadRegion

__all__ = ["OffloadWorker", "TransferJob", "canonical_row_bytes", "group_layer_mappings"]
__all__ += ["spec_mismatch"]


def _check_scales(kv_caches, specs, scales, scale_caches) -> tuple[list, list, list]:
    """Each layer's scales, scale tensor and scale page spec (None where it has none), checked
    (the arguments are :class:`OffloadWorker`'s)."""
    count = len(kv_caches)
    for name, given in (("scales", scales), ("scale_caches", scale_caches)):
        if given is not None and (
            isinstance(given, (torch.Tensor, KVScales, str)) or len(given) != count
        ):
            got = "one" if isinstance(given, (torch.Tensor, KVScales)) else len(given)
            raise ValueError(f"{name}: expected one entry (or None) per layer ({count}), got {got}")
    scales = [None] * count if scales is None else list(scales)
    caches = [None] * count if scale_caches is None else list(scale_caches)
    pages: list[LayerSpec | None] = []
    for layer, (kv, spec, scale, cache) in enumerate(zip(kv_caches, specs, scales, caches)):
        if scale is not None:
            if not isinstance(scale, KVScales):
                got = type(scale).__name__
                raise TypeError(f"scales[{layer}]: expected layouts.KVScales or None, got {got}")
            unknown = "it is None (layout not recognised: a scaled layer needs its LayerSpec)"
            problem = unknown if spec is None else scales_mismatch(spec, scale)
            if problem is not None:
                raise ValueError(f"scales[{layer}]: cannot scale specs[{layer}]: {problem}")
        page = scale.page_spec(spec) if scale is not None and scale.has_page else None
        pages.append(page)
        name, got = f"scale_caches[{layer}]", type(cache).__name__
        if page is None:
            if cache is not None:
                raise ValueError(
                    f"{name}: expected None (layer {layer} has no per-token-head scales in "
                    f"scales[{layer}]), got {got}"
                )
            continue
        if not isinstance(cache, torch.Tensor) or cache.dim() < 1:
            raise ValueError(
                f"{name}: expected the layer's per-token-head scales ({page}), got {got}"
            )
        problem = spec_mismatch(cache, page)
        if problem is not None:
            raise ValueError(
                f"{name}: does not match scales[{layer}].page_spec(specs[{layer}]): expected {problem}"
            )
        if cache.size(0) != kv.size(0) or cache.device != kv.device:
            raise ValueError(
                f"{name}: expected {kv.size(0)} blocks on {kv.device} like kv_caches[{layer}], "
                f"got {cache.size(0)} on {cache.device}"
            )
    return scales, caches, pages


def physical_layout(tensor: torch.Tensor) -> str:
    """How a page of unknown layout lies in ``tensor`` (one block per index of dim 0): its
    dtype, a block's shape and the strides. A namespace records it for such a layer
    (``StoreNamespace.from_specs(fallback_layouts=...)``), so engines whose unrecognised pages
    differ at one topology never share units."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{dtype} block {list(tensor.shape[1:])} strides {list(tensor.stride())}"


def _layout(tensors: Sequence[torch.Tensor | None]) -> list:
    return [None if t is None else (t.dtype, t.shape, t.stride()) for t in tensors]


def _check_held(name: str, now: Sequence, held: tuple, layout: list) -> None:
    """Refuse tensors replaced, or changed in place, since the plan was built for ``held``."""
    if len(now) != len(held):
        raise ValueError(f"{name}: expected {len(held)} entries (as built), got {len(now)}")
    for index, (tensor, before, was, new) in enumerate(zip(now, held, layout, _layout(now))):
        if tensor is not before:
            raise ValueError(
                f"{name}[{index}]: expected the tensor this worker was built for (its plan and "
                f"layout checks describe that tensor), got a replaced entry; build a new "
                f"OffloadWorker for new caches"
            )
        if new != was:
            built, got = (f"{d} shape {tuple(s)} strides {tuple(st)}" for d, s, st in (was, new))
            raise ValueError(
                f"{name}[{index}]: expected {built} (as at construction), got {got}; the tensor "
                f"was changed in place since the plan was built"
            )


@dataclass
class TransferJob:
    """One submitted store or load: ``num_blocks`` (block, page) pairs, ``num_bytes`` local
    bytes (a store: only the pages this rank writes), ``perf_counter`` stamps (``finished_at``
    None while in flight), a CUDA job's device error (``CanonicalTransferError``)."""

    job_id: int
    kind: str
    num_blocks: int
    num_bytes: int
    submitted_at: float
    finished_at: float | None = None
    error: BaseException | None = None
    _transfer: QueuedTransfer | None = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    @property
    def seconds(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.submitted_at

    def make_stream_wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Order ``stream`` (default: current) after this job without blocking the host."""
        if self._transfer is not None:
            self._transfer.make_stream_wait(stream)


class OffloadWorker:
    """Stores and loads this rank's KV blocks to/from canonical pages.

    ``kv_caches``: one tensor per layer (leading dim = blocks; CPU or one CUDA device), laid
    out exactly as its ``specs`` entry says (None: unrecognised, stored opaquely); every call
    refuses a replaced entry or a changed dtype, shape or strides. ``ctx``: this rank in the
    TP x PCP group. ``cpu_pages``: uint8 ``(num_rows, row_bytes)`` (or a region) shared by the
    group, pinned for CUDA, ``pages_per_row`` pages of each layer per row, rows of exactly
    :attr:`row_bytes` unless ``area_offsets`` places each plan entry's area (rows of another
    topology; areas must not overlap). ``layer_names``: named in tiling errors. ``scales``:
    each layer's ``layouts.KVScales`` or None (per-tensor scales move no bytes);
    ``scale_caches``: each per-token-head scaled layer's scale tensor (exactly
    ``scales[l].page_spec(specs[l])``, as many blocks as the data), None elsewhere, checked as
    ``kv_caches``; its scale page follows the layer's data page in a row. On a
    :class:`SharedOffloadRegion` the worker claims its areas of the rows when built
    (:meth:`SharedOffloadRegion.claim_rows`): opaque pages of another topology there raise
    ``RegionTopologyError``, never load. Plain rows carry no such record: their owner keeps
    one topology's opaque pages away from another.

    Attributes: ``plan_entries``, ``mappings`` / ``group_mappings`` (this rank's / every
    rank's, per entry), ``fallback_reasons`` (opaque layers and why), ``format_id``
    (``"v1-nhd"`` / ``"v1-hnd"``; None: mixed or no spec), ``storage_namespace`` (``format_id``
    when every layer is certified, else with the topology and an opaque-page digest appended),
    ``physical_layouts`` (per layer: :func:`physical_layout` of an opaque one, else None: the
    ``fallback_layouts`` of the store's ``StoreNamespace.from_specs``).
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
        check_layer_lists(kv_caches, specs)
        for layer, (kv, spec) in enumerate(zip(kv_caches, specs)):
            problem = None if spec is None else spec_mismatch(kv, spec)
            if problem is not None:
                where = f"kv_caches[{layer}]: does not match specs[{layer}]"
                raise ValueError(f"{where}: expected {problem}")
        checked = _check_scales(kv_caches, specs, scales, scale_caches)
        self.scales, self.scale_caches, scale_pages = checked
        self.kv_caches = list(kv_caches)
        # What every call checks: the very tensors (and layouts) the plan was built for.
        held = {"kv_caches": self.kv_caches, "scale_caches": self.scale_caches}
        self._held = {name: (tuple(ts), _layout(ts)) for name, ts in held.items()}
        # Plan entries (layer, "kv" | "scales") in row order: a layer's data, then its scales.
        entries = []
        for layer, (kv, spec, page) in enumerate(zip(self.kv_caches, specs, scale_pages)):
            entries.append(((layer, "kv"), spec, kv))
            if page is not None:
                entries.append(((layer, "scales"), page, self.scale_caches[layer]))
        self.plan_entries, entry_specs, self._plan_tensors = map(list, zip(*entries))
        self.ctx = ctx
        self.region = cpu_pages if not isinstance(cpu_pages, torch.Tensor) else None
        self.cpu_pages = cpu_pages if isinstance(cpu_pages, torch.Tensor) else cpu_pages.tensor
        self.pages_per_row = pages_per_row = check_int("pages_per_row", pages_per_row, minimum=1)
        sizes = [kv.stride(0) * kv.element_size() for kv in self.kv_caches]  # bytes per block
        groups = group_layer_mappings(
            specs, ctx, fallback_page_sizes=sizes, layer_names=layer_names
        )
        self.group_mappings = []
        ctx_args = (ctx.tp_size, ctx.total_kv_heads, ctx.dcp_size, ctx.pcp_size, ctx.interleave)
        for layer, group in enumerate(groups):
            if scale_pages[layer] is None:
                self.group_mappings.append(group)
            else:  # data and scales certify together (or are both opaque): layouts decides
                name = layer_names[layer] if layer_names else f"layer {layer}"
                args = (specs[layer], self.scales[layer], *ctx_args)
                self.group_mappings.extend(derive_scaled_group_mappings(*args, layer_name=name))
        self.mappings = [group[ctx.rank] for group in self.group_mappings]
        self.fallback_reasons: dict[int, str] = {}
        for (layer, _), group in zip(self.plan_entries, self.group_mappings):
            if group[0].fallback_reason is not None:
                self.fallback_reasons.setdefault(layer, group[0].fallback_reason)
        opaque = [layer in self.fallback_reasons for layer, _ in self.plan_entries]  # by entry
        self.physical_layouts = [
            physical_layout(kv) if layer in self.fallback_reasons else None
            for layer, kv in enumerate(self.kv_caches)
        ]
        orders = {spec.order for spec in specs if spec is not None}
        self.format_id = canonical_format_id(orders.pop()) if len(orders) == 1 else None
        base = self.format_id or f"v{CANONICAL_FORMAT_VERSION}-{'mixed' if orders else 'opaque'}"
        self.storage_namespace = base
        if any(opaque):
            # An opaque page is a rank's physical page verbatim: readable only by a group
            # with the same ranks and the same physical pages, so both go into the name.
            pages = tuple(
                (
                    *(entry, None if entry_specs[entry] is None else repr(entry_specs[entry])),
                    *(str(t.dtype), tuple(t.shape[1:]), t.stride()),
                    self.mappings[entry].canonical_page_size_bytes,
                )
                for entry, t in enumerate(self._plan_tensors)
                if opaque[entry]
            )
            topology = (ctx.tp_size, ctx.pcp_size, ctx.dcp_size, ctx.interleave)
            digest = hashlib.sha256(repr(((*topology, ctx.total_kv_heads), pages)).encode())
            self.storage_namespace = (
                f"{base}-topo-tp{ctx.tp_size}-pcp{ctx.pcp_size}-dcp{ctx.dcp_size}-"
                f"il{ctx.interleave}-{digest.hexdigest()[:12]}"
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
            specs=[None if opaque[entry] else spec for entry, spec in enumerate(entry_specs)],
        )
        self.area_offsets = [int(offset) for offset in area_offsets]
        self.device = self.kv_caches[0].device
        self._queue = TransferQueue(self.device, self.cpu_pages, pages_per_row)
        self._job_ids = itertools.count()
        self._in_flight: list[TransferJob] = []
        self._share = RankShare(self.mappings)
        if isinstance(self.region, SharedOffloadRegion):
            self._claim_rows(layer_names)

    def _claim_rows(self, layer_names: Sequence[str] | None) -> None:
        """Claim this worker's areas of the region's rows (last: a refusal leaves nothing
        built): opaque pages of another topology are never loaded, RegionTopologyError."""
        areas = []
        for entry, ((layer, kind), group) in enumerate(zip(self.plan_entries, self.group_mappings)):
            name = f"layer {layer}" + (f" ({layer_names[layer]!r})" if layer_names else "")
            name += "'s scales" if kind == "scales" else ""
            start = self.area_offsets[entry]
            end = start + self.pages_per_row * self.mappings[entry].canonical_page_size_bytes
            areas.append(RowArea(name, start, end, group[0].fallback_reason))
        ctx = self.ctx
        try:
            self.region.claim_rows((ctx.tp_size, ctx.dcp_size, ctx.pcp_size, ctx.interleave), areas)
        except RegionTopologyError as error:
            raise RegionTopologyError(f"cpu_pages: {error}") from None

    @property
    def opaque_layers(self) -> list[int]:
        """Layers stored with the opaque fallback (readable by this topology only)."""
        return sorted(self.fallback_reasons)

    @property
    def is_topology_independent(self) -> bool:
        """Whether every layer is certified, so the canonical bytes do not depend on TP/DCP/PCP."""
        return not self.fallback_reasons

    def _check_kv_caches(self) -> None:
        for name, (held, layout) in self._held.items():
            _check_held(name, getattr(self, name), held, layout)

    # Tensor-level calls: what a model step would call; traceable by torch.compile.
    def store_tensors(self, *, block_ids: torch.Tensor, page_ids: torch.Tensor) -> None:
        """Launch the store of blocks ``block_ids`` into pages ``page_ids`` on the current stream."""
        self._launch(torch.ops.canonical.canonical_store, block_ids, page_ids)

    def load_tensors(self, *, block_ids: torch.Tensor, page_ids: torch.Tensor) -> None:
        """Launch the load of pages ``page_ids`` into blocks ``block_ids`` on the current stream."""
        self._launch(torch.ops.canonical.canonical_load, block_ids, page_ids)

    def _launch(self, op, block_ids: torch.Tensor, page_ids: torch.Tensor) -> None:
        self._check_kv_caches()
        op(self._plan_tensors, self.cpu_pages, self.plan, block_ids, page_ids)

    def _submit(self, kind: str, block_ids, page_ids) -> TransferJob:
        self._check_kv_caches()
        block_ids, page_ids = check_ids("block_ids", block_ids), check_ids("page_ids", page_ids)
        pages = page_ids.cpu().numpy() if isinstance(page_ids, torch.Tensor) else page_ids
        store = kind == "store"
        num_bytes = self._share.store_bytes(pages) if store else self._share.load_bytes(len(pages))
        call = PlanCall([(self._plan_tensors, self.plan)], block_ids, page_ids)
        transfer = self._queue.submit(store, [call])
        job = TransferJob(next(self._job_ids), kind, len(pages), num_bytes, transfer.started)
        job._transfer = transfer
        if transfer.done:  # CPU: ran synchronously
            job.finished_at = transfer.finished
        else:
            self._in_flight.append(job)
        return job

    def store(self, *, block_ids, page_ids) -> TransferJob:
        """Store block ``block_ids[i]`` into canonical page ``page_ids[i]`` (this rank's
        elected bytes only; 1-D integer tensors, arrays or sequences); keyword-only so a
        store and a load never swap their ids."""
        return self._submit("store", block_ids, page_ids)

    def load(self, *, block_ids, page_ids) -> TransferJob:
        """Load canonical pages into blocks (every byte of each local page): page
        ``page_ids[i]`` into block ``block_ids[i]``; keyword-only, like :meth:`store`."""
        return self._submit("load", block_ids, page_ids)

    def _finish(self, job: TransferJob) -> None:
        transfer = self._queue.finish(job._transfer)
        job.finished_at, job.error = transfer.finished, transfer.error
        self._in_flight.remove(job)

    def poll(self) -> list[TransferJob]:
        """Jobs finished since the last poll/wait, without blocking: one event query per
        job in flight, nothing queued on (or waiting for) the compute stream."""
        finished = [job for job in self._in_flight if job._transfer.ready()]
        for job in finished:
            self._finish(job)
        return finished

    def wait(self, job: TransferJob) -> TransferJob:
        """Block until ``job`` is done (its own event only); raises its device-side error."""
        if job in self._in_flight:
            self._queue.synchronize(job._transfer)
            self._finish(job)
        if job.error is not None:
            raise job.error
        return job
