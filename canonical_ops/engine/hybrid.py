"""Hybrid models (attention + Mamba / GDN state) without vLLM: the state side. A request's
state is one *state unit* per (prefix key, pipeline stage): the canonical slot
(:mod:`layouts.state`) of each of the stage's state layers, under ``namespace.state_units()``;
a StageCache moves them as it moves KV units."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

import canonical_ops.ops as ops
from layouts import RankContext
from layouts.spec import dtype_name
from layouts.state import StateLayerMappings, StateSpec, derive_state_group_mappings

from ..checks import check_int, check_type
from ..plan import make_plan
from ..units.namespace import (
    ModelIdentity,
    StateGeometry,
    StoreNamespace,
)
from .misses import explain_state_miss
from .pages import PageManager
from .region import RegionTopologyError, RowArea, SharedOffloadRegion

__all__ = ["StateWorker", "explain_state_miss", "hybrid_namespace", "split_stage_layers"]
__all__ += ["state_group_mappings", "state_page_manager", "state_shard"]


def split_stage_layers(
    is_state: Sequence[bool], first: int, end: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """A stage's model layers ``[first, end)`` as (attention range, state range), each
    counted among the layers of its own kind (either may be empty)."""
    kinds = [bool(k) for k in is_state]
    first = check_int("first", first, minimum=0, maximum=max(0, len(kinds) - 1))
    end = check_int("end", end, minimum=first + 1, maximum=len(kinds))
    states_before, states_in = sum(kinds[:first]), sum(kinds[first:end])
    attention = (first - states_before, end - states_before - states_in)
    return attention, (states_before, states_before + states_in)


def state_group_mappings(
    specs: Sequence[StateSpec | None],
    ctx: RankContext,
    *,
    tensor_bytes: Sequence[Sequence[int] | None] | None = None,
    layer_names: Sequence[str] | None = None,
) -> list[tuple[StateLayerMappings, ...]]:
    """Every state layer's verified mappings at every rank of ``ctx``'s group;
    ``tensor_bytes[l]`` (each state tensor's bytes per slot on a rank) is needed for a
    layer that falls back to the opaque mapping."""
    check_type("ctx", ctx, RankContext)
    return [
        derive_state_group_mappings(
            spec,
            ctx.tp_size,
            dcp_size=ctx.dcp_size,
            pcp_size=ctx.pcp_size,
            tensor_bytes=None if tensor_bytes is None else tensor_bytes[layer],
            layer_name=layer_names[layer] if layer_names else f"state layer {layer}",
        )
        for layer, spec in enumerate(specs)
    ]


def hybrid_namespace(
    model: ModelIdentity,
    attention_specs: Sequence[Any],
    state_specs: Sequence[StateSpec | None],
    ctx: RankContext,
    *,
    kv_quant: str = "none",
    state_tensor_bytes: Sequence[Sequence[int] | None] | None = None,
    **from_specs: Any,
) -> StoreNamespace:
    """The KV namespace of a hybrid model with every state layer (None: unknown layout) in
    it, so another state geometry misses both kinds; ``.state_units()`` keys the state
    units. ``state_tensor_bytes[l]``: layer ``l``'s tensors' bytes per slot on a rank, needed
    where it cannot be resharded (stored opaquely). Else as ``StoreNamespace.from_specs``."""
    if isinstance(state_specs, (str, bytes)) or not isinstance(state_specs, Sequence):
        raise TypeError("state_specs: expected a sequence of StateSpec (or None), one per layer")
    if not state_specs:
        raise ValueError("state_specs: expected at least one state layer (else use from_specs)")
    states = []
    for i, spec in enumerate(state_specs):
        sizes = None if state_tensor_bytes is None else state_tensor_bytes[i]
        try:
            if spec is None:
                if sizes is None:
                    raise ValueError("a state of unknown layout needs state_tensor_bytes")
                states.append(StateGeometry.opaque_from_bytes(sizes, ctx))
            else:
                states.append(StateGeometry.from_spec(spec, ctx, tensor_bytes=sizes))
        except (TypeError, ValueError) as error:
            raise type(error)(f"state_specs[{i}]: {error}") from None
    base = StoreNamespace.from_specs(model, attention_specs, ctx, kv_quant=kv_quant, **from_specs)
    return replace(base, states=tuple(states))


def state_page_manager(
    num_pages: int, groups: Sequence[Sequence[StateLayerMappings]]
) -> PageManager:
    """A :class:`PageManager` of state pages: page ``p`` is ready once every rank elected to
    write it in any state layer and segment reported it."""
    segment_groups = [
        [layer.segments[i].mapping for layer in group]
        for group in groups
        for i in range(len(group[0].segments))
    ]
    return PageManager.from_mappings(num_pages, segment_groups)


def state_shard(
    spec: StateSpec, full: dict[str, np.ndarray], tp: int, rank: int
) -> tuple[np.ndarray, np.ndarray]:
    """The ``(conv, ssm)`` of one slot that ``rank`` of ``tp`` holds, by vLLM's rule: each
    conv segment's own ``1/tp`` of its units side by side (Mamba2's single group whole on
    every rank), the SSM heads split. ``full[segment]``: each segment of
    ``spec.canonical_layout()`` unsharded, ``(outer, channels, inner)``. For tests and demos."""
    check_type("spec", spec, StateSpec)
    tp = check_int("tp", tp, minimum=1)
    rank = check_int("rank", rank, minimum=0, maximum=tp - 1)
    parts: list[list[np.ndarray]] = [[], []]
    for seg in spec.segments:
        if seg.name not in full:
            raise ValueError(
                f"full: expected segment {seg.name!r} of {spec.kind}'s canonical layout"
            )
        data = full[seg.name]
        if seg.units % tp == 0:
            per = seg.channels // tp
            parts[seg.tensor].append(data[:, rank * per : (rank + 1) * per])
        elif seg.replicable and seg.units == 1:
            parts[seg.tensor].append(data)
        else:
            raise ValueError(f"tp: {seg.name} has {seg.units} units, which tp={tp} cannot shard")
    conv, ssm = (np.concatenate(part, axis=1) for part in parts)  # (outer, channels, inner)
    # SD: (state_len, channels, 1) -> (state_len, channels); DS: (1, channels, state_len).
    conv = conv[0] if spec.conv_layout == "DS" else conv[:, :, 0]
    return conv, ssm[0].reshape(ssm.shape[1], *spec.ssm_head_shape())


class StateWorker:
    """One rank's state layers of one pipeline stage <-> the stage's state region rows
    (uint8 ``(num_pages, row_bytes)``, a row per state unit, or a
    :class:`~.region.SharedOffloadRegion` of them). ``state_caches[l]``: layer ``l``'s
    ``(conv, ssm)``, ``(num_slots, ...)`` with contiguous slots, exactly what ``layouts.state``
    says this rank holds (an opaque layer: stored whole). One op call per direction; stores
    write only the bytes this rank is elected for. On a region the worker claims its rows
    when built (topology (tp, dcp, pcp, 1)): an opaque state layer of another topology
    raises ``RegionTopologyError``, never loads."""

    def __init__(
        self,
        state_caches: Sequence[Sequence[torch.Tensor]],
        specs: Sequence[StateSpec | None],
        ctx: RankContext,
        rows: torch.Tensor | SharedOffloadRegion,
    ) -> None:
        check_type("ctx", ctx, RankContext)
        region = rows if isinstance(rows, SharedOffloadRegion) else None
        rows = rows if region is None else region.tensor
        if isinstance(state_caches, torch.Tensor) or not len(state_caches):
            raise ValueError("state_caches: expected one (conv, ssm) pair per state layer")
        if len(specs) != len(state_caches):
            raise ValueError(
                f"specs: expected one StateSpec (or None) per state layer ({len(state_caches)}), "
                f"got {len(specs)}"
            )
        self.ctx, self.specs = ctx, list(specs)
        self.state_caches = [tuple(pair) for pair in state_caches]
        pairs = zip(self.specs, self.state_caches)
        sizes = [self._check_layer(i, spec, pair) for i, (spec, pair) in enumerate(pairs)]
        self.groups = state_group_mappings(self.specs, ctx, tensor_bytes=sizes)
        self.mappings = [group[ctx.rank] for group in self.groups]
        self.row_bytes = sum(layer.canonical_bytes for layer in self.mappings)
        if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8 or rows.dim() != 2:
            raise TypeError("rows: expected a uint8 (num_pages, row_bytes) tensor")
        if rows.size(1) != self.row_bytes:
            raise ValueError(
                f"rows: expected rows of exactly {self.row_bytes} bytes (the canonical state "
                f"slots of these {len(self.mappings)} state layers), got {rows.size(1)}"
            )
        self.rows = rows
        self._tensors, mappings, offsets, position = [], [], [], 0
        for layer, pair in zip(self.mappings, self.state_caches):
            for segment, area in zip(layer.segments, layer.area_offsets):
                self._tensors.append(pair[segment.tensor])
                mappings.append(segment.mapping)
                offsets.append(position + area)
            position += layer.canonical_bytes
        self.plan = make_plan(mappings, self._tensors, rows, area_offsets=offsets)
        # State layer -> why it is stored opaquely (only the same topology reads it).
        reasons = enumerate(layer.fallback_reason for layer in self.mappings)
        self.fallback_reasons = {i: why for i, why in reasons if why is not None}
        if region is not None:  # last: a refusal leaves nothing built
            self._claim_rows(region)

    def _claim_rows(self, region: SharedOffloadRegion) -> None:
        areas, position = [], 0
        for index, layer in enumerate(self.mappings):
            end = position + layer.canonical_bytes
            areas.append(RowArea(f"state layer {index}", position, end, layer.fallback_reason))
            position = end
        ctx = self.ctx
        try:
            region.claim_rows((ctx.tp_size, ctx.dcp_size, ctx.pcp_size, 1), areas)
        except RegionTopologyError as error:
            raise RegionTopologyError(f"rows: {error}") from None

    def _check_layer(
        self, index: int, spec: StateSpec | None, pair: Sequence[torch.Tensor]
    ) -> list[int]:
        """Each tensor's bytes per slot, after checking it is what ``spec`` says."""
        name = f"state_caches[{index}]"
        if spec is not None and not isinstance(spec, StateSpec):
            raise TypeError(f"specs[{index}]: expected a StateSpec or None")
        if len(pair) != 2 or not all(isinstance(t, torch.Tensor) for t in pair):
            raise ValueError(f"{name}: expected a (conv, ssm) pair of tensors")
        shapes = None if spec is None else spec.local_shapes(self.ctx.tp_size)
        sizes = []
        for t, tensor in enumerate(pair):
            where = f"{name}[{t}]"
            if tensor.dim() < 2:
                raise ValueError(f"{where}: expected (num_slots, ...) with a slot dimension")
            contiguous = torch.empty(tensor.shape[1:], device="meta").stride()
            if tuple(tensor.stride()[1:]) != contiguous:
                raise ValueError(
                    f"{where}: expected each slot contiguous, got strides {tensor.stride()}"
                )
            dtype = dtype_name(tensor.dtype)
            if spec is not None and dtype != spec.dtypes[t]:
                raise ValueError(f"{where}: expected dtype {spec.dtypes[t]}, got {dtype}")
            if shapes is not None and tuple(tensor.shape[1:]) != shapes[t]:
                raise ValueError(
                    f"{where}: expected slots of shape {shapes[t]} ({spec.kind} at "
                    f"tp_size={self.ctx.tp_size}), got {tuple(tensor.shape[1:])}"
                )
            sizes.append(math.prod(tensor.shape[1:]) * tensor.element_size())
        return sizes

    @property
    def is_topology_independent(self) -> bool:
        """Every state layer certified: readable at any TP."""
        return not self.fallback_reasons

    def store(self, *, slot_ids: Any, page_ids: Any) -> None:
        """Slots ``slot_ids`` -> state rows ``page_ids`` (this rank's elected bytes)."""
        ops.store(self._tensors, self.rows, self.plan, slot_ids, page_ids)

    def load(self, *, slot_ids: Any, page_ids: Any) -> None:
        """State rows ``page_ids`` -> slots ``slot_ids`` (this rank's shard)."""
        ops.load(self._tensors, self.rows, self.plan, slot_ids, page_ids)
