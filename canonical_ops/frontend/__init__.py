"""Old import paths of round 3 (``canonical_ops.frontend...``), kept working: importing one
gives the moved module itself (one module object under two names) and warns once, naming it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

# Old module (below canonical_ops.frontend) -> its replacement.
MOVED = {
    "store": "canonical_ops.units",
    "store.encoding": "canonical_ops.units.unit",
    "store.state_geometry": "canonical_ops.units.geometry",
    "shared_region": "canonical_ops.engine.region",
    "page_manager": "canonical_ops.engine.pages",
    "worker": "canonical_ops.engine.worker",
    "tiers": "canonical_ops.engine.cache",
    "hybrid": "canonical_ops.engine.hybrid",
    "demo": "canonical_ops.demo",
}


def replacement(old: str) -> str | None:
    """The module that replaces ``canonical_ops.frontend.<old>`` (None: no such module)."""
    parts = old.split(".")
    for count in range(len(parts), 0, -1):  # the longest moved prefix, then the last name
        if (head := ".".join(parts[:count])) in MOVED:
            return ".".join([MOVED[head], *parts[count:]])
    return MOVED.get(parts[-1])


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    prefix = __name__ + "."

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix(self.prefix)
        new = None if old == fullname else replacement(old)
        return new and importlib.machinery.ModuleSpec(fullname, self, loader_state=new)

    def create_module(self, spec):
        new = spec.loader_state
        message = f"{spec.name} moved to {new}; import it from there"
        warnings.warn(message, DeprecationWarning, stacklevel=3)
        module = importlib.import_module(new)
        spec.loader_state = (new, module.__spec__)
        return module

    def exec_module(self, module):
        # The import system set the alias's spec on the module: give it back its own.
        module.__spec__ = module.__spec__.loader_state[1]


if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Alias())

from .._lazy import lazy_exports  # noqa: E402
from ..engine import __all__  # noqa: E402  (the old package's names, resolved lazily)

__getattr__, __dir__ = lazy_exports(__name__, globals(), dict.fromkeys(__all__, "..engine"))
