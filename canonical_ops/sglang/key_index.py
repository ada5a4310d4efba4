"""SGLang page hash -> canonical store key (key scheme v2, ``units.token_keys``: vLLM's block
hash of the page's last hash block): a local index fed by wrapping SGLang's own ``get_hash_str``
(its storage calls carry only page hashes). Fail closed: a hash never seen has no canonical key,
so it is a miss and never stored; it never maps to another prefix."""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ..checks import check_int, check_type
from ..units.token_keys import TokenKeyScheme

__all__ = ["TokenKeyIndex", "install_hash_observer", "observed_token_ids"]

logger = logging.getLogger(__name__)

_observers: weakref.WeakSet[TokenKeyIndex] = weakref.WeakSet()
_install_lock = threading.Lock()


class TokenKeyIndex:
    """Bounded map (least recently used go first) from an engine's page hash to the key
    ``scheme`` gives the same page of ``page_size`` tokens (SGLang's ``page_size``, a whole
    number of the scheme's hash blocks), and to what keys units of other token counts
    (:meth:`unit_keys_within`, :meth:`position`)."""

    def __init__(self, scheme: TokenKeyScheme, page_size: int, capacity: int = 1 << 20) -> None:
        self.scheme = check_type("scheme", scheme, TokenKeyScheme)
        self.page_size = scheme.check_unit_tokens(check_int("page_size", page_size, minimum=1))
        self.capacity = check_int("capacity", capacity, minimum=1)
        # engine page hash -> (the scheme's hash of each hash block of the page, the page's
        # index in its sequence)
        self._map: OrderedDict[str, tuple[tuple[bytes, ...], int]] = OrderedDict()
        self._lock = threading.Lock()

    def _entry(self, engine_key: str) -> tuple[tuple[bytes, ...], int] | None:
        with self._lock:
            value = self._map.get(engine_key)
            if value is not None:
                self._map.move_to_end(engine_key)
            return value

    def canonical(self, engine_key: str) -> bytes | None:
        """The store key recorded for ``engine_key``, or None."""
        entry = self._entry(engine_key)
        return None if entry is None else self.scheme.unit_key(entry[0][-1])

    def position(self, engine_key: str) -> int | None:
        """The page's index in its sequence (page ``p`` holds tokens ``[p * page_size, (p +
        1) * page_size)``), or None."""
        entry = self._entry(engine_key)
        return None if entry is None else entry[1]

    def unit_keys_within(self, engine_key: str, unit_tokens: int) -> list[bytes] | None:
        """Store keys of the units of ``unit_tokens`` (a divisor of the page size, whole hash
        blocks) that make up the page, first first; None when the page is unknown."""
        entry = self._entry(engine_key)
        if entry is None:
            return None
        per_unit = self.scheme.check_unit_tokens(unit_tokens) // self.scheme.hash_block_tokens
        return [self.scheme.unit_key(h) for h in entry[0][per_unit - 1 :: per_unit]]

    def prefix(self, engine_keys: Sequence[str]) -> list[bytes]:
        """Canonical keys of the leading ``engine_keys`` recorded (up to the first unknown)."""
        out = []
        for engine_key in engine_keys:
            key = self.canonical(engine_key)
            if key is None:
                break
            out.append(key)
        return out

    def observe(
        self, token_ids: Sequence[int], prior: str | None, engine_keys: Sequence[str]
    ) -> int:
        """Record the store keys of ``engine_keys`` (page ``i``'s hash of ``token_ids``,
        chained after the page hashed ``prior``, None: none; unknown: nothing); how many."""
        parent, first = None, 0
        if prior is not None:
            entry = self._entry(prior)
            if entry is None:
                return 0
            parent, first = entry[0][-1], entry[1] + 1
        per_page = self.page_size // self.scheme.hash_block_tokens
        # Whole pages only: SGLang also names a trailing partial page, which no unit holds.
        pages_whole = min(len(engine_keys), len(token_ids) // self.page_size)
        tokens = token_ids[: pages_whole * self.page_size]
        hashes = self.scheme.block_hashes(tokens, parent)
        pages = [tuple(hashes[at : at + per_page]) for at in range(0, len(hashes), per_page)]
        pages = pages[: len(engine_keys)]
        with self._lock:
            for i, (engine_key, page) in enumerate(zip(engine_keys, pages)):
                self._map[engine_key] = (page, first + i)
                self._map.move_to_end(engine_key)
            while len(self._map) > self.capacity:
                self._map.popitem(last=False)
        return len(pages)


def observed_token_ids(key: Any) -> list[int] | None:
    """Plain token ids of what SGLang hashed (a list or a ``RadixKey``), or None when the KV
    is not a function of them alone: a request namespace (extra key, cache salt), a bigram
    key or tuple (multimodal) tokens."""
    if getattr(key, "extra_key", None) is not None or getattr(key, "cache_salt", None) is not None:
        return None
    raw = getattr(key, "raw_token_ids", None)  # a RadixKey's ids up to its limit: what it hashed
    try:
        source = raw() if callable(raw) else getattr(key, "token_ids", key)
        tokens = None if getattr(key, "is_bigram", False) else list(source)
    except TypeError:
        return None
    if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        return None
    return tokens


def _notify(token_ids: Any, prior: Any, page_size: Any, result: Any) -> None:
    if not isinstance(result, list) or not all(isinstance(h, str) for h in result):
        return
    observers = [o for o in list(_observers) if o.page_size == page_size]
    tokens = observed_token_ids(token_ids) if observers else None
    if tokens is not None and (prior is None or isinstance(prior, str)):
        for index in observers:
            index.observe(tokens, prior, result)


def install_hash_observer(index: TokenKeyIndex, utils_module: Any = None) -> None:
    """Feed ``index`` (kept weakly) from SGLang's storage hashing: wraps ``get_hash_str`` of
    ``utils_module`` (default ``sglang.srt.mem_cache.utils``) once per process."""
    check_type("index", index, TokenKeyIndex)
    if utils_module is None:
        import sglang.srt.mem_cache.utils as utils_module
    with _install_lock:
        original = utils_module.get_hash_str
        if not getattr(original, "_canonical_kv_observer", False):

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
