"""The namespace's view of one state layer (Mamba / GDN) of a hybrid model.

A :class:`StateGeometry` is to a state layer what
:class:`~.namespace.LayerGeometry` is to an attention layer: everything that
decides the meaning of its bytes in a *state unit* (one request's state, the
layers of one pipeline stage). A state layer that ``layouts.state`` certifies
is parallelism free (its canonical slot is the same under any TP); one that
cannot be resharded is *opaque* (each rank's slot whole) and carries its
topology, so only that topology reads it, and :meth:`StateGeometry.refusal`
says why, naming the kind.

This module imports nothing from :mod:`.namespace` (which imports it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from layouts.spec import RankContext, dtype_name
from layouts.state import (
    CONV_LAYOUTS,
    STATE_KINDS,
    StateSpec,
    state_certification_failure,
)

from ..checks import check_int

__all__ = ["StateGeometry", "StateReshardError"]

_UNKNOWN = "unknown"
_MAX_BYTES = 1 << 40  # bound on what a namespace.json read from disk may claim
_FIELDS = (
    "kind",
    "dims",
    "conv_dtype",
    "ssm_dtype",
    "conv_layout",
    "canonical_bytes",
    "opaque",
)


class StateReshardError(ValueError):
    """State units of a layer that cannot be resharded, asked for by another topology.

    Attributes
    ----------
    layer : int
        The state layer (index among the model's state layers).
    kind : str
        Its kind (``"mamba2"``, ``"gdn"``, ... or ``"unknown"``).
    reason : str
        Why it cannot be resharded.
    """

    def __init__(self, layer: int, kind: str, reason: str, message: str) -> None:
        super().__init__(message)
        self.layer, self.kind, self.reason = layer, kind, reason


@dataclass(frozen=True)
class StateGeometry:
    """One state layer's canonical slot: everything that decides its bytes' meaning.

    Parameters
    ----------
    kind : {"mamba1", "mamba2", "gdn", "unknown"}
        ``"unknown"`` only for an opaque layer built from its slot bytes.
    dims : tuple[tuple[str, int], ...]
        The kind's model dims (``layouts.state.StateSpec.dims``); empty when unknown.
    conv_dtype, ssm_dtype : str
        Dtype names, or ``"unknown"``.
    conv_layout : {"SD", "DS", "unknown"}
    canonical_bytes : int
        Bytes of one slot of this layer in a state unit.
    opaque : bool
        Each rank's slot stored whole: readable only by ``topology``.
    topology : tuple[int, int, int] | None
        ``(tp, dcp, pcp)`` of an opaque layer; None when certified.
    reason : str
        Why an opaque layer cannot be resharded (not part of the description:
        it is derived from the rest).
    """

    kind: str
    dims: tuple[tuple[str, int], ...]
    conv_dtype: str
    ssm_dtype: str
    conv_layout: str
    canonical_bytes: int
    opaque: bool = False
    topology: tuple[int, int, int] | None = None
    reason: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in (*STATE_KINDS, _UNKNOWN):
            raise ValueError(f"kind: expected one of {(*STATE_KINDS, _UNKNOWN)}, got {self.kind!r}")
        if isinstance(self.dims, Mapping):
            object.__setattr__(self, "dims", tuple(self.dims.items()))
        if not isinstance(self.dims, (tuple, list)) or not all(
            isinstance(d, (tuple, list)) and len(d) == 2 and isinstance(d[0], str)
            for d in self.dims
        ):
            raise ValueError(f"dims: expected (name, int) pairs, got {self.dims!r}")
        # Sorted by name: one value per geometry, however the dims were listed (JSON sorts).
        dims = sorted((k, check_int(f"dims[{k!r}]", v, minimum=0)) for k, v in self.dims)
        if len({k for k, _ in dims}) != len(dims):
            raise ValueError(f"dims: expected distinct names, got {self.dims!r}")
        object.__setattr__(self, "dims", tuple(dims))
        for name in ("conv_dtype", "ssm_dtype"):
            value = getattr(self, name)
            if value != _UNKNOWN:
                object.__setattr__(self, name, dtype_name(value))
        if self.conv_layout not in (*CONV_LAYOUTS, _UNKNOWN):
            raise ValueError(
                f"conv_layout: expected one of {(*CONV_LAYOUTS, _UNKNOWN)}, got {self.conv_layout!r}"
            )
        check_int("canonical_bytes", self.canonical_bytes, minimum=0, maximum=_MAX_BYTES)
        if not isinstance(self.opaque, (bool, np.bool_)):
            raise TypeError(f"opaque: expected a bool, got {self.opaque!r}")
        object.__setattr__(self, "opaque", bool(self.opaque))
        spec = self.spec()
        if self.opaque:
            topo = self.topology
            if not isinstance(topo, (tuple, list)) or len(topo) != 3:
                raise ValueError(
                    f"topology: expected (tp, dcp, pcp) for an opaque state layer, got {topo!r}"
                )
            names = ("topology.tp", "topology.dcp", "topology.pcp")
            topo = tuple(check_int(n, v, minimum=1) for n, v in zip(names, topo))
            object.__setattr__(self, "topology", topo)
            if not self.reason:
                reason = (
                    "unrecognised state layout"
                    if spec is None
                    else state_certification_failure(
                        spec, topo[0], dcp_size=topo[1], pcp_size=topo[2]
                    )
                )
                object.__setattr__(self, "reason", reason or "stored opaquely")
            return
        if self.topology is not None:
            raise ValueError(
                f"topology: expected None for a certified state layer (its bytes are "
                f"parallelism free), got {self.topology!r}"
            )
        if spec is None:
            raise ValueError(
                "opaque: a certified state layer must know its kind, dims, dtypes and conv "
                "layout; build one of unknown layout with StateGeometry.opaque_from_bytes"
            )
        if self.canonical_bytes != spec.canonical_bytes:
            raise ValueError(
                f"canonical_bytes: expected {spec.canonical_bytes} for {spec.describe()}, "
                f"got {self.canonical_bytes}"
            )

    def spec(self) -> StateSpec | None:
        """The :class:`~layouts.state.StateSpec` described, or None (unknown layout)."""
        if _UNKNOWN in (self.kind, self.conv_dtype, self.ssm_dtype, self.conv_layout):
            return None
        try:
            return StateSpec(
                self.kind, self.dims, self.conv_dtype, self.ssm_dtype, self.conv_layout
            )
        except (TypeError, ValueError) as error:
            raise ValueError(f"dims: {error}") from None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_spec(
        cls, spec: StateSpec, ctx: RankContext, *, tensor_bytes: Sequence[int] | None = None
    ) -> StateGeometry:
        """The geometry of state layer ``spec`` in ``ctx``'s group.

        Certified when ``layouts.state`` certifies the topology; otherwise opaque
        (each rank's slot whole, ``ctx``'s topology), with ``tensor_bytes`` the
        rank's bytes per slot of each state tensor (required then).
        """
        if not isinstance(spec, StateSpec):
            raise TypeError(f"spec: expected a StateSpec, got {type(spec).__name__}")
        if not isinstance(ctx, RankContext):
            raise TypeError(f"ctx: expected a RankContext, got {type(ctx).__name__}")
        common = dict(
            kind=spec.kind,
            dims=spec.dims,
            conv_dtype=spec.conv_dtype,
            ssm_dtype=spec.ssm_dtype,
            conv_layout=spec.conv_layout,
        )
        reason = state_certification_failure(
            spec, ctx.tp_size, dcp_size=ctx.dcp_size, pcp_size=ctx.pcp_size
        )
        if reason is None:
            return cls(canonical_bytes=spec.canonical_bytes, **common)
        if tensor_bytes is None:
            raise ValueError(
                f"tensor_bytes: {spec.kind} state cannot be resharded ({reason}); its opaque "
                f"geometry needs each state tensor's bytes per slot on one rank"
            )
        sizes = [check_int(f"tensor_bytes[{i}]", b, minimum=0) for i, b in enumerate(tensor_bytes)]
        return cls(
            canonical_bytes=ctx.group_size * sum(sizes),
            opaque=True,
            topology=(ctx.tp_size, ctx.dcp_size, ctx.pcp_size),
            reason=reason,
            **common,
        )

    @classmethod
    def opaque_from_bytes(cls, tensor_bytes: Sequence[int], ctx: RankContext) -> StateGeometry:
        """A state layer of unknown layout: each rank's slot (``tensor_bytes`` per tensor) whole."""
        if not isinstance(ctx, RankContext):
            raise TypeError(f"ctx: expected a RankContext, got {type(ctx).__name__}")
        sizes = [check_int(f"tensor_bytes[{i}]", b, minimum=0) for i, b in enumerate(tensor_bytes)]
        return cls(
            kind=_UNKNOWN,
            dims=(),
            conv_dtype=_UNKNOWN,
            ssm_dtype=_UNKNOWN,
            conv_layout=_UNKNOWN,
            canonical_bytes=ctx.group_size * sum(sizes),
            opaque=True,
            topology=(ctx.tp_size, ctx.dcp_size, ctx.pcp_size),
            reason="unrecognised state layout",
        )

    # ------------------------------------------------------------------ description

    def describe(self) -> dict[str, Any]:
        """JSON description of this state layer (part of the namespace description)."""
        out: dict[str, Any] = {
            "kind": self.kind,
            "dims": dict(self.dims),
            "conv_dtype": self.conv_dtype,
            "ssm_dtype": self.ssm_dtype,
            "conv_layout": self.conv_layout,
            "canonical_bytes": self.canonical_bytes,
            "opaque": self.opaque,
        }
        if self.topology is not None:
            tp, dcp, pcp = self.topology
            out["topology"] = {"tp": tp, "dcp": dcp, "pcp": pcp}
        return out

    @classmethod
    def from_description(cls, desc: Any, path: str = "state") -> StateGeometry:
        """Inverse of :meth:`describe`; strict (no missing or unknown field)."""
        if not isinstance(desc, Mapping):
            raise ValueError(f"{path}: expected an object, got {type(desc).__name__}")
        keys = set(desc)
        if not set(_FIELDS) <= keys or not keys <= {*_FIELDS, "topology"}:
            raise ValueError(
                f"{path}: expected fields {sorted(_FIELDS)} (+ topology when opaque), "
                f"got {sorted(keys)}"
            )
        kwargs = {name: desc[name] for name in _FIELDS}
        if not isinstance(kwargs["dims"], Mapping):
            raise ValueError(f"{path}.dims: expected an object")
        kwargs["dims"] = tuple(kwargs["dims"].items())
        topo = desc.get("topology")
        if topo is not None:
            if not isinstance(topo, Mapping) or set(topo) != {"tp", "dcp", "pcp"}:
                raise ValueError(f"{path}.topology: expected tp, dcp and pcp")
            kwargs["topology"] = (topo["tp"], topo["dcp"], topo["pcp"])
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{path}: {error}") from None

    def refusal(self, layer: int, ctx: RankContext) -> StateReshardError | None:
        """The error to raise when ``ctx``'s topology asks for this layer's units,
        or None when it may read them (certified, or the very same topology)."""
        if not self.opaque:
            return None
        here = (ctx.tp_size, ctx.dcp_size, ctx.pcp_size)
        if here == self.topology:
            return None
        tp, dcp, pcp = self.topology
        return StateReshardError(
            layer,
            self.kind,
            self.reason,
            f"state layer {layer} ({self.kind}) cannot be resharded: {self.reason}; its units "
            f"are readable only at tp={tp}, dcp={dcp}, pcp={pcp}, not at tp={here[0]}, "
            f"dcp={here[1]}, pcp={here[2]}",
        )
