"""Why a reader misses units another topology of the same model stored in a FileStore root.

Failing closed is silent: a reader whose namespace differs from the writer's only because a
layer's pages are not parallelism free (stored opaque, pinned to the writer's topology), or
because this reader cannot certify a layer the writer stored certified, finds nothing, and a
0% hit rate says nothing. :func:`explain_miss` reads the other namespaces of ``root`` (this
user's private directories and regular files only) and names the first such layer and both
topologies in one line."""

from __future__ import annotations

import os

from layouts import RankContext

from ..checks import check_type
from ..units import fsutil
from ..units.geometry import LayerTopologyError, StateReshardError, topology_text
from ..units.namespace import StoreNamespace, is_namespace_hex
from ..units.store_report import parse_namespace

__all__ = ["explain_miss", "explain_state_miss"]

_MAX_NAMESPACE_FILE = 1 << 20  # a namespace.json is a few KiB: bound what is read
# What must agree for two KV layers to be the same model's layer, whatever the topology.
_LAYER_MODEL_FIELDS = (
    "attention",
    "total_kv_heads",
    "head_size",
    "dtype",
    "packing",
    "order",
    "per_token_head_scales",
    "tokens_per_state",
    "scales",
    "physical",
)
_STATE_MODEL_FIELDS = ("kind", "dims", "conv_dtype", "ssm_dtype", "conv_layout")


def explain_miss(
    root: str | os.PathLike, namespace: StoreNamespace, ctx: RankContext
) -> LayerTopologyError | StateReshardError | None:
    """The error naming why units of ``namespace``'s model (its ``unit_kind``) are stored in
    FileStore ``root`` but unreadable at ``ctx``'s topology, or None (none such, or the miss
    has another cause: another model, dtype, key scheme, or units never stored)."""
    check_type("namespace", namespace, StoreNamespace)
    check_type("ctx", ctx, RankContext)
    try:
        top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (OSError, TypeError, ValueError):
        return None
    perms = fsutil.Perms()
    try:
        for entry in sorted(os.listdir(top)):
            if not is_namespace_hex(entry) or entry == namespace.hex:
                continue
            other = _read_namespace(top, entry, perms)
            if other is not None and _same_model(namespace, other):
                error = _refusal(namespace, other, ctx)
                if error is not None:
                    return error
    finally:
        os.close(top)
    return None


def explain_state_miss(
    root: str | os.PathLike, namespace: StoreNamespace, ctx: RankContext
) -> StateReshardError | None:
    """:func:`explain_miss` for ``namespace``'s state units (a hybrid model's state layers)."""
    check_type("namespace", namespace, StoreNamespace)
    return explain_miss(root, namespace.state_units(), ctx)


def _refusal(
    mine: StoreNamespace, other: StoreNamespace, ctx: RankContext
) -> LayerTopologyError | StateReshardError | None:
    """Why ``other``'s units (the same model's) are not readable at ``ctx`` with ``mine``."""
    state = mine.unit_kind == "state"
    theirs = other.states if state else other.layers
    for layer, (ours, stored) in enumerate(zip(mine.states if state else mine.layers, theirs)):
        if (error := stored.refusal(layer, ctx)) is not None:
            return error  # the writer's layer is pinned to the writer's topology
        if ours.opaque and not stored.opaque:  # stored certified, not certifiable here
            if state:
                tp, dcp, pcp = ctx.tp_size, ctx.dcp_size, ctx.pcp_size
                message = (
                    f"state layer {layer} ({ours.kind}) cannot be resharded at tp={tp}, "
                    f"dcp={dcp}, pcp={pcp}: {ours.reason}; its units are stored certified "
                    f"(parallelism free) by another topology, readable only where the layer "
                    f"certifies"
                )
                return StateReshardError(layer, ours.kind, ours.reason, message)
            message = (
                f"layer {layer} is not parallelism free at {topology_text(ours.topology)}: "
                f"its units are stored certified by another topology, readable only where "
                f"the layer certifies"
            )
            return LayerTopologyError(layer, None, message)
    return None


def _same_model(a: StoreNamespace, b: StoreNamespace) -> bool:
    """Same model, quantisation, unit kind and layer kinds: only topology-bound parts (and
    so the key scheme, which an opaque namespace does not share) may differ."""
    if (a.format_id, a.model, a.kv_quant, a.unit_kind) != (
        b.format_id,
        b.model,
        b.kv_quant,
        b.unit_kind,
    ):
        return False
    if len(a.states) != len(b.states) or len(a.layers) != len(b.layers):
        return False
    if a.unit_kind == "state":
        pairs, names = zip(a.states, b.states), _STATE_MODEL_FIELDS
    else:
        pairs, names = zip(a.layers, b.layers), _LAYER_MODEL_FIELDS
    return all([getattr(x, f) for f in names] == [getattr(y, f) for f in names] for x, y in pairs)


def _read_namespace(top: int, entry: str, perms: fsutil.Perms) -> StoreNamespace | None:
    """``<entry>/namespace.json`` through checked descriptors, or None (unsafe, unreadable)."""
    fd = directory = -1
    try:
        directory = fsutil.open_dir(top, entry, perms) or -1
        fd, st = fsutil.open_file(directory, "namespace.json")
        if st.st_uid != os.geteuid() or st.st_size > _MAX_NAMESPACE_FILE:
            return None
        described = parse_namespace(os.read(fd, _MAX_NAMESPACE_FILE), _MAX_NAMESPACE_FILE)
        return described if described.hex == entry else None
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    finally:
        for descriptor in (fd, directory):
            if descriptor >= 0:
                os.close(descriptor)
