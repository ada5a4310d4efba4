"""``--store``: where the persistent phases keep units, and opening those tiers."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from .config import DemoConfig, UsageError

REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


def redact(value: str) -> str:
    """A store argument safe to print: a URL's user and password replaced by ``***``."""
    return re.sub(r"//[^@/]*@", "//***@", value)


@dataclass(frozen=True)
class StorePlan:
    """Where and how the persistent phases keep units (from --store, --phase, ...)."""

    locations: tuple[str, ...]  # directories (absolute) and URLs, in lookup order
    phase: str
    capacity_bytes: int | None
    promote: bool = False  # read engine: copy what came from Redis into the directory

    @property
    def enabled(self) -> bool:
        return bool(self.locations)


def plan_stores(args) -> StorePlan:
    """Check --store, --phase and --store-capacity (UsageError); nothing is opened here."""
    values = args.store or []
    if not values and args.phase != "both":
        raise UsageError(
            f"--phase {args.phase}: needs --store DIR (without --store both engines run at "
            "once in shared memory)"
        )
    if args.store_capacity is not None and not values:
        raise UsageError("--store-capacity: needs --store DIR")
    locations: list[str] = []
    kinds: list[str] = []
    for value in values:
        scheme = value.split("://", 1)[0].lower() if "://" in value else None
        if scheme is None:
            if not value.strip():
                raise UsageError("--store: expected a directory, got an empty path")
            locations.append(os.path.abspath(value))
            kinds.append("files")
            continue
        if scheme not in REDIS_SCHEMES:
            raise UsageError(
                f"--store {redact(value)}: expected a directory or a redis:// URL, got a "
                f"{scheme}:// URL"
            )
        locations.append(value)
        kinds.append("redis")
    for kind in ("files", "redis"):
        if kinds.count(kind) > 1:
            raise UsageError(
                f"--store: expected at most one directory and one redis:// URL, got "
                f"{kinds.count(kind)} {'directories' if kind == 'files' else 'URLs'}"
            )
    if args.store_capacity is not None and "files" not in kinds:
        raise UsageError(
            "--store-capacity: needs --store DIR (a Redis server's capacity is its own maxmemory)"
        )
    if args.no_promote and sorted(kinds) != ["files", "redis"]:
        raise UsageError("--no-promote: needs two --store, a directory and a redis:// URL")
    # Nearest first: the local directory, then the shared server (whatever the flag order).
    ordered = sorted(zip(kinds, locations), key=lambda kl: kl[0] != "files")
    promote = len(ordered) > 1 and not args.no_promote
    return StorePlan(tuple(loc for _, loc in ordered), args.phase, args.store_capacity, promote)


def tier_kind(location: str) -> str:
    return "files" if "://" not in location else "redis"


def open_tiers(plan: StorePlan, namespace, queue_depth: int) -> list[tuple[str, str, Any]]:
    """(name, location, tier) of every --store, opened for ``namespace``; UsageError when
    a root is missing, not a directory or not writable, or a server refuses us."""
    tiers: list[tuple[str, str, Any]] = []
    # Servers first: a refused connection or password leaves no directory created.
    opening = sorted(plan.locations, key=lambda location: tier_kind(location) == "files")
    try:
        for location in opening:
            shown = redact(location)
            try:
                if tier_kind(location) == "files":
                    from ..units import FileStore

                    tier = FileStore(
                        location,
                        namespace,
                        capacity_bytes=plan.capacity_bytes,
                        queue_depth=queue_depth,
                    )
                else:
                    try:
                        from ..units import RedisStore
                    except ImportError as error:
                        raise UsageError(
                            f"--store {shown}: needs the redis package (pip install redis): {error}"
                        ) from None
                    tier = RedisStore(location, namespace, queue_depth=queue_depth)
            except (OSError, ValueError, RuntimeError) as error:
                raise UsageError(f"--store {shown}: {error}") from None
            tiers.append((tier_kind(location), shown, tier))
    except BaseException:
        for _, _, tier in tiers:
            tier.close()
        raise
    return sorted(tiers, key=lambda opened: opened[0] != "files")  # lookup order: files first


def queue_depth(cfg: DemoConfig) -> int:
    """Tier queue depth: room for one prompt of every stage at once (no back-pressure refusals
    in the demo; an engine under load would retry refused stores later)."""
    return max(64, cfg.prompt_blocks * max(cfg.writer_pp, cfg.reader_pp) + 16)
