"""Canonical units of per-request recurrent state (Mamba, gated delta net), format v1: each
segment of the conv channels sharded on its own, as vLLM 0.33 and SGLang shard them, and stored
unsharded in order; what cannot be proven resharded falls back to each rank's slot whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from typing import Any

import numpy as np

from .mapping import CanonicalPageMapping, CopyRun, coalesce_runs
from .spec import check_choice, dtype_name, element_size, is_int
from .tiling import TilingError, _first_defect, verify_writers

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
    if not is_int(value) or value < minimum:
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
    """One state layer of a hybrid model, unsharded (build it with :meth:`mamba1`,
    :meth:`mamba2` or :meth:`gdn`): the kind's ``dims`` (model values) in its order, the conv
    and SSM storage dtypes and ``conv_layout`` "SD" ``(state_len, channels)`` or "DS"."""

    kind: str
    dims: tuple[tuple[str, int], ...]
    conv_dtype: Any
    ssm_dtype: Any
    conv_layout: str = "SD"

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, STATE_KINDS)
        check_choice("conv_layout", self.conv_layout, CONV_LAYOUTS)
        try:
            given = dict(self.dims)
        except (TypeError, ValueError):
            raise ValueError(f"dims: expected (name, int) pairs, got {self.dims!r}") from None
        names = _KIND_DIMS[self.kind].split()
        if set(given) != set(names) or len(given) != len(self.dims):
            raise ValueError(f"dims: expected exactly {list(names)} for {self.kind}, got {given}")
        minimum = {"num_spec": 0, "conv_kernel": 2}  # other dims: 1
        dims = tuple((name, _check_dim(name, given[name], minimum.get(name, 1))) for name in names)
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "conv_dtype", dtype_name(self.conv_dtype))
        object.__setattr__(self, "ssm_dtype", dtype_name(self.ssm_dtype))
        d = dict(dims)
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
        product = num_heads * head_dim if is_int(num_heads) and is_int(head_dim) else 0
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
        dims = dict(self.dims)
        if name not in dims:
            raise KeyError(f"name: expected one of {list(dims)}, got {name!r}")
        return dims[name]

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
        conv, ssm = channels
        conv_shape = (self.state_len, conv) if self.conv_layout == "SD" else (conv, self.state_len)
        return conv_shape, (ssm, *self.ssm_head_shape())

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


@dataclass(frozen=True)
class StateSegmentMapping:
    """One segment's byte mapping for one rank: the local page is the rank's whole slot of
    state tensor ``tensor`` (the runs touch only this segment), the canonical page the
    segment's canonical area (a plan gets one entry per segment)."""

    tensor: int
    name: str
    mapping: CanonicalPageMapping


@dataclass(frozen=True)
class StateLayerMappings:
    """One rank's mappings of one state layer: its ``segments`` in canonical order (their
    canonical areas follow each other), each state tensor's bytes per slot on this rank
    (``tensor_bytes``: conv, SSM) and why the layer is stored opaquely (each rank's slot
    whole), or None (``fallback_reason``)."""

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
        sizes = [s.mapping.canonical_page_size_bytes for s in self.segments]
        return tuple(accumulate(sizes, initial=0))[: len(sizes)]


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
    local_channels, local_starts = [0, 0], []  # per tensor: the rank's segments side by side
    for seg in spec.segments:
        local_starts.append(local_channels[seg.tensor])
        local_channels[seg.tensor] += seg.local_units(tp_size) * seg.unit_channels
    mappings = []
    for seg, local_start in zip(spec.segments, local_starts):
        outer, inner = spec._outer_inner(seg.tensor)
        channel_bytes = inner * element_size(spec.dtypes[seg.tensor])
        row_bytes = local_channels[seg.tensor] * channel_bytes  # one outer row of the rank's
        shard_bytes = seg.local_units(tp_size) * seg.unit_channels * channel_bytes
        replicated = seg.units % tp_size != 0  # one unit held whole by every rank
        run = CopyRun(
            local_offset=local_start * channel_bytes,
            canonical_offset=(0 if replicated else rank) * shard_bytes,
            fragment_size=shard_bytes,
            num_fragments=outer,
            local_stride=row_bytes,
            canonical_stride=seg.channels * channel_bytes,
        )
        mapping = CanonicalPageMapping(
            canonical_page_size_bytes=outer * seg.channels * channel_bytes,
            local_page_size_bytes=outer * row_bytes,
            runs=coalesce_runs([run]),
            num_writers=tp_size if replicated else 1,
            writer_index=rank if replicated else 0,
            parallelism_agnostic=True,
        )
        mappings.append(StateSegmentMapping(seg.tensor, seg.name, mapping))
    return StateLayerMappings(tuple(mappings), spec.local_tensor_bytes(tp_size))


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
    """Fallback: the rank's slot of every state tensor whole at ``rank * slot_bytes``, one
    segment per tensor (``"conv.opaque"``, ``"ssm.opaque"``); same topology only."""
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
    """Check a group's mappings (by rank) of one state layer tile exactly: each rank's slots
    covered once, each canonical byte written once per page id (``TilingError`` naming the
    layer, the segment or tensor, the byte range and the ranks)."""
    if not group:
        raise TilingError(layer_name, "no mappings (expected one per rank)")
    names = [s.name for s in group[0].segments]
    for rank, layer in enumerate(group):
        if [s.name for s in layer.segments] != names:
            raise TilingError(layer_name, f"rank {rank} has segments {layer.segments}, not {names}")
        for tensor, size in enumerate(layer.tensor_bytes):
            frags = [s.mapping.fragments() for s in layer.segments if s.tensor == tensor]
            frags = np.concatenate([np.empty((0, 3), dtype=np.int64), *frags])
            frags = frags[np.argsort(frags[:, 0], kind="stable")]
            defect = _first_defect(frags[:, 0], frags[:, 0] + frags[:, 2], size)
            if defect and size:
                kind, begin, end = defect
                raise TilingError(
                    layer_name,
                    f"rank {rank}'s segments leave {kind} in "
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
    """One state layer's mappings for every rank of a ``tp_size * pcp_size`` group, verified:
    all certified (cached), or all :func:`opaque_state_mappings` of ``tensor_bytes`` (each state
    tensor's bytes per slot; a refused layer without it is a ValueError saying why)."""
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
