"""``python -m canonical_ops store stats|verify|gc DIR``: inspect and maintain a file store.

``DIR`` is a store root (holding namespace directories) or one namespace
directory (holding ``namespace.json``).

Exit codes (the contract)
-------------------------
``verify``
    0 when every unit file checks (size, header, namespace, placement,
    checksum) and every ``namespace.json`` matches its directory; otherwise 1,
    with the count and the path of each bad file.
``stats``, ``gc``
    0 on success.
any command
    2 for bad arguments (one line on stderr, never a traceback).

``--json`` prints one JSON object instead of text. Sizes (``--capacity``)
accept plain byte counts and the suffixes K, M, G, T (powers of 1024; ``KiB``,
``MiB``, ``GiB``, ``TiB`` and a trailing ``B`` mean the same).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass

from layouts.cli import CliParser

from .files import (
    NAMESPACE_FILE,
    QUARANTINE_DIR,
    TMP_DIR,
    check_unit_file,
    gc_directories,
    iter_unit_files,
)
from .namespace import StoreNamespace, is_namespace_hex
from .unit import CorruptUnit

__all__ = ["main", "parse_size"]

_SIZE = re.compile(r"\s*(\d+)\s*(?:([KMGT])(?:i?B)?|B)?\s*", re.IGNORECASE)
_POWERS = {"K": 1, "M": 2, "G": 3, "T": 4}
_MAX_NAMESPACE_FILE = 16 << 20  # a namespace.json is a few KiB; bound what is read


def parse_size(text: str) -> int:
    """Bytes from ``"1073741824"``, ``"1G"``, ``"512MiB"``, ``"64k"`` (powers of 1024).

    Raises
    ------
    ValueError
        Anything else (negative, fractional, unknown suffix).
    """
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"expected a byte count like 1073741824, 64K, 512MiB or 1G, got {text!r}")
    return int(match[1]) * 1024 ** _POWERS.get((match[2] or "").upper(), 0)


def _capacity(text: str) -> int:
    """argparse ``type`` of ``--capacity``."""
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


@dataclass
class _Namespace:
    """One namespace directory and what its namespace.json says."""

    path: str
    hex: str
    namespace: StoreNamespace | None
    problem: str | None


def _load_namespace(path: str) -> _Namespace:
    name = os.path.basename(os.path.normpath(path))
    file = os.path.join(path, NAMESPACE_FILE)
    try:
        with open(file, "rb") as f:
            raw = f.read(_MAX_NAMESPACE_FILE + 1)
        if len(raw) > _MAX_NAMESPACE_FILE:
            raise ValueError(f"larger than {_MAX_NAMESPACE_FILE} bytes")
        namespace = StoreNamespace.from_description(json.loads(raw))
    except (OSError, ValueError, UnicodeDecodeError) as error:
        return _Namespace(path, name, None, f"{file}: unreadable namespace ({error})")
    if namespace.hex != name:
        return _Namespace(
            path, name, None, f"{file}: describes namespace {namespace.hex}, not its directory"
        )
    return _Namespace(path, name, namespace, None)


def _namespaces(directory: str) -> list[_Namespace]:
    if os.path.isfile(os.path.join(directory, NAMESPACE_FILE)):
        return [_load_namespace(directory)]
    return [
        _load_namespace(entry.path)
        for entry in sorted(os.scandir(directory), key=lambda e: e.name)
        if entry.is_dir(follow_symlinks=False) and is_namespace_hex(entry.name)
    ]


def _count_files(path: str) -> int:
    try:
        return sum(1 for e in os.scandir(path) if e.is_file(follow_symlinks=False))
    except FileNotFoundError:
        return 0


def _stats(directory: str, as_json: bool) -> int:
    report = []
    for ns in _namespaces(directory):
        units = nbytes = 0
        keys: set[str] = set()
        ranges: Counter[str] = Counter()
        for unit in iter_unit_files(ns.path):
            if not unit.well_named:
                continue
            try:
                nbytes += os.lstat(unit.path).st_size
            except FileNotFoundError:
                continue
            units += 1
            keys.add(unit.kd)
            ranges[f"{unit.first}-{unit.end}"] += 1
        model = ns.namespace.model if ns.namespace else None
        report.append(
            {
                "namespace": ns.hex,
                "path": ns.path,
                "model": model.name if model else None,
                "revision": model.revision if model else None,
                "format_id": ns.namespace.format_id if ns.namespace else None,
                "kv_quant": ns.namespace.kv_quant if ns.namespace else None,
                "num_layers": ns.namespace.num_layers if ns.namespace else None,
                "units": units,
                "bytes": nbytes,
                "keys": len(keys),
                "layer_ranges": dict(sorted(ranges.items())),
                "temp_files": _count_files(os.path.join(ns.path, TMP_DIR)),
                "quarantined_files": _count_files(os.path.join(ns.path, QUARANTINE_DIR)),
                "problem": ns.problem,
            }
        )
    if as_json:
        print(json.dumps({"directory": directory, "namespaces": report}, indent=1))
        return 0
    print(f"{directory}: {len(report)} namespace(s)")
    for item in report:
        model = item["model"] or "?"
        print(
            f"  {item['namespace'][:16]}  model={model} rev={item['revision'] or '-'} "
            f"format={item['format_id'] or '?'} layers={item['num_layers'] or '?'}"
        )
        print(
            f"    units={item['units']} bytes={item['bytes']} keys={item['keys']} "
            f"temp={item['temp_files']} quarantined={item['quarantined_files']}"
        )
        if item["layer_ranges"]:
            ranges = ", ".join(f"[{r}): {n}" for r, n in item["layer_ranges"].items())
            print(f"    layer ranges: {ranges}")
        if item["problem"]:
            print(f"    PROBLEM: {item['problem']}")
    return 0


def _verify(directory: str, as_json: bool) -> int:
    bad: list[dict[str, str]] = []
    checked = 0
    namespaces = _namespaces(directory)
    for ns in namespaces:
        if ns.problem is not None:
            bad.append({"path": os.path.join(ns.path, NAMESPACE_FILE), "reason": ns.problem})
        digest = bytes.fromhex(ns.hex)
        for unit in iter_unit_files(ns.path):
            checked += 1
            if not unit.well_named:
                bad.append({"path": unit.path, "reason": "not a unit file name"})
                continue
            try:
                check_unit_file(
                    unit.path,
                    ns.namespace,
                    namespace_digest=digest,
                    kd=unit.kd,
                    first=unit.first,
                    end=unit.end,
                )
            except CorruptUnit as error:
                bad.append({"path": unit.path, "reason": error.reason})
            except FileNotFoundError:
                checked -= 1  # evicted while we looked: not a bad file
            except OSError as error:
                bad.append({"path": unit.path, "reason": f"unreadable: {error.strerror}"})
    if as_json:
        print(
            json.dumps(
                {
                    "directory": directory,
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
            f"{directory}: {checked} unit file(s) in {len(namespaces)} namespace(s) checked, "
            f"{len(bad)} bad"
        )
        for item in bad:
            print(f"BAD {item['path']}: {item['reason']}")
    return 1 if bad else 0


def _gc(directory: str, capacity: int, as_json: bool) -> int:
    report = gc_directories([ns.path for ns in _namespaces(directory)], capacity)
    if as_json:
        print(json.dumps({"directory": directory, "capacity_bytes": capacity, **asdict(report)}))
    else:
        print(
            f"{directory}: evicted {report.units_evicted} unit(s) ({report.bytes_evicted} bytes), "
            f"removed {report.temps_removed} temp file(s); {report.units_on_disk} unit(s), "
            f"{report.bytes_on_disk} bytes left (capacity {capacity})"
        )
    return 0


def _parser() -> CliParser:
    parser = CliParser(
        prog="python -m canonical_ops store",
        description="Inspect and maintain a canonical-kv file store.",
    )
    sub = parser.add_subparsers(dest="command", parser_class=CliParser)
    for name, text in (
        ("stats", "namespaces, unit counts, bytes, keys, layer ranges"),
        ("verify", "check every unit file; exit 1 and list the bad ones"),
        ("gc", "evict least recently used units (tails first) down to --capacity"),
    ):
        command = sub.add_parser(name, help=text, description=text)
        command.add_argument("directory", metavar="DIR", help="store root or namespace directory")
        command.add_argument("--json", action="store_true", help="print one JSON object")
        if name == "gc":
            command.add_argument(
                "--capacity",
                type=_capacity,
                required=True,
                metavar="BYTES",
                help="e.g. 500G, 1TiB, 1048576",
            )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``store`` with ``argv`` (without the ``store`` word); returns the exit code.

    Usage errors are one line on stderr and exit status 2 (``layouts.cli.CliParser``,
    as every CLI of the project).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.fail("expected a command: stats, verify or gc")
        directory = os.path.abspath(args.directory)
        if not os.path.isdir(directory):
            parser.fail(f"DIR: expected a store directory, {args.directory!r} is not one")
    except SystemExit as exit_:  # usage errors (2) and --help (0)
        return exit_.code if isinstance(exit_.code, int) else 0
    if args.command == "gc":
        return _gc(directory, args.capacity, args.json)
    if args.command == "stats":
        return _stats(directory, args.json)
    return _verify(directory, args.json)
