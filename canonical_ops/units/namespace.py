"""Store namespaces: what a reader must share with a writer to reuse its canonical KV.

A :class:`StoreNamespace` holds what decides a unit's bytes and meaning (format, model, KV
quantisation, every layer's page and state slot); its digest, sha256 of the canonical JSON of
its description (keys sorted, no whitespace, ASCII, no NaN, integral floats as ints), tags
every unit. TP / DCP / PCP are in it only for opaque layers (canonical pages are parallelism
free).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from layouts import KVScales, LayerSpec, RankContext, canonical_format_id

from ..checks import check_int, check_type
from .auth import StoreSecret
from .geometry import (
    LayerGeometry,
    LayerTopologyError,
    StateGeometry,
    StateReshardError,
    _check_str,
    _choice,
    _strict,
    canonical_json,
)

__all__ = [
    "NAMESPACE_SCHEMA",
    "UNIT_KINDS",
    "LayerGeometry",
    "LayerTopologyError",
    "ModelIdentity",
    "StateGeometry",
    "StateReshardError",
    "StoreNamespace",
    "canonical_json",
    "is_namespace_hex",
]

# Part of the digest: a change of what the description means never aliases an older one.
NAMESPACE_SCHEMA = "canonical-kv.store-namespace.v1"
UNIT_KINDS = ("kv", "state")  # one block's KV pages, or one request's state slots
MAX_LAYERS = 1 << 16  # bound on what a namespace.json may claim
_FORMAT_IDS = (canonical_format_id("NHD"), canonical_format_id("HND"))


@dataclass(frozen=True)
class ModelIdentity:
    """Which weights produced the KV: ``name``, weights ``revision`` ("" when unknown), and
    ``extra``: anything else that changes a KV byte (RoPE scaling, a LoRA...), any JSON-able
    mapping, kept canonical and read-only."""

    name: str
    revision: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        _check_str("name", self.name)
        _check_str("revision", self.revision, empty=True)
        check_type("extra", self.extra, Mapping)
        frozen = json.loads(canonical_json(self.extra, "extra"))  # later changes cannot reach it
        object.__setattr__(self, "extra", MappingProxyType(frozen))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "revision": self.revision, "extra": dict(self.extra)}


def _geometries(name: str, values: Any, kind: type) -> tuple:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name}: expected a sequence of {kind.__name__}, got {values!r}")
    return tuple(check_type(f"{name}[{i}]", value, kind) for i, value in enumerate(values))


@dataclass(frozen=True)
class StoreNamespace:
    """Everything a reader must share with a writer to reuse its canonical KV.

    ``format_id``: ``layouts.canonical_format_id(order)`` ("v1-nhd" / "v1-hnd");
    ``model``; ``kv_quant`` (e.g. "none", "fp8_e4m3"); ``layers``: every attention layer
    of the model (all pipeline stages); ``states``: every state layer of a hybrid model
    (empty otherwise, then not described); ``unit_kind``: "kv" (one block's pages of
    ``layers``) or "state" (one request's slots of ``states``); ``key_id``/``secret``:
    an authenticated namespace's (:meth:`authenticated`); ``key_scheme``: the unit keys'
    scheme when every engine shares it (:meth:`shared_prefix`; "": the engine's own). A unit
    of layers ``[first, end)`` is their canonical pages in layer order, :meth:`layer_bytes`
    long.
    """

    format_id: str
    model: ModelIdentity
    kv_quant: str
    layers: tuple[LayerGeometry, ...]
    states: tuple[StateGeometry, ...] = ()
    unit_kind: str = "kv"
    key_id: str = ""
    key_scheme: str = ""
    secret: Any = field(default=None, repr=False, compare=False)
    _prefix: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _choice("format_id", _check_str("format_id", self.format_id), _FORMAT_IDS)
        check_type("model", self.model, ModelIdentity)
        _check_str("kv_quant", self.kv_quant)
        _choice("unit_kind", self.unit_kind, UNIT_KINDS)
        states = _geometries("states", self.states, StateGeometry)
        layers = _geometries("layers", self.layers, LayerGeometry)
        if len(states) > MAX_LAYERS:
            raise ValueError(f"states: expected at most {MAX_LAYERS} state layers")
        if self.unit_kind == "state" and not states:
            raise ValueError("states: expected at least one state layer for unit_kind='state'")
        # A model of state layers only has no attention layer; its KV units hold nothing.
        if not (self.unit_kind == "kv") <= len(layers) <= MAX_LAYERS:
            raise ValueError(f"layers: expected 1 to {MAX_LAYERS} layers, got {len(layers)}")
        family = self.format_id.rsplit("-", 1)[1].upper()
        for i, layer in enumerate(layers):  # MLA latents have no head axis: either order
            if layer.attention == "full" and layer.order != family:
                raise ValueError(
                    f"layers[{i}]: order {layer.order} does not match format_id {self.format_id!r}"
                )
        _check_str("key_id", self.key_id, empty=True)
        if self.key_id and not re.fullmatch(r"[0-9a-f]{32}", self.key_id):
            raise ValueError(f"key_id: expected 32 lowercase hex characters, got {self.key_id!r}")
        _check_str("key_scheme", self.key_scheme, empty=True)
        if self.key_scheme and not re.fullmatch(r"[!-~]{1,200}", self.key_scheme):
            raise ValueError(
                f"key_scheme: expected at most 200 printable ASCII characters, got "
                f"{self.key_scheme!r:.80}"
            )
        if self.secret is not None and getattr(self.secret, "key_id", None) != self.key_id:
            raise ValueError("secret: expected a StoreSecret whose key_id is the namespace's")
        object.__setattr__(self, "states", states)
        object.__setattr__(self, "layers", layers)
        pages = [g.canonical_page_size_bytes for g in layers]
        sizes = [s.canonical_bytes for s in states] if self.unit_kind == "state" else pages
        object.__setattr__(self, "_prefix", tuple(itertools.accumulate(sizes, initial=0)))
        text = canonical_json(self.describe())
        object.__setattr__(self, "_digest", hashlib.sha256(text.encode("ascii")).digest())

    def authenticated(self, secret: Any) -> StoreNamespace:
        """This namespace for units MAC-ed with ``secret`` (a :class:`~.auth.StoreSecret`):
        its description carries the key's id, so its digest is another."""
        check_type("secret", secret, StoreSecret)
        return replace(self, key_id=secret.key_id, secret=secret)

    def for_store(self, secret: Any = None) -> StoreNamespace:
        """The namespace a store works in: :meth:`authenticated` with ``secret`` when given.
        An authenticated namespace (``key_id``) without its secret is refused: it could verify
        no unit, so every one would read as corrupt (and a store drops corrupt units)."""
        if secret is not None:
            return self.authenticated(secret)
        if self.key_id and self.secret is None:
            raise ValueError(
                f"namespace: authenticated (key_id {self.key_id}) but without its secret; "
                "expected secret=StoreSecret(...) of that key"
            )
        return self

    def shared_prefix(self, key_scheme: Any) -> StoreNamespace:
        """The namespace every engine uses for this model's KV keyed by ``key_scheme`` (a
        ``token_keys.TokenKeyScheme``): this one with the scheme described, so the same model,
        format, dtype / quantisation, layer geometries and tokens per unit give one digest
        whichever engine writes. ValueError (why sharing cannot work) for state units,
        opaque layers, layers of different tokens per page, or a page that is not a whole
        number of the scheme's hash blocks."""
        describe = getattr(key_scheme, "describe", None)
        unit_tokens = getattr(key_scheme, "check_unit_tokens", None)
        if describe is None or unit_tokens is None:
            raise TypeError(
                f"key_scheme: expected a token_keys.TokenKeyScheme, got {type(key_scheme).__name__}"
            )
        if self.unit_kind != "kv" or self.states:
            raise ValueError("shared prefix: expected a KV namespace of attention layers only")
        if self.topology_bound:
            raise ValueError(
                "shared prefix: opaque layers are read at their writer's topology only"
            )
        tokens = {g.tokens_per_page for g in self.layers}
        if len(tokens) != 1:
            raise ValueError(f"shared prefix: layers of different tokens per page {sorted(tokens)}")
        unit_tokens(tokens.pop())
        return replace(self, key_scheme=describe())

    @property
    def unit_tokens(self) -> int:
        """Tokens of one KV unit (every layer's tokens per page; the first layer's)."""
        return self.layers[0].tokens_per_page

    def state_units(self) -> StoreNamespace:
        """This model's namespace of state units (``unit_kind="state"``)."""
        return self if self.unit_kind == "state" else replace(self, unit_kind="state")

    def kv_units(self) -> StoreNamespace:
        """This model's namespace of KV units (``unit_kind="kv"``)."""
        return self if self.unit_kind == "kv" else replace(self, unit_kind="kv")

    def check_kv_readable(self, ctx: RankContext) -> None:
        """Raise :class:`LayerTopologyError` (naming the layer and both topologies) when a
        layer here is opaque and ``ctx`` is not its writer's topology."""
        check_type("ctx", ctx, RankContext)
        for i, layer in enumerate(self.layers):
            if (error := layer.refusal(i, ctx)) is not None:
                raise error

    def check_state_readable(self, ctx: RankContext) -> None:
        """Raise :class:`StateReshardError` (naming the layer, its kind and why) when a
        state layer here is opaque and ``ctx`` is not its writer's topology."""
        check_type("ctx", ctx, RankContext)
        for i, state in enumerate(self.states):
            if (error := state.refusal(i, ctx)) is not None:
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
        fallback_layouts: Sequence[str | None] | None = None,
        block_size: int | None = None,
        scales: Sequence[KVScales | None] | None = None,
    ) -> StoreNamespace:
        """The namespace of a model whose every layer's page on one rank of ``ctx`` is
        ``specs[l]``; None marks a layout not recognised, stored opaquely with
        ``fallback_page_sizes[l]`` bytes per rank page of ``block_size`` tokens, laid out as
        ``fallback_layouts[l]`` says (``OffloadWorker.physical_layouts``: two engines whose
        unrecognised pages differ never share units). ``scales[l]``: layer ``l``'s
        ``layouts.KVScales`` or None."""
        if isinstance(specs, (str, bytes)) or not isinstance(specs, Sequence):
            raise TypeError("specs: expected a sequence of LayerSpec (or None), one per layer")
        if scales is None:
            scales = [None] * len(specs)
        elif isinstance(scales, (KVScales, str)) or len(scales) != len(specs):
            got = "one" if isinstance(scales, KVScales) else len(scales)
            raise ValueError(
                f"scales: expected one KVScales (or None) per layer ({len(specs)}), got {got}"
            )
        for name, per_layer in (
            ("fallback_page_sizes", fallback_page_sizes),
            ("fallback_layouts", fallback_layouts),
        ):
            if per_layer is not None and (
                isinstance(per_layer, (str, bytes))
                or not isinstance(per_layer, Sequence)
                or len(per_layer) != len(specs)
            ):
                raise ValueError(
                    f"{name}: expected one entry per layer ({len(specs)}), got {per_layer!r}"
                )
        layers = []
        for i, spec in enumerate(specs):
            if spec is not None:
                try:
                    layers.append(LayerGeometry.from_spec(spec, ctx, scales[i]))
                except (TypeError, ValueError) as error:
                    if scales[i] is None:
                        raise
                    raise type(error)(f"scales[{i}]: {error}") from None
            elif scales[i] is not None:
                raise ValueError(f"scales[{i}]: a layer of unknown layout cannot be scaled")
            elif fallback_page_sizes is None or fallback_layouts is None or block_size is None:
                raise ValueError(
                    f"specs[{i}]: None needs fallback_page_sizes[{i}], fallback_layouts[{i}] "
                    "(the page's physical layout: OffloadWorker.physical_layouts) and block_size"
                )
            else:
                page, physical = fallback_page_sizes[i], fallback_layouts[i]
                if not isinstance(physical, str) or not physical:
                    raise ValueError(
                        f"fallback_layouts[{i}]: expected the physical layout of a page of "
                        f"unknown layout (a non-empty str), got {physical!r}"
                    )
                layers.append(
                    LayerGeometry.opaque_from_bytes(
                        page, ctx, block_size=block_size, physical=physical
                    )
                )
        orders = {s.order for s in specs if s is not None and s.attention == "full"}
        if len(orders) > 1:
            raise ValueError(f"specs: expected one stride order for all layers, got {orders}")
        order = orders.pop() if orders else "NHD"
        return cls(canonical_format_id(order), model, kv_quant, tuple(layers))

    @property
    def digest(self) -> bytes:
        """32 bytes: sha256 of :meth:`describe`'s canonical JSON text."""
        return self._digest

    @property
    def hex(self) -> str:
        """:attr:`digest` in 64 lowercase hex characters (the namespace's directory name)."""
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
        # Described only when present: namespaces without them keep their digests.
        if self.states:
            out["states"] = [state.describe() for state in self.states]
        if self.unit_kind != "kv":
            out["unit_kind"] = self.unit_kind
        if self.key_id:
            out["key_id"] = self.key_id
        if self.key_scheme:
            out["key_scheme"] = self.key_scheme
        return out

    @classmethod
    def from_description(cls, desc: Any) -> StoreNamespace:
        """Rebuild a namespace from :meth:`describe`'s output (a ``namespace.json``);
        ``ValueError`` on anything missing, unknown or inconsistent."""
        fields_ = ("schema", "format_id", "model", "kv_quant", "num_layers", "layers")
        optional = ("states", "unit_kind", "key_id", "key_scheme")
        d = _strict(desc, "namespace", fields_, optional)
        states, layers = d.get("states", []), d["layers"]
        if "states" in d and not (isinstance(states, list) and 0 < len(states) <= MAX_LAYERS):
            raise ValueError(
                f"states: expected a non-empty list of at most {MAX_LAYERS} state layers"
            )
        if (
            d.get("unit_kind", "state") == "kv"
            or d.get("key_id", "x") == ""
            or d.get("key_scheme", "x") == ""
        ):
            raise ValueError(
                "unit_kind, key_id, key_scheme: expected them absent for their defaults"
            )
        if d["schema"] != NAMESPACE_SCHEMA:
            raise ValueError(f"schema: expected {NAMESPACE_SCHEMA!r}, got {d['schema']!r}")
        model = _strict(d["model"], "model", ("name", "revision", "extra"))
        if not isinstance(layers, list) or len(layers) > MAX_LAYERS:
            raise ValueError(f"layers: expected a list of at most {MAX_LAYERS} layers")
        if d["num_layers"] != len(layers):
            raise ValueError(
                f"num_layers: expected {len(layers)} (the layers listed), got {d['num_layers']!r}"
            )
        layers = [LayerGeometry.from_description(g, f"layers[{i}]") for i, g in enumerate(layers)]
        states = [StateGeometry.from_description(g, f"states[{i}]") for i, g in enumerate(states)]
        rest = (layers, states, d.get("unit_kind", "kv"), d.get("key_id", ""))
        rest += (d.get("key_scheme", ""),)
        try:
            return cls(d["format_id"], ModelIdentity(**model), d["kv_quant"], *rest)
        except TypeError as error:
            raise ValueError(str(error)) from None

    # ------------------------------------------------------------------ unit geometry

    @property
    def num_layers(self) -> int:
        """Layers a unit's range indexes: attention layers (KV units) or state layers."""
        return len(self._prefix) - 1

    @property
    def total_bytes(self) -> int:
        """Bytes of one unit of every layer."""
        return self._prefix[-1]

    def layer_range(self, first: Any, end: Any) -> tuple[int, int]:
        """``(first, end)`` as ints, ``ValueError`` / ``TypeError`` naming them unless
        ``0 <= first < end <= num_layers``."""
        if type(first) is int and type(end) is int and 0 <= first < end < len(self._prefix):
            return first, end  # the hot path of every store and load
        first = check_int("first", first, minimum=0, maximum=self.num_layers - 1)
        return first, check_int("end", end, minimum=first + 1, maximum=self.num_layers)

    def layer_bytes(self, first: int, end: int) -> int:
        """Payload bytes of a unit of layers ``[first, end)``."""
        first, end = self.layer_range(first, end)
        return self._prefix[end] - self._prefix[first]

    def payload_offsets(self, first: int, end: int) -> tuple[int, ...]:
        """Offset of each layer ``first .. end-1`` in such a unit, then its length."""
        first, end = self.layer_range(first, end)
        return tuple(p - self._prefix[first] for p in self._prefix[first : end + 1])

    def layer_span(self, first: int, end: int) -> tuple[int, int]:
        """``[start, stop)`` of layers ``[first, end)`` in a unit of every layer."""
        first, end = self.layer_range(first, end)
        return self._prefix[first], self._prefix[end]

    def unit_ends(self, first: int, payload_bytes: int) -> list[int]:
        """Every ``end`` for which layers ``[first, end)`` take ``payload_bytes`` (several
        only when zero-byte opaque layers follow)."""
        first = check_int("first", first, minimum=0, maximum=self.num_layers - 1)
        target = self._prefix[first] + check_int("payload_bytes", payload_bytes, minimum=0)
        low = max(bisect_left(self._prefix, target), first + 1)
        return list(range(low, bisect_right(self._prefix, target)))

    @property
    def topology_bound(self) -> bool:
        """Some layer or state layer is opaque: the namespace pins the topology."""
        return any(g.opaque for g in self.layers) or any(s.opaque for s in self.states)


def is_namespace_hex(name: str) -> bool:
    """Whether ``name`` looks like a namespace directory name (64 lowercase hex)."""
    return bool(re.fullmatch(r"[0-9a-f]{64}", name))
