"""Hybrid models (attention + Mamba / GDN state) for engines without vLLM: the state side.

A hybrid model's attention layers keep paged KV, stored as KV units exactly as
for any model (:class:`~.worker.OffloadWorker`, :class:`~.tiers.StageCache`).
Its state layers keep one fixed-size state per request; that state is stored
as *state units*: one per (request prefix key, pipeline stage), holding the
canonical state slot (:mod:`layouts.state`) of each of the stage's state
layers, in the same tiers under the model's state namespace
(``namespace.state_units()``: its own digest, so its own directory and keys).

The pieces, one per job:

* :func:`hybrid_namespace`: the model's KV namespace, whose description
  includes every state layer (a reader with another state geometry misses
  both kinds); ``.state_units()`` of it keys the state units.
* :func:`split_stage_layers`: a pipeline stage's model layers ``[first, end)``
  as its attention range and its state range (each indexes its own kind).
* :class:`StateWorker`: one rank's state tensors <-> the state region rows,
  one op call per direction (``canonical_ops.store`` / ``load`` with a plan
  built once): a request's state slot plays the part of a block.
* :func:`state_page_manager`: the scheduler-side :class:`~.page_manager.PageManager`
  of a state region, whose pages turn ready when every elected writer stored.
* :func:`explain_state_miss`: when state units are missing because the store
  holds them for another topology and a state kind cannot be resharded, the
  :class:`~.store.namespace.StateReshardError` that says so.

A :class:`~.tiers.StageCache` over the state rows and ``state_units()`` tiers
does lookup / fetch / persist / promote for state units as it does for KV
(block hashes are the requests' prefix keys).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from layouts import RankContext
from layouts.spec import dtype_name
from layouts.state import StateLayerMappings, StateSpec, derive_state_group_mappings

from ..checks import check_int
from ..plan import make_plan
from ..units.namespace import (
    ModelIdentity,
    StateGeometry,
    StateReshardError,
    StoreNamespace,
    is_namespace_hex,
)
from .pages import PageManager

__all__ = [
    "StateWorker",
    "explain_state_miss",
    "hybrid_namespace",
    "split_stage_layers",
    "state_group_mappings",
    "state_page_manager",
]


def split_stage_layers(
    is_state: Sequence[bool], first: int, end: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """A stage's model layers ``[first, end)`` as ``(attention range, state range)``.

    Parameters
    ----------
    is_state : sequence of bool
        For every model layer, whether it is a state (Mamba / GDN) layer.
    first, end : int
        The stage's model layers (e.g. ``tiers.pp_layer_range``).

    Returns
    -------
    tuple[tuple[int, int], tuple[int, int]]
        ``[a, b)`` among the attention layers and ``[s, t)`` among the state
        layers (each may be empty, ``a == b``).
    """
    kinds = [bool(k) for k in is_state]
    first = check_int("first", first, minimum=0, maximum=max(0, len(kinds) - 1))
    end = check_int("end", end, minimum=first + 1, maximum=len(kinds))
    states_before = sum(kinds[:first])
    states_in = sum(kinds[first:end])
    attention_before = first - states_before
    attention_in = (end - first) - states_in
    return (
        (attention_before, attention_before + attention_in),
        (states_before, states_before + states_in),
    )


def state_group_mappings(
    specs: Sequence[StateSpec | None],
    ctx: RankContext,
    *,
    tensor_bytes: Sequence[Sequence[int] | None] | None = None,
    layer_names: Sequence[str] | None = None,
) -> list[tuple[StateLayerMappings, ...]]:
    """Every state layer's verified mappings for every rank of ``ctx``'s group.

    ``tensor_bytes[l]`` (each state tensor's bytes per slot on one rank) is
    needed for a layer that falls back to the opaque mapping.
    """
    if not isinstance(ctx, RankContext):
        raise TypeError(f"ctx: expected a RankContext, got {type(ctx).__name__}")
    out = []
    for layer, spec in enumerate(specs):
        sizes = None if tensor_bytes is None else tensor_bytes[layer]
        out.append(
            derive_state_group_mappings(
                spec,
                ctx.tp_size,
                dcp_size=ctx.dcp_size,
                pcp_size=ctx.pcp_size,
                tensor_bytes=sizes,
                layer_name=layer_names[layer] if layer_names else f"state layer {layer}",
            )
        )
    return out


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
    """The KV namespace of a hybrid model, its state layers included.

    Parameters
    ----------
    model, kv_quant
        As for ``StoreNamespace.from_specs``.
    attention_specs : sequence of LayerSpec | None
        Every attention layer (one rank's page), model order.
    state_specs : sequence of StateSpec | None
        Every state layer, model order; None: a state of unknown layout.
    ctx : RankContext
        This engine's topology.
    state_tensor_bytes : sequence, optional
        Per state layer, each state tensor's bytes per slot on one rank: needed
        for layers that cannot be resharded (stored opaquely, topology-bound).
    **from_specs
        Passed on to ``StoreNamespace.from_specs`` (``fallback_page_sizes``, ...).

    Returns
    -------
    StoreNamespace
        ``unit_kind="kv"``; ``.state_units()`` is the namespace of its state units.
    """
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
    namespace = StoreNamespace.from_specs(
        model, attention_specs, ctx, kv_quant=kv_quant, **from_specs
    )
    return replace(namespace, states=tuple(states))


def state_page_manager(
    num_pages: int, groups: Sequence[Sequence[StateLayerMappings]], **kwargs: Any
) -> PageManager:
    """A :class:`PageManager` for state pages: page ``p`` is ready when every rank
    elected to write it in any state layer and segment reported it."""
    segment_groups = [
        [layer.segments[i].mapping for layer in group]
        for group in groups
        for i in range(len(group[0].segments))
    ]
    return PageManager.from_mappings(num_pages, segment_groups, **kwargs)


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(1, size)
    return tuple(reversed(strides))


class StateWorker:
    """One rank's state layers of one pipeline stage <-> the stage's state region rows.

    Parameters
    ----------
    state_caches : sequence of (conv, ssm) tensors
        Per state layer of the stage, its two state tensors, each
        ``(num_slots, ...)`` with one request's state per slot, the slot
        contiguous (the slot stride may be larger: padded pages).
    specs : sequence of StateSpec | None
        Per state layer; None: a state of unknown layout (stored opaquely).
    ctx : RankContext
        This rank and its group.
    rows : torch.Tensor
        uint8 ``(num_pages, row_bytes)``: the stage's state region rows, each
        one state unit (``state_namespace.layer_bytes(first, end)`` bytes).

    Notes
    -----
    A certified layer's tensors must be exactly what ``layouts.state`` says
    this rank holds (dtype, per-slot shape); an opaque one's are stored whole.
    Stores write only the bytes this rank is an elected writer of (a
    replicated group: one rank per page, taking turns). Calls are synchronous
    on CPU; on CUDA they are queued on the current stream.
    """

    def __init__(
        self,
        state_caches: Sequence[Sequence[torch.Tensor]],
        specs: Sequence[StateSpec | None],
        ctx: RankContext,
        rows: torch.Tensor,
    ) -> None:
        if not isinstance(ctx, RankContext):
            raise TypeError(f"ctx: expected a RankContext, got {type(ctx).__name__}")
        if isinstance(state_caches, torch.Tensor) or not len(state_caches):
            raise ValueError("state_caches: expected one (conv, ssm) pair per state layer")
        if len(specs) != len(state_caches):
            raise ValueError(
                f"specs: expected one StateSpec (or None) per state layer ({len(state_caches)}), "
                f"got {len(specs)}"
            )
        self.ctx = ctx
        self.specs = list(specs)
        self.state_caches = [tuple(pair) for pair in state_caches]
        sizes = [self._check_layer(i, spec, pair) for i, (spec, pair) in enumerate(
            zip(self.specs, self.state_caches)
        )]  # fmt: skip
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
        tensors, mappings, offsets, position = [], [], [], 0
        for layer, pair in zip(self.mappings, self.state_caches):
            for segment, area in zip(layer.segments, layer.area_offsets):
                tensors.append(pair[segment.tensor])
                mappings.append(segment.mapping)
                offsets.append(position + area)
            position += layer.canonical_bytes
        self._tensors = tensors
        self.plan = make_plan(mappings, tensors, rows, area_offsets=offsets)

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
            if tuple(tensor.stride()[1:]) != _contiguous_strides(tensor.shape[1:]):
                raise ValueError(
                    f"{where}: expected each slot contiguous, got strides {tensor.stride()}"
                )
            if spec is not None:
                dtype = dtype_name(tensor.dtype)
                if dtype != spec.dtypes[t]:
                    raise ValueError(f"{where}: expected dtype {spec.dtypes[t]}, got {dtype}")
            if shapes is not None and tuple(tensor.shape[1:]) != shapes[t]:
                raise ValueError(
                    f"{where}: expected slots of shape {shapes[t]} ({spec.kind} at "
                    f"tp_size={self.ctx.tp_size}), got {tuple(tensor.shape[1:])}"
                )
            sizes.append(math.prod(tensor.shape[1:]) * tensor.element_size())
        return sizes

    @property
    def fallback_reasons(self) -> dict[int, str]:
        """State layer -> why it is stored opaquely (only the same topology reads it)."""
        return {
            i: layer.fallback_reason
            for i, layer in enumerate(self.mappings)
            if layer.fallback_reason is not None
        }

    @property
    def is_topology_independent(self) -> bool:
        """True when every state layer is certified (readable at any TP)."""
        return not self.fallback_reasons

    def store(self, *, slot_ids: Any, page_ids: Any) -> None:
        """Copy the states of slots ``slot_ids`` into state rows ``page_ids`` (this rank's
        elected bytes)."""
        from .. import ops

        ops.store(self._tensors, self.rows, self.plan, slot_ids, page_ids)

    def load(self, *, slot_ids: Any, page_ids: Any) -> None:
        """Copy state rows ``page_ids`` into slots ``slot_ids`` (this rank's shard)."""
        from .. import ops

        ops.load(self._tensors, self.rows, self.plan, slot_ids, page_ids)


def explain_state_miss(
    root: str | os.PathLike, namespace: StoreNamespace, ctx: RankContext
) -> StateReshardError | None:
    """Why state units this reader looks for are stored but not readable here, if so.

    Looks at the namespaces of a :class:`~.store.FileStore` directory ``root``
    for state units of the same model (format, identity, KV quantisation,
    attention and state kinds and dims) written at another topology with a
    state layer that cannot be resharded, and returns the error naming that
    layer, its kind and the reason (raise it); None when there is none.
    Unreadable or foreign ``namespace.json`` files are skipped.
    """
    if not isinstance(namespace, StoreNamespace):
        raise TypeError(f"namespace: expected a StoreNamespace, got {type(namespace).__name__}")
    mine = namespace.state_units()
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return None
    for entry in entries:
        if not is_namespace_hex(entry) or entry == mine.hex:
            continue
        try:
            with open(os.path.join(root, entry, "namespace.json"), encoding="utf-8") as f:
                other = StoreNamespace.from_description(json.load(f))
        except (OSError, ValueError):
            continue
        if other.unit_kind != "state" or not _same_model(mine, other):
            continue
        try:
            other.check_state_readable(ctx)
        except StateReshardError as error:
            return error
    return None


def _same_model(a: StoreNamespace, b: StoreNamespace) -> bool:
    """Same model, quantisation and layer kinds; only topology-bound parts may differ."""
    if (a.format_id, a.model, a.kv_quant) != (b.format_id, b.model, b.kv_quant):
        return False
    if len(a.states) != len(b.states) or len(a.layers) != len(b.layers):
        return False
    return all(
        (x.kind, x.dims, x.conv_dtype, x.ssm_dtype) == (y.kind, y.dims, y.conv_dtype, y.ssm_dtype)
        for x, y in zip(a.states, b.states)
    )
