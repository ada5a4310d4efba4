"""Results of bench_transfer.py in memory (keyed by :class:`MethodKey`) and on disk (JSON).

In memory, every timing that belongs to a method and a direction is keyed by a
``MethodKey(method, direction)`` tuple. JSON objects need string keys, so on disk the key is
joined (the format every results file so far has used, kept so that old files still read):

* ``blocks_sweep`` / ``layers_sweep`` points: ``"methods"`` and ``"errors"`` keyed
  ``"canonical_store"``, ``"vllm_expand_loop_store"``, ...;
* ``sm_sweep`` points: those keys directly in the point, next to ``case``, ``sm_budget`` and
  ``bytes`` (in memory they sit in the point's ``"methods"``);
* ``verification``: per case, keyed ``"canonical store"``, ``"pytorch load"``, ...

:func:`results_to_json` and :func:`results_from_json` are the only places that join or split
these keys. Fragment-sweep rows need neither: they nest ``row[direction][method]``.
"""

from __future__ import annotations

from typing import NamedTuple

DIRECTIONS = ("store", "load")


class MethodKey(NamedTuple):
    """Which timing: a method and the direction it moves bytes in.

    ``direction`` is None for a timing that has none, such as one of the CPU limit's
    contiguous copies (``limit_torch``, ``limit_numpy``, ``limit_numpythreads``), which serve
    as the limit of both directions.
    """

    method: str
    direction: str | None = None

    @property
    def label(self) -> str:
        """``canonical_store``: the key's name in sweep points on disk, NVTX ranges and logs."""
        return self.method if self.direction is None else f"{self.method}_{self.direction}"

    @classmethod
    def from_label(cls, label: str) -> MethodKey:
        """Inverse of :attr:`label` (a label without a direction suffix has no direction)."""
        method, _, direction = label.rpartition("_")
        return cls(method, direction) if method and direction in DIRECTIONS else cls(label)

    def __str__(self) -> str:
        """``canonical store``: the key as verification results and messages show it."""
        return self.method if self.direction is None else f"{self.method} {self.direction}"

    @classmethod
    def from_str(cls, text: str) -> MethodKey:
        """Inverse of :meth:`__str__`."""
        method, _, direction = text.rpartition(" ")
        return cls(method, direction) if method and direction in DIRECTIONS else cls(text)


def verification_to_json(verification: dict[str, dict[MethodKey, str]]) -> dict:
    """``{case: {MethodKey: status}}`` as JSON: ``{case: {"canonical store": status}}``."""
    return {case: {str(k): v for k, v in checks.items()} for case, checks in verification.items()}


def verification_from_json(verification: dict) -> dict[str, dict[MethodKey, str]]:
    """Inverse of :func:`verification_to_json`."""
    return {
        case: {MethodKey.from_str(k): v for k, v in checks.items()}
        for case, checks in verification.items()
    }


def results_to_json(results: dict) -> dict:
    """A copy of in-memory ``results`` whose every key is a string (the on-disk format).

    Parameters
    ----------
    results
        As bench_transfer.py builds them: sweep points and verification keyed by
        :class:`MethodKey`.

    Returns
    -------
    dict
        Ready for ``json.dumps``; keys in the order they were inserted.
    """
    out = dict(results)
    for section in ("blocks_sweep", "layers_sweep"):
        if section in results:
            out[section] = [_host_point_to_json(p) for p in results[section]]
    if "sm_sweep" in results:
        out["sm_sweep"] = [_sm_point_to_json(p) for p in results["sm_sweep"]]
    if "verification" in results:
        out["verification"] = verification_to_json(results["verification"])
    return out


def results_from_json(results: dict) -> dict:
    """In-memory results from a JSON results file (inverse of :func:`results_to_json`)."""
    out = dict(results)
    for section in ("blocks_sweep", "layers_sweep"):
        if section in results:
            out[section] = [_host_point_from_json(p) for p in results[section]]
    if "sm_sweep" in results:
        out["sm_sweep"] = [_sm_point_from_json(p) for p in results["sm_sweep"]]
    if "verification" in results:
        out["verification"] = verification_from_json(results["verification"])
    return out


def _host_point_to_json(point: dict) -> dict:
    return {
        name: {k.label: v for k, v in value.items()} if name in ("methods", "errors") else value
        for name, value in point.items()
    }


def _host_point_from_json(point: dict) -> dict:
    return {
        name: {MethodKey.from_label(k): v for k, v in value.items()}
        if name in ("methods", "errors")
        else value
        for name, value in point.items()
    }


def _sm_point_to_json(point: dict) -> dict:
    out: dict = {}
    for name, value in point.items():
        if name == "methods":
            out.update((k.label, v) for k, v in value.items())
        else:
            out[name] = value
    return out


def _sm_point_from_json(point: dict) -> dict:
    out: dict = {"methods": {}}
    for name, value in point.items():
        key = MethodKey.from_label(name)
        if key.direction is not None:
            out["methods"][key] = value
        else:
            out[name] = value
    out["methods"] = out.pop("methods")  # after the point's own fields, as when measured
    return out


def goal_row(goal: str, measured: float, target: float, *, at_most: bool = False, digits: int = 3):
    """One row of a benchmark's ``goals`` list (what bench/summary.py prints): met when
    ``measured >= target`` (``at_most``: when ``<=``)."""
    met = measured <= target if at_most else measured >= target
    return dict(goal=goal, measured=round(measured, digits), target=target, met=bool(met))
