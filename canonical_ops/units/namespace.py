"""Store namespaces: what must match for persisted canonical KV to be reusable.

A persisted unit is only meaningful to a reader that would have written the
very same bytes: same canonical format (version and family), same model
(name, revision and anything else that changes the KV: RoPE scaling, a
fine-tune, ...), same KV quantisation and, for every layer, the same canonical
page geometry. :class:`StoreNamespace` is that description for ALL layers of a
model, and its :attr:`~StoreNamespace.digest` (sha256 of a canonical JSON
text, :meth:`~StoreNamespace.describe`) tags every unit on disk or on the
wire; a reader whose digest differs never sees the unit.

What is deliberately NOT in the digest: the tensor, decode-context,
prefill-context and pipeline parallelism of a model whose layers are all
certified. Canonical pages are parallelism free (``layouts``), so an engine at
TP=8 reads what one at TP=2 x PP=2 wrote, without either declaring the other.
What CP does fold into a page is its token span: ``tokens_per_page =
block_size * dcp * pcp`` is part of every layer's geometry. A layer that
cannot be certified is stored *opaque* (each rank's page whole), whose bytes
only the same topology can read: such a layer carries its topology (tp, dcp,
pcp, interleave), so the digest then pins the topology too.

Quantised KV: a layer's dtype (``float8_e4m3fn``, ``float8_e5m2``, ...) and its
scales (``layouts.KVScales``: granularity, scale dtype, per-tensor values, the
per-token-head companion page) are part of its geometry, so a reader that
quantises differently is in another namespace (a miss, never a misread). A
layer without scales describes exactly as before the scales existed: the
digests of existing namespaces did not change, and no unit format changed.

Canonical JSON: keys sorted, no whitespace, ASCII only, no NaN/inf, booleans
kept apart from numbers, integral floats written as ints (``10000.0`` and
``10000`` are the same RoPE theta) and other floats in Python's shortest
round-trip form (one text per double, one double per text).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from types import MappingProxyType
from typing import Any

import numpy as np

from layouts import (
    KVScales,
    LayerSpec,
    RankContext,
    canonical_format_id,
    derive_layer_mapping,
)
from layouts.quant import QUANTISED_KV_DTYPES, scales_mismatch
from layouts.spec import dtype_name, element_size

from ..checks import check_int
from .state_geometry import StateGeometry, StateReshardError

__all__ = [
    "NAMESPACE_SCHEMA",
    "UNIT_KINDS",
    "LayerGeometry",
    "ModelIdentity",
    "StateGeometry",
    "StateReshardError",
    "StoreNamespace",
    "canonical_json",
    "is_namespace_hex",
]

# Name and version of the description format; part of the digest, so a change
# of what the description means can never alias an older namespace.
NAMESPACE_SCHEMA = "canonical-kv.store-namespace.v1"

_FORMAT_IDS = (canonical_format_id("NHD"), canonical_format_id("HND"))
_UNKNOWN = "unknown"  # fields an opaque layer built from page bytes alone does not know
# Bounds on what a namespace.json read from disk may claim, so that a forged
# file cannot make a reader allocate or loop without bound.
MAX_LAYERS = 1 << 16
MAX_PAGE_BYTES = 1 << 40
# What a unit holds: attention KV pages of one block, or one request's state slots.
UNIT_KINDS = ("kv", "state")


def _json_value(value: Any, path: str) -> Any:
    """``value`` as canonical JSON-able data (see the module docstring)."""
    if value is None or isinstance(value, (bool, np.bool_)):
        return None if value is None else bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(f"{path}: expected a finite number, got {value!r}")
        return int(number) if number.is_integer() else number
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{path}: expected str keys, got {key!r}")
            out[key] = _json_value(item, f"{path}[{key!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [_json_value(item, f"{path}[{i}]") for i, item in enumerate(value)]
    raise TypeError(
        f"{path}: expected JSON-able data (None, bool, int, float, str, list, dict), "
        f"got {type(value).__name__}"
    )


def canonical_json(value: Any, name: str = "value") -> str:
    """The canonical JSON text of ``value`` (the input of every digest here).

    ``name`` is the argument named in errors.
    """
    return json.dumps(
        _json_value(value, name),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=True,
        allow_nan=False,
    )


def _check_str(name: str, value: Any, *, empty: bool = False) -> str:
    if not isinstance(value, str) or (not empty and not value):
        expected = "a str" if empty else "a non-empty str"
        raise TypeError(f"{name}: expected {expected}, got {value!r}")
    return value


@dataclass(frozen=True)
class ModelIdentity:
    """Which weights produced the KV.

    Parameters
    ----------
    name : str
        Model name, e.g. ``"meta-llama/Llama-3.1-8B-Instruct"``.
    revision : str
        Weights revision (commit hash); ``""`` when unknown.
    extra : Mapping
        Anything else that changes a KV byte: RoPE scaling, a LoRA, a max
        position that changes the rotary table, ... Any JSON-able mapping; it
        is canonicalised (see :func:`canonical_json`) and kept read-only.
    """

    name: str
    revision: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        _check_str("name", self.name)
        _check_str("revision", self.revision, empty=True)
        if not isinstance(self.extra, Mapping):
            raise TypeError(f"extra: expected a mapping, got {type(self.extra).__name__}")
        # A canonical deep copy: later changes to the caller's dict cannot move the digest.
        frozen = json.loads(canonical_json(self.extra, "extra"))
        object.__setattr__(self, "extra", MappingProxyType(frozen))

    def describe(self) -> dict[str, Any]:
        """JSON description (part of the namespace description)."""
        return {"name": self.name, "revision": self.revision, "extra": json.loads(self._extra())}

    def _extra(self) -> str:
        return canonical_json(dict(self.extra))


def _fraction_text(value: int | Fraction) -> str:
    fraction = Fraction(value)
    return str(fraction.numerator) if fraction.denominator == 1 else str(fraction)


@dataclass(frozen=True)
class LayerGeometry:
    """One layer's canonical page: everything that decides its bytes' meaning.

    Parameters
    ----------
    attention : {"full", "mla", "unknown"}
        ``"unknown"`` only for an opaque layer built from its page bytes.
    total_kv_heads : int
        KV heads of the whole model layer (1 for MLA; 0 when unknown).
    head_size : int
        Elements per head (MLA: latent width); 0 when unknown.
    dtype : str
        Storage dtype name (``"bfloat16"``), or ``"unknown"``.
    packing : {"packed", "split", "unknown"}
    order : {"NHD", "HND", "unknown"}
    tokens_per_page : int
        Tokens of one canonical page: ``block_size * dcp * pcp``.
    canonical_page_size_bytes : int
        Bytes of one canonical page (0 is legal for an empty opaque page).
    per_token_head_scales : bool
        Quantisation scales per (token, head): never certified.
    tokens_per_state : str
        Tokens per stored state, as a fraction text (``"1"`` when uncompressed).
    opaque : bool
        The page is each rank's page whole, readable only by ``topology``.
    topology : tuple[int, int, int, int] | None
        ``(tp, dcp, pcp, interleave)`` of an opaque layer; None when certified.
    scales : layouts.KVScales | None
        A quantised layer's scales (granularity, scale dtype; per-tensor: the
        values; per-token-head: the companion page's packing); None when the
        layer has none (then the field is not described at all, so the
        digests of namespaces without scales are what they always were).
        Per-token-head scales are part of the layer's canonical page: the data
        page, then the scale page (``canonical_page_size_bytes`` counts both).
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

    def __post_init__(self) -> None:
        _check_str("attention", self.attention)
        if self.attention not in ("full", "mla", _UNKNOWN):
            raise ValueError(
                f"attention: expected 'full', 'mla' or 'unknown', got {self.attention!r}"
            )
        check_int("total_kv_heads", self.total_kv_heads, minimum=0)
        check_int("head_size", self.head_size, minimum=0)
        check_int("tokens_per_page", self.tokens_per_page, minimum=1)
        check_int(
            "canonical_page_size_bytes",
            self.canonical_page_size_bytes,
            minimum=0,
            maximum=MAX_PAGE_BYTES,
        )
        if self.packing not in ("packed", "split", _UNKNOWN):
            raise ValueError(
                f"packing: expected 'packed', 'split' or 'unknown', got {self.packing!r}"
            )
        if self.order not in ("NHD", "HND", _UNKNOWN):
            raise ValueError(f"order: expected 'NHD', 'HND' or 'unknown', got {self.order!r}")
        if self.dtype != _UNKNOWN:
            object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if not isinstance(self.per_token_head_scales, (bool, np.bool_)):
            raise TypeError(
                f"per_token_head_scales: expected a bool, got {self.per_token_head_scales!r}"
            )
        object.__setattr__(self, "per_token_head_scales", bool(self.per_token_head_scales))
        if not isinstance(self.tokens_per_state, str):
            raise TypeError(
                f"tokens_per_state: expected a fraction text like '1' or '1/4', "
                f"got {self.tokens_per_state!r}"
            )
        try:
            tps = Fraction(self.tokens_per_state)
        except (ValueError, ZeroDivisionError):
            raise ValueError(
                f"tokens_per_state: expected a fraction text like '1' or '1/4', "
                f"got {self.tokens_per_state!r}"
            ) from None
        if tps <= 0:
            raise ValueError(f"tokens_per_state: expected > 0, got {self.tokens_per_state!r}")
        object.__setattr__(self, "tokens_per_state", _fraction_text(tps))
        if self.scales is not None:
            if not isinstance(self.scales, KVScales):
                raise TypeError(
                    f"scales: expected layouts.KVScales or None, got {type(self.scales).__name__}"
                )
            if self.dtype not in QUANTISED_KV_DTYPES:
                raise ValueError(
                    f"scales: expected a quantised dtype {QUANTISED_KV_DTYPES} for a scaled "
                    f"layer, got {self.dtype}"
                )
            if self.scales.has_page and self.attention != "full":
                raise ValueError(
                    f"scales: per-token-head scales need full attention, got {self.attention}"
                )
        if not isinstance(self.opaque, (bool, np.bool_)):
            raise TypeError(f"opaque: expected a bool, got {self.opaque!r}")
        object.__setattr__(self, "opaque", bool(self.opaque))
        if self.opaque:
            topo = self.topology
            if not isinstance(topo, (tuple, list)) or len(topo) != 4:
                raise ValueError(
                    f"topology: expected (tp, dcp, pcp, interleave) for an opaque layer, got {topo!r}"
                )
            names = ("topology.tp", "topology.dcp", "topology.pcp", "topology.interleave")
            object.__setattr__(
                self, "topology", tuple(check_int(n, v, minimum=1) for n, v in zip(names, topo))
            )
            return
        if self.topology is not None:
            raise ValueError(
                f"topology: expected None for a certified layer (its bytes are "
                f"parallelism free), got {self.topology!r}"
            )
        self._check_certified()

    def _check_certified(self) -> None:
        """A certified page's size follows from its geometry: refuse any other claim."""
        if _UNKNOWN in (self.attention, self.dtype, self.packing, self.order):
            raise ValueError(
                "opaque: a certified layer must know attention, dtype, packing and order; "
                "build layers of unknown layout with LayerGeometry.opaque_from_bytes"
            )
        if self.per_token_head_scales or self.tokens_per_state != "1":
            raise ValueError(
                "opaque: per-token-head scales and compressed states are never certified; "
                "expected opaque=True"
            )
        if self.attention == "mla" and self.total_kv_heads != 1:
            raise ValueError(f"total_kv_heads: expected 1 for MLA, got {self.total_kv_heads}")
        if self.total_kv_heads < 1 or self.head_size < 1:
            raise ValueError("total_kv_heads, head_size: expected >= 1 for a certified layer")
        width = self.head_size if self.attention == "mla" else 2 * self.head_size
        expected = self.total_kv_heads * self.tokens_per_page * width * element_size(self.dtype)
        if self.scales is not None and self.scales.has_page:
            # K and V scale of every (token, head), after the data page.
            expected += (
                self.total_kv_heads * self.tokens_per_page * 2 * element_size(self.scales.dtype)
            )
        if self.canonical_page_size_bytes != expected:
            raise ValueError(
                f"canonical_page_size_bytes: expected {expected} for this geometry, "
                f"got {self.canonical_page_size_bytes}"
            )

    @classmethod
    def from_spec(
        cls, spec: LayerSpec, ctx: RankContext, scales: KVScales | None = None
    ) -> LayerGeometry:
        """The geometry of a layer described by one rank's ``spec`` in ``ctx``'s group.

        Certified exactly when every rank of the group certifies (as
        ``layouts.derive_group_mappings`` decides; with per-token-head
        ``scales``, their companion page too, as
        ``layouts.derive_scaled_group_mappings`` does); otherwise the layer is
        opaque and carries ``ctx``'s topology.
        """
        if not isinstance(spec, LayerSpec):
            raise TypeError(f"spec: expected a LayerSpec, got {type(spec).__name__}")
        if not isinstance(ctx, RankContext):
            raise TypeError(f"ctx: expected a RankContext, got {type(ctx).__name__}")
        if scales is not None:
            problem = scales_mismatch(spec, scales)
            if problem is not None:
                raise ValueError(f"scales: {problem}")
        pages = [spec]
        if scales is not None and scales.has_page:
            pages.append(scales.page_spec(spec))
        tokens = spec.block_size * ctx.cp_size
        contexts = [
            RankContext(
                ctx.tp_size, ctx.total_kv_heads, rank, ctx.dcp_size, ctx.pcp_size, ctx.interleave
            )
            for rank in range(ctx.group_size)
        ]
        mappings = [derive_layer_mapping(page, c) for page in pages for c in contexts]
        common = dict(
            attention=spec.attention,
            head_size=spec.head_size,
            dtype=spec.dtype,
            packing=spec.packing,
            order=spec.order,
            tokens_per_page=tokens,
            per_token_head_scales=spec.per_token_head_scales,
            tokens_per_state=_fraction_text(spec.tokens_per_state),
            scales=scales,
        )
        if all(m is not None for m in mappings):
            heads = 1 if spec.attention == "mla" else ctx.total_kv_heads
            return cls(
                total_kv_heads=heads,
                canonical_page_size_bytes=sum(
                    mappings[i * len(contexts)].canonical_page_size_bytes for i in range(len(pages))
                ),
                **common,
            )
        return cls(
            total_kv_heads=1 if spec.attention == "mla" else ctx.total_kv_heads,
            canonical_page_size_bytes=ctx.group_size * sum(p.page_size_bytes for p in pages),
            opaque=True,
            topology=_topology(ctx),
            **common,
        )

    @classmethod
    def opaque_from_bytes(
        cls, local_page_size_bytes: int, ctx: RankContext, *, block_size: int
    ) -> LayerGeometry:
        """An opaque layer of unrecognised layout: each rank's ``local_page_size_bytes`` whole.

        Matches ``layouts.opaque_fallback_mapping``: the canonical page is
        ``tp * pcp`` local pages, readable only by ``ctx``'s topology.
        """
        if not isinstance(ctx, RankContext):
            raise TypeError(f"ctx: expected a RankContext, got {type(ctx).__name__}")
        page = check_int("local_page_size_bytes", local_page_size_bytes, minimum=0)
        block_size = check_int("block_size", block_size, minimum=1)
        return cls(
            attention=_UNKNOWN,
            total_kv_heads=0,
            head_size=0,
            dtype=_UNKNOWN,
            packing=_UNKNOWN,
            order=_UNKNOWN,
            tokens_per_page=block_size * ctx.cp_size,
            canonical_page_size_bytes=ctx.group_size * page,
            opaque=True,
            topology=_topology(ctx),
        )

    def describe(self) -> dict[str, Any]:
        """JSON description of this layer (part of the namespace description)."""
        out: dict[str, Any] = {
            "attention": self.attention,
            "total_kv_heads": self.total_kv_heads,
            "head_size": self.head_size,
            "dtype": self.dtype,
            "packing": self.packing,
            "order": self.order,
            "tokens_per_page": self.tokens_per_page,
            "canonical_page_size_bytes": self.canonical_page_size_bytes,
            "per_token_head_scales": self.per_token_head_scales,
            "tokens_per_state": self.tokens_per_state,
            "opaque": self.opaque,
        }
        if self.topology is not None:
            tp, dcp, pcp, interleave = self.topology
            out["topology"] = {"tp": tp, "dcp": dcp, "pcp": pcp, "interleave": interleave}
        if self.scales is not None:
            out["scales"] = self.scales.describe()
        return out

    @classmethod
    def from_description(cls, desc: Any, path: str = "layer") -> LayerGeometry:
        """Inverse of :meth:`describe`; strict (no missing or unknown field)."""
        if not isinstance(desc, Mapping):
            raise ValueError(f"{path}: expected an object, got {type(desc).__name__}")
        fields = {
            "attention",
            "total_kv_heads",
            "head_size",
            "dtype",
            "packing",
            "order",
            "tokens_per_page",
            "canonical_page_size_bytes",
            "per_token_head_scales",
            "tokens_per_state",
            "opaque",
        }
        keys = set(desc)
        allowed = fields | {"topology", "scales"}
        if not fields <= keys or not keys <= allowed:
            raise ValueError(
                f"{path}: expected fields {sorted(fields)} (+ topology when opaque, scales "
                f"when quantised with scales), got {sorted(keys)}"
            )
        kwargs = {name: desc[name] for name in fields}
        topo = desc.get("topology")
        if topo is not None:
            if not isinstance(topo, Mapping) or set(topo) != {"tp", "dcp", "pcp", "interleave"}:
                raise ValueError(f"{path}.topology: expected tp, dcp, pcp and interleave")
            kwargs["topology"] = (topo["tp"], topo["dcp"], topo["pcp"], topo["interleave"])
        if "scales" in desc:
            kwargs["scales"] = _scales_from_description(desc["scales"], f"{path}.scales")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{path}: {error}") from None


def _scales_from_description(desc: Any, path: str) -> KVScales:
    """Inverse of ``KVScales.describe``; strict, and refuses values it would round."""
    if not isinstance(desc, Mapping) or "granularity" not in desc:
        raise ValueError(f"{path}: expected an object with a granularity")
    per_tensor = desc["granularity"] == "per-tensor"
    fields = {"granularity", "dtype"} | ({"k_scale", "v_scale"} if per_tensor else {"packing"})
    if set(desc) != fields:
        raise ValueError(f"{path}: expected fields {sorted(fields)}, got {sorted(desc)}")
    try:
        scales = KVScales(**desc)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {error}") from None
    if per_tensor and (scales.k_scale, scales.v_scale) != (desc["k_scale"], desc["v_scale"]):
        raise ValueError(
            f"{path}: k_scale, v_scale: expected values exact in {scales.dtype}, got "
            f"{desc['k_scale']!r}, {desc['v_scale']!r}"
        )
    return scales


def _topology(ctx: RankContext) -> tuple[int, int, int, int]:
    return (ctx.tp_size, ctx.dcp_size, ctx.pcp_size, ctx.interleave)


@dataclass(frozen=True)
class StoreNamespace:
    """Everything a reader must share with a writer to reuse its canonical KV.

    Parameters
    ----------
    format_id : str
        Canonical format, ``layouts.canonical_format_id(order)``: ``"v1-nhd"``
        or ``"v1-hnd"``.
    model : ModelIdentity
    kv_quant : str
        KV quantisation mode, e.g. ``"none"``, ``"fp8_e4m3"``: the same bytes
        mean other values under another mode.
    layers : tuple[LayerGeometry, ...]
        Every attention layer of the model (all pipeline stages), layer 0 first.
    states : tuple[StateGeometry, ...]
        Every state layer (Mamba / GDN) of a hybrid model, in model order;
        empty for other models (and then not described: digests unchanged).
    unit_kind : {"kv", "state"}
        What this namespace's units hold: ``"kv"`` (default) one block's
        canonical pages of ``layers``; ``"state"`` one request's canonical
        state slots of ``states`` (:meth:`state_units`). The kind is part of
        the description, so the two never share a digest, a directory or a key.

    Notes
    -----
    A *unit* holds the canonical pages of a contiguous layer range ``[first,
    end)`` of one block, concatenated in layer order; its payload is
    :meth:`layer_bytes` long and layer ``l`` starts at
    ``payload_offsets(first, end)[l - first]``. For state units, "layers" are
    the state layers: ``num_layers`` counts them and ``[first, end)`` indexes them.
    """

    format_id: str
    model: ModelIdentity
    kv_quant: str
    layers: tuple[LayerGeometry, ...]
    states: tuple[StateGeometry, ...] = ()
    unit_kind: str = "kv"
    _prefix: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_str("format_id", self.format_id)
        if self.format_id not in _FORMAT_IDS:
            raise ValueError(f"format_id: expected one of {_FORMAT_IDS}, got {self.format_id!r}")
        if not isinstance(self.model, ModelIdentity):
            raise TypeError(f"model: expected a ModelIdentity, got {type(self.model).__name__}")
        _check_str("kv_quant", self.kv_quant)
        self._check_states()
        if isinstance(self.layers, (str, bytes)) or not isinstance(self.layers, Sequence):
            raise TypeError(f"layers: expected a sequence of LayerGeometry, got {self.layers!r}")
        layers = tuple(self.layers)
        # A model of state layers only has no attention layer; its KV units hold nothing.
        if not (self.unit_kind == "kv") <= len(layers) <= MAX_LAYERS:
            raise ValueError(f"layers: expected 1 to {MAX_LAYERS} layers, got {len(layers)}")
        family = self.format_id.rsplit("-", 1)[1].upper()
        for i, layer in enumerate(layers):
            if not isinstance(layer, LayerGeometry):
                raise TypeError(
                    f"layers[{i}]: expected a LayerGeometry, got {type(layer).__name__}"
                )
            # MLA latents have no head axis: NHD and HND pages are the same bytes.
            if layer.attention == "full" and layer.order != family:
                raise ValueError(
                    f"layers[{i}]: order {layer.order} does not match format_id {self.format_id!r}"
                )
        object.__setattr__(self, "layers", layers)
        prefix = [0]
        if self.unit_kind == "state":
            for state in self.states:
                prefix.append(prefix[-1] + state.canonical_bytes)
        for layer in layers if self.unit_kind == "kv" else ():
            prefix.append(prefix[-1] + layer.canonical_page_size_bytes)
        object.__setattr__(self, "_prefix", tuple(prefix))
        text = canonical_json(self.describe())
        object.__setattr__(self, "_digest", hashlib.sha256(text.encode("ascii")).digest())

    def _check_states(self) -> None:
        if self.unit_kind not in UNIT_KINDS:
            raise ValueError(f"unit_kind: expected one of {UNIT_KINDS}, got {self.unit_kind!r}")
        if isinstance(self.states, (str, bytes)) or not isinstance(self.states, Sequence):
            raise TypeError(f"states: expected a sequence of StateGeometry, got {self.states!r}")
        states = tuple(self.states)
        if len(states) > MAX_LAYERS:
            raise ValueError(f"states: expected at most {MAX_LAYERS} state layers")
        for i, state in enumerate(states):
            if not isinstance(state, StateGeometry):
                raise TypeError(
                    f"states[{i}]: expected a StateGeometry, got {type(state).__name__}"
                )
        if self.unit_kind == "state" and not states:
            raise ValueError("states: expected at least one state layer for unit_kind='state'")
        object.__setattr__(self, "states", states)

    def state_units(self) -> StoreNamespace:
        """This model's namespace of state units (``unit_kind="state"``)."""
        return self if self.unit_kind == "state" else replace(self, unit_kind="state")

    def kv_units(self) -> StoreNamespace:
        """This model's namespace of KV units (``unit_kind="kv"``)."""
        return self if self.unit_kind == "kv" else replace(self, unit_kind="kv")

    def check_state_readable(self, ctx: RankContext) -> None:
        """Raise :class:`StateReshardError` if a state layer here cannot be read at ``ctx``.

        A certified state layer is read at any topology. One that cannot be
        resharded (opaque) is readable only by the topology that wrote it: a
        reader of another topology gets this error naming the layer, its kind
        and why, instead of a miss it could not explain.
        """
        if not isinstance(ctx, RankContext):
            raise TypeError(f"ctx: expected a RankContext, got {type(ctx).__name__}")
        for i, state in enumerate(self.states):
            error = state.refusal(i, ctx)
            if error is not None:
                raise error

    @classmethod
    def from_specs(
        cls,
        model: ModelIdentity,
        specs: Sequence[LayerSpec | None],
        ctx: RankContext,
        *,
        kv_quant: str = "none",
        fallback_page_sizes: Sequence[int] | None = None,
        block_size: int | None = None,
        scales: Sequence[KVScales | None] | None = None,
    ) -> StoreNamespace:
        """The namespace of a model whose layers ``specs`` (ALL layers) are seen from ``ctx``.

        ``specs[l]`` is one rank's page of layer ``l`` (every stage can build
        it from the model config, even for layers it does not own); None marks
        a layout that is not recognised, stored opaquely with
        ``fallback_page_sizes[l]`` bytes per rank page and ``block_size``
        tokens per block. The format family comes from the full-attention
        layers' order (NHD when there are none). ``scales[l]`` (optional) is
        layer ``l``'s ``layouts.KVScales``, or None for a layer without scales.
        """
        if isinstance(specs, (str, bytes)) or not isinstance(specs, Sequence):
            raise TypeError("specs: expected a sequence of LayerSpec (or None), one per layer")
        if scales is None:
            scales = [None] * len(specs)
        elif isinstance(scales, (KVScales, str)) or len(scales) != len(specs):
            raise ValueError(
                f"scales: expected one KVScales (or None) per layer ({len(specs)}), got "
                f"{'one' if isinstance(scales, KVScales) else len(scales)}"
            )
        layers = []
        for i, spec in enumerate(specs):
            if spec is None:
                if scales[i] is not None:
                    raise ValueError(f"scales[{i}]: a layer of unknown layout cannot be scaled")
                if fallback_page_sizes is None or block_size is None:
                    raise ValueError(
                        f"specs[{i}]: None needs fallback_page_sizes[{i}] and block_size"
                    )
                layers.append(
                    LayerGeometry.opaque_from_bytes(
                        fallback_page_sizes[i], ctx, block_size=block_size
                    )
                )
            else:
                try:
                    layers.append(LayerGeometry.from_spec(spec, ctx, scales[i]))
                except (TypeError, ValueError) as error:
                    if scales[i] is None:
                        raise
                    raise type(error)(f"scales[{i}]: {error}") from None
        orders = {s.order for s in specs if s is not None and s.attention == "full"}
        if len(orders) > 1:
            raise ValueError(f"specs: expected one stride order for all layers, got {orders}")
        format_id = canonical_format_id(orders.pop() if orders else "NHD")
        return cls(format_id, model, kv_quant, tuple(layers))

    # ------------------------------------------------------------------ identity

    @property
    def digest(self) -> bytes:
        """32 bytes: sha256 of :meth:`describe`'s canonical JSON text."""
        return self._digest

    @property
    def hex(self) -> str:
        """:attr:`digest` as 64 lowercase hex characters (the namespace's directory name)."""
        return self._digest.hex()

    def describe(self) -> dict[str, Any]:
        """The JSON description hashed into :attr:`digest` (``namespace.json``)."""
        out = {
            "schema": NAMESPACE_SCHEMA,
            "format_id": self.format_id,
            "model": self.model.describe(),
            "kv_quant": self.kv_quant,
            "num_layers": len(self.layers),
            "layers": [layer.describe() for layer in self.layers],
        }
        # Described only when present: namespaces of models without state keep their digests.
        if self.states:
            out["states"] = [state.describe() for state in self.states]
        if self.unit_kind != "kv":
            out["unit_kind"] = self.unit_kind
        return out

    @classmethod
    def from_description(cls, desc: Any) -> StoreNamespace:
        """Rebuild a namespace from :meth:`describe`'s output (e.g. a ``namespace.json``).

        Raises
        ------
        ValueError
            Anything missing, unknown or inconsistent.
        """
        if not isinstance(desc, Mapping):
            raise ValueError(f"namespace: expected an object, got {type(desc).__name__}")
        expected = {"schema", "format_id", "model", "kv_quant", "num_layers", "layers"}
        optional = {"states", "unit_kind"}
        if not expected <= set(desc) <= expected | optional:
            raise ValueError(
                f"namespace: expected fields {sorted(expected)} (+ {sorted(optional)}), "
                f"got {sorted(desc)}"
            )
        states = desc.get("states", [])
        if (
            not isinstance(states, list)
            or len(states) > MAX_LAYERS
            or ("states" in desc and not states)
        ):
            raise ValueError(
                f"states: expected a non-empty list of at most {MAX_LAYERS} state layers"
            )
        if desc.get("unit_kind", "state") == "kv":
            raise ValueError("unit_kind: expected it absent for KV units (the default)")
        if desc["schema"] != NAMESPACE_SCHEMA:
            raise ValueError(f"schema: expected {NAMESPACE_SCHEMA!r}, got {desc['schema']!r}")
        model = desc["model"]
        if not isinstance(model, Mapping) or set(model) != {"name", "revision", "extra"}:
            raise ValueError("model: expected fields name, revision, extra")
        layers = desc["layers"]
        if not isinstance(layers, list) or len(layers) > MAX_LAYERS:
            raise ValueError(f"layers: expected a list of at most {MAX_LAYERS} layers")
        if desc["num_layers"] != len(layers):
            raise ValueError(
                f"num_layers: expected {len(layers)} (the layers listed), got {desc['num_layers']!r}"
            )
        try:
            return cls(
                desc["format_id"],
                ModelIdentity(model["name"], model["revision"], model["extra"]),
                desc["kv_quant"],
                tuple(
                    LayerGeometry.from_description(layer, f"layers[{i}]")
                    for i, layer in enumerate(layers)
                ),
                tuple(
                    StateGeometry.from_description(state, f"states[{i}]")
                    for i, state in enumerate(states)
                ),
                desc.get("unit_kind", "kv"),
            )
        except TypeError as error:
            raise ValueError(str(error)) from None

    # ------------------------------------------------------------------ unit geometry

    @property
    def num_layers(self) -> int:
        """Layers a unit's range indexes: the model's attention layers (all pipeline
        stages) for KV units, its state layers for state units."""
        return len(self._prefix) - 1

    @property
    def total_bytes(self) -> int:
        """Bytes of one block's canonical pages over all layers."""
        return self._prefix[-1]

    def _range(self, first: Any, end: Any) -> tuple[int, int]:
        if type(first) is int and type(end) is int and 0 <= first < end < len(self._prefix):
            return first, end  # hot path of every store and load
        first = check_int("first", first, minimum=0, maximum=self.num_layers - 1)
        end = check_int("end", end, minimum=first + 1, maximum=self.num_layers)
        return first, end

    def layer_bytes(self, first: int, end: int) -> int:
        """Payload bytes of a unit holding layers ``[first, end)``."""
        first, end = self._range(first, end)
        return self._prefix[end] - self._prefix[first]

    def payload_offsets(self, first: int, end: int) -> tuple[int, ...]:
        """Byte offset of each layer ``first .. end-1`` in a unit, then the payload length.

        Returns
        -------
        tuple[int, ...]
            ``end - first + 1`` offsets; layer ``l`` spans
            ``[offsets[l - first], offsets[l - first + 1])``.
        """
        first, end = self._range(first, end)
        base = self._prefix[first]
        return tuple(p - base for p in self._prefix[first : end + 1])

    def layer_span(self, first: int, end: int) -> tuple[int, int]:
        """``[start, stop)`` of layers ``[first, end)`` within a whole-model payload (bytes)."""
        first, end = self._range(first, end)
        return self._prefix[first], self._prefix[end]

    def unit_ends(self, first: int, payload_bytes: int) -> list[int]:
        """Every ``end`` for which layers ``[first, end)`` take ``payload_bytes`` bytes.

        Several ends match only when zero-byte (empty opaque) layers follow.
        """
        first = check_int("first", first, minimum=0, maximum=self.num_layers - 1)
        target = self._prefix[first] + check_int("payload_bytes", payload_bytes, minimum=0)
        lo = max(bisect_left(self._prefix, target), first + 1)
        hi = bisect_right(self._prefix, target)
        return list(range(lo, hi))

    @property
    def topology_bound(self) -> bool:
        """True when some layer or state layer is opaque, i.e. the namespace pins the topology."""
        return any(layer.opaque for layer in self.layers) or any(s.opaque for s in self.states)


_HEX64 = re.compile(r"[0-9a-f]{64}")


def is_namespace_hex(name: str) -> bool:
    """Whether ``name`` looks like a namespace directory name (64 lowercase hex)."""
    return bool(_HEX64.fullmatch(name))
