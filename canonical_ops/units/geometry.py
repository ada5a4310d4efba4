"""Layer and state geometries: what decides the bytes of a layer's canonical page or state
slot, as ``layouts`` derived them. A certified one is parallelism free; an *opaque* one is
each rank's page (slot) whole, read only at its writer's topology. Descriptions are strict
(no missing or unknown field) and bounded: a ``namespace.json`` is not trusted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from fractions import Fraction
from typing import Any

import numpy as np

from layouts import KVScales, LayerSpec, RankContext, derive_group_mappings
from layouts.quant import QUANTISED_KV_DTYPES, derive_scaled_group_mappings, scales_mismatch
from layouts.spec import dtype_name
from layouts.state import CONV_LAYOUTS, STATE_KINDS, StateSpec, state_certification_failure

from ..checks import check_bool, check_int, check_type

__all__ = ["LayerGeometry", "StateGeometry", "StateReshardError", "canonical_json"]

MAX_PAGE_BYTES = 1 << 40  # bound on what a namespace.json may claim
_UNKNOWN = "unknown"  # what an opaque layer built from bytes alone does not know
_TOPO_LAYER, _TOPO_STATE = ("tp", "dcp", "pcp", "interleave"), ("tp", "dcp", "pcp")


def _json_value(value: Any, path: str) -> Any:
    if value is None or isinstance(value, (bool, np.bool_)):
        return None if value is None else bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(number := float(value)):
            raise ValueError(f"{path}: expected a finite number, got {value!r}")
        return int(number) if number.is_integer() else number
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        if bad := [k for k in value if not isinstance(k, str)]:
            raise TypeError(f"{path}: expected str keys, got {bad[0]!r}")
        return {k: _json_value(v, f"{path}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(item, f"{path}[{i}]") for i, item in enumerate(value)]
    raise TypeError(
        f"{path}: expected JSON-able data (None, bool, int, float, str, list, dict), "
        f"got {type(value).__name__}"
    )


def canonical_json(value: Any, name: str = "value") -> str:
    """The canonical JSON text of ``value`` (the input of every digest); ``name`` is the
    argument named in errors."""
    data = _json_value(value, name)
    return json.dumps(
        data, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    )


def _check_str(name: str, value: Any, *, empty: bool = False) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise TypeError(f"{name}: expected {'a' if empty else 'a non-empty'} str, got {value!r}")
    return value


def _choice(name: str, value: Any, choices: tuple) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


def _flag(obj: Any, name: str) -> None:
    object.__setattr__(obj, name, check_bool(name, getattr(obj, name)))


def _check_topology(obj: Any, names: tuple[str, ...], what: str) -> None:
    """Check ``obj.topology``: the writer's for an opaque ``what``, None when certified."""
    topo = obj.topology
    if not obj.opaque:
        if topo is not None:
            raise ValueError(
                f"topology: expected None for a certified {what} (its bytes are "
                f"parallelism free), got {topo!r}"
            )
        return
    if not isinstance(topo, (tuple, list)) or len(topo) != len(names):
        raise ValueError(
            f"topology: expected ({', '.join(names)}) for an opaque {what}, got {topo!r}"
        )
    topo = tuple(check_int(f"topology.{n}", v, minimum=1) for n, v in zip(names, topo))
    object.__setattr__(obj, "topology", topo)


def _strict(desc: Any, path: str, required: Sequence[str], optional: Sequence[str] = ()) -> dict:
    """``desc`` as a dict with exactly the ``required`` fields (and any ``optional``)."""
    if not isinstance(desc, Mapping):
        raise ValueError(f"{path}: expected an object, got {type(desc).__name__}")
    if not set(required) <= set(desc) <= {*required, *optional}:
        more = f" (+ {sorted(optional)})" if optional else ""
        raise ValueError(f"{path}: expected fields {sorted(required)}{more}, got {sorted(desc)}")
    return dict(desc)


def _from_description(cls: type, desc: Any, path: str, fields_: tuple, names: tuple) -> Any:
    """A geometry from its description: strict fields, a topology object, errors naming ``path``."""
    optional = ("topology", "scales", "physical") if cls is LayerGeometry else ("topology",)
    d = _strict(desc, path, fields_, optional)
    kwargs = {name: d[name] for name in fields_}
    if d.get("topology") is not None:
        topo = _strict(d["topology"], f"{path}.topology", names)
        kwargs["topology"] = tuple(topo[n] for n in names)
    if "scales" in d:
        kwargs["scales"] = _scales_from_description(d["scales"], f"{path}.scales")
    if "physical" in d:
        kwargs["physical"] = d["physical"]
    if "dims" in d:
        if not isinstance(d["dims"], Mapping):
            raise ValueError(f"{path}.dims: expected an object")
        kwargs["dims"] = tuple(d["dims"].items())
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from None


def _describe(obj: Any, fields_: tuple, names: tuple) -> dict[str, Any]:
    out = {name: getattr(obj, name) for name in fields_}
    if obj.topology is not None:
        out["topology"] = dict(zip(names, obj.topology))
    return out


def _ctx_topology(ctx: RankContext) -> tuple[int, int, int, int]:
    """``ctx``'s (tp, dcp, pcp, interleave): an opaque layer's topology (a state's: 3 first)."""
    return (check_type("ctx", ctx, RankContext).tp_size, ctx.dcp_size, ctx.pcp_size, ctx.interleave)


@dataclass(frozen=True)
class LayerGeometry:
    """One layer's canonical page: everything that decides its bytes' meaning.

    ``attention`` full / mla; ``total_kv_heads`` of the whole layer (1 for MLA);
    ``head_size`` (MLA: latent width); ``dtype``, ``packing``, ``order`` ("unknown" only
    for an opaque layer built from bytes); ``tokens_per_page`` = block size x dcp x pcp;
    ``canonical_page_size_bytes`` (data page, then a per-token-head scale page);
    ``per_token_head_scales`` and ``tokens_per_state`` != "1" are never certified;
    ``opaque`` pages are each rank's page whole, readable by ``topology`` (tp, dcp, pcp,
    interleave) only; ``scales``: a quantised layer's ``layouts.KVScales`` (None: not
    described at all, so digests of unscaled namespaces never changed); ``physical``: an
    opaque layer of unknown layout's page as its writer holds it (dtype, shape, strides:
    ``engine.worker.physical_layout``), so that two engines whose unrecognised pages differ
    at one topology never share units (None: not described; certified layers have none).
    """

    attention: str
    total_kv_heads: int
    head_size: int
    dtype: str
    packing: str
    order: str
    tokens_per_page: int
    canonical_page_size_bytes: int
    per_token_head_scales: bool = False
    tokens_per_state: str = "1"
    opaque: bool = False
    topology: tuple[int, int, int, int] | None = None
    scales: KVScales | None = None
    physical: str | None = None

    def __post_init__(self) -> None:
        _choice("attention", self.attention, ("full", "mla", _UNKNOWN))
        _choice("packing", self.packing, ("packed", "split", _UNKNOWN))
        _choice("order", self.order, ("NHD", "HND", _UNKNOWN))
        check_int("total_kv_heads", self.total_kv_heads, minimum=0)
        check_int("head_size", self.head_size, minimum=0)
        check_int("tokens_per_page", self.tokens_per_page, minimum=1)
        page_bytes = self.canonical_page_size_bytes
        check_int("canonical_page_size_bytes", page_bytes, minimum=0, maximum=MAX_PAGE_BYTES)
        if self.dtype != _UNKNOWN:
            object.__setattr__(self, "dtype", dtype_name(self.dtype))
        _flag(self, "per_token_head_scales")
        _flag(self, "opaque")
        tokens_text = self.tokens_per_state
        try:
            tokens = Fraction(_check_str("tokens_per_state", tokens_text))
        except (TypeError, ValueError, ZeroDivisionError):
            tokens = Fraction(0)
        if tokens <= 0:
            expected = "expected a fraction text > 0 like '1' or '1/4'"
            raise ValueError(f"tokens_per_state: {expected}, got {tokens_text!r}")
        object.__setattr__(self, "tokens_per_state", str(tokens))  # "1", "1/4"
        if self.scales is not None:
            if not isinstance(self.scales, KVScales):
                raise TypeError(
                    f"scales: expected layouts.KVScales or None, got {type(self.scales).__name__}"
                )
            if self.dtype not in QUANTISED_KV_DTYPES:
                raise ValueError(
                    f"scales: expected a quantised dtype {QUANTISED_KV_DTYPES} "
                    f"for a scaled layer, got {self.dtype}"
                )
            if self.scales.has_page and self.attention != "full":
                raise ValueError(
                    f"scales: per-token-head scales need full attention, got {self.attention}"
                )
        _check_topology(self, _TOPO_LAYER, "layer")
        if self.physical is not None:
            _check_str("physical", self.physical)
            if not self.opaque:
                raise ValueError(
                    "physical: expected None for a certified layer (its bytes are canonical), "
                    f"got {self.physical!r}"
                )
        if not self.opaque:
            self._check_certified()

    def _check_certified(self) -> None:
        """A certified page's size is what ``layouts`` gives the whole group's page."""
        if _UNKNOWN in (self.attention, self.dtype, self.packing, self.order):
            raise ValueError(
                "opaque: a certified layer must know attention, dtype, packing and order; "
                "build layers of unknown layout with LayerGeometry.opaque_from_bytes"
            )
        if self.per_token_head_scales or self.tokens_per_state != "1":
            raise ValueError(
                "opaque: per-token-head scales and compressed states are never "
                "certified; expected opaque=True"
            )
        if self.attention == "mla" and self.total_kv_heads != 1:
            raise ValueError(f"total_kv_heads: expected 1 for MLA, got {self.total_kv_heads}")
        if self.total_kv_heads < 1 or self.head_size < 1:
            raise ValueError("total_kv_heads, head_size: expected >= 1 for a certified layer")
        try:  # the whole layer on one rank: its page is the canonical page
            shape = (self.total_kv_heads, self.head_size, self.dtype, self.packing, self.order)
            spec = LayerSpec(self.attention, self.tokens_per_page, *shape)
            expected = spec.page_size_bytes
            if self.scales is not None and self.scales.has_page:
                expected += self.scales.page_spec(spec).page_size_bytes
        except (TypeError, ValueError) as error:
            raise ValueError(f"layer: {error}") from None
        if self.canonical_page_size_bytes != expected:
            raise ValueError(
                f"canonical_page_size_bytes: expected {expected} for this "
                f"geometry, got {self.canonical_page_size_bytes}"
            )

    @classmethod
    def from_spec(
        cls, spec: LayerSpec, ctx: RankContext, scales: KVScales | None = None
    ) -> LayerGeometry:
        """The geometry of a layer whose page on one rank of ``ctx``'s group is ``spec``:
        certified exactly when ``layouts`` certifies every rank of the group (with
        per-token-head ``scales``, their page too), else opaque with ``ctx``'s topology."""
        check_type("spec", spec, LayerSpec)
        topology = _ctx_topology(ctx)
        if scales is not None and (problem := scales_mismatch(spec, scales)) is not None:
            raise ValueError(f"scales: {problem}")
        group = (ctx.tp_size, ctx.total_kv_heads, ctx.dcp_size, ctx.pcp_size, ctx.interleave)
        if scales is None:
            data, page = derive_group_mappings(spec, *group), None
        else:
            data, page = derive_scaled_group_mappings(spec, scales, *group)
        certified = data[0].fallback_reason is None  # opaque mappings say why they are
        size = sum(m[0].canonical_page_size_bytes for m in (data, page) if m)
        heads = 1 if spec.attention == "mla" else ctx.total_kv_heads
        tokens = spec.block_size * ctx.cp_size
        return cls(
            spec.attention,
            heads,
            spec.head_size,
            spec.dtype,
            spec.packing,
            spec.order,
            tokens,
            size,
            spec.per_token_head_scales,
            str(Fraction(spec.tokens_per_state)),
            not certified,
            None if certified else topology,
            scales,
        )

    @classmethod
    def opaque_from_bytes(
        cls,
        local_page_size_bytes: int,
        ctx: RankContext,
        *,
        block_size: int,
        physical: str | None = None,
    ) -> LayerGeometry:
        """A layer of unrecognised layout: ``tp * pcp`` local pages of
        ``local_page_size_bytes`` side by side (``layouts.opaque_fallback_mapping``), each
        laid out as ``physical`` says (None: a page whose layout its namespace names otherwise,
        as vLLM's rows, described by the model identity)."""
        topology, u = _ctx_topology(ctx), _UNKNOWN
        page = check_int("local_page_size_bytes", local_page_size_bytes, minimum=0)
        tokens = check_int("block_size", block_size, minimum=1) * ctx.cp_size
        size = ctx.group_size * page
        return cls(
            u, 0, 0, u, u, u, tokens, size, opaque=True, topology=topology, physical=physical
        )

    def refusal(self, layer: int, ctx: RankContext) -> LayerTopologyError | None:
        """The error for ``ctx``'s topology asking for this layer's units, or None when it
        may read them (certified, or the writer's own topology)."""
        here = _ctx_topology(ctx)
        if not self.opaque or here == self.topology:
            return None
        message = (
            f"layer {layer} is stored opaque (its pages are not parallelism free): its units "
            f"are readable only at {topology_text(self.topology)}, not at {topology_text(here)}"
        )
        return LayerTopologyError(layer, self.topology, message)

    def describe(self) -> dict[str, Any]:
        """JSON description (part of the namespace's)."""
        out = _describe(self, _LAYER_FIELDS, _TOPO_LAYER)
        if self.scales is not None:
            out["scales"] = self.scales.describe()
        if self.physical is not None:
            out["physical"] = self.physical
        return out

    @classmethod
    def from_description(cls, desc: Any, path: str = "layer") -> LayerGeometry:
        """Inverse of :meth:`describe`; strict (no missing or unknown field)."""
        return _from_description(cls, desc, path, _LAYER_FIELDS, _TOPO_LAYER)


def _scales_from_description(desc: Any, path: str) -> KVScales:
    """Inverse of ``KVScales.describe``; strict, and refuses values it would round."""
    per_tensor = isinstance(desc, Mapping) and desc.get("granularity") == "per-tensor"
    more = ("k_scale", "v_scale") if per_tensor else ("packing",)
    d = _strict(desc, path, ("granularity", "dtype", *more))
    try:
        scales = KVScales(**d)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from None
    if per_tensor and (scales.k_scale, scales.v_scale) != (d["k_scale"], d["v_scale"]):
        raise ValueError(
            f"{path}: k_scale, v_scale: expected values exact in {scales.dtype}, "
            f"got {d['k_scale']!r}, {d['v_scale']!r}"
        )
    return scales


class LayerTopologyError(ValueError):
    """KV units of a ``layer`` whose pages are not parallelism free, stored by the
    ``topology`` (tp, dcp, pcp, interleave) that wrote them (None: stored certified, and the
    reader's topology cannot certify the layer), asked for by another topology."""

    def __init__(self, layer: int, topology: tuple[int, ...] | None, message: str) -> None:
        super().__init__(message)
        self.layer, self.topology = layer, topology


def topology_text(topology: Sequence[int]) -> str:
    """``tp=4, dcp=1, pcp=1, interleave=1`` (a state layer's: the first three)."""
    return ", ".join(f"{name}={value}" for name, value in zip(_TOPO_LAYER, topology))


class StateReshardError(ValueError):
    """State units of a ``layer`` that cannot be resharded (its ``kind``, ``reason``),
    asked for by another topology than the writer's."""

    def __init__(self, layer: int, kind: str, reason: str, message: str) -> None:
        super().__init__(message)
        self.layer, self.kind, self.reason = layer, kind, reason


@dataclass(frozen=True)
class StateGeometry:
    """One state layer's (Mamba / GDN) canonical slot: its ``kind``, model ``dims``,
    dtypes, conv layout and ``canonical_bytes`` as ``layouts.state`` gives them; an
    ``opaque`` one (not reshardable) holds each rank's slot whole, for ``topology`` (tp,
    dcp, pcp) only, and ``reason`` (derived, not described) says why."""

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
        _choice("kind", self.kind, (*STATE_KINDS, _UNKNOWN))
        _choice("conv_layout", self.conv_layout, (*CONV_LAYOUTS, _UNKNOWN))
        dims = tuple(self.dims.items()) if isinstance(self.dims, Mapping) else self.dims
        if not isinstance(dims, (tuple, list)) or not all(
            isinstance(d, (tuple, list)) and len(d) == 2 and isinstance(d[0], str) for d in dims
        ):
            raise ValueError(f"dims: expected (name, int) pairs, got {self.dims!r}")
        dims = tuple(sorted((k, check_int(f"dims[{k!r}]", v, minimum=0)) for k, v in dims))
        if len({k for k, _ in dims}) != len(dims):
            raise ValueError(f"dims: expected distinct names, got {self.dims!r}")
        object.__setattr__(self, "dims", dims)
        for name in ("conv_dtype", "ssm_dtype"):
            if (value := getattr(self, name)) != _UNKNOWN:
                object.__setattr__(self, name, dtype_name(value))
        check_int("canonical_bytes", self.canonical_bytes, minimum=0, maximum=MAX_PAGE_BYTES)
        _flag(self, "opaque")
        _check_topology(self, _TOPO_STATE, "state layer")
        spec = self.spec()
        if self.opaque:
            if not self.reason:
                tp, dcp, pcp = self.topology
                why = spec and state_certification_failure(spec, tp, dcp_size=dcp, pcp_size=pcp)
                why = why or ("unrecognised state layout" if spec is None else "stored opaquely")
                object.__setattr__(self, "reason", why)
        elif spec is None:
            raise ValueError(
                "opaque: a certified state layer must know its kind, dims, dtypes and conv "
                "layout; build one of unknown layout with StateGeometry.opaque_from_bytes"
            )
        elif self.canonical_bytes != spec.canonical_bytes:
            raise ValueError(
                f"canonical_bytes: expected {spec.canonical_bytes} for "
                f"{spec.describe()}, got {self.canonical_bytes}"
            )

    def spec(self) -> StateSpec | None:
        """The ``layouts.state.StateSpec`` described, or None (unknown layout)."""
        if _UNKNOWN in (self.kind, self.conv_dtype, self.ssm_dtype, self.conv_layout):
            return None
        try:
            return StateSpec(
                self.kind, self.dims, self.conv_dtype, self.ssm_dtype, self.conv_layout
            )
        except (TypeError, ValueError) as error:
            raise ValueError(f"dims: {error}") from None

    @classmethod
    def from_spec(
        cls, spec: StateSpec, ctx: RankContext, *, tensor_bytes: Sequence[int] | None = None
    ) -> StateGeometry:
        """State layer ``spec`` in ``ctx``'s group: certified when ``layouts.state``
        certifies the topology, else opaque, with ``tensor_bytes`` (one rank's bytes per
        slot of each state tensor, required then)."""
        check_type("spec", spec, StateSpec)
        topology = _ctx_topology(ctx)[:3]
        common = (spec.kind, spec.dims, spec.conv_dtype, spec.ssm_dtype, spec.conv_layout)
        reason = state_certification_failure(
            spec, ctx.tp_size, dcp_size=ctx.dcp_size, pcp_size=ctx.pcp_size
        )
        if reason is None:
            return cls(*common, spec.canonical_bytes)
        if tensor_bytes is None:
            raise ValueError(
                f"tensor_bytes: {spec.kind} state cannot be resharded ({reason}); "
                f"its opaque geometry needs each state tensor's bytes per slot on one rank"
            )
        return cls(*common, ctx.group_size * _sum_sizes(tensor_bytes), True, topology, reason)

    @classmethod
    def opaque_from_bytes(cls, tensor_bytes: Sequence[int], ctx: RankContext) -> StateGeometry:
        """A state layer of unknown layout: each rank's slot (``tensor_bytes`` per tensor) whole."""
        topology, u = _ctx_topology(ctx)[:3], _UNKNOWN
        size = ctx.group_size * _sum_sizes(tensor_bytes)
        return cls(u, (), u, u, u, size, True, topology, "unrecognised state layout")

    def describe(self) -> dict[str, Any]:
        return _describe(self, _STATE_FIELDS, _TOPO_STATE) | {"dims": dict(self.dims)}

    @classmethod
    def from_description(cls, desc: Any, path: str = "state") -> StateGeometry:
        """Inverse of :meth:`describe`; strict (no missing or unknown field)."""
        return _from_description(cls, desc, path, _STATE_FIELDS, _TOPO_STATE)

    def refusal(self, layer: int, ctx: RankContext) -> StateReshardError | None:
        """The error for ``ctx``'s topology asking for this layer's units, or None when it
        may read them (certified, or the writer's own topology)."""
        here = _ctx_topology(ctx)[:3]
        if not self.opaque or here == self.topology:
            return None
        tp, dcp, pcp = self.topology
        message = (
            f"state layer {layer} ({self.kind}) cannot be resharded: {self.reason}; its units "
            f"are readable only at tp={tp}, dcp={dcp}, pcp={pcp}, not at tp={here[0]}, "
            f"dcp={here[1]}, pcp={here[2]}"
        )
        return StateReshardError(layer, self.kind, self.reason, message)


def _sum_sizes(tensor_bytes: Sequence[int]) -> int:
    return sum(check_int(f"tensor_bytes[{i}]", b, minimum=0) for i, b in enumerate(tensor_bytes))


# What a description holds besides the topology (the dataclass fields, in their order).
_LAYER_FIELDS = tuple(
    f.name for f in fields(LayerGeometry) if f.name not in ("topology", "scales", "physical")
)
_STATE_FIELDS = tuple(f.name for f in fields(StateGeometry) if f.name not in ("topology", "reason"))
