"""Canonical units of per-request recurrent state (Mamba, gated delta net), format v1.

A hybrid model keeps, besides paged KV, a fixed-size state per request and state layer (a
conv window and an SSM / delta-rule matrix), stored as its own unit kind: one request's
slot stands for one "block" of the state tensors. Segments of the conv channels ([x, B, C],
[q, k, v], [x]) are sharded on their own, as vLLM 0.33 and SGLang shard them (Mamba2's one
group replicated); the canonical unit is each segment unsharded, in order. What cannot be
proven resharded falls back to each rank's slot whole (:func:`opaque_state_mappings`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from .mapping import CanonicalPageMapping, CopyRun, coalesce_runs
from .spec import dtype_name, element_size
from .tiling import TilingError, _first_defect, _kind, verify_writers

__all__ = [
    "CONV_LAYOUTS",
    "STATE_KINDS",
    "StateLayerMappings",
    "StateSegment",
    "StateSegmentMapping",
    "StateSpec",
    "derive_state_group_mappings",
    "derive_state_mappings",
    "opaque_state_mappings",
    "state_certification_failure",
    "verify_state_tiling",
]

STATE_KINDS = ("mamba1", "mamba2", "gdn")
CONV_LAYOUTS = ("SD", "DS")
TENSOR_NAMES = ("conv", "ssm")

# The dims each kind is described by (unsharded model values), in this order.
_KIND_DIMS = {
    "mamba1": "intermediate_size state_size conv_kernel num_spec",
    "mamba2": "num_heads head_dim n_groups state_size conv_kernel num_spec intermediate_size",
    "gdn": "num_k_heads num_v_heads head_k_dim head_v_dim conv_kernel num_spec",
}


def _check_dim(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class StateSegment:
    """A run of channels of state tensor ``tensor`` (0 conv, 1 SSM), sharded as one piece:
    ``units`` shardable units (heads or groups) of ``unit_channels`` channels each. When
    ``replicable``, a single unit is replicated on every rank when TP exceeds it (Mamba2's
    ``n_groups == 1``); otherwise TP must divide ``units``."""

    tensor: int
    name: str
    units: int
    unit_channels: int
    replicable: bool = False

    @property
    def channels(self) -> int:
        """Channels of the whole segment (unsharded)."""
        return self.units * self.unit_channels

    def local_units(self, tp_size: int) -> int | None:
        """Units one rank holds at ``tp_size``, or None when that cannot be proven."""
        if self.units % tp_size == 0:
            return self.units // tp_size
        if self.replicable and self.units == 1:
            return 1
        return None


@dataclass(frozen=True)
class StateSpec:
    """One state layer of a hybrid model, unsharded (what the model config says).

    Build it with :meth:`mamba1`, :meth:`mamba2` or :meth:`gdn`.

    Parameters
    ----------
    kind : {"mamba1", "mamba2", "gdn"}
    dims : tuple[tuple[str, int], ...]
        The kind's dims (model values, before TP), in the kind's order.
    conv_dtype, ssm_dtype : str | torch.dtype | numpy dtype
        Storage dtypes of the conv and the temporal state; normalised to names.
    conv_layout : {"SD", "DS"}
        Conv state per slot: ``(state_len, channels)`` or ``(channels, state_len)``.
    """

    kind: str
    dims: tuple[tuple[str, int], ...]
    conv_dtype: Any
    ssm_dtype: Any
    conv_layout: str = "SD"

    def __post_init__(self) -> None:
        if self.kind not in STATE_KINDS:
            raise ValueError(f"kind: expected one of {STATE_KINDS}, got {self.kind!r}")
        if self.conv_layout not in CONV_LAYOUTS:
            raise ValueError(
                f"conv_layout: expected one of {CONV_LAYOUTS}, got {self.conv_layout!r}"
            )
        if isinstance(self.dims, dict):
            object.__setattr__(self, "dims", tuple(self.dims.items()))
        try:
            given = dict(self.dims)
        except (TypeError, ValueError):
            raise ValueError(f"dims: expected (name, int) pairs, got {self.dims!r}") from None
        names = _KIND_DIMS[self.kind].split()
        if set(given) != set(names) or len(given) != len(self.dims):
            raise ValueError(f"dims: expected exactly {list(names)} for {self.kind}, got {given}")
        dims = tuple(
            (name, _check_dim(name, given[name], 0 if name == "num_spec" else 1)) for name in names
        )
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "conv_dtype", dtype_name(self.conv_dtype))
        object.__setattr__(self, "ssm_dtype", dtype_name(self.ssm_dtype))
        d = dict(dims)
        if d["conv_kernel"] < 2:
            raise ValueError(f"conv_kernel: expected an int >= 2, got {d['conv_kernel']}")
        if self.kind == "mamba2":
            if d["intermediate_size"] != d["num_heads"] * d["head_dim"]:
                raise ValueError(
                    f"intermediate_size: expected num_heads * head_dim = "
                    f"{d['num_heads'] * d['head_dim']}, got {d['intermediate_size']}"
                )
            if d["num_heads"] % d["n_groups"]:
                raise ValueError(
                    f"n_groups: expected a divisor of num_heads={d['num_heads']}, "
                    f"got {d['n_groups']}"
                )
        if self.kind == "gdn" and d["num_v_heads"] % d["num_k_heads"]:
            raise ValueError(
                f"num_k_heads: expected a divisor of num_v_heads={d['num_v_heads']}, "
                f"got {d['num_k_heads']}"
            )

    # ------------------------------------------------------------------ constructors

    @classmethod
    def mamba1(
        cls,
        *,
        intermediate_size: int,
        state_size: int,
        conv_kernel: int,
        conv_dtype: Any,
        ssm_dtype: Any = None,
        conv_layout: str = "SD",
        num_spec: int = 0,
    ) -> StateSpec:
        """A Mamba1 mixer (Jamba): conv ``[x]`` and SSM ``(intermediate, state_size)``."""
        dims = dict(intermediate_size=intermediate_size, state_size=state_size)
        return cls._mixer("mamba1", dims, conv_kernel, num_spec, conv_dtype, ssm_dtype, conv_layout)

    @classmethod
    def mamba2(
        cls,
        *,
        num_heads: int,
        head_dim: int,
        n_groups: int,
        state_size: int,
        conv_kernel: int,
        conv_dtype: Any,
        ssm_dtype: Any = None,
        conv_layout: str = "SD",
        num_spec: int = 0,
    ) -> StateSpec:
        """A Mamba2 mixer: conv ``[x, B, C]`` and SSM ``(num_heads, head_dim, state_size)``."""
        dims = dict(
            num_heads=num_heads, head_dim=head_dim, n_groups=n_groups, state_size=state_size
        )
        # vLLM's mixer: intermediate_size = num_heads * head_dim (checked again below)
        product = num_heads * head_dim if _is_int(num_heads, head_dim) else 0
        args = (conv_kernel, num_spec, conv_dtype, ssm_dtype, conv_layout)
        return cls._mixer("mamba2", dims, *args, intermediate_size=product)

    @classmethod
    def gdn(
        cls,
        *,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        conv_dtype: Any,
        ssm_dtype: Any = None,
        conv_layout: str = "SD",
        num_spec: int = 0,
    ) -> StateSpec:
        """A gated delta net (Qwen3-Next): conv ``[q, k, v]``, state
        ``(num_v_heads, head_v_dim, head_k_dim)``."""
        dims = dict(
            num_k_heads=num_k_heads,
            num_v_heads=num_v_heads,
            head_k_dim=head_k_dim,
            head_v_dim=head_v_dim,
        )
        return cls._mixer("gdn", dims, conv_kernel, num_spec, conv_dtype, ssm_dtype, conv_layout)

    @classmethod
    def _mixer(
        cls, kind, dims, conv_kernel, num_spec, conv_dtype, ssm_dtype, conv_layout, **after
    ) -> StateSpec:
        """The spec of ``kind``: its dims, then ``conv_kernel`` and ``num_spec`` (then
        ``after``), in that order; the SSM dtype defaults to the conv's."""
        dims = {**dims, "conv_kernel": conv_kernel, "num_spec": num_spec, **after}
        ssm = conv_dtype if ssm_dtype is None else ssm_dtype
        return cls(kind, tuple(dims.items()), conv_dtype, ssm, conv_layout)

    # ------------------------------------------------------------------ geometry

    def dim(self, name: str) -> int:
        """One of the kind's dims by name."""
        for key, value in self.dims:
            if key == name:
                return value
        raise KeyError(f"name: expected one of {[k for k, _ in self.dims]}, got {name!r}")

    @property
    def state_len(self) -> int:
        """Conv window kept per slot: ``conv_kernel - 1 + num_spec``."""
        return self.dim("conv_kernel") - 1 + self.dim("num_spec")

    @property
    def dtypes(self) -> tuple[str, str]:
        """Dtype names of the conv and the SSM tensor."""
        return (self.conv_dtype, self.ssm_dtype)

    @property
    def segments(self) -> tuple[StateSegment, ...]:
        """Every segment, conv segments first, in canonical order."""
        d = dict(self.dims)
        if self.kind == "mamba1":
            return (
                StateSegment(0, "conv.x", d["intermediate_size"], 1),
                StateSegment(1, "ssm", d["intermediate_size"], 1),
            )
        if self.kind == "mamba2":
            return (
                StateSegment(0, "conv.x", d["num_heads"], d["head_dim"]),
                StateSegment(0, "conv.B", d["n_groups"], d["state_size"], replicable=True),
                StateSegment(0, "conv.C", d["n_groups"], d["state_size"], replicable=True),
                StateSegment(1, "ssm", d["num_heads"], 1),
            )
        return (
            StateSegment(0, "conv.q", d["num_k_heads"], d["head_k_dim"]),
            StateSegment(0, "conv.k", d["num_k_heads"], d["head_k_dim"]),
            StateSegment(0, "conv.v", d["num_v_heads"], d["head_v_dim"]),
            StateSegment(1, "ssm", d["num_v_heads"], 1),
        )

    def ssm_head_shape(self) -> tuple[int, ...]:
        """Per-head (per-channel for Mamba1) shape of the SSM state, vLLM's order."""
        d = dict(self.dims)
        if self.kind == "mamba1":
            return (d["state_size"],)
        if self.kind == "mamba2":
            return (d["head_dim"], d["state_size"])
        return (d["head_v_dim"], d["head_k_dim"])

    def _outer_inner(self, tensor: int) -> tuple[int, int]:
        """``(outer, inner)`` around the sharded channel axis of ``tensor``, per slot."""
        if tensor == 1:
            return 1, math.prod(self.ssm_head_shape())
        return (self.state_len, 1) if self.conv_layout == "SD" else (1, self.state_len)

    def tensor_shape(self, tensor: int, channels: int) -> tuple[int, ...]:
        """Per-slot shape of state tensor ``tensor`` holding ``channels`` channels."""
        if tensor == 1:
            return (channels, *self.ssm_head_shape())
        if self.conv_layout == "SD":
            return (self.state_len, channels)
        return (channels, self.state_len)

    def canonical_layout(self) -> tuple[tuple[str, str, tuple[int, int, int], int], ...]:
        """The canonical unit of this layer: ``(segment, dtype, (outer, channels, inner),
        byte offset)`` per segment, in order."""
        out, offset = [], 0
        for seg in self.segments:
            outer, inner = self._outer_inner(seg.tensor)
            dtype = self.dtypes[seg.tensor]
            out.append((seg.name, dtype, (outer, seg.channels, inner), offset))
            offset += outer * seg.channels * inner * element_size(dtype)
        return tuple(out)

    @property
    def canonical_bytes(self) -> int:
        """Bytes of one slot of this layer in canonical form (the unit's share)."""
        _, dtype, (outer, channels, inner), offset = self.canonical_layout()[-1]
        return offset + outer * channels * inner * element_size(dtype)

    def local_shapes(self, tp_size: int) -> tuple[tuple[int, ...], ...] | None:
        """Per-slot shapes of the conv and SSM tensors one rank allocates at ``tp_size``
        (vLLM's rule), or None when the sharding cannot be proven."""
        channels = [0, 0]
        for seg in self.segments:
            units = seg.local_units(tp_size)
            if units is None:
                return None
            channels[seg.tensor] += units * seg.unit_channels
        return tuple(self.tensor_shape(t, channels[t]) for t in range(len(TENSOR_NAMES)))

    def local_tensor_bytes(self, tp_size: int) -> tuple[int, ...] | None:
        """Bytes per slot of each state tensor at ``tp_size`` (None: not provable)."""
        shapes = self.local_shapes(tp_size)
        if shapes is None:
            return None
        return tuple(math.prod(s) * element_size(d) for s, d in zip(shapes, self.dtypes))

    def describe(self) -> str:
        dims = ", ".join(f"{k}={v}" for k, v in self.dims)
        return (
            f"{self.kind}({dims}; conv {self.conv_dtype} {self.conv_layout}, ssm {self.ssm_dtype})"
        )


def _is_int(*values: Any) -> bool:
    return all(
        isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in values
    )


@dataclass(frozen=True)
class StateSegmentMapping:
    """One segment's byte mapping for one rank.

    ``mapping``'s local page is the rank's whole slot of state tensor ``tensor``
    (its runs touch only this segment's bytes of it); its canonical page is the
    segment's canonical area. A plan gets one entry per segment, each with the
    tensor it reads and its own canonical area.
    """

    tensor: int
    name: str
    mapping: CanonicalPageMapping


@dataclass(frozen=True)
class StateLayerMappings:
    """One rank's mappings of one state layer.

    Attributes
    ----------
    segments : tuple[StateSegmentMapping, ...]
        In canonical order; their canonical areas follow each other.
    tensor_bytes : tuple[int, ...]
        Bytes per slot of each state tensor on this rank (conv, SSM).
    fallback_reason : str | None
        Why the layer is stored opaquely (each rank's slot whole), or None.
    """

    segments: tuple[StateSegmentMapping, ...]
    tensor_bytes: tuple[int, ...]
    fallback_reason: str | None = None

    @property
    def canonical_bytes(self) -> int:
        """Bytes of this layer's slot in the canonical unit."""
        return sum(s.mapping.canonical_page_size_bytes for s in self.segments)

    @property
    def area_offsets(self) -> tuple[int, ...]:
        """Offset of each segment's canonical area in the layer's canonical slot."""
        out, position = [], 0
        for s in self.segments:
            out.append(position)
            position += s.mapping.canonical_page_size_bytes
        return tuple(out)


def state_certification_failure(
    spec: StateSpec, tp_size: int, *, dcp_size: int = 1, pcp_size: int = 1
) -> str | None:
    """Why the state layer ``spec`` cannot be resharded at this topology, or None."""
    if not isinstance(spec, StateSpec):
        raise TypeError(f"spec: expected a StateSpec, got {type(spec).__name__}")
    tp_size = _check_dim("tp_size", tp_size, 1)
    dcp_size = _check_dim("dcp_size", dcp_size, 1)
    pcp_size = _check_dim("pcp_size", pcp_size, 1)
    if dcp_size > 1 or pcp_size > 1:
        return (
            f"context parallelism (dcp_size={dcp_size}, pcp_size={pcp_size}) with "
            f"{spec.kind} state is not certified"
        )
    for seg in spec.segments:
        if seg.local_units(tp_size) is not None:
            continue
        if seg.replicable:
            return (
                f"{spec.kind} {seg.name}: tp_size={tp_size} does not divide n_groups={seg.units} "
                f"and n_groups is not 1 (groups are replicated only when n_groups == 1)"
            )
        return f"{spec.kind} {seg.name}: tp_size={tp_size} does not divide its {seg.units} units"
    return None


def _derive(spec: StateSpec, tp_size: int, rank: int) -> StateLayerMappings:
    """The certified mappings of ``rank`` (the caller checked certification)."""
    local_channels = [0, 0]
    layout = []  # (segment, local units, local channel start)
    for seg in spec.segments:
        units = seg.local_units(tp_size)
        layout.append((seg, units, local_channels[seg.tensor]))
        local_channels[seg.tensor] += units * seg.unit_channels
    mappings = []
    for seg, units, local_start in layout:
        outer, inner = spec._outer_inner(seg.tensor)
        elem = element_size(spec.dtypes[seg.tensor])
        channel_bytes = inner * elem
        replicated = seg.units % tp_size != 0  # one unit held whole by every rank
        shard = 0 if replicated else rank
        run = CopyRun(
            local_offset=local_start * channel_bytes,
            canonical_offset=shard * units * seg.unit_channels * channel_bytes,
            fragment_size=units * seg.unit_channels * channel_bytes,
            num_fragments=outer,
            local_stride=local_channels[seg.tensor] * channel_bytes,
            canonical_stride=seg.channels * channel_bytes,
        )
        mappings.append(
            StateSegmentMapping(
                seg.tensor,
                seg.name,
                CanonicalPageMapping(
                    canonical_page_size_bytes=outer * seg.channels * channel_bytes,
                    local_page_size_bytes=outer * local_channels[seg.tensor] * channel_bytes,
                    runs=coalesce_runs([run]),
                    num_writers=tp_size if replicated else 1,
                    writer_index=rank if replicated else 0,
                    parallelism_agnostic=True,
                ),
            )
        )
    tensor_bytes = tuple(
        outer_inner[0] * channels * outer_inner[1] * element_size(dtype)
        for outer_inner, channels, dtype in zip(
            (spec._outer_inner(0), spec._outer_inner(1)), local_channels, spec.dtypes
        )
    )
    return StateLayerMappings(tuple(mappings), tensor_bytes)


def derive_state_mappings(
    spec: StateSpec, tp_size: int, rank: int, *, dcp_size: int = 1, pcp_size: int = 1
) -> StateLayerMappings | None:
    """Certified mappings of one state layer at one rank, or None (fail closed; see
    :func:`state_certification_failure`)."""
    if state_certification_failure(spec, tp_size, dcp_size=dcp_size, pcp_size=pcp_size):
        return None
    rank = _check_dim("rank", rank, 0)
    if rank >= tp_size:
        raise ValueError(f"rank: expected an int in [0, {tp_size}), got {rank}")
    return _derive(spec, tp_size, rank)


def opaque_state_mappings(
    tensor_bytes: Sequence[int], num_ranks: int, rank: int, *, reason: str
) -> StateLayerMappings:
    """Fallback: the rank's slot of every state tensor, whole, at ``rank * slot_bytes``.

    One segment per tensor (``"conv.opaque"``, ``"ssm.opaque"``); the canonical
    slot is ``num_ranks`` rank slots, readable only by the same topology.
    """
    sizes = [_check_dim(f"tensor_bytes[{i}]", b, 0) for i, b in enumerate(tensor_bytes)]
    if not sizes:
        raise ValueError("tensor_bytes: expected one size per state tensor, got none")
    num_ranks = _check_dim("num_ranks", num_ranks, 1)
    rank = _check_dim("rank", rank, 0)
    if rank >= num_ranks:
        raise ValueError(f"rank: expected an int in [0, {num_ranks}), got {rank}")
    segments = []
    for tensor, size in enumerate(sizes):
        run = CopyRun(0, rank * size, size, 1, size, size)
        mapping = CanonicalPageMapping(
            canonical_page_size_bytes=num_ranks * size,
            local_page_size_bytes=size,
            runs=(run,) if size else (),
            num_writers=1,
            writer_index=0,
            parallelism_agnostic=False,
            fallback_reason=reason,
        )
        name = TENSOR_NAMES[tensor] if tensor < len(TENSOR_NAMES) else f"tensor{tensor}"
        segments.append(StateSegmentMapping(tensor, f"{name}.opaque", mapping))
    return StateLayerMappings(tuple(segments), tuple(sizes), fallback_reason=reason)


def verify_state_tiling(group: Sequence[StateLayerMappings], layer_name: str | None = None) -> None:
    """Check a group's mappings (indexed by rank) of one state layer tile exactly.

    Every rank's segments must cover each of its state tensors' slots exactly
    once (a load restores the whole slot), and for every segment and page id
    the elected writers must write each canonical byte exactly once.

    Raises
    ------
    TilingError
        Naming the layer, the segment or tensor, the byte range and the ranks.
    """
    if not group:
        raise TilingError(layer_name, "no mappings (expected one per rank)")
    names = [s.name for s in group[0].segments]
    for rank, layer in enumerate(group):
        if [s.name for s in layer.segments] != names:
            raise TilingError(layer_name, f"rank {rank} has segments {layer.segments}, not {names}")
        for tensor, size in enumerate(layer.tensor_bytes):
            frags = [s.mapping.fragments() for s in layer.segments if s.tensor == tensor]
            local = np.concatenate([f[:, [0, 2]] for f in frags]) if frags else np.empty((0, 2))
            order = np.argsort(local[:, 0], kind="stable")
            starts = local[order, 0].astype(np.int64)
            defect = _first_defect(starts, starts + local[order, 1].astype(np.int64), size)
            if defect and size:
                kind, begin, end = defect
                raise TilingError(
                    layer_name,
                    f"rank {rank}'s segments leave {_kind(kind)} in "
                    f"its {TENSOR_NAMES[tensor] if tensor < 2 else tensor} slot at bytes "
                    f"[{begin}, {end}) of {size}",
                )
    for index, name in enumerate(names):
        verify_writers([layer.segments[index].mapping for layer in group], layer_name, name)


def derive_state_group_mappings(
    spec: StateSpec | None,
    tp_size: int,
    *,
    dcp_size: int = 1,
    pcp_size: int = 1,
    tensor_bytes: Sequence[int] | None = None,
    layer_name: str = "<state layer>",
) -> tuple[StateLayerMappings, ...]:
    """One state layer's mappings for every rank of a ``tp_size * pcp_size`` group, verified.

    Every rank certifies, or every rank gets :func:`opaque_state_mappings` with
    ``tensor_bytes`` (each state tensor's bytes per slot on one rank; needed
    only when the layer falls back, i.e. ``spec`` is None or refused).
    Cached per (spec, topology).

    Raises
    ------
    ValueError
        A refused layer without ``tensor_bytes`` (the message says why it is refused).
    TilingError
        The mappings do not tile (a bug, never silently used).
    """
    if spec is not None and not isinstance(spec, StateSpec):
        raise TypeError(f"spec: expected a StateSpec or None, got {type(spec).__name__}")
    tp_size = _check_dim("tp_size", tp_size, 1)
    if spec is None:
        reason = "unrecognised state layout (no StateSpec)"
    else:
        reason = state_certification_failure(spec, tp_size, dcp_size=dcp_size, pcp_size=pcp_size)
    if reason is None:
        try:
            return _certified_group(spec, tp_size)
        except TilingError as error:
            raise TilingError(layer_name, error.detail) from None
    if tensor_bytes is None:
        raise ValueError(
            f"tensor_bytes: {layer_name} cannot be resharded ({reason}); its opaque fallback "
            f"needs each state tensor's bytes per slot"
        )
    ranks = tp_size * _check_dim("pcp_size", pcp_size, 1)
    group = tuple(
        opaque_state_mappings(tensor_bytes, ranks, r, reason=reason) for r in range(ranks)
    )
    verify_state_tiling(group, layer_name)
    return group


@lru_cache(maxsize=256)
def _certified_group(spec: StateSpec, tp_size: int) -> tuple[StateLayerMappings, ...]:
    group = tuple(_derive(spec, tp_size, rank) for rank in range(tp_size))
    verify_state_tiling(group)  # a failure is not cached: lru_cache stores only returns
    return group
