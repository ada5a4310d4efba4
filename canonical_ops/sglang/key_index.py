"""SGLang page hash -> canonical store key: a local index fed by SGLang's own hashing.

SGLang's storage calls carry only its page hashes (a sha256 chain of its own
over token ids, with its own root and request namespaces), never the token
ids. The store is keyed by :mod:`canonical_ops.frontend.store.token_keys`, the
engine-independent chain every engine can compute. So the backend watches
SGLang compute its storage hashes: :func:`install_hash_observer` wraps
``sglang.srt.mem_cache.utils.get_hash_str`` (the one function every storage
hash of SGLang 0.5.x goes through), and for every chain it hashes the
observer computes the canonical keys of the same token blocks and records
``SGLang hash -> canonical key`` in each live :class:`TokenKeyIndex`.

Fail closed: a page hash the index never saw (a chain SGLang hashed before the
backend was attached, another hashing path, a salted or multimodal chain whose
tokens are not plain ids) has no canonical key, so it is a miss and is never
stored; it never maps to another prefix's unit.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ..units.token_keys import ROOT_KEY, chain_keys

__all__ = ["TokenKeyIndex", "install_hash_observer", "observed_token_ids"]

logger = logging.getLogger(__name__)

_observers: weakref.WeakSet[TokenKeyIndex] = weakref.WeakSet()
_install_lock = threading.Lock()


class TokenKeyIndex:
    """Bounded map from an engine's page hash to the canonical key of the same block.

    Parameters
    ----------
    block_tokens : int
        Tokens per page (SGLang's ``page_size``, the namespace's tokens per page).
    capacity : int
        Entries kept; the least recently used go first.
    """

    def __init__(self, block_tokens: int, capacity: int = 1 << 20) -> None:
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
            raise ValueError(f"block_tokens: expected a positive int, got {block_tokens!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity: expected a positive int, got {capacity!r}")
        self.block_tokens = block_tokens
        self.capacity = capacity
        self._map: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._map)

    def canonical(self, engine_key: str) -> bytes | None:
        """The canonical key recorded for ``engine_key``, or None."""
        with self._lock:
            key = self._map.get(engine_key)
            if key is not None:
                self._map.move_to_end(engine_key)
            return key

    def record(self, engine_keys: Sequence[str], canonical_keys: Sequence[bytes]) -> None:
        """Record pairs (the shorter of the two sequences decides how many)."""
        with self._lock:
            for engine_key, key in zip(engine_keys, canonical_keys):
                self._map[engine_key] = key
                self._map.move_to_end(engine_key)
            while len(self._map) > self.capacity:
                self._map.popitem(last=False)

    def observe(
        self, token_ids: Sequence[int], prior: str | None, engine_keys: Sequence[str]
    ) -> int:
        """Record the canonical keys of a chain the engine hashed; returns how many.

        ``engine_keys[i]`` is the engine's hash of block ``i`` of ``token_ids``,
        chained after the block whose engine hash is ``prior`` (None: the
        sequence's first block). Nothing is recorded when ``prior`` is unknown.
        """
        parent = ROOT_KEY if prior is None else self.canonical(prior)
        if parent is None:
            return 0
        keys = chain_keys(parent, token_ids, self.block_tokens)
        n = min(len(keys), len(engine_keys))
        self.record(engine_keys[:n], keys[:n])
        return n


def observed_token_ids(key: Any) -> list[int] | None:
    """Plain token ids of what SGLang hashed, or None when it is not a plain, unsalted chain.

    ``key`` is a list of ids or SGLang's ``RadixKey`` (``token_ids``,
    ``extra_key``, ``cache_salt``, ``is_bigram``). Request namespaces
    (extra key, cache salt), bigram keys and tuple tokens (multimodal) are
    left out: their KV is not a function of the plain token ids alone.
    """
    if getattr(key, "extra_key", None) is not None or getattr(key, "cache_salt", None) is not None:
        return None
    if getattr(key, "is_bigram", False):
        return None
    tokens = getattr(key, "token_ids", key)
    try:
        tokens = list(tokens)
    except TypeError:
        return None
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        return None
    return tokens


def _notify(token_ids: Any, prior: Any, page_size: Any, result: Any) -> None:
    if not isinstance(result, list) or not all(isinstance(h, str) for h in result):
        return
    if prior is not None and not isinstance(prior, str):
        return
    observers = [o for o in list(_observers) if o.block_tokens == page_size]
    if not observers:
        return
    tokens = observed_token_ids(token_ids)
    if tokens is None:
        return
    for index in observers:
        index.observe(tokens, prior, result)


def install_hash_observer(index: TokenKeyIndex, utils_module: Any = None) -> None:
    """Feed ``index`` from SGLang's storage hashing (idempotent per process).

    Parameters
    ----------
    index : TokenKeyIndex
        Kept weakly: an index that is gone stops being fed.
    utils_module : module, optional
        The module whose ``get_hash_str`` is wrapped (default
        ``sglang.srt.mem_cache.utils``).
    """
    if not isinstance(index, TokenKeyIndex):
        raise TypeError(f"index: expected a TokenKeyIndex, got {type(index).__name__}")
    if utils_module is None:
        import sglang.srt.mem_cache.utils as utils_module
    with _install_lock:
        current = utils_module.get_hash_str
        if not getattr(current, "_canonical_kv_observer", False):
            original = current

            def get_hash_str(token_ids, prior_hash=None, page_size=None):
                result = original(token_ids, prior_hash, page_size)
                try:
                    _notify(token_ids, prior_hash, page_size, result)
                except Exception:
                    # Observing must never break SGLang's hashing: the chain just stays unindexed.
                    logger.warning("canonical-kv: page hashes not indexed", exc_info=True)
                return result

            get_hash_str._canonical_kv_observer = True
            get_hash_str.__wrapped__ = original
            get_hash_str.__doc__ = original.__doc__
            utils_module.get_hash_str = get_hash_str
        _observers.add(index)
