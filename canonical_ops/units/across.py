"""Units of another token count read as an engine's own units (issue 31 item 2).

Engines cut one prefix into units of different token counts (vLLM's offloaded block, SGLang's
page, the standalone engine's block). Tokens per unit are in the namespace, so each count has
its own namespace and its own keys (key scheme v2: a unit is named by its last hash block). A
reader of units of ``U`` tokens reads units of ``S`` tokens when one is a multiple of the
other: its unit ``j`` (tokens ``[j*U, (j+1)*U)``) is part ``j % k`` of source unit ``j // k``
(``S = k*U``: split) or source units ``j*k .. j*k + k-1`` joined (``U = k*S``), in
``layouts.tokens``. Each source unit is loaded and verified by its store as any load; a unit
is built only from sources that were all verified: a source missing or corrupt makes exactly
the units depending on it misses, never partial bytes. :class:`UnitsAcross` is the one
implementation; each adapter names the sources (its keys) and loads them its way (one call,
or batch jobs).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from layouts import LayerSpec
from layouts.cli import escape_text
from layouts.tokens import join_units, split_unit, token_runs

from ..checks import check_int, check_type
from .namespace import StoreNamespace
from .token_keys import TokenKeyScheme

__all__ = ["UnitsAcross", "keys_by_size", "readable_across"]

logger = logging.getLogger(__name__)

# A LayerGeometry's fields that make its whole layer's LayerSpec, in LayerSpec's order.
_PAGE_FIELDS = ("attention", "tokens_per_page", "total_kv_heads", "head_size", "dtype")
_PAGE_FIELDS += ("packing", "order")


@dataclass(frozen=True)
class UnitsAcross:
    """How units of ``namespace`` (another engine's, of ``namespace.unit_tokens`` tokens) make
    units of ``unit_tokens`` tokens; build with :meth:`of`."""

    unit_tokens: int
    namespace: StoreNamespace

    @classmethod
    def of(cls, own: StoreNamespace, tokens: int) -> UnitsAcross:
        """Units of ``tokens`` tokens read as units of the shared namespace ``own``: the same
        model, format, quantisation, layers and key scheme, ``tokens`` per unit. ValueError
        (why) for a size neither a multiple nor a divisor of ``own``'s, not whole hash blocks,
        ``own``'s own size, or a namespace not exactly its ``shared_prefix`` or with pages not
        made of tokens."""
        check_type("own", own, StoreNamespace)
        tokens = check_int("tokens", tokens, minimum=1)
        mine = own.unit_tokens
        if tokens == mine:
            raise ValueError(f"tokens: {tokens} is this engine's own unit size")
        if tokens % mine and mine % tokens:
            raise ValueError(f"neither a multiple nor a divisor of the unit size {mine}")
        if not own.key_scheme or own.topology_bound or own.unit_kind != "kv":
            raise ValueError("this engine's own units are not shared")
        scheme = TokenKeyScheme.described(own.key_scheme)
        try:  # exactly its shared prefix: one tokens per page, whole hash blocks, no states
            shared = own.shared_prefix(scheme).digest == own.digest
        except ValueError:  # e.g. SGLang's own namespace with the scheme described
            shared = False
        if not shared:
            raise ValueError("this engine's own units are not shared")
        scheme.check_unit_tokens(tokens)
        layers = []
        for i, layer in enumerate(own.layers):
            if layer.scales is not None and layer.scales.has_page:
                raise ValueError(f"layers[{i}]: pages with per-token-head scales are not split")
            spec = replace(LayerSpec(*(getattr(layer, n) for n in _PAGE_FIELDS)), block_size=tokens)
            token_runs(spec)  # refuses pages whose bytes are not per token
            size = spec.page_size_bytes
            layers.append(replace(layer, tokens_per_page=tokens, canonical_page_size_bytes=size))
        return cls(mine, replace(own, layers=tuple(layers)))

    @property
    def tokens(self) -> int:
        """Tokens of one source unit."""
        return self.namespace.unit_tokens

    @property
    def splits(self) -> bool:
        """Source units are bigger (each split into several units) rather than joined."""
        return self.tokens > self.unit_tokens

    @property
    def ratio(self) -> int:
        """Units per source unit (splits) or source units per unit (joins)."""
        return max(self.tokens, self.unit_tokens) // min(self.tokens, self.unit_tokens)

    def sources(self, unit: int) -> range:
        """Indices in the prefix of the source units that unit ``unit`` is made of."""
        if self.splits:
            return range(unit // self.ratio, unit // self.ratio + 1)
        return range(unit * self.ratio, (unit + 1) * self.ratio)

    def covered(self, unit: int, found: int, limit: int) -> int:
        """Units from ``unit`` on (at most ``limit``) made of the ``found`` leading source
        units from ``sources(unit).start``."""
        if self.splits:
            return max(0, min((unit // self.ratio + found) * self.ratio - unit, limit))
        return min(found // self.ratio, limit)

    def source_bytes(self, first: int, end: int) -> int:
        """Bytes of a source unit of layers ``[first, end)``."""
        return self.namespace.layer_bytes(first, end)

    def specs(self, first: int, end: int) -> list[LayerSpec]:
        """Each source layer's whole canonical page in ``[first, end)`` (``layouts.tokens``'
        view)."""
        return [
            LayerSpec(*(getattr(g, name) for name in _PAGE_FIELDS))
            for g in self.namespace.layers[first:end]
        ]

    def build(
        self,
        loaded: Mapping[int, np.ndarray | None],
        units: Sequence[int],
        first: int,
        end: int,
    ) -> list[np.ndarray | None]:
        """The bytes (layers ``[first, end)``) of each unit of ``units`` (indices in the
        prefix) from ``loaded``: source index -> its verified row, or None / absent for a
        source missing or corrupt, whose units are then None."""
        specs, parts, out = self.specs(first, end), {}, []
        for unit in units:
            rows = [loaded.get(source) for source in self.sources(unit)]
            if any(row is None for row in rows):
                out.append(None)
            elif self.splits:
                source = unit // self.ratio
                if source not in parts:  # one split serves every unit of the source
                    parts[source] = split_unit(np.asarray(rows[0]), specs, self.ratio)
                out.append(parts[source][unit % self.ratio])
            else:
                out.append(join_units(rows, specs))
        return out


def readable_across(own: StoreNamespace, sizes: Iterable[int]) -> list[UnitsAcross]:
    """:class:`UnitsAcross` of each of ``sizes`` (other engines' tokens per unit, e.g. vLLM's
    offloaded block) the engine of namespace ``own`` can read, in order; ``own``'s size is
    skipped and each other one is one warning line saying why it is not read."""
    out = []
    for tokens in dict.fromkeys(sizes):
        if tokens == own.unit_tokens:
            continue
        try:
            out.append(UnitsAcross.of(own, tokens))
        except ValueError as error:
            logger.warning(
                "canonical-kv: not reading units of %d tokens: %s", tokens, escape_text(str(error))
            )
    return out


def keys_by_size(
    scheme: TokenKeyScheme, token_ids: Sequence[int], sizes: Iterable[int]
) -> dict[int, list[bytes]]:
    """{tokens: ``scheme.unit_keys(token_ids, tokens)``} for each of ``sizes``, from one pass
    of block hashes (what a StageCache's ``across_keys`` takes, its own size included)."""
    check_type("scheme", scheme, TokenKeyScheme)
    sizes = [scheme.check_unit_tokens(tokens) for tokens in dict.fromkeys(sizes)]
    hashes = scheme.block_hashes(token_ids)
    out = {}
    for tokens in sizes:
        per_unit = tokens // scheme.hash_block_tokens
        out[tokens] = [scheme.unit_key(h) for h in hashes[per_unit - 1 :: per_unit]]
    return out
