"""The unit stores a :class:`~canonical_ops.engine.cache.StageCache` reads besides its tiers:
other engines' units read across (another token count, ``units.across``), checked, and the
keys of the same prefix in them; and the checks a tier and such a store share."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from ..checks import check_int
from ..units.across import UnitsAcross, readable_across
from ..units.namespace import StoreNamespace
from ..units.unit import normalize_key

__all__ = ["AcrossStores", "check_store", "checked_hashes"]

_TIER_METHODS = ("submit_lookup", "submit_loads", "submit_stores", "wait")


def check_store(name: str, store: Any, namespace: StoreNamespace, expected: str) -> None:
    """``store`` is a unit store (TypeError) of ``namespace`` (ValueError: "``name``:
    expected ``expected``, got ...")."""
    missing = [m for m in _TIER_METHODS if not callable(getattr(store, m, None))]
    if missing:
        raise TypeError(f"{name}: expected a unit store, lacks {missing}")
    theirs = getattr(store, "namespace", None)
    if not isinstance(theirs, StoreNamespace) or theirs.digest != namespace.digest:
        got = theirs.hex[:16] + "..." if isinstance(theirs, StoreNamespace) else theirs
        raise ValueError(f"{name}: expected {expected}, got {got!r}")


def checked_hashes(hashes: Any, name: str = "hashes") -> list[Hashable]:
    """``hashes`` as a list of block hashes, each a valid unit key (naming ``name[i]``)."""
    if isinstance(hashes, (str, bytes, bytearray, memoryview, int)):
        raise TypeError(f"{name}: expected a sequence of block hashes, got a single one")
    out = list(hashes)
    for i, h in enumerate(out):
        try:
            normalize_key(h)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{name}[{i}]: {error}") from None
    return out


class AcrossStores:
    """``across`` ({tokens per unit: unit stores, nearest first}; None: none) of namespace
    ``own``'s stage, checked: ``stores`` with, each, its ``units`` (how its units make the
    stage's) and ``names``; ``sizes`` read, ``refused`` (another size is one warning line and
    not read)."""

    def __init__(self, own: StoreNamespace, across: Any) -> None:
        self.stores: list[Any] = []
        self.units: list[UnitsAcross] = []
        self.names: list[str] = []
        self.sizes: set[int] = set()
        self.refused: set[int] = set()
        if across is None:
            return
        if not isinstance(across, Mapping):
            raise TypeError(
                f"across: expected {{tokens per unit: unit stores}}, got {type(across).__name__}"
            )
        for tokens, stores in across.items():
            check_int("across: tokens per unit", tokens, minimum=1)
            if tokens == own.unit_tokens:
                raise ValueError(
                    f"across: {tokens} tokens is this stage's own unit size; pass its stores "
                    "as tiers"
                )
            if isinstance(stores, (str, bytes)) or not isinstance(stores, Sequence):
                raise TypeError(f"across[{tokens}]: expected a sequence of unit stores")
        readable = {units.tokens: units for units in readable_across(own, across)}
        for tokens, stores in across.items():
            units = readable.get(tokens)
            if units is None:  # the line saying why was logged
                self.refused.add(tokens)
                continue
            self.sizes.add(tokens)
            for i, store in enumerate(stores):
                expected = (
                    f"a store of namespace {units.namespace.hex[:16]}... (the stage's in units "
                    f"of {tokens} tokens)"
                )
                check_store(f"across[{tokens}][{i}]", store, units.namespace, expected)
                self.stores.append(store)
                self.units.append(units)
                self.names.append(f"across{tokens}:{i}:{type(store).__name__}")

    def keys(self, across_keys: Any) -> dict[int, tuple[Hashable, ...]]:
        """``across_keys`` checked: {tokens: keys} of the sizes read across."""
        if across_keys is None:
            return {}
        if not isinstance(across_keys, Mapping):
            raise TypeError(
                f"across_keys: expected {{tokens per unit: keys}}, got {type(across_keys).__name__}"
            )
        out = {}
        for tokens, keys in across_keys.items():
            if tokens in self.sizes:
                out[tokens] = tuple(checked_hashes(keys, f"across_keys[{tokens}]"))
            elif tokens not in self.refused:  # a refused size: its line was logged
                raise ValueError(
                    f"across_keys: expected keys of the sizes given as across "
                    f"{sorted(self.sizes | self.refused)}, got {tokens!r}"
                )
        return dict(sorted(out.items()))
