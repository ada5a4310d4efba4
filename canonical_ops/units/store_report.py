"""What ``python -m canonical_ops store stats|verify|gc`` reads and prints, the same for file
stores (:mod:`.cli`) and Redis / Valkey (:mod:`.redis_cli`): a stored namespace description
checked before use, one ``stats`` item per namespace, and the reports. Human lines show every
text from a store, a path or a server through :func:`layouts.cli.escape_text` (one line each,
no terminal control); ``--json`` keeps the exact values."""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterable
from typing import Any

from layouts.cli import escape_text

from .auth import StoreSecret
from .namespace import StoreNamespace

__all__ = [
    "MAX_DESCRIPTION",
    "parse_namespace",
    "print_error",
    "print_gc",
    "print_stats",
    "print_verify",
    "read_namespace",
    "stats_item",
]

MAX_DESCRIPTION = 16 << 20  # a namespace description is a few KiB; bound what is read


def parse_namespace(raw: Any, limit: int = MAX_DESCRIPTION) -> StoreNamespace:
    """The namespace a stored description (bytes of at most ``limit``) describes; ValueError
    for anything else, a JSON text nested past the parser's depth included (json raises
    RecursionError there: a store CLI or a reader must report it, not die on it)."""
    if not isinstance(raw, bytes) or len(raw) > limit:
        raise ValueError(f"expected a JSON text of at most {limit} bytes")
    try:
        return StoreNamespace.from_description(json.loads(raw))
    except RecursionError:
        raise ValueError("nested too deep to be a namespace description") from None


def read_namespace(raw: Any, digest_hex: str, owner: str) -> tuple[StoreNamespace | None, str]:
    """The namespace a stored description (bytes, or the error reading it) describes and
    its problem. Never trusted: it must be the namespace its ``owner`` (directory, key)
    names by ``digest_hex``; an authenticated one needs the environment's secret."""
    try:
        if isinstance(raw, Exception):
            raise ValueError(raw)
        namespace = parse_namespace(raw)
    except (ValueError, UnicodeDecodeError) as error:
        return None, f"unreadable namespace description ({error})"
    if not namespace.hex.startswith(digest_hex):
        return None, f"describes namespace {namespace.hex[:16]}..., not its {owner}"
    secret = StoreSecret.from_env() if namespace.key_id else None
    if secret is not None and secret.key_id == namespace.key_id:
        return namespace.authenticated(secret), ""
    no_key = "authenticated; set CANONICAL_KV_STORE_SECRET(_FILE) to its key (no secret here)"
    return namespace, no_key if namespace.key_id else ""


def print_error(line: str) -> int:
    """``line`` on stderr, escaped (a path or a server's reply in it may hold any character);
    the exit code 2."""
    print(escape_text(line), file=sys.stderr)
    return 2


def _emit(as_json: bool, report: dict, lines: Iterable[str], code: int = 0) -> int:
    """``report`` as JSON (exact values), or ``lines`` each escaped into one line."""
    print(json.dumps(report, indent=1) if as_json else "\n".join(map(escape_text, lines)))
    return code


def stats_item(
    hex_: str, ns: StoreNamespace | None, problem: str, units: list, **more: Any
) -> dict:
    """``stats`` of a namespace (None: unknown) from its ``(kd, first, end, bytes, ...)`` units."""
    ranges = Counter(f"{unit[1]}-{unit[2]}" for unit in units)
    return {
        "namespace": ns.hex if ns else hex_,
        "model": ns and ns.model.name,
        "revision": ns and ns.model.revision,
        "extra": dict(ns.model.extra) if ns else None,
        "format_id": ns and ns.format_id,
        "kv_quant": ns and ns.kv_quant,
        "num_layers": ns and ns.num_layers,
        "authenticated": bool(ns.key_id) if ns else None,
        "units": len(units),
        "bytes": sum(unit[3] for unit in units),
        "keys": len({unit[0] for unit in units}),
        "layer_ranges": dict(sorted(ranges.items())),
        **more,
        "problem": problem or None,
    }


def print_stats(where: dict, items: list[dict], as_json: bool, note: str = "") -> int:
    """``where`` (the target first, then JSON-only fields), then each :func:`stats_item`."""
    lines = [f"{next(iter(where.values()))}: {len(items)} namespace(s){note}"]
    for item in items:
        auth = " authenticated" if item["authenticated"] else ""
        extra = item.get("extra")  # what else tells two namespaces of one model apart
        extra = f" extra={json.dumps(extra, sort_keys=True, ensure_ascii=False)}" if extra else ""
        lines.append(
            f"  {item['namespace'][:16]}  model={item['model'] or '?'} "
            f"rev={item['revision'] or '-'}{extra} format={item['format_id'] or '?'} "
            f"layers={item['num_layers'] or '?'}{auth}"
        )
        names = [k for k in ("temp_files", "quarantined_files") if k in item]
        files = "".join(f" {k.removesuffix('_files')}={item[k]}" for k in names)
        lines.append(f"    units={item['units']} bytes={item['bytes']} keys={item['keys']}{files}")
        if item["layer_ranges"]:
            ranges = ", ".join(f"[{r}): {n}" for r, n in item["layer_ranges"].items())
            lines.append(f"    layer ranges: {ranges}")
        if item["problem"]:
            lines.append(f"    PROBLEM: {item['problem']}")
    return _emit(as_json, {**where, "namespaces": items}, lines)


def print_verify(where: dict, spaces: int, checked: int, bad: list[dict], as_json: bool) -> int:
    """``verify``'s report: ``bad`` items name the unit (``path`` or ``key``), then why."""
    noun = "unit file(s)" if "directory" in where else "unit(s)"
    target = next(iter(where.values()))
    lines = [f"{target}: {checked} {noun} in {spaces} namespace(s) checked, {len(bad)} bad"]
    lines += [f"BAD {next(iter(item.values()))}: {item['reason']}" for item in bad]
    report = {"namespaces": spaces, "checked": checked, "bad_count": len(bad), "bad": bad}
    return _emit(as_json, {**where, **report, "ok": not bad}, lines, 1 if bad else 0)


def print_gc(where: dict, report: dict, left: tuple, listing: list[str], as_json: bool) -> int:
    """``gc``'s report (``dry_run``, ``capacity_bytes``, ``units_evicted``, ``bytes_evicted``
    and optional ``temps_removed``), ``left`` (units, bytes), ``listing`` (dry run)."""
    dry, removed = report["dry_run"], "would remove" if report["dry_run"] else "removed"
    temps = (
        f", {removed} {report['temps_removed']} temp file(s)" if "temps_removed" in report else ""
    )
    lines = [
        f"{next(iter(where.values()))}: {'would evict' if dry else 'evicted'} "
        f"{report['units_evicted']} unit(s) ({report['bytes_evicted']} bytes){temps}; "
        f"{left[0]} unit(s), {left[1]} bytes left (capacity {report['capacity_bytes']})",
        *(f"  {line}" for line in listing),
    ]
    return _emit(as_json, {**where, **report}, lines)
