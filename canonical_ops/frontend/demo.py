"""`python -m canonical_ops demo`: KV stored by one TP group, read bit-exact by another.

A Llama-3-8B-like model (32 layers, 8 KV heads, head 128, bf16, block 16, packed
NHD) by default. TP=4 writer processes each hold their KV-head shard of a prompt's
KV (filled deterministically from the unsharded truth) and store it into one
shared /dev/shm region in the canonical layout; the scheduler-side PageManager
marks a page ready once every elected writer reported it; then TP=2 reader
processes load the ready pages into their own (differently sharded) caches and
compare every byte of every head, token and layer with the unsharded truth.
PASS only when every prompt page was loaded by every reader and the readers
together covered every KV head, bit-exact; every FAIL says what failed.

Runs on CUDA when a GPU is present (pinned region, side streams), on CPU otherwise.
Exit status: 0 PASS, 1 FAIL, 2 a usage error (one line on stderr, checked before
any work: flags, the model's possible topologies, the device, /dev/shm and memory).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
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

# torch is imported where it is used: usage errors are answered without it.

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

MAX_TP = 64  # processes per group on one node (the region takes at most 496 ranks)
MAX_LAYERS = 1024
MAX_PROMPT_TOKENS = 1 << 24  # beyond any model's context; /dev/shm bounds it further
MAX_TIMEOUT_S = 86400.0
MAX_SEED = (1 << 32) - 1
PLAIN_COPY_CAP_BYTES = 256 << 20  # the plain-copy baseline copies at most this much
PROCESS_OVERHEAD_BYTES = 128 << 20  # private memory of one rank process beyond its tensors
SHM_DIR = "/dev/shm"


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

    @property
    def prompt_tokens(self) -> int:
        return self.prompt_blocks * self.block_size

    @property
    def gpu_blocks(self) -> int:
        return self.prompt_blocks + 8  # the prompt's blocks land at scattered block ids

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
        help="TP of the writers; must divide the KV heads or be a multiple of them",
    )
    parser.add_argument(
        "--reader-tp",
        type=int_in(1, MAX_TP),
        default=2,
        help="TP of the readers; must divide the KV heads or be a multiple of them",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int_in(1, MAX_PROMPT_TOKENS),
        default=2048,
        help="prompt length (rounded up to whole blocks)",
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
        help="seconds each process group may take",
    )
    parser.add_argument(
        "--seed",
        type=int_in(0, MAX_SEED),
        default=0,
        help="seed of the prompt's KV and of the block tables",
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
    cfg = DemoConfig(
        attention=preset.attention,
        layers=args.layers or preset.layers,
        total_kv_heads=preset.kv_heads,
        head_size=preset.head_size,
        dtype=preset.dtype,
        block_size=preset.block_size,
        packing=args.packing,
        order=args.order,
        writer_tp=args.writer_tp,
        reader_tp=args.reader_tp,
        prompt_blocks=-(-args.prompt_tokens // preset.block_size),
        device=device,
        seed=args.seed,
        preset=args.preset,
    )
    for flag, tp in (("--writer-tp", cfg.writer_tp), ("--reader-tp", cfg.reader_tp)):
        problem = cfg.topology_problem(tp)
        if problem is not None:
            raise UsageError(f"{flag} {tp}: {args.preset} cannot run there: {problem}")
    return cfg


@dataclass(frozen=True)
class Geometry:
    """Canonical mappings of both groups and the region they share (O(layers) to build)."""

    writer_groups: list[tuple[CanonicalPageMapping, ...]]
    reader_groups: list[tuple[CanonicalPageMapping, ...]]
    row_bytes: int
    canonical_page_bytes: int  # of one layer

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


def region_bytes(cfg: DemoConfig, geometry: Geometry) -> int:
    from canonical_ops.frontend.shared_region import HEADER_BYTES

    return HEADER_BYTES + cfg.prompt_blocks * geometry.row_bytes


def rank_tensor_bytes(cfg: DemoConfig, geometry: Geometry, tp: int) -> tuple[int, int]:
    """(KV cache bytes, transient bytes) of one rank: caches, one layer's truth, plain copy."""
    kv = cfg.layers * cfg.gpu_blocks * cfg.spec(tp).page_size_bytes
    truth = 2 * cfg.prompt_blocks * geometry.canonical_page_bytes  # truth + its shard
    moved = cfg.layers * cfg.prompt_blocks * cfg.spec(tp).page_size_bytes
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


def check_resources(cfg: DemoConfig, geometry: Geometry, shm_dir: str = SHM_DIR) -> None:
    """Refuse (UsageError) a run that cannot fit, before any O(pages) work.

    The shared region must fit in ``shm_dir``'s free space; the region plus the
    larger group's caches and transients must fit in available memory (host
    memory on CPU; on CUDA the caches must fit in the GPU's free memory).
    """
    size = region_bytes(cfg, geometry)
    vfs = os.statvfs(shm_dir)
    free = vfs.f_bavail * vfs.f_frsize
    hint = "use fewer --prompt-tokens or --layers"
    if size > free:
        raise UsageError(
            f"--prompt-tokens {cfg.prompt_tokens}: the shared region needs {_gib(size)} but "
            f"{shm_dir} has only {_gib(free)} free; {hint} (docker: --shm-size)"
        )
    kv, transient = {}, {}
    for tp in (cfg.writer_tp, cfg.reader_tp):
        per_kv, per_transient = rank_tensor_bytes(cfg, geometry, tp)
        kv[tp], transient[tp] = tp * per_kv, tp * (per_transient + PROCESS_OVERHEAD_BYTES)
    groups = (cfg.writer_tp, cfg.reader_tp)  # run one after the other
    if cfg.device == "cuda":
        import torch

        gpu_free, _ = torch.cuda.mem_get_info(0)
        gpu_need = max(kv[tp] for tp in groups)
        if gpu_need > gpu_free:
            raise UsageError(
                f"--prompt-tokens {cfg.prompt_tokens}: the ranks' KV caches need "
                f"{_gib(gpu_need)} of GPU memory but only {_gib(gpu_free)} is free; {hint}"
            )
        host_need = size + max(transient[tp] for tp in groups)
    else:
        host_need = size + max(kv[tp] + transient[tp] for tp in groups)
    available = _mem_available()
    if available is not None and host_need > available:
        raise UsageError(
            f"--prompt-tokens {cfg.prompt_tokens}: the region and the ranks' tensors need "
            f"about {_gib(host_need)} of memory but only {_gib(available)} is available; {hint}"
        )


# ------------------------------------------------------------------------ tensors


def _bits_dtype(cfg: DemoConfig):
    """The integer dtype whose bit patterns stand for the KV dtype's values."""
    import torch

    elem = LayerSpec("full", 1, 1, 1, cfg.dtype, "packed", "NHD").element_size
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[elem]


def truth_layer(cfg: DemoConfig, layer: int, num_blocks: int | None = None):
    """The unsharded KV of the prompt's first ``num_blocks`` blocks for one layer, as bits.

    Full attention: (blocks, tokens, heads, 2 * head_size) with K then V in the
    last dim; MLA: (blocks, tokens, latent). Deterministic in (seed, layer).
    """
    import torch

    gen = torch.Generator().manual_seed(cfg.seed * 1000003 + layer)
    bits = _bits_dtype(cfg)
    if cfg.attention == "mla":
        shape = (cfg.prompt_blocks, cfg.block_size, cfg.head_size)
    else:
        shape = (cfg.prompt_blocks, cfg.block_size, cfg.total_kv_heads, 2 * cfg.head_size)
    if bits == torch.uint8:
        truth = torch.randint(0, 256, shape, generator=gen, dtype=bits)
    else:
        info = torch.iinfo(bits)
        truth = torch.randint(info.min, info.max, shape, generator=gen, dtype=bits)
    return truth if num_blocks is None else truth[:num_blocks]


def allocate_kv(cfg: DemoConfig, tp: int, device) -> list:
    """Per-layer caches in the physical layout of (packing, order), as int bit patterns."""
    import torch

    heads, bs, hs = cfg.heads_per_rank(tp), cfg.block_size, cfg.head_size
    bits = _bits_dtype(cfg)
    caches = []
    for _ in range(cfg.layers):
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


def compare_with_truth(cfg: DemoConfig, tp: int, rank: int, kv: Sequence, blocks) -> dict:
    """Every byte of the rank's loaded blocks, every layer, against the unsharded truth.

    Returns what was checked (layers, blocks, tokens, the global heads of every
    local head slot) and the differing bytes per layer; the coordinator checks
    that the readers together covered every head.
    """
    import torch

    heads = cfg.global_heads(tp, rank)
    wrong: dict[int, int] = {}
    checked = 0
    slots = set()
    for layer in range(cfg.layers):
        got = from_cache_blocks(cfg, kv[layer][blocks])
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
        layers=cfg.layers,
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


def writer_rank(cfg: DemoConfig, rank: int, worker, kv, page_ids, emit) -> dict:
    """Fill this writer's caches from the truth and store the prompt's blocks."""
    import torch

    device = kv[0].device
    blocks = block_table(cfg, salt=1).to(device)
    for layer in range(cfg.layers):
        kv[layer][blocks] = shard_of(cfg, truth_layer(cfg, layer), cfg.writer_tp, rank).to(device)
    emit("started")
    # Transfers are idempotent: the first warms page tables and caches, the second is timed.
    worker.wait(worker.store(block_ids=blocks, page_ids=torch.tensor(page_ids)))
    job = worker.wait(worker.store(block_ids=blocks, page_ids=torch.tensor(page_ids)))
    emit("stored")
    return dict(pages=len(page_ids), bytes=job.num_bytes, seconds=job.seconds)


def reader_rank(cfg: DemoConfig, rank: int, worker, kv, page_ids, emit) -> dict:
    """Load the ready pages into this reader's caches and check them against the truth."""
    import torch

    device = kv[0].device
    blocks = block_table(cfg, salt=2)[: len(page_ids)].to(device)
    emit("started")
    pages = torch.tensor(page_ids, dtype=torch.int64)
    worker.wait(worker.load(block_ids=blocks, page_ids=pages))
    job = worker.wait(worker.load(block_ids=blocks, page_ids=pages))
    emit("loaded")
    check = compare_with_truth(cfg, cfg.reader_tp, rank, kv, blocks)
    emit("verified")
    return dict(pages=len(page_ids), bytes=job.num_bytes, seconds=job.seconds, **check)


def rank_main(
    role: str, cfg_dict: dict, rank: int, region_args: dict, page_ids: list[int], events
) -> None:
    """One writer or reader process; reports milestones and its result through ``events``."""

    def emit(event: str, payload: Any = None) -> None:
        events.put((event, rank, payload))

    try:
        import torch

        from canonical_ops.frontend import OffloadWorker, SharedOffloadRegion

        torch.set_num_threads(1)
        cfg = DemoConfig(**cfg_dict)
        tp = cfg.writer_tp if role == "writer" else cfg.reader_tp
        device = torch.device(cfg.device)
        if device.type == "cuda":
            torch.cuda.set_device(0)
        region = SharedOffloadRegion(**region_args)
        try:
            kv = allocate_kv(cfg, tp, device)
            ctx = RankContext(tp, cfg.total_kv_heads, rank)
            # The caches hold int bit patterns; the worker checks dtypes, so it gets typed views.
            typed = [t.view(getattr(torch, cfg.dtype)) for t in kv]
            worker = OffloadWorker(typed, [cfg.spec(tp)] * cfg.layers, ctx, region)
            body = writer_rank if role == "writer" else reader_rank
            report = body(cfg, rank, worker, kv, page_ids, emit)
            report["copy_seconds"] = plain_copy_seconds(max(report["bytes"], 1), device)
            del worker, kv
        finally:
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
    """What one process group reported."""

    role: str
    tp: int
    reports: dict[int, dict] = field(default_factory=dict)  # rank -> final report
    errors: dict[int, str] = field(default_factory=dict)  # rank -> why it failed
    phase_seconds: dict[str, float] = field(default_factory=dict)  # milestone -> since previous

    @property
    def ok(self) -> bool:
        return not self.errors and len(self.reports) == self.tp


def run_group(
    pool,
    role: str,
    cfg: DemoConfig,
    tp: int,
    first_rank: int,
    region_args: dict,
    page_ids: list[int],
    timeout_s: float,
    progress: Progress,
    milestones: dict[str, str],
) -> GroupRun:
    """Run ``tp`` rank processes; print a line when all live ranks reach each milestone."""
    run = GroupRun(role, tp)
    events = pool.Queue()
    procs = {}
    plural = f"{role}s"
    progress(f"{plural}: spawning {tp} process{'es' if tp > 1 else ''} (TP={tp})")
    start = last = time.perf_counter()
    reached: dict[str, set[int]] = {m: set() for m in milestones}
    announced: set[str] = set()
    dead_since: dict[int, float] = {}
    try:
        for rank in range(tp):
            args = dict(region_args, rank=first_rank + rank)
            p = pool.Process(
                target=rank_main, args=(role, asdict(cfg), rank, args, page_ids, events)
            )
            p.start()
            procs[rank] = p
        deadline = start + timeout_s
        while len(run.reports) + len(run.errors) < tp:
            now = time.perf_counter()
            if now >= deadline:
                for rank in procs:
                    if rank not in run.reports and rank not in run.errors:
                        run.errors[rank] = f"no report within --timeout {timeout_s:g} s"
                break
            try:
                event, rank, payload = events.get(timeout=min(0.5, deadline - now))
            except Exception:  # queue.Empty: look for ranks that died without a word
                for rank, p in procs.items():
                    if rank in run.reports or rank in run.errors or p.exitcode is None:
                        continue
                    first = dead_since.setdefault(rank, now)
                    if now - first > 2.0:  # its last words had time to arrive
                        run.errors[rank] = f"process exited with code {p.exitcode} before reporting"
            else:
                if event == "done":
                    run.reports[rank] = payload
                elif event == "error":
                    run.errors[rank] = payload
                elif event in reached:
                    reached[event].add(rank)
            live = tp - len(run.errors)
            for milestone, words in milestones.items():
                if milestone not in announced and live and len(reached[milestone]) >= live:
                    announced.add(milestone)
                    now = time.perf_counter()
                    run.phase_seconds[milestone] = now - last
                    progress(
                        f"{plural}: {len(reached[milestone])}/{tp} {words} ({now - last:.1f} s)"
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


@dataclass
class Session:
    """State shared by the phases of one demo run."""

    cfg: DemoConfig
    geometry: Geometry
    progress: Progress
    out: TextIO
    timeout_s: float
    pool: Any = None
    manager: Any = None
    hashes: list = field(default_factory=list)
    page_ids: list[int] = field(default_factory=list)
    generations: list[int] = field(default_factory=list)  # of page_ids, read at allocate
    region_args: dict = field(default_factory=dict)


def run_writers(s: Session) -> tuple[GroupRun, int]:
    """The writer engine: allocate pages, let every writer store its share; pages ready."""
    cfg = s.cfg
    run = run_group(
        s.pool,
        "writer",
        cfg,
        cfg.writer_tp,
        1,
        s.region_args,
        s.page_ids,
        s.timeout_s,
        s.progress,
        {"started": "started (caches filled)", "stored": "stored their share"},
    )
    for rank in run.reports:
        for page, generation in zip(s.page_ids, s.generations):
            if rank in s.manager.writer_ranks(page):
                s.manager.complete_store(page, rank, generation=generation)
    return run, s.manager.lookup(s.hashes)


def run_readers(s: Session, ready: int) -> GroupRun:
    """The reader engine: load the ready prefix of the prompt's pages, check every byte."""
    cfg = s.cfg
    pages = s.manager.acquire(s.hashes[:ready])
    try:
        return run_group(
            s.pool,
            "reader",
            cfg,
            cfg.reader_tp,
            1 + cfg.writer_tp,
            s.region_args,
            pages,
            s.timeout_s,
            s.progress,
            {
                "started": "started",
                "loaded": "loaded",
                "verified": "compared with the unsharded truth",
            },
        )
    finally:
        s.manager.release(pages)


def _last_line(text: str) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "unknown error"


@dataclass
class Verification:
    failures: list[str]
    pages_loaded: int
    pages_missed: int
    bytes_wrong: int
    bytes_checked: int


def verify(
    cfg: DemoConfig, writers: GroupRun, ready: int, readers: GroupRun | None
) -> Verification:
    """The verdict against the unsharded truth: every prompt page loaded by every reader,
    every layer, block, token and KV head checked by some reader, no byte different."""
    failures = []
    for run in (writers, readers):
        if run is None:
            continue
        for rank, error in sorted(run.errors.items()):
            failures.append(f"{run.role} rank {rank} failed: {_last_line(error)}")
    total = cfg.prompt_blocks
    if ready < total:
        failures.append(
            f"only {ready}/{total} prompt pages became ready (a writer did not store its share)"
        )
    if readers is None:
        failures.append("no reader ran (no page was ready)")
        return Verification(failures, 0, total, 0, 0)
    loaded = min((r["pages"] for r in readers.reports.values()), default=0) if readers.ok else 0
    if loaded < ready and readers.ok:
        failures.append(f"the readers loaded {loaded} of the {ready} ready pages")
    covered: set[int] = set()
    bytes_wrong = bytes_checked = 0
    for rank, r in sorted(readers.reports.items()):
        bytes_checked += r["bytes_checked"]
        if r["layers"] != cfg.layers or r["blocks"] != r["pages"]:
            failures.append(
                f"reader rank {rank} checked {r['layers']}/{cfg.layers} layers of "
                f"{r['blocks']}/{r['pages']} loaded blocks"
            )
        if r["local_head_slots"] != [len(r["heads"])]:
            failures.append(
                f"reader rank {rank} holds {r['local_head_slots']} head slots but "
                f"{len(r['heads'])} heads were checked"
            )
        covered.update(r["heads"])
        wrong = {int(k): v for k, v in r["bytes_wrong_by_layer"].items()}
        if wrong:
            bytes_wrong += sum(wrong.values())
            failures.append(
                f"reader rank {rank}: layers {sorted(wrong)} differ from the unsharded truth "
                f"({sum(wrong.values())} bytes)"
            )
    expected_heads = 1 if cfg.attention == "mla" else cfg.total_kv_heads
    missing = sorted(set(range(expected_heads)) - covered)
    if readers.reports and missing:
        failures.append(f"KV heads {missing} were held by no reader rank: never verified")
    return Verification(failures, loaded, total - loaded, bytes_wrong, bytes_checked)


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


def summarize(
    s: Session,
    writers: GroupRun,
    ready: int,
    readers: GroupRun | None,
    verification: Verification,
) -> dict:
    """The run as one JSON-able object (the names are stable: scripts read them)."""
    cfg = s.cfg
    phases = {
        "spawn_writers": writers.phase_seconds.get("started"),
        "store": writers.phase_seconds.get("stored"),
        "spawn_readers": readers.phase_seconds.get("started") if readers else None,
        "load": readers.phase_seconds.get("loaded") if readers else None,
        "verify": readers.phase_seconds.get("verified") if readers else None,
        "total": s.progress.elapsed(),
    }
    return dict(
        verdict="FAIL" if verification.failures else "PASS",
        failures=verification.failures,
        pages_total=cfg.prompt_blocks,
        pages_ready=ready,
        pages_loaded=verification.pages_loaded,
        pages_missed=verification.pages_missed,
        bytes_wrong=verification.bytes_wrong,
        bytes_checked=verification.bytes_checked,
        model=dict(
            preset=cfg.preset,
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
            writer_tp=cfg.writer_tp,
            reader_tp=cfg.reader_tp,
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
    m = summary["model"]
    if summary["verdict"] == "PASS":
        heads = "the latent" if m["attention"] == "mla" else f"all {m['kv_heads']} KV heads"
        print(
            f"verified: {summary['pages_loaded']}/{summary['pages_total']} pages loaded by "
            f"every reader; {heads} x {summary['prompt_tokens']} tokens x {m['layers']} layers "
            f"bit-exact against the unsharded truth",
            file=out,
        )
        print("PASS", file=out, flush=True)
        return
    for failure in summary["failures"]:
        print(f"FAIL: {failure}", file=err, flush=True)
    print(
        f"FAIL: {len(summary['failures'])} problem(s): pages loaded "
        f"{summary['pages_loaded']}/{summary['pages_total']}, {summary['bytes_wrong']} bytes wrong",
        file=out,
        flush=True,
    )


def print_header(cfg: DemoConfig, geometry: Geometry, out: TextIO) -> None:
    print(
        f"model: {cfg.preset} ({cfg.attention} attention, {cfg.layers} layers, "
        f"{cfg.total_kv_heads} KV heads x {cfg.head_size}, {cfg.dtype}, block {cfg.block_size}, "
        f"{cfg.packing} {cfg.order}); device: {cfg.device}",
        file=out,
    )
    print(
        f"topologies: writers TP={cfg.writer_tp} -> readers TP={cfg.reader_tp}; format id: "
        f"{canonical_format_id(cfg.order)}; parallelism agnostic: "
        f"{geometry.parallelism_agnostic}",
        file=out,
    )
    print(
        f"prompt: {cfg.prompt_tokens} tokens = {cfg.prompt_blocks} pages; canonical page "
        f"{geometry.canonical_page_bytes} B per layer, region "
        f"{cfg.prompt_blocks * geometry.row_bytes / 2**20:.1f} MiB",
        file=out,
    )
    print("writers of layer 0, page 0:", file=out)
    print(picture(geometry.writer_groups[0], page_id=0, width=64), file=out, flush=True)


def run_demo(s: Session, err: TextIO) -> dict:
    """Region, page manager, writers, readers, verification: the summary of one run."""
    from canonical_ops.frontend import PageManager, SharedOffloadRegion

    cfg = s.cfg
    s.manager = PageManager.from_mappings(cfg.prompt_blocks, s.geometry.writer_groups)
    s.hashes = [f"prompt-block-{i}".encode() for i in range(cfg.prompt_blocks)]
    s.page_ids = s.manager.allocate(s.hashes)
    s.generations = [s.manager.generation(page) for page in s.page_ids]
    s.region_args = dict(
        engine_id=f"demo-{os.getpid()}-{uuid.uuid4().hex[:8]}",
        num_rows=cfg.prompt_blocks,
        row_bytes=s.geometry.row_bytes,
        world_size=1 + cfg.writer_tp + cfg.reader_tp,
        pin=cfg.device == "cuda",
    )
    region = SharedOffloadRegion(**s.region_args, rank=0)
    try:
        writers, ready = run_writers(s)
        print(f"stored: {ready}/{cfg.prompt_blocks} pages ready", file=s.out, flush=True)
        readers = run_readers(s, ready) if ready else None
    finally:
        region.close()
        # Readers that never attached (failed writers, nothing ready) leave the region's
        # "closed before every rank attached" marker: this engine id is never reused.
        SharedOffloadRegion.remove_closed_marker(s.region_args["engine_id"])
    verification = verify(cfg, writers, ready, readers)
    for run in (writers, readers):  # tracebacks in full (the FAIL lines quote their last line)
        for rank, error in sorted(run.errors.items()) if run else ():
            if "\n" in error.strip():
                print(f"{run.role} rank {rank}: {error.rstrip()}", file=err, flush=True)
    return summarize(s, writers, ready, readers, verification)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    out = sys.stderr if args.json else sys.stdout
    try:
        cfg = build_config(args, args.device)  # pure checks first: answered in a blink
        geometry = plan_geometry(cfg)
        cfg = replace(cfg, device=resolve_device(args.device))  # imports torch
        check_resources(cfg, geometry)  # before any O(pages) work
    except UsageError as error:
        parser.fail(str(error))
    pool = rank_pool()  # its server imports torch while the header is printed
    progress = Progress(out)
    print_header(cfg, geometry, out)
    session = Session(cfg, geometry, progress, out, args.timeout, pool)
    try:
        summary = run_demo(session, sys.stderr)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    report(summary, out, sys.stderr)
    if args.json:
        print(json.dumps(summary, indent=2), flush=True)
    return 0 if summary["verdict"] == "PASS" else 1
