"""The vLLM side of the prefix every engine shares (tier option ``shared_prefix``).

vLLM's tiers see offload keys and rows, never token ids nor layer geometry. Key scheme v2
(``units.token_keys``) IS vLLM's offload key, so only the namespace and the payload need
bridging: the operator states the model's attention geometry in ``shared_prefix``, the
scheduler side checks what it can (dtype, layout family, one KV-cache group, row size,
granularity) and the worker side proves the rest at start-up against the real KV tensors
(:func:`check_worker_rows`): its canonical mappings must be exactly those ``layouts`` derives
for the stated geometry, one layer per tensor in layer order, so that a row's first
``namespace.total_bytes`` are every layer's canonical page of the chunk's tokens. What the
scheduler side cannot share is said in one line and the tier keeps its own namespace.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from layouts import LayerSpec, RankContext, derive_group_mappings
from layouts.spec import dtype_name
from layouts.tokens import join_units, split_unit, token_runs

from ..units import ModelIdentity, StoreNamespace
from ..units.token_keys import TokenKeyScheme

__all__ = ["SharedPrefix", "check_worker_rows", "chunk_pages", "chunk_to_unit", "shared_namespace"]
__all__ += ["shared_prefix_options", "unit_to_chunk"]

_OPTION = "shared_prefix"
_FIELDS = {
    "hash_algorithm": "vLLM's prefix_caching_hash_algo: sha256 (default) or sha256_cbor",
    "attention": "full (default) or mla",
    "total_kv_heads": "KV heads of the model (1 for MLA)",
    "head_size": "elements per head (MLA: the latent width)",
    "packing": "the canonical page's packing vLLM certifies: split (FlashAttention's "
    "(2, blocks, ...) caches) or packed",
    "model_revision": "weights revision (default '')",
    "model_extra": "anything else that changes a KV byte, as every engine states it",
}
_FLOAT_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class SharedPrefix:
    """A tier's ``shared_prefix`` option: what the scheduler side cannot see (fields as
    ``_FIELDS`` describes them)."""

    total_kv_heads: int
    head_size: int
    hash_algorithm: str = "sha256"
    attention: str = "full"
    packing: str = "split"
    model_revision: str = ""
    model_extra: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @classmethod
    def from_option(cls, value: Any) -> SharedPrefix:
        """Parse the option (a JSON object); ValueError naming the field."""
        if not isinstance(value, Mapping):
            raise ValueError(f"{_OPTION}: expected an object with {sorted(_FIELDS)}, got {value!r}")
        unknown = sorted(set(value) - set(_FIELDS))
        if unknown:
            raise ValueError(
                f"{_OPTION}: unknown fields {unknown}; expected some of {sorted(_FIELDS)}"
            )
        try:
            out = cls(**value)
            out.layer_spec(16, "NHD", "bfloat16")  # every field checked by layouts
            TokenKeyScheme(out.hash_algorithm, 1)
            ModelIdentity("check", out.model_revision, out.model_extra)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{_OPTION}: {error}") from None
        return out

    def layer_spec(self, tokens: int, order: str, dtype: str) -> LayerSpec:
        """One layer's canonical page of ``tokens`` tokens (the whole layer on one rank)."""
        if self.attention == "mla":
            order = "NHD"
        return LayerSpec(
            self.attention, tokens, self.total_kv_heads, self.head_size, dtype, self.packing, order
        )


def shared_prefix_options(extra_config: Mapping[str, Any]) -> list[SharedPrefix]:
    """The ``shared_prefix`` options of the engine's secondary tiers (worker side)."""
    tiers = extra_config.get("secondary_tiers") or []
    return [
        SharedPrefix.from_option(tier[_OPTION])
        for tier in tiers
        if isinstance(tier, Mapping) and tier.get(_OPTION) is not None
    ]


def _order(config: Any) -> str:
    layout = str(config.kv_cache_layout or "")
    return "HND" if layout in ("LBHNC", "HND") or layout.endswith("hnd") else "NHD"


def _refusal(shared: SharedPrefix, config: Any) -> str | None:
    """Why an engine of ``config`` (vLLM's ``OffloadingConfig``) cannot share, or None."""
    parallel = config.parallel
    dtype = str(config.model.dtype).removeprefix("torch.")
    if len(config.groups) != 1:
        return f"{len(config.groups)} KV-cache groups (hybrid models are keyed per group)"
    if not parallel.is_parallelism_agnostic or parallel.pp_size > 1:
        return "the topology is not parallelism agnostic (PP, CP or opaque layers)"
    if parallel.dcp_size > 1 or parallel.pcp_size > 1:
        return "context parallelism shards the tokens of a block"
    try:
        dtype = dtype_name(dtype)
    except ValueError:
        return f"KV dtype {dtype!r} is not one the canonical format stores"
    if dtype not in _FLOAT_DTYPES:
        return f"KV dtype {dtype} (quantised KV is not shared yet)"
    return None


def chunk_pages(shared: SharedPrefix, config: Any) -> tuple[list[LayerSpec], int] | None:
    """Each layer's page of one GPU block and the blocks per chunk when a chunk row must be
    regrouped to be the shared unit (``blocks_per_chunk`` pages of a layer that is not
    token-major: split or HND), else None (the row's prefix is the unit as it is)."""
    bpc, group = config.cache.blocks_per_chunk, config.groups[0]
    dtype = dtype_name(str(config.model.dtype).removeprefix("torch."))
    page = shared.layer_spec(group.tokens_per_block, _order(config), dtype)
    if bpc == 1 or token_runs(page)[0] == 1:
        return None
    return [page] * len(group.layer_names), bpc


def chunk_to_unit(row: Any, pages: list[LayerSpec], bpc: int) -> np.ndarray:
    """The shared unit of a chunk row whose every layer holds ``bpc`` pages ``pages[l]``
    (layer-major): each layer's ``bpc`` pages joined into one page of ``bpc`` times the
    tokens (``layouts.tokens``)."""
    data, out, at = np.frombuffer(row, np.uint8), [], 0
    for page in pages:
        size = page.page_size_bytes
        out.append(
            join_units([data[at + j * size : at + (j + 1) * size] for j in range(bpc)], [page])
        )
        at += bpc * size
    return np.concatenate(out)


def unit_to_chunk(unit: np.ndarray, pages: list[LayerSpec], bpc: int, row: Any) -> None:
    """:func:`chunk_to_unit` inverted: write ``unit`` into the chunk ``row`` (writable)."""
    out, at = np.frombuffer(row, np.uint8), 0
    for page in pages:
        whole = replace(page, block_size=page.block_size * bpc)
        parts = split_unit(unit[at : at + whole.page_size_bytes], [whole], bpc)
        out[at : at + whole.page_size_bytes] = np.concatenate(parts)
        at += whole.page_size_bytes


def shared_namespace(
    shared: SharedPrefix, spec: Any, row_bytes: int, model_name: str
) -> tuple[StoreNamespace | None, str]:
    """The shared namespace of ``spec``'s rows (a ``CanonicalOffloadingSpec``: the caller
    checks, as only its worker proves the geometry), or None and the one-line reason why this
    engine cannot share."""
    config, cache = spec.config, spec.config.cache
    why = _refusal(shared, config)
    if why is not None:
        return None, why
    dtype = dtype_name(str(config.model.dtype).removeprefix("torch."))
    group = config.groups[0]
    tokens = group.tokens_per_block * cache.blocks_per_chunk
    scheme = TokenKeyScheme(shared.hash_algorithm, cache.tokens_per_hash)
    unit = shared.layer_spec(tokens, _order(config), dtype)
    layers = [unit] * len(group.layer_names)
    ctx = RankContext(1, unit.num_kv_heads, 0)
    model = ModelIdentity(model_name, shared.model_revision, shared.model_extra)
    try:
        namespace = StoreNamespace.from_specs(model, layers, ctx).shared_prefix(scheme)
    except ValueError as error:
        return None, str(error)
    if namespace.total_bytes > row_bytes:
        return None, (
            f"the stated geometry needs {namespace.total_bytes} bytes per chunk, vLLM's row "
            f"has {row_bytes}: check {_OPTION}"
        )
    return namespace, ""


def check_worker_rows(shared: SharedPrefix, kv_caches: Any, config: Any, worker: Any) -> None:
    """Refuse to start (RuntimeError) unless this rank's rows begin with every layer's canonical
    page of the stated geometry: one ref per KV tensor, in layer order, each mapping exactly
    the one ``layouts`` derives (so the bytes are those every engine writes). ``worker``: the
    rank's ``CanonicalOffloadingWorker`` (its cells and their offsets in a row). An engine that
    does not share at all (:func:`_refusal`: the tier says why) is not checked."""
    if _refusal(shared, config) is not None:
        return
    cell_sizes, offsets = worker.cell_sizes, worker.cell_offsets
    parallel = config.parallel
    refs = list(kv_caches.group_data_refs[0]) if kv_caches.group_data_refs else []
    group = config.groups[0]
    dtype = dtype_name(str(config.model.dtype).removeprefix("torch."))
    spec = shared.layer_spec(group.tokens_per_block, _order(config), dtype)
    where = f"{_OPTION} ({shared}) does not describe this engine's KV cache"
    tensors = list(range(len(kv_caches.tensors)))
    if [ref.tensor_idx for ref in refs] != tensors or len(refs) != len(group.layer_names):
        raise RuntimeError(f"{where}: expected one KV tensor per layer, in layer order")
    tp, rank = parallel.tp_size, parallel.rank % parallel.tp_size
    heads = 1 if spec.attention == "mla" else max(1, spec.num_kv_heads // tp)
    local = LayerSpec(
        spec.attention, spec.block_size, heads, spec.head_size, dtype, spec.packing, spec.order
    )
    try:
        mapping = derive_group_mappings(local, tp, spec.num_kv_heads)[rank]
    except (TypeError, ValueError) as error:
        raise RuntimeError(f"{where}: {error}") from None
    from .worker import _as_layouts_mapping

    for i, ref in enumerate(refs):
        got = None if ref.mapping is None else _as_layouts_mapping(ref.mapping, cell_sizes[i])
        if got is None or tuple(got.runs) != tuple(mapping.runs):
            raise RuntimeError(f"{where}: layer {i}'s canonical mapping differs")
        if offsets[i] != i * spec.page_size_bytes * worker.blocks_per_chunk:
            raise RuntimeError(f"{where}: layer {i}'s cell is not where its page goes in a row")
        if cell_sizes[i] != spec.page_size_bytes:
            raise RuntimeError(
                f"{where}: layer {i}'s row cell is {cell_sizes[i]} bytes, its canonical page "
                f"{spec.page_size_bytes}"
            )
