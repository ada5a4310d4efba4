"""``python -m canonical_ops store stats|verify|gc TARGET``: inspect and maintain a store.

``TARGET`` is a file store root, one namespace directory, or a Redis / Valkey URL
(``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://``: handed to
:mod:`.redis_cli`; printed with its password redacted). Exit codes: ``verify`` 0 when
every unit and ``namespace.json`` checks, else 1 with each bad path; ``stats``/``gc`` 0;
2 for bad arguments (one line, never a traceback). ``--json`` prints one JSON object;
``gc --dry-run`` lists what it would remove. Directories are walked as the store walks
them (:mod:`.fsutil`): a symlink, FIFO or another user's directory is reported, never
followed, read or cleaned.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict

from layouts.cli import CliParser

from .auth import StoreSecret
from .files import NAMESPACE_FILE, QUARANTINE_DIR, TMP_DIR, GcReport
from .fsutil import Perms, clean_temps, open_dir, open_file
from .namespace import StoreNamespace, is_namespace_hex
from .policy import Entry, LruPolicy
from .unit import CorruptUnit, peek_header
from .unitfile import Found, check_unit, iter_units

__all__ = ["main", "parse_size", "print_stats", "redact"]

_SIZE = re.compile(r"\s*(\d+)\s*(?:([KMGT])(?:i?B)?|B)?\s*", re.IGNORECASE)
_URL = re.compile(r"(?i)(rediss?|unix|rediss?\+cluster)://")
_MAX_NAMESPACE_FILE = 16 << 20  # a namespace.json is a few KiB; bound what is read


def parse_size(text: str) -> int:
    """Bytes from ``"1073741824"``, ``"1G"``, ``"512MiB"``, ``"64k"`` (powers of 1024);
    ``ValueError`` for anything else."""
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"expected a byte count like 1073741824, 64K, 512MiB or 1G, got {text!r}")
    return int(match[1]) * 1024 ** " KMGT".index((match[2] or " ").upper())


def redact(url: str) -> str:
    """``url`` without its credentials: userinfo up to the last ``@`` (unencoded ``/ # ?``
    included) and any ``password=`` query value."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.rsplit("@", 1)[1]
    return re.sub(r"(?i)(password=)[^&#]*", r"\1***", scheme + sep + rest)


class _Ns:
    """One namespace directory: its descriptor, its namespace (None: unknown) and problem."""

    def __init__(self, path: str, fd: int | None, namespace: StoreNamespace | None, problem: str):
        self.path, self.fd, self.namespace, self.problem = path, fd, namespace, problem
        self.hex = os.path.basename(path)


def _describe(fd: int, path: str, hex_: str) -> tuple[StoreNamespace | None, str]:
    file = f"{path}/{NAMESPACE_FILE}"
    try:
        nfd, _ = open_file(fd, NAMESPACE_FILE)
        try:
            raw = os.read(nfd, _MAX_NAMESPACE_FILE + 1)
        finally:
            os.close(nfd)
        if len(raw) > _MAX_NAMESPACE_FILE:
            raise ValueError(f"larger than {_MAX_NAMESPACE_FILE} bytes")
        namespace = StoreNamespace.from_description(json.loads(raw))
    except (OSError, ValueError, UnicodeDecodeError) as error:
        return None, f"{file}: unreadable namespace ({error})"
    if namespace.hex != hex_:
        return None, f"{file}: describes namespace {namespace.hex}, not its directory"
    if namespace.key_id:
        secret = StoreSecret.from_env()
        if secret is None or secret.key_id != namespace.key_id:
            return None, f"{file}: authenticated; set CANONICAL_KV_STORE_SECRET(_FILE) to its key"
        namespace = namespace.authenticated(secret)
    return namespace, ""


@contextlib.contextmanager
def _namespaces(target: str, perms: Perms) -> Iterator[list[_Ns]]:
    """The namespace directories of a root (or the one given), opened safely."""
    single = os.path.isfile(os.path.join(target, NAMESPACE_FILE))
    parent = os.path.dirname(target) if single else target
    root = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    out: list[_Ns] = []
    try:
        names = [os.path.basename(target)] if single else sorted(os.listdir(root))
        for name in names:
            if not (single or is_namespace_hex(name)):
                continue
            path = os.path.join(parent, name)
            try:
                fd = open_dir(root, name, perms, what=path)
            except OSError as error:
                out.append(_Ns(path, None, None, f"{path}: unsafe, not used ({error.strerror})"))
                continue
            out.append(_Ns(path, fd, *_describe(fd, path, name)))
        yield out
    finally:
        for ns in out:
            if ns.fd is not None:
                os.close(ns.fd)
        os.close(root)


def _path(ns: _Ns, found: Found) -> str:
    where = found.name if found.dir_fd < 0 else f"{found.kd[:2]}/{found.kd}/{found.name}"
    return f"{ns.path}/{where}"


def _count(ns: _Ns, name: str) -> int:
    with contextlib.suppress(OSError):
        fd = open_dir(ns.fd, name, Perms(True))
        if fd is not None:
            try:
                return sum(1 for e in os.scandir(fd) if e.is_file(follow_symlinks=False))
            finally:
                os.close(fd)
    return 0


def _stats(target: str, perms: Perms, as_json: bool) -> int:
    report = []
    with _namespaces(target, perms) as namespaces:
        for ns in namespaces:
            units = nbytes = 0
            keys, ranges = set(), Counter()
            for found in iter_units(ns.fd, perms) if ns.fd is not None else ():
                with contextlib.suppress(OSError):
                    st = os.stat(found.name, dir_fd=found.dir_fd, follow_symlinks=False)
                    if not found.problem:
                        units, nbytes = units + 1, nbytes + st.st_size
                        keys.add(found.kd)
                        ranges[f"{found.first}-{found.end}"] += 1
            n = ns.namespace
            report.append(
                {
                    "namespace": ns.hex,
                    "path": ns.path,
                    "model": n and n.model.name,
                    "revision": n and n.model.revision,
                    "format_id": n and n.format_id,
                    "kv_quant": n and n.kv_quant,
                    "num_layers": n and n.num_layers,
                    "authenticated": bool(n and n.key_id),
                    "units": units,
                    "bytes": nbytes,
                    "keys": len(keys),
                    "layer_ranges": dict(sorted(ranges.items())),
                    "temp_files": _count(ns, TMP_DIR) if ns.fd is not None else 0,
                    "quarantined_files": _count(ns, QUARANTINE_DIR) if ns.fd is not None else 0,
                    "problem": ns.problem or None,
                }
            )
    return print_stats(target, report, as_json)


def print_stats(target: str, report: list[dict], as_json: bool) -> int:
    """Print ``stats`` of namespaces (dicts with namespace, model, revision, format_id,
    num_layers, units, bytes, keys, layer_ranges, problem and optional authenticated,
    temp_files, quarantined_files): one JSON object or text. The Redis tool shares it."""
    if as_json:
        print(json.dumps({"directory": target, "namespaces": report}, indent=1))
        return 0
    print(f"{target}: {len(report)} namespace(s)")
    for item in report:
        auth = " authenticated" if item.get("authenticated") else ""
        print(
            f"  {item['namespace'][:16]}  model={item['model'] or '?'} "
            f"rev={item['revision'] or '-'} format={item['format_id'] or '?'} "
            f"layers={item['num_layers'] or '?'}{auth}"
        )
        files = "".join(f" {k}={item[k]}" for k in ("temp_files", "quarantined_files") if k in item)
        files = files.replace("temp_files", "temp").replace("quarantined_files", "quarantined")
        print(f"    units={item['units']} bytes={item['bytes']} keys={item['keys']}{files}")
        if item["layer_ranges"]:
            ranges = ", ".join(f"[{r}): {n}" for r, n in item["layer_ranges"].items())
            print(f"    layer ranges: {ranges}")
        if item["problem"]:
            print(f"    PROBLEM: {item['problem']}")
    return 0


def _verify(target: str, perms: Perms, as_json: bool) -> int:
    bad: list[dict[str, str]] = []
    checked = 0
    with _namespaces(target, perms) as namespaces:
        for ns in namespaces:
            if ns.problem:
                bad.append(
                    {
                        "path": ns.path if ns.fd is None else f"{ns.path}/{NAMESPACE_FILE}",
                        "reason": ns.problem,
                    }
                )
            for found in iter_units(ns.fd, perms) if ns.fd is not None else ():
                checked += 1
                reason = found.problem
                try:
                    if not reason:
                        fd, st = open_file(found.dir_fd, found.name)
                        try:
                            check_unit(
                                fd,
                                st.st_size,
                                ns.namespace,
                                found,
                                digest=bytes.fromhex(ns.hex),
                                full=True,
                            )
                        finally:
                            os.close(fd)
                except CorruptUnit as error:
                    reason = error.reason
                except FileNotFoundError:
                    checked -= 1  # evicted while we looked: not a bad file
                except OSError as error:
                    reason = f"unreadable: {error.strerror}"
                if reason:
                    bad.append({"path": _path(ns, found), "reason": reason})
    if as_json:
        print(
            json.dumps(
                {
                    "directory": target,
                    "namespaces": len(namespaces),
                    "checked": checked,
                    "bad_count": len(bad),
                    "bad": bad,
                    "ok": not bad,
                },
                indent=1,
            )
        )
    else:
        print(
            f"{target}: {checked} unit file(s) in {len(namespaces)} namespace(s) checked, "
            f"{len(bad)} bad"
        )
        for item in bad:
            print(f"BAD {item['path']}: {item['reason']}")
    return 1 if bad else 0


def _entries(ns: _Ns, perms: Perms) -> list[Entry]:
    """The units of a namespace for the eviction order (headers read for positions)."""
    entries = []
    for found in iter_units(ns.fd, perms):
        if found.problem:
            continue
        with contextlib.suppress(OSError):
            fd, st = open_file(found.dir_fd, found.name)
            try:
                position = peek_header(os.pread(fd, 1120, 0)).position
            except CorruptUnit:
                position = 0  # `store verify` reports it; gc only needs an order
            finally:
                os.close(fd)
            last = max(st.st_atime_ns, st.st_mtime_ns)
            where = (ns, _path(ns, found), found.kd)
            kd = f"{ns.hex}/{found.kd}"  # one order over every namespace
            entries.append(
                Entry(b"", kd, found.first, found.end, st.st_size, position, last, where)
            )
    return entries


def _remove(entry: Entry, perms: Perms) -> int:
    """Unlink a unit through its directories' descriptors; the bytes freed."""
    ns, _, kd = entry.where
    with contextlib.suppress(OSError):
        fanout = open_dir(ns.fd, kd[:2], perms)
        try:
            keydir = open_dir(fanout, kd, perms)
            try:
                os.unlink(f"{entry.first}-{entry.end}.ckv", dir_fd=keydir)
            finally:
                os.close(keydir)
            with contextlib.suppress(OSError):  # not empty: fine
                os.rmdir(kd, dir_fd=fanout)
            return entry.size
        finally:
            os.close(fanout)
    return 0


def _gc(target: str, perms: Perms, capacity: int, as_json: bool, dry_run: bool) -> int:
    policy, temps, entries = LruPolicy(1.0), 0, []
    with _namespaces(target, perms) as namespaces:
        for ns in namespaces:
            if ns.fd is None:
                continue
            with contextlib.suppress(OSError):  # a symlinked tmp/ is never cleaned
                tmp = open_dir(ns.fd, TMP_DIR, perms)
                if tmp is not None:
                    try:
                        temps += clean_temps(tmp, 3600.0, dry_run=dry_run)
                    finally:
                        os.close(tmp)
            entries += _entries(ns, perms)
        for entry in sorted(entries, key=lambda e: e.last_used):
            policy.add(entry)
        victims = policy.victims(policy.bytes - capacity) if policy.bytes > capacity else []
        freed = sum(v.size if dry_run else _remove(v, perms) for v in victims)
    paths = tuple(v.where[1] for v in victims)
    report = GcReport(
        len(victims),
        freed,
        temps,
        0,
        len(policy) - len(victims),
        policy.bytes - freed,
        paths if dry_run else (),
    )
    if as_json:
        print(
            json.dumps(
                {
                    "directory": target,
                    "capacity_bytes": capacity,
                    "dry_run": dry_run,
                    **asdict(report),
                }
            )
        )
        return 0
    verb = "would evict" if dry_run else "evicted"
    print(
        f"{target}: {verb} {report.units_evicted} unit(s) ({report.bytes_evicted} bytes), "
        f"{'would remove' if dry_run else 'removed'} {report.temps_removed} temp file(s); "
        f"{report.units_on_disk} unit(s), {report.bytes_on_disk} bytes left "
        f"(capacity {capacity})"
    )
    for path in report.evicted:
        print(f"  {path}")
    return 0


def _parser() -> CliParser:
    parser = CliParser(
        prog="python -m canonical_ops store",
        description="Inspect and maintain a canonical-kv store (files or Redis / Valkey).",
    )
    sub = parser.add_subparsers(dest="command", parser_class=CliParser)
    for name, text in (
        ("stats", "namespaces, unit counts, bytes, keys, layer ranges"),
        ("verify", "check every unit; exit 1 and list the bad ones"),
        ("gc", "evict least recently used units (tails first) down to --capacity"),
    ):
        command = sub.add_parser(name, help=text, description=text)
        command.add_argument(
            "target", metavar="TARGET", help="store root, namespace directory or redis:// URL"
        )
        command.add_argument("--json", action="store_true", help="print one JSON object")
        command.add_argument(
            "--group-shared",
            action="store_true",
            help="trust directories of the user's groups (group_shared stores)",
        )
        if name == "gc":
            command.add_argument(
                "--capacity",
                type=_capacity,
                required=True,
                metavar="BYTES",
                help="e.g. 500G, 1TiB, 1048576",
            )
            command.add_argument("--dry-run", action="store_true", help="list, remove nothing")
    return parser


def _capacity(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def main(argv: list[str] | None = None) -> int:
    """Run ``store`` with ``argv`` (without the ``store`` word); returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.fail("expected a command: stats, verify or gc")
        if _URL.match(args.target):
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


def _redis(args) -> int:
    try:
        from .redis_cli import run
    except ImportError:
        print(
            f"store {args.command} for Redis needs canonical_ops.units.redis_cli", file=sys.stderr
        )
        return 2
    return run(
        args.command,
        args.target,
        as_json=args.json,
        dry_run=getattr(args, "dry_run", False),
        capacity=getattr(args, "capacity", None),
    )
