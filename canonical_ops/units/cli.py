"""``python -m canonical_ops store stats|verify|gc TARGET``: inspect and maintain a store.

``TARGET``: a file store root, one namespace directory, or a Redis / Valkey URL (read by
:mod:`.redis_cli`, printed redacted). Exit codes: 0; ``verify`` 1 when a unit or namespace
description is bad (each listed); 2 for bad arguments (one line, no traceback). ``--json``
prints one object. Directories are walked as the store walks them: a symlink, FIFO or
another user's directory is reported, never followed, read or cleaned.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from typing import Any, NamedTuple

from layouts.cli import CliParser

from .auth import StoreSecret
from .files import NAMESPACE_FILE, QUARANTINE_DIR, TMP_DIR, GcReport
from .fsutil import Perms, clean_temps, open_dir, open_file
from .namespace import StoreNamespace, is_namespace_hex
from .policy import Entry, LruPolicy
from .redis_url import REDIS_SCHEMES
from .unit import CorruptUnit, peek_header
from .unitfile import Found, check_unit, iter_units

__all__ = [
    "main",
    "parse_size",
    "print_gc",
    "print_stats",
    "print_verify",
    "read_namespace",
    "stats_item",
]

_SIZE = re.compile(r"\s*(\d+)\s*(?:([KMGT])(?:i?B)?|B)?\s*", re.IGNORECASE)
MAX_DESCRIPTION = 16 << 20  # a namespace description is a few KiB; bound what is read


def parse_size(text: str) -> int:
    """Bytes from ``"1073741824"``, ``"1G"``, ``"512MiB"``, ``"64k"`` (powers of 1024);
    ``ValueError`` for anything else."""
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"expected a byte count like 1073741824, 64K, 512MiB or 1G, got {text!r}")
    return int(match[1]) * 1024 ** " KMGT".index((match[2] or " ").upper())


def read_namespace(raw: Any, digest_hex: str, owner: str) -> tuple[StoreNamespace | None, str]:
    """The namespace a stored description (bytes, or the error reading it) describes and
    its problem. Never trusted: it must be the namespace its ``owner`` (directory, key)
    names by ``digest_hex``; an authenticated one needs the environment's secret."""
    try:
        if isinstance(raw, Exception):
            raise ValueError(raw)
        if not isinstance(raw, bytes) or len(raw) > MAX_DESCRIPTION:
            raise ValueError(f"expected a JSON text of at most {MAX_DESCRIPTION} bytes")
        namespace = StoreNamespace.from_description(json.loads(raw))
    except (ValueError, UnicodeDecodeError) as error:
        return None, f"unreadable namespace description ({error})"
    if not namespace.hex.startswith(digest_hex):
        return None, f"describes namespace {namespace.hex[:16]}..., not its {owner}"
    secret = StoreSecret.from_env() if namespace.key_id else None
    if secret is not None and secret.key_id == namespace.key_id:
        return namespace.authenticated(secret), ""
    no_key = "authenticated; set CANONICAL_KV_STORE_SECRET(_FILE) to its key (no secret here)"
    return namespace, no_key if namespace.key_id else ""


# ---------------------------------------------------------------- printing (files and Redis)


def _emit(as_json: bool, report: dict, lines: Iterable[str], code: int = 0) -> int:
    print(json.dumps(report, indent=1) if as_json else "\n".join(lines))
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
        lines.append(
            f"  {item['namespace'][:16]}  model={item['model'] or '?'} "
            f"rev={item['revision'] or '-'} format={item['format_id'] or '?'} "
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


# ---------------------------------------------------------------- file stores


class _Ns(NamedTuple):
    """One namespace directory: path, name (hex), descriptor, namespace (None: unknown), problem."""

    path: str
    hex: str
    fd: int | None
    namespace: StoreNamespace | None
    problem: str


@contextlib.contextmanager
def _closing(fd: int | None) -> Iterator[int | None]:
    """Descriptor ``fd`` (None: none), closed on leaving."""
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def _description(fd: int) -> Any:
    try:
        with _closing(open_file(fd, NAMESPACE_FILE)[0]) as nfd:
            return os.read(nfd, MAX_DESCRIPTION + 1)
    except OSError as error:
        return error


@contextlib.contextmanager
def _namespaces(target: str, perms: Perms) -> Iterator[list[_Ns]]:
    """The namespace directories of a root (or the one given), opened safely."""
    single = os.path.isfile(os.path.join(target, NAMESPACE_FILE))
    parent = os.path.dirname(target) if single else target
    root = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    out: list[_Ns] = []
    try:
        names = [os.path.basename(target)] if single else sorted(os.listdir(root))
        for name in (n for n in names if single or is_namespace_hex(n)):
            path = os.path.join(parent, name)
            try:
                fd = open_dir(root, name, perms, what=path)
            except OSError as error:
                problem = f"{path}: unsafe, not used ({error.strerror})"
                out.append(_Ns(path, name, None, None, problem))
                continue
            namespace, problem = read_namespace(_description(fd), name, "directory")
            problem = problem and f"{path}/{NAMESPACE_FILE}: {problem}"
            out.append(_Ns(path, name, fd, namespace, problem))
        yield out
    finally:
        for fd in (ns.fd for ns in out if ns.fd is not None):
            os.close(fd)
        os.close(root)


def _units(ns: _Ns, perms: Perms) -> Iterator[Found]:
    return iter_units(ns.fd, perms) if ns.fd is not None else iter(())


def _path(ns: _Ns, found: Found) -> str:
    where = found.name if found.dir_fd < 0 else f"{found.kd[:2]}/{found.kd}/{found.name}"
    return f"{ns.path}/{where}"


def _count(ns: _Ns, name: str) -> int:
    """Regular files in directory ``name`` of a namespace (0: none, or unsafe)."""
    if ns.fd is None:
        return 0
    with contextlib.suppress(OSError), _closing(open_dir(ns.fd, name, Perms(True))) as fd:
        return 0 if fd is None else sum(e.is_file(follow_symlinks=False) for e in os.scandir(fd))
    return 0


def _stats(target: str, perms: Perms, as_json: bool) -> int:
    items = []
    with _namespaces(target, perms) as namespaces:
        for ns in namespaces:
            units = []
            for found in _units(ns, perms):
                with contextlib.suppress(OSError):
                    st = os.stat(found.name, dir_fd=found.dir_fd, follow_symlinks=False)
                    if not found.problem:
                        units.append((found.kd, found.first, found.end, st.st_size))
            files = {"temp_files": _count(ns, TMP_DIR)}
            files["quarantined_files"] = _count(ns, QUARANTINE_DIR)
            items.append(stats_item(ns.hex, ns.namespace, ns.problem, units, path=ns.path, **files))
    return print_stats({"directory": target}, items, as_json)


def _verify(target: str, perms: Perms, as_json: bool) -> int:
    bad: list[dict[str, str]] = []
    checked = 0
    with _namespaces(target, perms) as namespaces:
        for ns in namespaces:
            if ns.problem:
                path = ns.path if ns.fd is None else f"{ns.path}/{NAMESPACE_FILE}"
                bad.append({"path": path, "reason": ns.problem})
            for found in _units(ns, perms):
                checked += 1
                reason = found.problem
                try:
                    if not reason:
                        fd, st = open_file(found.dir_fd, found.name)
                        with _closing(fd):
                            digest = bytes.fromhex(ns.hex)
                            check_unit(
                                fd, st.st_size, ns.namespace, found, digest=digest, full=True
                            )
                except CorruptUnit as error:
                    reason = error.reason
                except FileNotFoundError:
                    checked -= 1  # evicted while we looked: not a bad file
                except OSError as error:
                    reason = f"unreadable: {error.strerror}"
                if reason:
                    bad.append({"path": _path(ns, found), "reason": reason})
    return print_verify({"directory": target}, len(namespaces), checked, bad, as_json)


def _entries(ns: _Ns, perms: Perms) -> list[Entry]:
    """The units of a namespace for the eviction order (headers read for positions)."""
    entries = []
    for found in _units(ns, perms):
        if found.problem:
            continue
        with contextlib.suppress(OSError):
            fd, st = open_file(found.dir_fd, found.name)
            with _closing(fd):
                try:
                    position = peek_header(os.pread(fd, 1120, 0)).position
                except CorruptUnit:
                    position = 0  # `store verify` reports it; gc only needs an order
            # "<namespace>/<kd>": one eviction order over every namespace
            unit = (f"{ns.hex}/{found.kd}", found.first, found.end, st.st_size, position)
            last, where = max(st.st_atime_ns, st.st_mtime_ns), (ns, _path(ns, found), found.kd)
            entries.append(Entry(b"", *unit, last, where))
    return entries


def _remove(entry: Entry, perms: Perms) -> int:
    """Unlink a unit through its directories' descriptors; the bytes freed."""
    ns, _, kd = entry.where
    with contextlib.suppress(OSError), _closing(open_dir(ns.fd, kd[:2], perms)) as fanout:
        with _closing(open_dir(fanout, kd, perms)) as keydir:
            os.unlink(f"{entry.first}-{entry.end}.ckv", dir_fd=keydir)
        with contextlib.suppress(OSError):  # not empty: fine
            os.rmdir(kd, dir_fd=fanout)
        return entry.size
    return 0


def _gc(target: str, perms: Perms, capacity: int, as_json: bool, dry_run: bool) -> int:
    policy, temps, entries = LruPolicy(1.0), 0, []
    with _namespaces(target, perms) as namespaces:
        for ns in (ns for ns in namespaces if ns.fd is not None):
            # a symlinked tmp/ is never cleaned
            with contextlib.suppress(OSError), _closing(open_dir(ns.fd, TMP_DIR, perms)) as tmp:
                temps += clean_temps(tmp, 3600.0, dry_run=dry_run) if tmp is not None else 0
            entries += _entries(ns, perms)
        for entry in sorted(entries, key=lambda e: e.last_used):
            policy.add(entry)
        victims = policy.victims(policy.bytes - capacity) if policy.bytes > capacity else []
        freed = sum(v.size if dry_run else _remove(v, perms) for v in victims)
    paths = [v.where[1] for v in victims] if dry_run else []
    left = (len(policy) - len(victims), policy.bytes - freed)
    report = GcReport(len(victims), freed, temps, 0, *left, tuple(paths))
    fields = {"capacity_bytes": capacity, "dry_run": dry_run, **asdict(report)}
    return print_gc({"directory": target}, fields, left, paths, as_json)


# ---------------------------------------------------------------- the command line


def _parser() -> CliParser:
    description = "Inspect and maintain a canonical-kv store (files or Redis / Valkey)."
    parser = CliParser(prog="python -m canonical_ops store", description=description)
    sub = parser.add_subparsers(dest="command", parser_class=CliParser)
    for name, text in (
        ("stats", "namespaces, unit counts, bytes, keys, layer ranges"),
        ("verify", "check every unit; exit 1 and list the bad ones"),
        ("gc", "evict least recently used units (tails first) down to --capacity"),
    ):
        add = sub.add_parser(name, help=text, description=text).add_argument
        add("target", metavar="TARGET", help="store root, namespace directory or redis:// URL")
        add("--json", action="store_true", help="print one JSON object")
        add("--group-shared", action="store_true", help="trust directories of the user's groups")
        if name == "gc":
            add("--capacity", type=_capacity, required=True, metavar="BYTES", help="e.g. 500G")
            add("--dry-run", action="store_true", help="list, remove nothing")
    return parser


def _capacity(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def main(argv: list[str] | None = None) -> int:
    """Run ``store`` with ``argv`` (without the ``store`` word); returns the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)  # None: sys.argv[1:]
        if args.command is None:
            parser.fail("expected a command: stats, verify or gc")
        if "://" in args.target and args.target.split("://")[0].lower() in REDIS_SCHEMES:
            return _redis(args)
        target = os.path.abspath(args.target)
        if not os.path.isdir(target):
            parser.fail(
                f"TARGET: expected a store directory or a Redis URL, {args.target!r} is neither"
            )
    except SystemExit as exit_:  # usage errors (2) and --help (0)
        return exit_.code if isinstance(exit_.code, int) else 0
    perms = Perms(args.group_shared)
    try:
        if args.command == "gc":
            return _gc(target, perms, args.capacity, args.json, args.dry_run)
        return (_stats if args.command == "stats" else _verify)(target, perms, args.json)
    except (OSError, ValueError) as error:
        print(f"python -m canonical_ops store {args.command}: {error}", file=sys.stderr)
        return 2


def _redis(args: argparse.Namespace) -> int:
    try:
        from .redis_cli import run
    except ImportError:
        print(f"store {args.command} for Redis needs {__package__}.redis_cli", file=sys.stderr)
        return 2
    gc = {"dry_run": getattr(args, "dry_run", False), "capacity": getattr(args, "capacity", None)}
    return run(args.command, args.target, as_json=args.json, **gc)
