"""``python -m canonical_ops store stats|verify|gc TARGET``: inspect and maintain a store.

``TARGET``: a file store root, one namespace directory, or a Redis / Valkey URL (read by
:mod:`.redis_cli`, printed redacted). Exit codes: 0; ``verify`` 1 when a unit or namespace
description is bad (each listed); 2 for bad arguments (one line, no traceback). ``--json``
prints one object. Directories are walked as the store walks them: a symlink, FIFO or
another user's directory is reported, never followed, read or cleaned; a root TARGET that is
a symlink, another user's, or writable by every user and not sticky is refused (2).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any, NamedTuple

from layouts.cli import CliParser

from .files import NAMESPACE_FILE, QUARANTINE_DIR, TMP_DIR, GcReport
from .fsutil import Perms, clean_temps, open_dir, open_file, open_tree
from .namespace import StoreNamespace, is_namespace_hex
from .policy import Entry, LruPolicy
from .redis_url import REDIS_SCHEMES, redact_url
from .store_report import (
    MAX_DESCRIPTION,
    print_error,
    print_gc,
    print_stats,
    print_verify,
    read_namespace,
    stats_item,
)
from .unit import CorruptUnit, peek_header
from .unitfile import Found, check_unit, iter_units

__all__ = ["main", "parse_size"]

_SIZE = re.compile(r"\s*(\d+)\s*(?:([KMGT])(?:i?B)?|B)?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``"1073741824"``, ``"1G"``, ``"512MiB"``, ``"64k"`` (powers of 1024);
    ``ValueError`` for anything else."""
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"expected a byte count like 1073741824, 64K, 512MiB or 1G, got {text!r}")
    return int(match[1]) * 1024 ** " KMGT".index((match[2] or " ").upper())


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
    # a namespace.json anyone may plant in a shared root does not make it a namespace
    # directory: a root holds namespace directories, a namespace directory none
    single = os.path.isfile(os.path.join(target, NAMESPACE_FILE))
    single = single and not any(is_namespace_hex(n) for n in os.listdir(target))
    parent = os.path.dirname(target) if single else target
    # a root: not a symlink, another user's or others' to swap (gc deletes through it); a
    # namespace directory's parent is the operator's path, the directory checked by open_dir
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    root = os.open(parent, flags) if single else open_tree(parent, perms)
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
                        with _closing(fd):  # a directory not named by its digest: none
                            digest = bytes.fromhex(ns.hex) if is_namespace_hex(ns.hex) else b""
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
            shown = redact_url(args.target)  # a mistyped scheme's URL: credentials hidden
            parser.fail(f"TARGET: expected a store directory or a Redis URL, {shown!r} is neither")
    except SystemExit as exit_:  # usage errors (2) and --help (0)
        return exit_.code if isinstance(exit_.code, int) else 0
    perms = Perms(args.group_shared)
    try:
        if args.command == "gc":
            return _gc(target, perms, args.capacity, args.json, args.dry_run)
        return (_stats if args.command == "stats" else _verify)(target, perms, args.json)
    except (OSError, ValueError) as error:
        return print_error(f"python -m canonical_ops store {args.command}: {error}")


def _redis(args: argparse.Namespace) -> int:
    try:
        from .redis_cli import run
    except ImportError:
        return print_error(f"store {args.command} for Redis needs {__package__}.redis_cli")
    gc = {"dry_run": getattr(args, "dry_run", False), "capacity": getattr(args, "capacity", None)}
    return run(args.command, args.target, as_json=args.json, **gc)
