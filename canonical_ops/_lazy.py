"""Lazy re-exports for package ``__init__`` modules (PEP 562).

A package lists ``public name -> defining submodule``; the submodule is imported on the
first access of one of its names, so importing the package itself stays light (no
compiled extension, no torch op registration) until an op is actually used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, namespace: dict[str, Any], exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` re-exporting ``exports`` lazily.

    Parameters
    ----------
    package : str
        The package's ``__name__``.
    namespace : dict
        The package's ``globals()``; a resolved name is cached there.
    exports : Mapping[str, str]
        Public name -> module defining it, relative to ``package`` (e.g. ``".ops"``).
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value  # later lookups do not come here again
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
