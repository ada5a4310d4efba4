"""`python -m canonical_ops demo`: KV stored by one topology, read bit-exact by another.

A Llama-3-8B-like model (32 layers, 8 KV heads, head 128, bf16, block 16, packed
NHD) by default. Writer processes (TP x PP ranks; pipeline stage s owns a
contiguous layer range, vLLM's split) each hold their KV-head shard of their
stage's layers of a prompt's KV (filled deterministically from the unsharded
truth) and store it into their stage's shared /dev/shm region in the canonical
layout; each stage's scheduler-side PageManager marks a page ready once every
elected writer reported it. Reader processes of another topology then load the
pages into their own (differently sharded and split) caches and compare every
byte of every head, token and layer with the unsharded truth.

Without --store (shared memory), the readers attach the writers' regions (a
reader stage spanning two writer stages reads both) while the writer engine
holds them. With --store (persistent), the engines share nothing but the store:
a directory (files), a Redis / Valkey server (``redis://HOST:PORT/DB``,
``rediss://``, ``unix://``, ``redis+cluster://``) or both, given as two
--store (lookup order region -> files -> Redis):

``--phase write``
    The writer engine stores the prompt, persists every stage's region rows
    (one unit per block and stage) into every store, and exits: its regions
    are gone.
``--phase read``
    A new engine with the reader topology and empty regions looks the prompt's
    blocks up (region, then files, then Redis), fills its regions from units it
    verified, loads them into its caches and checks them against the truth.
    With two stores, what came from Redis is also written to the directory
    (``promote`` in the JSON; --no-promote turns it off).
``--phase both`` (default)
    The write engine, closed, then a separate read engine, in this process.

The truth and the block hashes (a sha256 chain over deterministic token ids)
follow from the preset and --seed only, so a separate read process checks what
a write process stored. PASS only when every prompt page was persisted (write)
and every prompt page was loaded and is bit-exact (read); every FAIL says what
failed. A missing, corrupt or foreign unit is a miss (FAIL with pages_missed),
never a wrong byte.

Runs on CUDA when a GPU is present (pinned regions, side streams), on CPU otherwise.
Exit status: 0 PASS, 1 FAIL, 2 a usage error (one line on stderr, checked before
any work: flags, the model's possible topologies, the device, the store root,
/dev/shm and memory).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import re
import sys
import time
import traceback
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, NamedTuple, TextIO

from layouts import (
    CanonicalPageMapping,
    LayerSpec,
    RankContext,
    canonical_format_id,
    certification_failure,
    derive_group_mappings,
)
from layouts.cli import CliParser, float_in, int_in, lower, upper
from layouts.explain import picture

from .tiers import pp_layer_ranges

# torch and the store are imported where they are used: usage errors are answered without them.

PROG = "python -m canonical_ops demo"


class Preset(NamedTuple):
    attention: str
    layers: int
    kv_heads: int
    head_size: int
    dtype: str
    block_size: int

    def describe(self) -> str:
        heads = "1 latent" if self.attention == "mla" else f"{self.kv_heads} KV heads"
        return (
            f"{self.attention} attention, {self.layers} layers, {heads} x {self.head_size}, "
            f"{self.dtype}, block {self.block_size}"
        )


PRESETS = {
    "llama3-8b": Preset("full", 32, 8, 128, "bfloat16", 16),
    "llama3-70b": Preset("full", 80, 8, 128, "bfloat16", 16),
    "qwen2-7b": Preset("full", 28, 4, 128, "bfloat16", 16),
    "deepseek-v3": Preset("mla", 61, 1, 576, "bfloat16", 64),
    "tiny": Preset("full", 4, 8, 64, "float16", 16),
}

DTYPES = ("float16", "bfloat16", "float32")
MAX_TP = 64  # processes per group on one node (the region takes at most 496 ranks)
MAX_PP = 64
MAX_LAYERS = 1024
MAX_KV_HEADS = 1024
MAX_PROMPT_TOKENS = 1 << 24  # beyond any model's context; /dev/shm bounds it further
MAX_TIMEOUT_S = 86400.0
MAX_SEED = (1 << 32) - 1
PLAIN_COPY_CAP_BYTES = 256 << 20  # the plain-copy baseline copies at most this much
PROCESS_OVERHEAD_BYTES = 128 << 20  # private memory of one rank process beyond its tensors
SHM_DIR = "/dev/shm"
VOCAB = 128256  # token ids of the prompt are drawn from a Llama-3-sized vocabulary
REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


class UsageError(Exception):
    """A user error: reported as one line on stderr, exit status 2."""


# ------------------------------------------------------------------------------ config


@dataclass(frozen=True)
class DemoConfig:
    attention: str
    layers: int
    total_kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    packing: str
    order: str
    writer_tp: int
    reader_tp: int
    prompt_blocks: int
    device: str
    seed: int = 0
    preset: str = "custom"
    writer_pp: int = 1
    reader_pp: int = 1
    model_name: str = ""
    model_revision: str = ""

    @property
    def prompt_tokens(self) -> int:
        return self.prompt_blocks * self.block_size

    @property
    def gpu_blocks(self) -> int:
        return self.prompt_blocks + 8  # the prompt's blocks land at scattered block ids

    def tp(self, role: str) -> int:
        return self.writer_tp if role == "writer" else self.reader_tp

    def pp(self, role: str) -> int:
        return self.writer_pp if role == "writer" else self.reader_pp

    def stages(self, role: str) -> list[tuple[int, int]]:
        """Layers ``[first, end)`` of each pipeline stage of ``role``'s engine (vLLM's split)."""
        return pp_layer_ranges(self.layers, self.pp(role))

    def identity(self):
        """The model identity persisted units are namespaced by (with every layer's geometry)."""
        from .store import ModelIdentity

        return ModelIdentity(
            self.model_name or f"canonical-kv-demo/{self.preset}", self.model_revision
        )

    def global_heads(self, tp: int, rank: int) -> list[int]:
        """The model's KV heads held by ``rank`` of a TP group, in its cache's head order.

        As vLLM shards them: TP divides the heads (each rank holds a contiguous
        slice) or is a multiple of them (each head replicated on ``tp // heads``
        consecutive ranks). MLA: the one latent, on every rank.
        """
        total = self.total_kv_heads
        if self.attention == "mla":
            return [0]
        if total >= tp:
            per_rank = total // tp
            return list(range(rank * per_rank, (rank + 1) * per_rank))
        return [rank // (tp // total)]

    def heads_per_rank(self, tp: int) -> int:
        return len(self.global_heads(tp, 0))

    def spec(self, tp: int) -> LayerSpec:
        # An MLA latent has one layout, (blocks, tokens, latent): described as packed NHD.
        mla = self.attention == "mla"
        return LayerSpec(
            self.attention,
            self.block_size,
            self.heads_per_rank(tp),
            self.head_size,
            self.dtype,
            "packed" if mla else self.packing,
            "NHD" if mla else self.order,
        )

    def namespace(self, role: str):
        """The StoreNamespace an engine of ``role``'s topology builds from ALL layers."""
        from .store import StoreNamespace

        tp = self.tp(role)
        ctx = RankContext(tp, self.total_kv_heads, 0)
        return StoreNamespace.from_specs(self.identity(), [self.spec(tp)] * self.layers, ctx)

    def topology_problem(self, tp: int) -> str | None:
        """Why the model cannot run at TP=``tp`` with certified canonical pages, or None."""
        total = self.total_kv_heads
        if self.attention != "mla" and total % tp and tp % total:
            return (
                f"TP={tp} neither divides the model's {total} KV heads nor is a multiple of "
                f"them, as vLLM requires (certification: "
                f"{certification_failure(self.spec(tp), RankContext(tp, total, 0))})"
            )
        for rank in range(tp):
            reason = certification_failure(self.spec(tp), RankContext(tp, total, rank))
            if reason is not None:
                return f"TP={tp} is not certified: {reason}"
        return None


def _size(text: str) -> int:
    from .store.cli import parse_size

    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a non-empty name, got {text!r}")
    return text


def build_parser() -> CliParser:
    presets = "\n".join(f"  {name:<12} {p.describe()}" for name, p in PRESETS.items())
    parser = CliParser(
        prog=PROG,
        description=__doc__,
        epilog=f"presets:\n{presets}\n\nChoices are case-insensitive.",
    )
    parser.add_argument(
        "--preset", type=lower, choices=list(PRESETS), default="llama3-8b", help="model shape"
    )
    parser.add_argument(
        "--layers",
        type=int_in(1, MAX_LAYERS),
        default=None,
        help="override the preset's layer count",
    )
    parser.add_argument(
        "--kv-heads",
        type=int_in(1, MAX_KV_HEADS),
        default=None,
        help="override the preset's KV head count (full attention; MLA has one latent)",
    )
    parser.add_argument(
        "--dtype",
        type=lower,
        choices=list(DTYPES),
        default=None,
        help="override the preset's KV dtype",
    )
    parser.add_argument(
        "--packing",
        type=lower,
        choices=["packed", "split"],
        default="packed",
        help="KV cache packing (packed: K and V adjacent per head; split: two halves)",
    )
    parser.add_argument(
        "--order", type=upper, choices=["NHD", "HND"], default="NHD", help="stride order"
    )
    parser.add_argument(
        "--writer-tp",
        type=int_in(1, MAX_TP),
        default=4,
        help="TP of the writers; must divide the KV heads or be a multiple of them "
        "(--phase read ignores it)",
    )
    parser.add_argument(
        "--reader-tp",
        type=int_in(1, MAX_TP),
        default=2,
        help="TP of the readers; must divide the KV heads or be a multiple of them "
        "(--phase write ignores it)",
    )
    parser.add_argument(
        "--writer-pp",
        type=int_in(1, MAX_PP),
        default=1,
        help="pipeline stages of the writers (vLLM's layer split; at most the layer count)",
    )
    parser.add_argument(
        "--reader-pp",
        type=int_in(1, MAX_PP),
        default=1,
        help="pipeline stages of the readers (vLLM's layer split; at most the layer count)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int_in(1, MAX_PROMPT_TOKENS),
        default=2048,
        help="prompt length (rounded up to whole blocks)",
    )
    parser.add_argument(
        "--store",
        action="append",
        metavar="DIR",
        default=None,
        help="persist to and read from the file store at DIR (an existing writable "
        "directory) or a Redis / Valkey server (redis://[USER:PASSWORD@]HOST:PORT/DB, "
        "rediss://, unix://PATH, redis+cluster://); twice for both (files looked up first)",
    )
    parser.add_argument(
        "--phase",
        type=lower,
        choices=["write", "read", "both"],
        default="both",
        help="with --store: write (store, persist, exit), read (a new engine loads from the "
        "store and verifies) or both, one after the other",
    )
    parser.add_argument(
        "--store-capacity",
        type=_size,
        default=None,
        metavar="BYTES",
        help="bytes of unit files the file store keeps (least recently used evicted first, "
        "tails first), e.g. 512M; default unbounded",
    )
    parser.add_argument(
        "--no-promote",
        action="store_true",
        help="with a directory and a URL: do not copy units the read engine got from Redis "
        "into the directory",
    )
    parser.add_argument(
        "--model-name",
        type=_name,
        default=None,
        help="model identity persisted units are namespaced by (default: canonical-kv-demo/PRESET)",
    )
    parser.add_argument(
        "--model-revision",
        default="",
        help="weights revision in the model identity",
    )
    parser.add_argument(
        "--device",
        type=lower,
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the KV caches live (auto: cuda when a GPU and the CUDA kernels are present)",
    )
    parser.add_argument(
        "--timeout",
        type=float_in(0.0, MAX_TIMEOUT_S),
        default=600.0,
        help="seconds each process group (and each store phase) may take",
    )
    parser.add_argument(
        "--seed",
        type=int_in(0, MAX_SEED),
        default=0,
        help="seed of the prompt's tokens and KV and of the block tables",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON summary object on stdout (progress and report go to stderr)",
    )
    return parser


def build_config(args, device: str) -> DemoConfig:
    """The demo's configuration from parsed flags; UsageError for a topology the model lacks."""
    preset = PRESETS[args.preset]
    heads = getattr(args, "kv_heads", None)
    if heads is not None and preset.attention == "mla" and heads != 1:
        raise UsageError(f"--kv-heads {heads}: {args.preset} is MLA (one latent per token)")
    writer = (args.writer_tp, getattr(args, "writer_pp", 1))
    reader = (args.reader_tp, getattr(args, "reader_pp", 1))
    # A persistent phase runs one engine: the other role's flags are not used (a reader
    # neither knows nor needs the topology that wrote the store), so they mirror it.
    phase = getattr(args, "phase", "both") if getattr(args, "store", None) else "both"
    if phase == "write":
        reader = writer
    elif phase == "read":
        writer = reader
    cfg = DemoConfig(
        attention=preset.attention,
        layers=args.layers or preset.layers,
        total_kv_heads=heads or preset.kv_heads,
        head_size=preset.head_size,
        dtype=getattr(args, "dtype", None) or preset.dtype,
        block_size=preset.block_size,
        packing=args.packing,
        order=args.order,
        writer_tp=writer[0],
        reader_tp=reader[0],
        prompt_blocks=-(-args.prompt_tokens // preset.block_size),
        device=device,
        seed=args.seed,
        preset=args.preset,
        writer_pp=writer[1],
        reader_pp=reader[1],
        model_name=getattr(args, "model_name", None) or "",
        model_revision=getattr(args, "model_revision", ""),
    )
    for flag, tp in (("--writer-tp", cfg.writer_tp), ("--reader-tp", cfg.reader_tp)):
        problem = cfg.topology_problem(tp)
        if problem is not None:
            raise UsageError(f"{flag} {tp}: {args.preset} cannot run there: {problem}")
    for flag, pp in (("--writer-pp", cfg.writer_pp), ("--reader-pp", cfg.reader_pp)):
        if pp > cfg.layers:
            raise UsageError(
                f"{flag} {pp}: the model has {cfg.layers} layers; a pipeline stage needs at "
                f"least one (expected at most {cfg.layers})"
            )
    return cfg


# ------------------------------------------------------------------------------ stores


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
                    from .store import FileStore

                    tier = FileStore(
                        location,
                        namespace,
                        capacity_bytes=plan.capacity_bytes,
                        queue_depth=queue_depth,
                    )
                else:
                    try:
                        from .store import RedisStore
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


# ------------------------------------------------------------------------------ geometry


@dataclass(frozen=True)
class Geometry:
    """Canonical mappings of both groups and the rows they use (O(layers) to build)."""

    writer_groups: list[tuple[CanonicalPageMapping, ...]]
    reader_groups: list[tuple[CanonicalPageMapping, ...]]
    row_bytes: int  # every layer's canonical page: one block of the whole model
    canonical_page_bytes: int  # of one layer

    def groups(self, role: str) -> list[tuple[CanonicalPageMapping, ...]]:
        return self.writer_groups if role == "writer" else self.reader_groups

    def stage_row_bytes(self, first: int, end: int) -> int:
        return (end - first) * self.canonical_page_bytes

    @property
    def parallelism_agnostic(self) -> bool:
        return all(
            m.parallelism_agnostic for g in self.writer_groups + self.reader_groups for m in g
        )


def plan_geometry(cfg: DemoConfig) -> Geometry:
    """Both groups' verified mappings (identical layers derive once) and the row size."""
    groups = {}
    for tp in (cfg.writer_tp, cfg.reader_tp):
        mappings = derive_group_mappings(cfg.spec(tp), tp, cfg.total_kv_heads)
        groups[tp] = [mappings] * cfg.layers
    w, r = groups[cfg.writer_tp], groups[cfg.reader_tp]
    w_row = sum(g[0].canonical_page_size_bytes for g in w)
    r_row = sum(g[0].canonical_page_size_bytes for g in r)
    if w_row != r_row:  # cannot happen for certified topologies (build_config checks them)
        raise UsageError(
            f"writer (TP={cfg.writer_tp}) and reader (TP={cfg.reader_tp}) canonical pages "
            f"differ in size ({w_row} vs {r_row} B per row)"
        )
    return Geometry(w, r, w_row, w[0][0].canonical_page_size_bytes)


def resolve_device(requested: str) -> str:
    """``auto`` -> cuda or cpu; UsageError for cuda without a GPU or without CUDA kernels."""
    import torch

    try:
        from canonical_ops._extension import BUILT_WITH_CUDA
    except ImportError as error:
        raise UsageError(str(error)) from None
    gpu = torch.cuda.is_available()
    if requested == "auto":
        return "cuda" if gpu and BUILT_WITH_CUDA else "cpu"
    if requested == "cuda" and not gpu:
        raise UsageError(
            "--device cuda: no CUDA GPU is available (torch.cuda.is_available() is False); "
            "use --device cpu or --device auto"
        )
    if requested == "cuda" and not BUILT_WITH_CUDA:
        raise UsageError(
            "--device cuda: the extension was built without its CUDA kernels (no nvcc at "
            "build time); rebuild it with nvcc, or use --device cpu"
        )
    return requested


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def region_bytes(cfg: DemoConfig, geometry: Geometry, role: str = "writer") -> int:
    """/dev/shm bytes of ``role``'s regions (one per pipeline stage)."""
    from canonical_ops.frontend.shared_region import HEADER_BYTES

    return cfg.pp(role) * HEADER_BYTES + cfg.prompt_blocks * geometry.row_bytes


def rank_tensor_bytes(cfg: DemoConfig, geometry: Geometry, tp: int, layers: int) -> tuple[int, int]:
    """(KV cache bytes, transient bytes) of one rank holding ``layers`` layers: caches, one
    layer's truth, plain copy."""
    kv = layers * cfg.gpu_blocks * cfg.spec(tp).page_size_bytes
    truth = 2 * cfg.prompt_blocks * geometry.canonical_page_bytes  # truth + its shard
    moved = layers * cfg.prompt_blocks * cfg.spec(tp).page_size_bytes
    return kv, truth + 2 * min(moved, PLAIN_COPY_CAP_BYTES)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_resources(
    cfg: DemoConfig, geometry: Geometry, shm_dir: str = SHM_DIR, persistent: bool = False
) -> None:
    """Refuse (UsageError) a run that cannot fit, before any O(pages) work.

    The regions must fit in ``shm_dir``'s free space (shared memory: the
    writers' regions, which the readers attach; persistent: one engine's at a
    time); the regions plus the larger group's caches and transients must fit
    in available memory (host memory on CPU; on CUDA the caches must fit in the
    GPU's free memory). Disk space is not checked: a full store fails stores
    cleanly (counted), which is the engine's behaviour to show.
    """
    roles = ("writer", "reader")
    size = (
        max(region_bytes(cfg, geometry, role) for role in roles)
        if persistent
        else (region_bytes(cfg, geometry, "writer"))
    )
    vfs = os.statvfs(shm_dir)
    free = vfs.f_bavail * vfs.f_frsize
    hint = "use fewer --prompt-tokens or --layers"
    if size > free:
        raise UsageError(
            f"--prompt-tokens {cfg.prompt_tokens}: the shared regions need {_gib(size)} but "
            f"{shm_dir} has only {_gib(free)} free; {hint} (docker: --shm-size)"
        )
    kv, transient = {}, {}
    for role in roles:
        tp = cfg.tp(role)
        per_kv = per_transient = 0
        for first, end in cfg.stages(role):
            stage_kv, stage_transient = rank_tensor_bytes(cfg, geometry, tp, end - first)
            per_kv += tp * stage_kv
            per_transient += tp * (stage_transient + PROCESS_OVERHEAD_BYTES)
        kv[role], transient[role] = per_kv, per_transient
    if cfg.device == "cuda":
        import torch

        gpu_free, _ = torch.cuda.mem_get_info(0)
        gpu_need = max(kv.values())
        if gpu_need > gpu_free:
            raise UsageError(
                f"--prompt-tokens {cfg.prompt_tokens}: the ranks' KV caches need "
                f"{_gib(gpu_need)} of GPU memory but only {_gib(gpu_free)} is free; {hint}"
            )
        host_need = size + max(transient.values())
    else:
        host_need = size + max(kv[role] + transient[role] for role in roles)
    available = _mem_available()
    if available is not None and host_need > available:
        raise UsageError(
            f"--prompt-tokens {cfg.prompt_tokens}: the regions and the ranks' tensors need "
            f"about {_gib(host_need)} of memory but only {_gib(available)} is available; {hint}"
        )


# ------------------------------------------------------------------------ the prompt


def prompt_token_ids(cfg: DemoConfig, block: int):
    """Token ids of block ``block`` of the prompt: deterministic in (seed, block)."""
    import numpy as np

    rng = np.random.default_rng([cfg.seed, 0x70C, block])
    return rng.integers(0, VOCAB, cfg.block_size, dtype=np.int64)


def block_hashes(cfg: DemoConfig) -> list[bytes]:
    """The prompt's block hashes, as an engine computes them: a chain over the token ids.

    ``h[i] = sha256(h[i-1] || token ids of block i)`` (little-endian int64), so a
    block's hash names its whole prefix. Model-independent, like vLLM's: the
    store's namespace keeps models apart.
    """
    parent = hashlib.sha256(b"canonical-kv demo prompt").digest()
    out = []
    for block in range(cfg.prompt_blocks):
        parent = hashlib.sha256(parent + prompt_token_ids(cfg, block).astype("<i8").tobytes())
        parent = parent.digest()
        out.append(parent)
    return out


# ------------------------------------------------------------------------ tensors


def _bits_dtype(cfg: DemoConfig):
    """The integer dtype whose bit patterns stand for the KV dtype's values."""
    import torch

    elem = LayerSpec("full", 1, 1, 1, cfg.dtype, "packed", "NHD").element_size
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[elem]


def truth_layer(cfg: DemoConfig, layer: int, num_blocks: int | None = None):
    """The unsharded KV of the prompt's first ``num_blocks`` blocks for one layer, as bits.

    Full attention: (blocks, tokens, heads, 2 * head_size) with K then V in the
    last dim; MLA: (blocks, tokens, latent). Each block's KV is deterministic in
    (seed, layer, block) alone, as a real model's is in the block's prefix: a
    shorter or longer prompt has the same KV for the blocks it shares.
    """
    import torch

    bits = _bits_dtype(cfg)
    blocks = cfg.prompt_blocks if num_blocks is None else num_blocks
    if cfg.attention == "mla":
        shape = (cfg.block_size, cfg.head_size)
    else:
        shape = (cfg.block_size, cfg.total_kv_heads, 2 * cfg.head_size)
    info = torch.iinfo(bits)
    low, high = (0, 256) if bits == torch.uint8 else (info.min, info.max)
    truth = torch.empty((blocks, *shape), dtype=bits)
    gen = torch.Generator()
    for block in range(blocks):
        gen.manual_seed(((cfg.seed * 1000003 + layer) * 1000033 + block) % (1 << 63))
        truth[block] = torch.randint(low, high, shape, generator=gen, dtype=bits)
    return truth


def allocate_kv(cfg: DemoConfig, tp: int, device, num_layers: int | None = None) -> list:
    """Per-layer caches in the physical layout of (packing, order), as int bit patterns."""
    import torch

    heads, bs, hs = cfg.heads_per_rank(tp), cfg.block_size, cfg.head_size
    bits = _bits_dtype(cfg)
    caches = []
    for _ in range(cfg.layers if num_layers is None else num_layers):
        n = cfg.gpu_blocks
        if cfg.attention == "mla":
            t = torch.zeros(n, bs, hs, dtype=bits, device=device)
        elif cfg.packing == "packed":
            physical = (n, bs, heads, 2 * hs) if cfg.order == "NHD" else (n, heads, bs, 2 * hs)
            t = torch.zeros(physical, dtype=bits, device=device)
            t = t.permute(0, 2, 1, 3) if cfg.order == "NHD" else t
        else:
            physical = (n, 2, bs, heads, hs) if cfg.order == "NHD" else (n, 2, heads, bs, hs)
            t = torch.zeros(physical, dtype=bits, device=device)
            t = t if cfg.order == "NHD" else t.permute(0, 1, 3, 2, 4)
        caches.append(t)
    return caches


def to_cache_blocks(cfg: DemoConfig, logical):
    """(blocks, tokens, heads, 2 * hs) -> the cache's logical block shape (MLA: unchanged)."""
    import torch

    if cfg.attention == "mla":
        return logical
    if cfg.packing == "packed":
        return logical.permute(0, 2, 1, 3)  # (blocks, heads, tokens, 2 * hs)
    hs = cfg.head_size
    return torch.stack(
        [logical[..., :hs], logical[..., hs:]], dim=1
    )  # (blocks, 2, tokens, heads, hs)


def from_cache_blocks(cfg: DemoConfig, blocks):
    """Inverse of :func:`to_cache_blocks`: cache blocks -> (blocks, tokens, heads, 2 * hs)."""
    import torch

    if cfg.attention == "mla":
        return blocks
    if cfg.packing == "packed":
        return blocks.permute(0, 2, 1, 3)
    return torch.cat([blocks[:, 0], blocks[:, 1]], dim=-1)


def shard_of(cfg: DemoConfig, truth, tp: int, rank: int):
    """This rank's logical view of the truth: its KV heads, shaped like its cache blocks."""
    if cfg.attention == "mla":
        return truth
    return to_cache_blocks(cfg, truth[:, :, cfg.global_heads(tp, rank)])


def compare_with_truth(
    cfg: DemoConfig, tp: int, rank: int, kv: Sequence, blocks, first_layer: int = 0
) -> dict:
    """Every byte of the rank's loaded blocks, every layer it holds, against the truth.

    ``kv[i]`` is layer ``first_layer + i``. Returns what was checked (the layer
    range, blocks, tokens, the global heads of every local head slot) and the
    differing bytes per (global) layer; the coordinator checks that the readers
    together covered every layer and head.
    """
    import torch

    heads = cfg.global_heads(tp, rank)
    wrong: dict[int, int] = {}
    checked = 0
    slots = set()
    for index, cache in enumerate(kv):
        layer = first_layer + index
        got = from_cache_blocks(cfg, cache[blocks])
        truth = truth_layer(cfg, layer, len(blocks)).to(got.device)
        expected = truth if cfg.attention == "mla" else truth[:, :, heads]
        slots.add(1 if cfg.attention == "mla" else got.shape[2])
        nbytes = expected.numel() * expected.element_size()
        checked += nbytes
        if got.shape != expected.shape:
            wrong[layer] = nbytes
            continue
        a = got.contiguous().view(torch.uint8)
        b = expected.contiguous().view(torch.uint8)
        differing = int((a != b).sum())
        if differing:
            wrong[layer] = differing
    return dict(
        first_layer=first_layer,
        end_layer=first_layer + len(kv),
        layers=len(kv),
        blocks=len(blocks),
        tokens=len(blocks) * cfg.block_size,
        heads=heads,
        local_head_slots=sorted(slots),
        bytes_checked=checked,
        bytes_wrong_by_layer=wrong,
    )


def block_table(cfg: DemoConfig, salt: int):
    """Scattered cache block ids holding the prompt's blocks (one permutation per group)."""
    import torch

    gen = torch.Generator().manual_seed(cfg.seed + 7919 * salt)
    return torch.randperm(cfg.gpu_blocks, generator=gen)[: cfg.prompt_blocks]


def plain_copy_seconds(num_bytes: int, device) -> float:
    """Time of one contiguous copy of the same bytes between the same memories.

    Copies at most ``PLAIN_COPY_CAP_BYTES`` and scales the time up linearly.
    """
    import torch

    sample = max(1, min(num_bytes, PLAIN_COPY_CAP_BYTES))
    if device.type == "cuda":
        src = torch.empty(sample, dtype=torch.uint8, device=device)
        dst = torch.empty(sample, dtype=torch.uint8, pin_memory=True)
    else:
        src = torch.ones(sample, dtype=torch.uint8)
        dst = torch.zeros(sample, dtype=torch.uint8)
    dst.copy_(src, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best * num_bytes / sample


# ------------------------------------------------------------------------ rank processes


@dataclass(frozen=True)
class Source:
    """Region rows a rank moves: layers ``[first, end)`` of pages ``page_ids`` of one region.

    ``area_offsets`` place those layers in the region's rows when the region
    belongs to another pipeline split (None: the rows are exactly these layers).
    """

    region_args: dict
    first: int
    end: int
    page_ids: tuple[int, ...]
    area_offsets: tuple[int, ...] | None = None


@dataclass(frozen=True)
class RankTask:
    """One rank process: its pipeline stage's layers, its TP rank and the regions it uses."""

    stage: int
    first: int
    end: int
    tp_rank: int
    sources: tuple[Source, ...]


def writer_rank(cfg: DemoConfig, task: RankTask, workers, kv, emit) -> dict:
    """Fill this writer's caches (its stage's layers) from the truth and store the prompt."""
    import torch

    [worker] = workers
    [source] = task.sources
    device = kv[0].device
    blocks = block_table(cfg, salt=1).to(device)
    for index, layer in enumerate(range(task.first, task.end)):
        shard = shard_of(cfg, truth_layer(cfg, layer), cfg.writer_tp, task.tp_rank)
        kv[index][blocks] = shard.to(device)
    emit("started")
    pages = torch.tensor(source.page_ids, dtype=torch.int64)
    # Transfers are idempotent: the first warms page tables and caches, the second is timed.
    worker.wait(worker.store(block_ids=blocks, page_ids=pages))
    job = worker.wait(worker.store(block_ids=blocks, page_ids=pages))
    emit("stored")
    return dict(pages=len(source.page_ids), bytes=job.num_bytes, seconds=job.seconds)


def reader_rank(cfg: DemoConfig, task: RankTask, workers, kv, emit) -> dict:
    """Load the pages into this reader's caches (from every source) and check them."""
    import torch

    device = kv[0].device
    counts = {len(source.page_ids) for source in task.sources}
    if len(counts) != 1:
        raise ValueError(f"sources: expected the same page count from each, got {counts}")
    count = counts.pop()
    blocks = block_table(cfg, salt=2)[:count].to(device)
    emit("started")
    seconds = num_bytes = 0
    for _ in range(2):  # the first warms page tables and caches, the second is timed
        seconds = num_bytes = 0
        for worker, source in zip(workers, task.sources):
            pages = torch.tensor(source.page_ids, dtype=torch.int64)
            job = worker.wait(worker.load(block_ids=blocks, page_ids=pages))
            seconds += job.seconds
            num_bytes += job.num_bytes
    emit("loaded")
    check = compare_with_truth(cfg, cfg.reader_tp, task.tp_rank, kv, blocks, task.first)
    emit("verified")
    return dict(pages=count, bytes=num_bytes, seconds=seconds, **check)


def rank_main(role: str, cfg_dict: dict, index: int, task: RankTask, events) -> None:
    """One writer or reader process; reports milestones and its result through ``events``."""

    def emit(event: str, payload: Any = None) -> None:
        events.put((event, index, payload))

    try:
        import torch

        from canonical_ops.frontend import OffloadWorker, SharedOffloadRegion

        torch.set_num_threads(1)
        cfg = DemoConfig(**cfg_dict)
        tp = cfg.tp(role)
        device = torch.device(cfg.device)
        if device.type == "cuda":
            torch.cuda.set_device(0)
        regions = []
        try:
            for source in task.sources:
                regions.append(SharedOffloadRegion(**source.region_args))
            kv = allocate_kv(cfg, tp, device, task.end - task.first)
            ctx = RankContext(tp, cfg.total_kv_heads, task.tp_rank)
            # The caches hold int bit patterns; the worker checks dtypes, so it gets typed views.
            typed = [t.view(getattr(torch, cfg.dtype)) for t in kv]
            workers = []
            for source, region in zip(task.sources, regions):
                lo, hi = source.first - task.first, source.end - task.first
                workers.append(
                    OffloadWorker(
                        typed[lo:hi],
                        [cfg.spec(tp)] * (hi - lo),
                        ctx,
                        region,
                        area_offsets=source.area_offsets,
                    )
                )
            body = writer_rank if role == "writer" else reader_rank
            report = body(cfg, task, workers, kv, emit)
            report.update(stage=task.stage, tp_rank=task.tp_rank)
            report["copy_seconds"] = plain_copy_seconds(max(report["bytes"], 1), device)
            del workers, kv, typed
        finally:
            for region in regions:
                region.close()
        emit("done", report)
    except BaseException:  # reported to the coordinator, which prints FAIL
        emit("error", traceback.format_exc())


# ------------------------------------------------------------------------ coordinator


class Progress:
    """Timestamped progress lines (seconds since the demo started)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, message: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {message}", file=self.stream, flush=True)


@dataclass
class GroupRun:
    """What one process group reported (processes numbered 0 .. ranks - 1)."""

    role: str
    ranks: int  # processes: TP x PP
    reports: dict[int, dict] = field(default_factory=dict)  # process -> final report
    errors: dict[int, str] = field(default_factory=dict)  # process -> why it failed
    phase_seconds: dict[str, float] = field(default_factory=dict)  # milestone -> since previous

    @property
    def ok(self) -> bool:
        return not self.errors and len(self.reports) == self.ranks


def run_group(
    pool,
    role: str,
    cfg: DemoConfig,
    tasks: Sequence[RankTask],
    timeout_s: float,
    progress: Progress,
    milestones: dict[str, str],
) -> GroupRun:
    """Run one process per task; print a line when all live ranks reach each milestone."""
    count = len(tasks)
    run = GroupRun(role, count)
    events = pool.Queue()
    procs = {}
    plural = f"{role}s"
    shape = f"TP={cfg.tp(role)}" + (f" x PP={cfg.pp(role)}" if cfg.pp(role) > 1 else "")
    progress(f"{plural}: spawning {count} process{'es' if count > 1 else ''} ({shape})")
    start = last = time.perf_counter()
    reached: dict[str, set[int]] = {m: set() for m in milestones}
    announced: set[str] = set()
    dead_since: dict[int, float] = {}
    try:
        for index, task in enumerate(tasks):
            p = pool.Process(target=rank_main, args=(role, asdict(cfg), index, task, events))
            p.start()
            procs[index] = p
        deadline = start + timeout_s
        while len(run.reports) + len(run.errors) < count:
            now = time.perf_counter()
            if now >= deadline:
                for index in procs:
                    if index not in run.reports and index not in run.errors:
                        run.errors[index] = f"no report within --timeout {timeout_s:g} s"
                break
            try:
                event, index, payload = events.get(timeout=min(0.5, deadline - now))
            except Exception:  # queue.Empty: look for ranks that died without a word
                for index, p in procs.items():
                    if index in run.reports or index in run.errors or p.exitcode is None:
                        continue
                    first = dead_since.setdefault(index, now)
                    if now - first > 2.0:  # its last words had time to arrive
                        run.errors[index] = (
                            f"process exited with code {p.exitcode} before reporting"
                        )
            else:
                if event == "done":
                    run.reports[index] = payload
                elif event == "error":
                    run.errors[index] = payload
                elif event in reached:
                    reached[event].add(index)
            live = count - len(run.errors)
            for milestone, words in milestones.items():
                if milestone not in announced and live and len(reached[milestone]) >= live:
                    announced.add(milestone)
                    now = time.perf_counter()
                    run.phase_seconds[milestone] = now - last
                    progress(
                        f"{plural}: {len(reached[milestone])}/{count} {words} ({now - last:.1f} s)"
                    )
                    last = now
    finally:
        grace = time.perf_counter() + 5.0  # for all of them together, then kill the rest
        for p in procs.values():
            p.join(timeout=max(0.0, grace - time.perf_counter()))
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return run


def rank_pool():
    """Process context of the ranks: a forkserver with torch and the ops preloaded, so that
    each rank starts in milliseconds instead of importing torch anew (spawn semantics).

    Started at once, so that the server's imports overlap the coordinator's set-up.
    """
    from multiprocessing import forkserver

    pool = mp.get_context("forkserver")
    pool.set_forkserver_preload(
        ["torch", "numpy", "canonical_ops.ops", "canonical_ops.frontend.worker", __name__]
    )
    forkserver.ensure_running()
    return pool


# ------------------------------------------------------------------------ engines


@dataclass
class Stage:
    """One pipeline stage of an engine, scheduler side (this coordinator is rank 0 of its
    region): the region, its PageManager and, with --store, its StageCache."""

    role: str
    index: int
    first: int
    end: int
    region_args: dict  # without ``rank``
    region: Any = None
    manager: Any = None
    cache: Any = None
    page_ids: list = field(default_factory=list)  # of the prompt's blocks, writers' stores
    generations: list[int] = field(default_factory=list)  # of page_ids, read at allocate
    ready: int = 0  # leading prompt blocks ready in the region
    attached: int = 0  # ranks given a region rank so far (rank 0 is the coordinator)

    def rank_args(self) -> dict:
        """Region arguments for the next rank to attach."""
        self.attached += 1
        return dict(self.region_args, rank=self.attached)


@dataclass
class Session:
    """State shared by the phases of one demo run."""

    cfg: DemoConfig
    geometry: Geometry
    progress: Progress
    out: TextIO
    timeout_s: float
    pool: Any = None
    stores: StorePlan = field(default_factory=lambda: StorePlan((), "both", None, False))
    hashes: list = field(default_factory=list)
    run_id: str = field(default_factory=lambda: f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
    first_tiers: list = field(default_factory=list)  # opened at start-up (usage checks)
    tier_reports: list[dict] = field(default_factory=list)


def open_stages(
    s: Session, role: str, extra_ranks: Sequence[int] = (), tiers: Sequence = ()
) -> list[Stage]:
    """``role``'s engine: per pipeline stage a region (rank 0 here), a PageManager and,
    with tiers, a StageCache over both. ``extra_ranks[i]``: other ranks attaching stage i."""
    from canonical_ops.frontend import PageManager, SharedOffloadRegion

    from .tiers import StageCache

    cfg = s.cfg
    groups = s.geometry.groups(role)
    namespace = cfg.namespace(role) if tiers else None
    stages: list[Stage] = []
    try:
        for index, (first, end) in enumerate(cfg.stages(role)):
            extra = extra_ranks[index] if extra_ranks else 0
            stage = Stage(
                role,
                index,
                first,
                end,
                dict(
                    engine_id=f"demo-{s.run_id}-{role[0]}{index}",
                    num_rows=cfg.prompt_blocks,
                    row_bytes=s.geometry.stage_row_bytes(first, end),
                    world_size=1 + cfg.tp(role) + extra,
                    pin=cfg.device == "cuda",
                ),
            )
            stage.region = SharedOffloadRegion(**stage.region_args, rank=0)
            stages.append(stage)
            stage.manager = PageManager.from_mappings(cfg.prompt_blocks, groups[first:end])
            if tiers:
                stage.cache = StageCache(
                    stage.manager,
                    stage.region,
                    (first, end),
                    namespace,
                    [tier for _, _, tier in tiers],
                    names=[name for name, _, _ in tiers],
                )
    except BaseException:
        close_stages(stages)
        raise
    return stages


def close_stages(stages: Sequence[Stage], timeout_s: float | None = None) -> None:
    """Drain the stages' tier I/O, drop every view of their rows, close the regions."""
    from canonical_ops.frontend import SharedOffloadRegion

    for stage in stages:
        try:
            if stage.cache is not None:
                stage.cache.close(timeout_s)
        finally:
            stage.cache = None
            if stage.region is not None:
                stage.region.close()
            # Ranks that never attached (a failed group) leave the region's "closed before
            # every rank attached" marker: this engine id is never reused.
            SharedOffloadRegion.remove_closed_marker(stage.region_args["engine_id"])


def close_tiers(s: Session, tiers: Sequence, engine: str) -> None:
    """Finish the tiers' queued I/O, record their counters for the summary, close them."""
    for name, location, tier in tiers:
        tier.close()
        metrics = tier.metrics()
        s.tier_reports.append(dict(engine=engine, name=name, location=location, **asdict(metrics)))


def run_writers(s: Session, stages: Sequence[Stage]) -> GroupRun:
    """The writer engine's ranks: every stage's pages allocated, every writer stores its
    share of its stage's layers; pages ready once every elected writer reported."""
    cfg = s.cfg
    tasks = []
    for stage in stages:
        stage.page_ids = stage.manager.allocate(s.hashes)
        stage.generations = [stage.manager.generation(page) for page in stage.page_ids]
        for tp_rank in range(cfg.writer_tp):
            source = Source(stage.rank_args(), stage.first, stage.end, tuple(stage.page_ids))
            tasks.append(RankTask(stage.index, stage.first, stage.end, tp_rank, (source,)))
    run = run_group(
        s.pool,
        "writer",
        cfg,
        tasks,
        s.timeout_s,
        s.progress,
        {"started": "started (caches filled)", "stored": "stored their share"},
    )
    for index, task in enumerate(tasks):
        if index not in run.reports:
            continue
        stage = stages[task.stage]
        for page, generation in zip(stage.page_ids, stage.generations):
            if task.tp_rank in stage.manager.writer_ranks(page):
                stage.manager.complete_store(page, task.tp_rank, generation=generation)
    for stage in stages:
        stage.ready = stage.manager.lookup(s.hashes)
    return run


def readers_per_writer_stage(cfg: DemoConfig) -> list[int]:
    """Shared memory: reader ranks attaching each writer stage's region (their layers meet)."""
    out = []
    for w_first, w_end in cfg.stages("writer"):
        stages = sum(first < w_end and w_first < end for first, end in cfg.stages("reader"))
        out.append(stages * cfg.reader_tp)
    return out


def run_readers(s: Session, sources_of_stage, count: int) -> GroupRun:
    """The reader engine's ranks: load ``count`` prompt pages into their caches, check every
    byte. ``sources_of_stage(stage index, first, end)`` gives a rank its regions and pages."""
    cfg = s.cfg
    tasks = [
        RankTask(index, first, end, tp_rank, tuple(sources_of_stage(index, first, end)))
        for index, (first, end) in enumerate(cfg.stages("reader"))
        for tp_rank in range(cfg.reader_tp)
    ]
    return run_group(
        s.pool,
        "reader",
        cfg,
        tasks,
        s.timeout_s,
        s.progress,
        {
            "started": "started",
            "loaded": "loaded",
            "verified": "compared with the unsharded truth",
        },
    )


def run_shared_memory(s: Session) -> dict:
    """Both engines at once: readers attach the writers' regions (no files)."""
    cfg = s.cfg
    writers = open_stages(s, "writer", readers_per_writer_stage(cfg))
    readers = None
    try:
        run_w = run_writers(s, writers)
        ready = min(stage.ready for stage in writers)
        print(f"stored: {ready}/{cfg.prompt_blocks} pages ready", file=s.out, flush=True)
        if ready:
            pages = [stage.manager.acquire(s.hashes[:ready]) for stage in writers]
            page_bytes = s.geometry.canonical_page_bytes

            def sources(index: int, first: int, end: int) -> list[Source]:
                out = []
                for w, stage in enumerate(writers):
                    lo, hi = max(first, stage.first), min(end, stage.end)
                    if lo >= hi:
                        continue
                    offsets = tuple((layer - stage.first) * page_bytes for layer in range(lo, hi))
                    out.append(Source(stage.rank_args(), lo, hi, tuple(pages[w]), offsets))
                return out

            try:
                readers = run_readers(s, sources, ready)
            finally:
                for stage, held in zip(writers, pages):
                    stage.manager.release(held)
    finally:
        close_stages(writers)
    verification = verify(cfg, run_w, ready, readers)
    return dict(writers=run_w, readers=readers, ready=ready, verification=verification)


def store_totals(stages: Sequence[Stage]) -> dict:
    """Tier stores of the stages so far (every tier, every stage): ok, failed, refused, bytes."""
    counters = [t for stage in stages for t in stage.cache.metrics().tiers]
    return dict(
        units_ok=sum(t.stores_ok for t in counters),
        units_failed=sum(t.stores_failed for t in counters),
        units_refused=sum(t.stores_refused for t in counters),
        bytes=sum(t.bytes_stored for t in counters),
    )


def persist_stages(s: Session, stages: Sequence[Stage], tiers: Sequence) -> dict:
    """Write-through of every stage's ready prompt pages to the tiers; waits for the I/O."""
    cfg = s.cfg
    start = time.perf_counter()
    submitted = 0
    for stage in stages:
        submitted += stage.cache.persist(s.hashes).submitted
    events = [event for stage in stages for event in stage.cache.drain(s.timeout_s)]
    seconds = time.perf_counter() - start
    counters = [t for stage in stages for t in stage.cache.metrics().tiers]
    totals = store_totals(stages)
    nbytes = totals["bytes"]
    # One example of each kind of failure ("store failed (disk full): [Errno 28] ...").
    problems: dict[str, str] = {}
    for event in events:
        if event.status != "ok":
            problems.setdefault(event.detail.split(": ", 1)[0], event.detail)
    problems.update({t.last_error: t.last_error for t in counters if t.last_error})
    return dict(
        units_expected=cfg.prompt_blocks * len(stages) * len(tiers),
        units_submitted=submitted,
        **totals,
        seconds=seconds,
        gbps=nbytes / seconds / 1e9 if seconds > 0 and nbytes else None,
        # Every layer of the model, across the stages' units: what any later split can read.
        pages_complete_in_store={
            name: tier.lookup(s.hashes, 0, cfg.layers) for name, _, tier in tiers
        },
        # The engine keeps serving from its regions whatever the tiers did.
        pages_ready_after_persist=min(stage.manager.lookup(s.hashes) for stage in stages),
        errors=list(problems.values()),
    )


def fill_stages(s: Session, stages: Sequence[Stage], tiers: Sequence) -> dict:
    """Look every stage's prompt blocks up (region, then tiers) and fill the region from
    verified units; the prefix every stage holds is what the readers load."""
    start = time.perf_counter()
    found = []
    for stage in stages:
        lookup = stage.cache.lookup(s.hashes)
        found.append(lookup.total)
        stage.cache.fetch(s.hashes, lookup)
    for stage in stages:
        stage.cache.drain(s.timeout_s)
        stage.ready = stage.manager.lookup(s.hashes)
    seconds = time.perf_counter() - start
    counters = [t for stage in stages for t in stage.cache.metrics().tiers]
    nbytes = sum(t.bytes_filled for t in counters)
    by_tier = {name: 0 for name, _, _ in tiers}
    for t in counters:
        by_tier[t.name] += t.fills_ok
    return dict(
        pages_found=min(found),
        pages_filled=min(stage.ready for stage in stages),
        pages_loaded_by_stages=sum(t.fills_ok for t in counters),
        pages_by_tier=by_tier,  # stage pages filled from each tier (files, redis)
        # Units read and verified (a stage of another split reads each unit it overlaps).
        unit_reads=sum(getattr(tier.metrics(), "units_loaded", 0) for _, _, tier in tiers),
        units_missed=sum(t.fills_missed for t in counters),
        units_failed=sum(t.fills_failed for t in counters),
        units_refused=sum(t.fills_refused for t in counters),
        bytes=nbytes,
        seconds=seconds,
        gbps=nbytes / seconds / 1e9 if seconds > 0 and nbytes else None,
    )


def promote_stages(s: Session, stages: Sequence[Stage], tiers: Sequence) -> dict:
    """Two tiers: store what the fill got from Redis into the directory (waits for it)."""
    start = time.perf_counter()
    before = store_totals(stages)
    submitted = sum(stage.cache.promote(s.hashes).submitted for stage in stages)
    for stage in stages:
        stage.cache.drain(s.timeout_s)
    seconds = time.perf_counter() - start
    after = store_totals(stages)
    return dict(
        to=tiers[0][0],
        units_submitted=submitted,
        **{key: after[key] - before[key] for key in after},
        seconds=seconds,
    )


def write_engine(s: Session, tiers: Sequence) -> dict:
    """Writer ranks store the prompt into the stages' regions; the stages persist every
    ready page to the tiers; then everything is closed (the regions are gone)."""
    cfg = s.cfg
    stages = []
    try:
        stages = open_stages(s, "writer", tiers=tiers)
        run_w = run_writers(s, stages)
        ready = min(stage.ready for stage in stages)
        print(f"stored: {ready}/{cfg.prompt_blocks} pages ready", file=s.out, flush=True)
        persist = persist_stages(s, stages, tiers)
        where = ", ".join(f"{name} {location}" for name, location, _ in tiers)
        s.progress(
            f"persist: {persist['units_ok']}/{persist['units_expected']} units "
            f"({cfg.prompt_blocks} pages x {len(stages)} stage(s)) to {where}; "
            f"{persist['units_failed']} failed, {persist['units_refused']} refused "
            f"({persist['seconds']:.1f} s)"
        )
    finally:
        try:
            close_stages(stages, s.timeout_s)
        finally:
            close_tiers(s, tiers, "write")
    return dict(writers=run_w, ready=ready, persist=persist)


def read_engine(s: Session, tiers: Sequence) -> dict:
    """A new engine, empty regions: fill them from the tiers, readers load and verify."""
    cfg = s.cfg
    stages = []
    readers = promote = None
    try:
        stages = open_stages(s, "reader", tiers=tiers)
        fill = fill_stages(s, stages, tiers)
        loaded = fill["pages_filled"]
        s.progress(
            f"fill: {fill['pages_found']}/{cfg.prompt_blocks} pages found in the store, "
            f"{loaded} filled from {fill['unit_reads']} verified unit reads "
            f"({fill['units_missed']} missed, {fill['units_failed']} failed) "
            f"({fill['seconds']:.1f} s)"
        )
        if s.stores.promote:
            promote = promote_stages(s, stages, tiers)
            s.progress(
                f"promote: {promote['units_ok']}/{promote['units_submitted']} units from "
                f"{tiers[-1][0]} written to {tiers[0][0]} {tiers[0][1]} "
                f"({promote['units_failed']} failed, {promote['units_refused']} refused)"
            )
        if loaded:
            pages = [stage.manager.acquire(s.hashes[:loaded]) for stage in stages]

            def sources(index: int, first: int, end: int) -> list[Source]:
                stage = stages[index]
                return [Source(stage.rank_args(), first, end, tuple(pages[index]))]

            try:
                readers = run_readers(s, sources, loaded)
            finally:
                for stage, held in zip(stages, pages):
                    stage.manager.release(held)
    finally:
        try:
            close_stages(stages, s.timeout_s)
        finally:
            close_tiers(s, tiers, "read")
    return dict(readers=readers, loaded=loaded, fill=fill, promote=promote)


def run_persistent(s: Session) -> dict:
    """--store: the write engine, the read engine, or one then the other (sharing only files)."""
    cfg = s.cfg
    phase = s.stores.phase
    out: dict[str, Any] = dict(writers=None, readers=None, persist=None, fill=None)
    tiers, s.first_tiers = s.first_tiers, []  # handed to the first engine, which closes them
    if phase in ("write", "both"):
        out.update(write_engine(s, tiers))
        # The read engine shares nothing with the write engine but the files: its own
        # tier objects (indexes rebuilt from disk), its own empty regions.
        tiers = []
        if phase == "both":
            tiers = open_tiers(s.stores, cfg.namespace("reader"), queue_depth(cfg))
    if phase in ("read", "both"):
        out.update(read_engine(s, tiers))
    out["verification"] = verify_persistent(cfg, phase, out)
    return out


def queue_depth(cfg: DemoConfig) -> int:
    """Tier queue depth: room for one prompt of every stage at once (no back-pressure refusals
    in the demo; an engine under load would retry refused stores later)."""
    return max(64, cfg.prompt_blocks * max(cfg.writer_pp, cfg.reader_pp) + 16)


# ------------------------------------------------------------------------ verification


def _last_line(text: str) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "unknown error"


@dataclass
class Verification:
    failures: list[str]
    pages_loaded: int | None
    pages_missed: int | None
    bytes_wrong: int
    bytes_checked: int


def verify(
    cfg: DemoConfig,
    writers: GroupRun | None,
    ready: int,
    readers: GroupRun | None,
    *,
    from_store: bool = False,
) -> Verification:
    """The verdict against the unsharded truth: every prompt page loaded by every reader,
    every layer, block, token and KV head checked by some reader, no byte different.

    ``ready`` is the number of leading prompt pages the readers were given (ready
    in the writers' regions, or, ``from_store``, found in the store and verified).
    """
    failures = []
    for run in (writers, readers):
        if run is None:
            continue
        for index, error in sorted(run.errors.items()):
            failures.append(f"{run.role} rank {index} failed: {_last_line(error)}")
    total = cfg.prompt_blocks
    if ready < total:
        if from_store:
            failures.append(
                f"only {ready}/{total} prompt pages were found in the store and verified; "
                f"the other {total - ready} are missing (never stored, evicted, corrupt or "
                "of another namespace: each a miss, none loaded)"
            )
        else:
            failures.append(
                f"only {ready}/{total} prompt pages became ready (a writer did not store its share)"
            )
    if readers is None:
        failures.append("no reader ran (no page was " + ("found)" if from_store else "ready)"))
        return Verification(failures, 0, total, 0, 0)
    loaded = min((r["pages"] for r in readers.reports.values()), default=0) if readers.ok else 0
    if loaded < ready and readers.ok:
        failures.append(f"the readers loaded {loaded} of the {ready} ready pages")
    bytes_wrong = bytes_checked = 0
    stages = cfg.stages("reader")
    covered: dict[tuple[int, int], set[int]] = {stage: set() for stage in stages}
    for index, r in sorted(readers.reports.items()):
        bytes_checked += r["bytes_checked"]
        layers = (r["first_layer"], r["end_layer"])
        if (
            layers not in covered
            or r["layers"] != layers[1] - layers[0]
            or (r["blocks"] != r["pages"])
        ):
            failures.append(
                f"reader rank {index} checked layers [{layers[0]}, {layers[1]}) "
                f"({r['layers']} layers) of {r['blocks']}/{r['pages']} loaded blocks; "
                f"expected one of the stages {stages}"
            )
        else:
            covered[layers].update(r["heads"])
        if r["local_head_slots"] != [len(r["heads"])]:
            failures.append(
                f"reader rank {index} holds {r['local_head_slots']} head slots but "
                f"{len(r['heads'])} heads were checked"
            )
        wrong = {int(k): v for k, v in r["bytes_wrong_by_layer"].items()}
        if wrong:
            bytes_wrong += sum(wrong.values())
            failures.append(
                f"reader rank {index}: layers {sorted(wrong)} differ from the unsharded truth "
                f"({sum(wrong.values())} bytes)"
            )
    expected_heads = 1 if cfg.attention == "mla" else cfg.total_kv_heads
    if readers.reports:
        for (first, end), heads in covered.items():
            missing = sorted(set(range(expected_heads)) - heads)
            if missing:
                where = f" for layers [{first}, {end})" if len(stages) > 1 else ""
                failures.append(
                    f"KV heads {missing} were held by no reader rank{where}: never verified"
                )
    return Verification(failures, loaded, total - loaded, bytes_wrong, bytes_checked)


def verify_persistent(cfg: DemoConfig, phase: str, out: dict) -> Verification:
    """The verdict of the persistent phases: every unit persisted (write), every prompt page
    loaded from the store and bit-exact (read)."""
    failures: list[str] = []
    persist = out.get("persist")
    writers = out.get("writers")
    if phase in ("write", "both"):
        for index, error in sorted(writers.errors.items()) if writers else ():
            failures.append(f"writer rank {index} failed: {_last_line(error)}")
        ready = out.get("ready", 0)
        if ready < cfg.prompt_blocks:
            failures.append(
                f"only {ready}/{cfg.prompt_blocks} prompt pages became ready (a writer did not "
                "store its share)"
            )
        if persist is not None and persist["units_ok"] < persist["units_expected"]:
            why = "; ".join(persist["errors"][:2])
            failures.append(
                f"{persist['units_expected'] - persist['units_ok']} of "
                f"{persist['units_expected']} units were not persisted "
                f"({persist['units_failed']} failed, {persist['units_refused']} refused"
                f"{': ' + why if why else ''})"
            )
    if phase == "write":
        return Verification(failures, None, None, 0, 0)
    fill = out["fill"]
    result = verify(cfg, None, fill["pages_filled"], out["readers"], from_store=True)
    result.failures = failures + result.failures
    return result


def transfer_stats(run: GroupRun | None) -> dict | None:
    """Bytes, seconds and aggregate GB/s (all ranks concurrently) and the plain-copy ratio."""
    if run is None or not run.ok:
        return None
    reports = list(run.reports.values())
    total = sum(r["bytes"] for r in reports)
    seconds = max(r["seconds"] for r in reports)
    rates = [r["bytes"] / r["seconds"] for r in reports if r["seconds"] > 0]
    copies = [r["bytes"] / r["copy_seconds"] for r in reports if r["copy_seconds"] > 0]
    return dict(
        ranks=len(reports),
        bytes=total,
        seconds=seconds,
        gbps=total / seconds / 1e9 if seconds > 0 else None,
        vs_plain_copy=(sum(rates) / sum(copies)) if rates and copies else None,
    )


def summarize(s: Session, result: dict) -> dict:
    """The run as one JSON-able object (the names are stable: scripts read them)."""
    cfg = s.cfg
    writers, readers = result.get("writers"), result.get("readers")
    verification: Verification = result["verification"]
    phases = {
        "spawn_writers": writers.phase_seconds.get("started") if writers else None,
        "store": writers.phase_seconds.get("stored") if writers else None,
        "persist": result["persist"]["seconds"] if result.get("persist") else None,
        "fill": result["fill"]["seconds"] if result.get("fill") else None,
        "spawn_readers": readers.phase_seconds.get("started") if readers else None,
        "load": readers.phase_seconds.get("loaded") if readers else None,
        "verify": readers.phase_seconds.get("verified") if readers else None,
        "total": s.progress.elapsed(),
    }
    if not s.stores.enabled:
        for key in ("persist", "fill"):
            del phases[key]
    tiers = s.tier_reports
    phase = s.stores.phase if s.stores.enabled else "both"
    roles = {"write": ("writer",), "read": ("reader",)}.get(phase, ("writer", "reader"))
    summary = dict(
        verdict="FAIL" if verification.failures else "PASS",
        failures=verification.failures,
        phase=s.stores.phase if s.stores.enabled else "shared-memory",
        pages_total=cfg.prompt_blocks,
        pages_ready=result.get("ready"),
        pages_loaded=verification.pages_loaded,
        pages_missed=verification.pages_missed,
        corrupt_detected=sum(t["corrupt_detected"] for t in tiers),
        bytes_wrong=verification.bytes_wrong,
        bytes_checked=verification.bytes_checked,
        model=dict(
            preset=cfg.preset,
            name=cfg.identity().name,
            revision=cfg.model_revision,
            attention=cfg.attention,
            layers=cfg.layers,
            kv_heads=cfg.total_kv_heads,
            head_size=cfg.head_size,
            dtype=cfg.dtype,
            block_size=cfg.block_size,
            packing=cfg.packing,
            order=cfg.order,
        ),
        topology=dict(
            **{
                f"{role}_{key}": (value if role in roles else None)
                for role in ("writer", "reader")
                for key, value in (
                    ("tp", cfg.tp(role)),
                    ("pp", cfg.pp(role)),
                    ("stages", [list(r) for r in cfg.stages(role)]),
                )
            },
            device=cfg.device,
            format_id=canonical_format_id(cfg.order),
            parallelism_agnostic=s.geometry.parallelism_agnostic,
        ),
        prompt_tokens=cfg.prompt_tokens,
        region_bytes=region_bytes(cfg, s.geometry),
        seed=cfg.seed,
        store=transfer_stats(writers),
        load=transfer_stats(readers),
        timings_s=phases,
    )
    if s.stores.enabled:
        summary.update(
            namespace=cfg.namespace("reader" if s.stores.phase == "read" else "writer").hex,
            stores=[redact(x) for x in s.stores.locations],
            persist=result.get("persist"),
            fill=result.get("fill"),
            promote=result.get("promote"),
            stores_failed=sum(t["stores_failed"] for t in tiers),
            tiers=tiers,
        )
    return summary


def report(summary: dict, out: TextIO, err: TextIO) -> None:
    """Human lines of the result on ``out``, each failure on ``err``, then PASS or FAIL."""
    for kind, stats in (("store", summary["store"]), ("load", summary["load"])):
        if stats and stats["gbps"] is not None:
            ratio = stats["vs_plain_copy"]
            versus = f" ({ratio:.2f}x a plain copy of the same bytes)" if ratio else ""
            print(
                f"{kind + ':':<6} {stats['bytes'] / 2**20:.1f} MiB by {stats['ranks']} ranks at "
                f"{stats['gbps']:.2f} GB/s{versus}",
                file=out,
            )
    persist, fill = summary.get("persist"), summary.get("fill")
    if persist:
        rate = f" at {persist['gbps']:.2f} GB/s" if persist["gbps"] else ""
        complete = ", ".join(
            f"{name} {n}/{summary['pages_total']}"
            for name, n in persist["pages_complete_in_store"].items()
        )
        print(
            f"persisted: {persist['units_ok']}/{persist['units_expected']} units "
            f"({persist['bytes'] / 2**20:.1f} MiB written{rate}); pages complete in the store "
            f"(every layer): {complete}; still served from the region: "
            f"{persist['pages_ready_after_persist']}/{summary['pages_total']}",
            file=out,
        )
    if fill:
        rate = f" at {fill['gbps']:.2f} GB/s" if fill["gbps"] else ""
        print(
            f"filled: {fill['pages_filled']}/{summary['pages_total']} pages from "
            f"{fill['unit_reads']} verified unit reads ({fill['bytes'] / 2**20:.1f} MiB{rate}); "
            f"corrupt units detected: {summary['corrupt_detected']}",
            file=out,
        )
    m = summary["model"]
    if summary["verdict"] == "PASS":
        if summary["pages_loaded"] is None:
            print(
                f"complete: every layer of all {summary['pages_total']} prompt pages is in the "
                "store, readable by any TP x PP",
                file=out,
            )
        else:
            heads = "the latent" if m["attention"] == "mla" else f"all {m['kv_heads']} KV heads"
            print(
                f"verified: {summary['pages_loaded']}/{summary['pages_total']} pages loaded by "
                f"every reader; {heads} x {summary['prompt_tokens']} tokens x {m['layers']} "
                "layers bit-exact against the unsharded truth",
                file=out,
            )
        print("PASS", file=out, flush=True)
        return
    for failure in summary["failures"]:
        print(f"FAIL: {failure}", file=err, flush=True)
    loaded = summary["pages_loaded"]
    pages = f"pages loaded {loaded}/{summary['pages_total']}, " if loaded is not None else ""
    print(
        f"FAIL: {len(summary['failures'])} problem(s): {pages}{summary['bytes_wrong']} bytes wrong",
        file=out,
        flush=True,
    )


def print_header(s: Session, out: TextIO) -> None:
    cfg, geometry = s.cfg, s.geometry
    print(
        f"model: {cfg.preset} ({cfg.attention} attention, {cfg.layers} layers, "
        f"{cfg.total_kv_heads} KV heads x {cfg.head_size}, {cfg.dtype}, block {cfg.block_size}, "
        f"{cfg.packing} {cfg.order}); device: {cfg.device}",
        file=out,
    )

    def shape(role: str) -> str:
        stages = cfg.stages(role)
        split = f" x PP={len(stages)} {stages}" if len(stages) > 1 else ""
        return f"TP={cfg.tp(role)}{split}"

    phase = s.stores.phase if s.stores.enabled else "both"
    if phase == "write":
        topology = f"topology: writers {shape('writer')} (any topology may read the store)"
    elif phase == "read":
        topology = f"topology: readers {shape('reader')} (whatever topology wrote the store)"
    else:
        topology = f"topologies: writers {shape('writer')} -> readers {shape('reader')}"
    print(
        f"{topology}; format id: {canonical_format_id(cfg.order)}; parallelism agnostic: "
        f"{geometry.parallelism_agnostic}",
        file=out,
    )
    print(
        f"prompt: {cfg.prompt_tokens} tokens = {cfg.prompt_blocks} pages; canonical page "
        f"{geometry.canonical_page_bytes} B per layer, regions "
        f"{cfg.prompt_blocks * geometry.row_bytes / 2**20:.1f} MiB",
        file=out,
    )
    if s.stores.enabled:
        role = "reader" if s.stores.phase == "read" else "writer"
        where = ", ".join(redact(x) for x in s.stores.locations)
        print(
            f"store: {where}; phase {s.stores.phase}; namespace "
            f"{cfg.namespace(role).hex[:16]}... ({cfg.identity().name}"
            f"{'@' + cfg.model_revision if cfg.model_revision else ''})",
            file=out,
        )
    if s.stores.phase != "read":
        print("writers of layer 0, page 0:", file=out)
        print(picture(geometry.writer_groups[0], page_id=0, width=64), file=out, flush=True)


def run_demo(s: Session, err: TextIO) -> dict:
    """Regions, page managers, writers, (tiers), readers, verification: the summary."""
    s.hashes = block_hashes(s.cfg)
    result = run_persistent(s) if s.stores.enabled else run_shared_memory(s)
    for run in (result.get("writers"), result.get("readers")):
        for index, error in sorted(run.errors.items()) if run else ():
            if "\n" in error.strip():  # tracebacks in full (the FAIL lines quote the last line)
                print(f"{run.role} rank {index}: {error.rstrip()}", file=err, flush=True)
    return summarize(s, result)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    out = sys.stderr if args.json else sys.stdout
    tiers: list = []
    try:
        stores = plan_stores(args)
        cfg = build_config(args, args.device)  # pure checks first: answered in a blink
        geometry = plan_geometry(cfg)
        cfg = replace(cfg, device=resolve_device(args.device))  # imports torch
        check_resources(cfg, geometry, persistent=stores.enabled)  # before any O(pages) work
        if stores.enabled:  # the first engine's tiers: a bad root is a usage error, now
            role = "reader" if stores.phase == "read" else "writer"
            tiers = open_tiers(stores, cfg.namespace(role), queue_depth(cfg))
    except UsageError as error:
        parser.fail(str(error))
    pool = rank_pool()  # its server imports torch while the header is printed
    progress = Progress(out)
    session = Session(cfg, geometry, progress, out, args.timeout, pool, stores)
    session.first_tiers = tiers
    print_header(session, out)
    try:
        summary = run_demo(session, sys.stderr)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except UsageError as error:  # the read engine's store became unusable after start-up
        parser.fail(str(error))
    finally:
        for _, _, tier in session.first_tiers:  # not handed to an engine (an early failure)
            tier.close()
    report(summary, out, sys.stderr)
    if args.json:
        print(json.dumps(summary, indent=2), flush=True)
    return 0 if summary["verdict"] == "PASS" else 1
