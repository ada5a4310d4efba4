"""Canonical store / load vs the baselines a user would pick, same run, same bytes (CPU, CUDA).

Workload: rank 0 of a TP group of a 128-dim bf16 model with 8 KV heads, block 16 (TP 1/2/4/8 x
NHD/HND x packed/split; fragments 256 B ... 64 KiB), plus an MLA 576-wide latent (18 KiB pages)
and dense references (a TP=1 page cut into exact 256 B ... 4 KiB fragments, so the destination
is dense: the kernel's per-fragment overhead without the sparse-access cost of a TP rank that
writes 1/TP of every canonical page). Block and page ids are random permutations; one CPU row
holds one canonical page of every layer (pages_per_row = 1, layer areas consecutive).

Methods, each moving exactly the fragments the canonical op moves:
  limit        one contiguous copy of the same byte count (CPU: best of torch copy_, numpy
               copyto, and numpy copyto split over torch's thread count; CUDA:
               cudaMemcpyAsync to / from pinned memory);
  canonical    canonical_ops.store / load (one fused call; on CUDA including the upload of
               the host ids: one H2D copy of both id arrays, then the kernel);
  vllm         vLLM-style host expansion (numpy: block base + fragment offsets broadcast into
               preallocated descriptor arrays). CPU: the expansion alone, reported as host
               work, and expansion + the canonical CPU kernel's copy loop over the
               descriptors (vllm_host); CUDA: expansion + ONE cuMemcpyBatchAsync
               (cuda-python entry point);
  pre_expanded CPU: that copy loop over descriptors expanded once before timing: our kernel's
               copy without any expansion, i.e. what the access pattern itself allows;
  uva_kernel   CUDA: the same expansion, one H2D copy of the descriptors, then a descriptor-
               driven copy kernel through UVA (vLLM's Triton-loader idea, our CUDA code, the
               same SM budget and lane/vector scheme as our kernel);
  per_fragment CUDA: the same expansion, then one cudaMemcpyAsync per fragment (C loop);
  pytorch      plain PyTorch: per layer and fragment run, strided views and
               ``dst[ids] = src[ids]`` (CUDA: gathered runs cross devices with .cpu() / .to()).

Timing: warm-up, then all methods of a case round-robin (same background load), best of N.
CPU: perf_counter around the call. CUDA: CUDA events bracketing the call on a side stream
(so host work before the first copy counts), host enqueue time = perf_counter around the call
only. Every measured call sits in an NVTX range (``nvtx`` package, else torch.cuda.nvtx).
Before timing, each method's bytes are checked against canonical_ops on small cases.

Outputs in --out: bench_<device>.json, bench_<device>.md (tables, goals) and, with matplotlib,
gbps_vs_fragment_<device>.png, host_time_vs_blocks_<device>.png, host_time_vs_layers_<device>.png
(re-render from the JSON anywhere with ``python bench/report.py OUT/bench_<device>.json``).

Usage:
  python bench/bench_transfer.py --quick --out DIR        # < 2 min on a 2-core CPU machine
  python bench/bench_transfer.py --device cuda --quick --out DIR
  python bench/bench_transfer.py --out DIR                # full sweep (CPU: ~4 min, ~6 GiB RAM)
  python bench/bench_transfer.py --only "split NHD TP8" --sections fragments   # one case
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import _baselines as bl
import report
from _results import (
    DIRECTIONS,
    MethodKey,
    results_to_json,
    verification_from_json,
    verification_to_json,
)

import canonical_ops
from canonical_ops.plan import spec_geometry
from layouts import LayerSpec, derive_group_mappings

KV_HEADS, HEAD, BLOCK = 8, 128, 16
CUDA_PLAN_MAX_FRAGMENT = 2048  # canonical_ops' default CUDA work-item size
# The CPU limit: the best of these contiguous copies of the same byte count (no direction:
# one copy of n bytes is the limit of a store and of a load alike).
CPU_LIMITS = (MethodKey("limit_torch"), MethodKey("limit_numpy"), MethodKey("limit_numpythreads"))


# ----------------------------------------------------------------------------- NVTX


def _nvtx_backend() -> tuple[str, Callable[[str], contextlib.AbstractContextManager]]:
    try:
        import nvtx

        return "nvtx", lambda msg: nvtx.annotate(msg, color="green", domain="canonical-kv")
    except ImportError:
        pass
    if torch.version.cuda is not None:
        return "torch.cuda.nvtx", torch.cuda.nvtx.range
    return "none", lambda msg: contextlib.nullcontext()


NVTX_BACKEND, nvtx_range = _nvtx_backend()


# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "sparse" (TP > 1), "dense" (whole page / dense reference), "mla"
    spec: LayerSpec
    tp: int
    total_heads: int
    split_bytes: int | None = None  # dense references: exact fragment size

    def mapping(self):
        return derive_group_mappings(self.spec, self.tp, self.total_heads)[0]

    def fragments(self) -> np.ndarray:
        return bl.split_fragments(self.mapping().fragments(), self.split_bytes)

    @property
    def fragment_bytes(self) -> int:
        return int(self.fragments()[:, 2].max())


def real_cases() -> list[Case]:
    cases = []
    for tp in (8, 4, 2, 1):
        for packing in ("split", "packed"):
            for order in ("NHD", "HND"):
                spec = LayerSpec("full", BLOCK, KV_HEADS // tp, HEAD, "bfloat16", packing, order)
                kind = "sparse" if tp > 1 else "dense"
                cases.append(Case(f"{packing} {order} TP{tp}", kind, spec, tp, KV_HEADS))
    mla = LayerSpec("mla", BLOCK, 1, 576, "bfloat16", "packed", "NHD")
    cases.append(Case("MLA 576 TP1", "mla", mla, 1, 1))
    return sorted(cases, key=lambda c: (c.fragment_bytes, c.name))


def dense_references(sizes: tuple[int, ...]) -> list[Case]:
    spec = LayerSpec("full", BLOCK, KV_HEADS, HEAD, "bfloat16", "packed", "HND")
    return [
        Case(f"dense ref {_size(s)} (TP1 page cut)", "dense-ref", spec, 1, KV_HEADS, s)
        for s in sizes
    ]


def _size(n: int) -> str:
    return f"{n // 1024} KiB" if n >= 1024 and n % 1024 == 0 else f"{n} B"


def frag_blocks(case: Case, cfg: Config) -> int:
    """Blocks so the case moves ~cfg.frag_target_bytes (every case well beyond the LLC)."""
    per_block = cfg.frag_layers * case.mapping().local_page_size_bytes
    return max(16, min(16384, cfg.frag_target_bytes // per_block))


def case_by_name(name: str) -> Case:
    for case in real_cases():
        if case.name.lower() == name.lower():
            return case
    raise SystemExit(f"unknown case {name!r}; cases: {[c.name for c in real_cases()]}")


# ----------------------------------------------------------------------------- config


@dataclass
class Config:
    frag_target_bytes: int  # bytes each fragment-sweep case moves (blocks derived per case)
    frag_layers: int
    dense_sizes: tuple[int, ...]
    sweep_blocks: tuple[int, ...]
    sweep_blocks_layers: int
    sweep_layers: tuple[int, ...]
    sweep_layers_blocks: int
    sm_budgets: tuple[int, ...]
    repeats: int
    warmup: int
    per_fragment_max_calls: int
    verify_blocks: int = 24
    verify_layers: int = 2


def make_config(quick: bool, cuda: bool) -> Config:
    if quick:
        return Config(
            frag_target_bytes=128 << 20,
            frag_layers=4,
            dense_sizes=(256, 512, 1024, 4096),
            sweep_blocks=(16, 64, 256, 1024, 4096, 16384),
            sweep_blocks_layers=1,
            sweep_layers=(1, 8, 32, 80),
            sweep_layers_blocks=64,
            sm_budgets=(2, 4, 8, 16),
            repeats=5 if cuda else 15,  # CPU: noisy shared VMs need more samples
            warmup=1,
            per_fragment_max_calls=1 << 16,
        )
    return Config(
        frag_target_bytes=512 << 20,
        frag_layers=8,
        dense_sizes=(256, 512, 1024, 2048, 4096, 8192, 16384),
        sweep_blocks=(16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
        sweep_blocks_layers=4,
        sweep_layers=(1, 2, 4, 8, 16, 32, 61, 80),
        sweep_layers_blocks=256,
        sm_budgets=(1, 2, 4, 8, 16, 32),
        repeats=11,
        warmup=2,
        per_fragment_max_calls=1 << 18,
    )


# ----------------------------------------------------------------------------- workspace


_PAGE = 4096
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _page_aligned(nbytes: int, *, huge: bool = False, **kwargs) -> torch.Tensor:
    """A uint8 tensor starting on a 4 KiB boundary, as a real page store does (a shared
    memory region or a pinned cudaHostAlloc buffer). torch's CPU allocator returns addresses
    64 bytes past a page boundary, which would make every 4 KiB fragment straddle two pages.

    ``huge`` (CPU, not yet touched): 2 MiB-aligned and madvise(MADV_HUGEPAGE)'d, as
    SharedOffloadRegion asks for its mapping, so transparent huge pages back it where
    the kernel allows (see :func:`anon_huge_page_bytes`)."""
    align = _HUGE_PAGE if huge else _PAGE
    raw = torch.empty(nbytes + align, dtype=torch.uint8, **kwargs)
    out = raw[(-raw.data_ptr()) % align :][:nbytes]
    if huge:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        length = nbytes // _HUGE_PAGE * _HUGE_PAGE
        if length and libc.madvise(out.data_ptr(), length, _MADV_HUGEPAGE) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE) failed")
    return out


def anon_huge_page_bytes() -> int:
    """This process's memory backed by transparent huge pages (smaps_rollup), 0 if unknown."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Workspace:
    """Pools reused by every case (no per-case allocation, pinned once on CUDA)."""

    def __init__(
        self,
        device: torch.device,
        kv_bytes: int,
        pages_bytes: int,
        desc_words: int,
        *,
        huge_pages: bool = False,
    ):
        cuda = device.type == "cuda"
        self.device, self.cuda = device, cuda
        huge = huge_pages and not cuda  # pinned CUDA host memory is the driver's
        with nvtx_range("workspace"):
            self.kv = _page_aligned(kv_bytes, device=device, huge=huge)
            self.kv.fill_(1)
            self.pages = _page_aligned(pages_bytes, pin_memory=cuda, huge=huge)
            self.pages.fill_(2)
            # The limit's other side (CPU: destination; CUDA: pinned host end of the copy).
            self.limit = _page_aligned(kv_bytes, pin_memory=cuda, huge=huge)
            self.limit.fill_(3)
            self.desc = torch.empty(desc_words, dtype=torch.int64, pin_memory=cuda)
            self.desc_np = self.desc.numpy()
            self.desc_dev = (
                torch.empty(desc_words, dtype=torch.int64, device=device) if cuda else None
            )


@dataclass
class Setup:
    case: Case
    blocks: int
    layers: int
    kv: list[torch.Tensor]  # uint8 (blocks, page) views
    kv_typed: list[torch.Tensor]  # the same memory as the caches the spec describes
    pages: torch.Tensor
    plan: torch.Tensor
    frags: list[np.ndarray]
    geo: bl.Geometry
    block_np: np.ndarray
    page_np: np.ndarray
    block_ids: torch.Tensor  # kv device
    page_ids: torch.Tensor  # kv device
    page_ids_cpu: torch.Tensor
    ids_host: torch.Tensor | None = None  # CUDA: pinned (2, n)
    ids_dev: torch.Tensor | None = None  # CUDA: (2, n)
    expanders: dict[str, bl.DescriptorExpander] = field(default_factory=dict)
    torch_baseline: bl.TorchBaseline | None = None

    @property
    def bytes(self) -> int:
        return self.blocks * self.geo.bytes_per_pair

    @property
    def descriptors(self) -> int:
        return self.blocks * self.geo.fragments_per_pair


def needs(case: Case, blocks: int, layers: int) -> tuple[int, int, int]:
    m = case.mapping()
    frags = case.fragments()
    return (
        blocks * layers * m.local_page_size_bytes,
        blocks * layers * m.canonical_page_size_bytes,
        3 * blocks * layers * frags.shape[0],
    )


def typed_view(blocks: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    """The cache ``spec`` describes, over a uint8 (num_blocks, page bytes) tensor's memory."""
    shape, strides = spec_geometry(spec)
    elements = blocks.view(getattr(torch, spec.dtype))
    return elements.as_strided((blocks.shape[0], *shape), (elements.stride(0), *strides))


def build_setup(ws: Workspace, case: Case, blocks: int, layers: int, seed: int = 0) -> Setup:
    mapping = case.mapping()
    frags = case.fragments()
    page = mapping.local_page_size_bytes
    kv = [
        ws.kv[layer * blocks * page : (layer + 1) * blocks * page].view(blocks, page)
        for layer in range(layers)
    ]
    row_bytes = layers * mapping.canonical_page_size_bytes
    pages = ws.pages[: blocks * row_bytes].view(blocks, row_bytes)
    plan_split = case.split_bytes
    if ws.cuda and plan_split:
        plan_split = min(plan_split, CUDA_PLAN_MAX_FRAGMENT)
    # The op gets each layer as the typed cache its mapping was derived for (make_plan checks
    # it); the baselines and the byte checks use byte views of the same memory.
    kv_typed = [typed_view(t, case.spec) for t in kv]
    plan = canonical_ops.make_plan(
        [mapping] * layers, kv_typed, pages, max_fragment_bytes=plan_split
    )
    areas = canonical_ops.default_area_offsets([mapping] * layers, 1)
    geo = bl.Geometry(
        frags=tuple([frags] * layers),
        kv_ptrs=tuple(t.data_ptr() for t in kv),
        block_strides=tuple(t.stride(0) for t in kv),
        pages_ptr=pages.data_ptr(),
        row_bytes=pages.stride(0),
        area_offsets=tuple(areas),
    )
    gen = torch.Generator().manual_seed(seed)
    block_cpu = torch.randperm(blocks, generator=gen)
    page_cpu = torch.randperm(blocks, generator=gen)
    setup = Setup(
        case=case,
        blocks=blocks,
        layers=layers,
        kv=kv,
        kv_typed=kv_typed,
        pages=pages,
        plan=plan,
        frags=[frags] * layers,
        geo=geo,
        block_np=block_cpu.numpy().copy(),
        page_np=page_cpu.numpy().copy(),
        block_ids=block_cpu.to(ws.device),
        page_ids=page_cpu.to(ws.device),
        page_ids_cpu=page_cpu,
    )
    if ws.cuda:
        setup.ids_host = torch.stack([block_cpu, page_cpu]).pin_memory()
        setup.ids_dev = setup.ids_host.to(ws.device)
    for direction, store in (("store", True), ("load", False)):
        setup.expanders[direction] = bl.DescriptorExpander(
            geo, blocks, store=store, buffer=ws.desc_np
        )
    setup.torch_baseline = bl.TorchBaseline(kv, pages, setup.frags, areas)
    return setup


# ----------------------------------------------------------------------------- timing


@dataclass
class Timing:
    time_s: float  # best call-to-completion (CPU wall, CUDA events)
    host_s: float  # best host time inside the call (perf_counter)
    host_median_s: float
    samples: int


def measure(
    fns: dict[MethodKey, Callable[[], object]],
    *,
    repeats: int,
    warmup: int,
    stream: torch.cuda.Stream | None,
    label: str,
    repeats_of: dict[MethodKey, int] | None = None,
    errors: dict[MethodKey, str] | None = None,
) -> dict[MethodKey, Timing]:
    """Round-robin best-of-N timing of ``fns``, each call in its own NVTX range.

    Each round runs the methods in its own order (a shuffle, seeded by the round), so that
    no method always follows the same one: a call runs faster after one that left the same
    pages' page-table entries or its source in the caches (a sparse TP=8 store measured
    0.82x of a torch copy when it always came right after the copies, 0.97x with the order
    varied; a store always right after another store of the same pages gains ~10-20%).

    Parameters
    ----------
    fns
        Zero-argument calls to time, by method and direction.
    repeats, warmup
        Timed rounds and untimed rounds before them (at least one).
    stream
        CUDA: the stream the calls run on (timed with events on it); CPU: None.
    label
        The case, in NVTX ranges (``"<method>_<direction> | <label>"``) and messages.
    repeats_of
        Fewer rounds for some keys (slow baselines).
    errors
        Receives the error of a call that raised during warm-up; that call is dropped.

    Returns
    -------
    dict
        A :class:`Timing` per key that was not dropped.
    """
    cuda = stream is not None
    fns = dict(fns)
    for _ in range(max(1, warmup)):
        for key, fn in list(fns.items()):
            try:
                with nvtx_range(f"warmup {key.label} | {label}"):
                    fn()
                if cuda:
                    stream.synchronize()
            except Exception as exc:
                del fns[key]
                if errors is not None:
                    errors[key] = f"error: {type(exc).__name__}: {exc}"[:300]
                print(f"[bench] {key.label} ({label}) dropped: {exc}", flush=True)
    samples: dict[MethodKey, list[tuple[float, float]]] = {key: [] for key in fns}
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    keys = list(fns)
    for rep in range(repeats):
        order = keys.copy()
        random.Random(rep).shuffle(order)
        for key in order:
            fn = fns[key]
            if repeats_of and rep >= repeats_of.get(key, repeats):
                continue
            with nvtx_range(f"{key.label} | {label}"):
                if cuda:
                    start.record(stream)
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                if cuda:
                    end.record(stream)
            if cuda:
                end.synchronize()
                elapsed = start.elapsed_time(end) / 1e3
            else:
                elapsed = t1 - t0
            samples[key].append((elapsed, t1 - t0))
    return {
        key: Timing(
            time_s=min(s[0] for s in values),
            host_s=min(s[1] for s in values),
            host_median_s=statistics.median(s[1] for s in values),
            samples=len(values),
        )
        for key, values in samples.items()
    }


# ----------------------------------------------------------------------------- methods


class Bench:
    def __init__(self, args: argparse.Namespace, cfg: Config, device: torch.device):
        self.args, self.cfg, self.device = args, cfg, device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.unavailable: dict[str, str] = {}
        self.batch = self.shim = None
        if self.cuda:
            canonical_ops.set_sm_budget(args.sm_budget)
            try:
                self.batch = bl.BatchMemcpy()
            except Exception as exc:
                self.unavailable["vllm_batch"] = f"{type(exc).__name__}: {exc}"
            try:
                self.shim = bl.CudaShim(args.build_dir)
            except Exception as exc:
                reason = f"{type(exc).__name__}: {exc}"
                self.unavailable["uva_kernel"] = self.unavailable["per_fragment"] = reason
        self.cpu_shim = None
        if not self.cuda:
            try:
                self.cpu_shim = bl.CpuShim(args.build_dir)
            except Exception as exc:
                reason = f"{type(exc).__name__}: {exc}"
                self.unavailable["vllm_host"] = self.unavailable["pre_expanded"] = reason
        for name, why in self.unavailable.items():
            print(f"[bench] {name} unavailable: {why}", flush=True)
        self.ws: Workspace | None = None
        self.copy_pool: ThreadPoolExecutor | None = None

    # -- method closures -----------------------------------------------------------------

    def methods(
        self, s: Setup, direction: str, *, host_sweep: bool = False
    ) -> dict[str, Callable[[], object]]:
        """name -> zero-argument call moving ``s``'s bytes in ``direction`` (limit excluded).

        ``host_sweep``: for the host-time sweeps, which time only canonical and the expansion:
        the CPU descriptor-loop baselines (whose pre-expanded descriptors cost an expansion and
        a copy to build) are not made."""
        store = direction == "store"
        op = canonical_ops.store if store else canonical_ops.load
        exp = s.expanders[direction]
        tb = s.torch_baseline
        fns: dict[str, Callable[[], object]] = {}
        if not self.cuda:
            fns["canonical"] = lambda: op(s.kv_typed, s.pages, s.plan, s.block_ids, s.page_ids)
            fns["vllm_expand"] = lambda: exp.expand(s.block_np, s.page_np)
            if self.cpu_shim is not None and not host_sweep:
                # vLLM-style on CPU: the expansion, then our copy loop over its descriptors.
                copy_live = self.cpu_shim.copier(s.geo, exp.views(s.descriptors), store=store)

                def vllm_host():
                    exp.expand(s.block_np, s.page_np)
                    copy_live()

                fns["vllm_host"] = vllm_host
                # The same loop over descriptors expanded once, here: no expansion at all.
                exp.expand(s.block_np, s.page_np)
                fixed = tuple(a.copy() for a in exp.views(s.descriptors))
                fns["pre_expanded"] = self.cpu_shim.copier(s.geo, fixed, store=store)
            move = tb.store if store else tb.load
            fns["pytorch"] = lambda: move(s.block_ids, s.page_ids)
            return {k: v for k, v in fns.items() if k not in self.unavailable}

        ids_host, ids_dev = s.ids_host, s.ids_dev
        blocks_dev, pages_dev = ids_dev[0], ids_dev[1]

        def canonical():
            ids_dev.copy_(ids_host, non_blocking=True)
            op(s.kv_typed, s.pages, s.plan, blocks_dev, pages_dev)

        fns["canonical"] = canonical
        fns["vllm_expand"] = lambda: exp.expand(s.block_np, s.page_np)
        handle = self.stream.cuda_stream
        base = self.ws.desc.data_ptr()
        count = s.descriptors
        if self.batch is not None:
            batch = self.batch

            def vllm_batch():
                n = exp.expand(s.block_np, s.page_np)
                batch(base + 8 * n, base, base + 16 * n, n, handle)

            fns["vllm_batch"] = vllm_batch
        if self.shim is not None:
            shim = self.shim
            group = shim.group_for(s.case.fragment_bytes)
            grid = shim.grid(count, group, self.args.sm_budget)
            desc, desc_dev = self.ws.desc, self.ws.desc_dev
            dev_ptr = desc_dev.data_ptr()

            def uva_kernel():
                n = exp.expand(s.block_np, s.page_np)
                desc_dev[: 3 * n].copy_(desc[: 3 * n], non_blocking=True)
                shim.descriptor_copy(dev_ptr, n, grid, group, handle)

            fns["uva_kernel"] = uva_kernel
            if count <= self.cfg.per_fragment_max_calls:

                def per_fragment():
                    n = exp.expand(s.block_np, s.page_np)
                    shim.memcpy_each(base, base + 8 * n, base + 16 * n, n, handle)

                fns["per_fragment"] = per_fragment
        move = tb.store if store else tb.load
        fns["pytorch"] = lambda: move(blocks_dev, s.page_ids_cpu)
        return {k: v for k, v in fns.items() if k not in self.unavailable}

    def limits(self, s: Setup) -> dict[MethodKey, Callable[[], object]]:
        """One contiguous copy of ``s``'s byte count: CPU, the :data:`CPU_LIMITS` candidates
        (each serves both directions); CUDA, one pinned copy per direction."""
        n = s.bytes
        dev, host = self.ws.kv[:n], self.ws.limit[:n]
        if not self.cuda:
            dev_np, host_np = dev.numpy(), host.numpy()
            # glibc memcpy (streaming stores for big copies) on as many threads as our op uses.
            threads = torch.get_num_threads()
            bounds = [n * i // threads for i in range(threads + 1)]
            parts = [(host_np[a:b], dev_np[a:b]) for a, b in itertools.pairwise(bounds)]
            if self.copy_pool is None:
                self.copy_pool = ThreadPoolExecutor(threads, thread_name_prefix="limit")
            pool = self.copy_pool
            torch_copy, numpy_copy, numpy_threads = CPU_LIMITS
            return {
                torch_copy: lambda: host.copy_(dev),
                numpy_copy: lambda: np.copyto(host_np, dev_np),
                numpy_threads: lambda: list(pool.map(lambda p: np.copyto(*p), parts)),
            }
        return {
            MethodKey("limit", "store"): lambda: host.copy_(dev, non_blocking=True),
            MethodKey("limit", "load"): lambda: dev.copy_(host, non_blocking=True),
        }

    def check_uva(self) -> None:
        """The descriptor kernel dereferences pinned host addresses as they are (UVA)."""
        if self.shim is None:
            return
        try:
            for name, t in (("pages", self.ws.pages), ("limit", self.ws.limit)):
                if self.shim.device_address(t.data_ptr()) != t.data_ptr():
                    raise RuntimeError(f"pinned {name} has a different device address")
        except Exception as exc:
            self.shim_uva_error = f"{type(exc).__name__}: {exc}"
            self.unavailable["uva_kernel"] = f"UVA identity not confirmed: {self.shim_uva_error}"
            print(f"[bench] uva_kernel unavailable: {self.shim_uva_error}", flush=True)

    def sms(self, method: str) -> int | None:
        if not self.cuda:
            return None
        return self.args.sm_budget if method in ("canonical", "uva_kernel") else 0

    # -- verification -----------------------------------------------------------------------

    def verify(self, cases: list[Case]) -> dict[str, dict[MethodKey, str]]:
        """Each method's bytes vs canonical_ops on small cases (stores, then loads)."""
        out: dict[str, dict[MethodKey, str]] = {}
        for case in cases:
            s = build_setup(self.ws, case, self.cfg.verify_blocks, self.cfg.verify_layers, 7)
            out[case.name] = self._verify_setup(s)
            bad = {str(k): v for k, v in out[case.name].items() if v != "ok"}
            print(f"[verify] {case.name}: {bad or 'all ok'}", flush=True)
        return out

    def _run(self, fn: Callable[[], object]) -> None:
        if self.cuda:
            torch.cuda.synchronize()  # fills / zeroing ran on the default stream
            with torch.cuda.stream(self.stream):
                fn()
            self.stream.synchronize()
        else:
            fn()

    def _verify_setup(self, s: Setup) -> dict[MethodKey, str]:
        result: dict[MethodKey, str] = {}
        gen = torch.Generator().manual_seed(1)
        for direction in DIRECTIONS:
            store = direction == "store"
            target = [s.pages] if store else s.kv
            source = s.kv if store else [s.pages]
            for t in source:
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))

            def snapshot(target=target):
                return [t.clone() for t in target]

            def clear(target=target):
                for t in target:
                    t.zero_()

            fns = self.methods(s, direction)
            exp = s.expanders[direction]
            if not self.cuda:
                # The expansion (both forms) executed with memmove stands in for the copy.
                fns["vllm_expand"] = lambda exp=exp: exp.execute_on_host(
                    exp.expand(s.block_np, s.page_np)
                )
                fns["vllm_expand_loop"] = lambda exp=exp: exp.execute_on_host(
                    exp.expand_per_layer(s.block_np, s.page_np)
                )
            else:
                fns.pop("vllm_expand", None)
            clear()
            self._run(fns.pop("canonical"))
            reference = snapshot()
            if not any(bool(t.any()) for t in reference):
                result[MethodKey("canonical", direction)] = "moved nothing"
            for name, fn in fns.items():
                key = MethodKey(name, direction)
                clear()
                try:
                    self._run(fn)
                    same = all(torch.equal(a, b) for a, b in zip(snapshot(), reference))
                    result[key] = "ok" if same else "MISMATCH"
                except Exception as exc:
                    result[key] = f"error: {type(exc).__name__}: {exc}"[:300]
        return result

    # -- sections ---------------------------------------------------------------------------

    def fragment_case(self, case: Case) -> dict:
        cfg = self.cfg
        s = build_setup(self.ws, case, frag_blocks(case, cfg), cfg.frag_layers)
        row = dict(
            case=case.name,
            kind=case.kind,
            tp=case.tp,
            fragment_bytes=case.fragment_bytes,
            fragments_per_block=int(s.frags[0].shape[0]),
            blocks=s.blocks,
            layers=s.layers,
            bytes=s.bytes,
            descriptors=s.descriptors,
        )
        fns: dict[MethodKey, Callable[[], object]] = dict(self.limits(s))
        for direction in DIRECTIONS:
            for name, fn in self.methods(s, direction).items():
                fns[MethodKey(name, direction)] = fn
        # The slow baselines: a few rounds tell their speed well enough.
        few = {k: min(3, cfg.repeats) for k in fns if k.method in ("per_fragment", "pytorch")}
        errors: dict[MethodKey, str] = {}
        t = self._measure(fns, case.name, repeats_of=few, errors=errors)
        for direction in DIRECTIONS:
            if self.cuda:
                limit = t[MethodKey("limit", direction)]
            else:
                limit = min((t[k] for k in CPU_LIMITS), key=lambda x: x.time_s)
            methods = {"limit": self._entry(limit, s.bytes, limit, "limit")}
            if not self.cuda:  # the plain torch copy_ alone: what #18's goals compare with
                methods["torch_copy"] = self._entry(t[CPU_LIMITS[0]], s.bytes, limit, "torch_copy")
            for key, timing in t.items():
                if key.direction == direction and key.method != "limit":
                    methods[key.method] = self._entry(timing, s.bytes, limit, key.method)
            if (
                self.cuda
                and "per_fragment" not in methods
                and "per_fragment" not in self.unavailable
            ):
                methods["per_fragment"] = {
                    "skipped": f"{s.descriptors} descriptors > --per-fragment-max-calls"
                }
            for name, why in self.unavailable.items():
                methods.setdefault(name, {"skipped": why})
            for key, why in errors.items():
                if key.direction == direction:
                    methods[key.method] = {"skipped": why}
            row[direction] = methods
        return row

    def _entry(self, t: Timing, nbytes: int, limit: Timing, name: str) -> dict:
        entry = dict(
            time_s=t.time_s,
            host_s=t.host_s,
            host_median_s=t.host_median_s,
            samples=t.samples,
        )
        if name != "vllm_expand":  # the expansion alone moves nothing
            entry["gbps"] = nbytes / t.time_s / 1e9
            entry["ratio"] = limit.time_s / t.time_s
        sms = self.sms(name)
        if sms is not None:
            entry["sms"] = sms
        return entry

    def host_point(self, case: Case, blocks: int, layers: int) -> dict:
        s = build_setup(self.ws, case, blocks, layers)
        point = dict(
            case=case.name,
            blocks=blocks,
            layers=layers,
            bytes=s.bytes,
            descriptors=s.descriptors,
        )
        fns: dict[MethodKey, Callable[[], object]] = {}
        if self.cuda:
            fns.update(self.limits(s))
        for direction in DIRECTIONS:
            methods = self.methods(s, direction, host_sweep=True)
            for name in ("pytorch", "per_fragment"):
                methods.pop(name, None)
            for name, fn in methods.items():
                if direction == "load" and name.startswith("vllm_expand"):
                    continue  # same work as the store's expansion
                fns[MethodKey(name, direction)] = fn
        exp = s.expanders["store"]
        if "vllm_expand" not in self.unavailable:
            fns[MethodKey("vllm_expand_loop", "store")] = lambda: exp.expand_per_layer(
                s.block_np, s.page_np
            )
        errors: dict[MethodKey, str] = {}
        t = self._measure(fns, f"{case.name} N={blocks} L={layers}", errors=errors)
        if errors:
            point["errors"] = errors
        point["methods"] = {
            key: dict(time_s=v.time_s, host_s=v.host_s, host_median_s=v.host_median_s)
            for key, v in t.items()
        }
        return point

    def sm_point(self, case: Case, budget: int) -> dict:
        cfg = self.cfg
        s = build_setup(self.ws, case, frag_blocks(case, cfg), cfg.frag_layers)
        previous = canonical_ops.set_sm_budget(budget)
        saved, self.args.sm_budget = self.args.sm_budget, budget
        try:
            fns = dict(self.limits(s))
            for direction in DIRECTIONS:
                methods = self.methods(s, direction)
                for name in ("canonical", "uva_kernel"):
                    if name in methods:
                        fns[MethodKey(name, direction)] = methods[name]
            t = self._measure(fns, f"{case.name} SMs={budget}")
        finally:
            canonical_ops.set_sm_budget(previous)
            self.args.sm_budget = saved
        return dict(
            case=case.name,
            sm_budget=budget,
            bytes=s.bytes,
            methods={
                key: dict(time_s=v.time_s, gbps=s.bytes / v.time_s / 1e9) for key, v in t.items()
            },
        )

    def _measure(self, fns: dict[MethodKey, Callable[[], object]], label: str, **kwargs):
        """measure() with this run's repeats and warm-up, on the side stream on CUDA."""
        ctx = torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()
        with ctx:
            return measure(
                fns,
                repeats=self.cfg.repeats,
                warmup=self.cfg.warmup,
                stream=self.stream,
                label=label,
                **kwargs,
            )


# ----------------------------------------------------------------------------- driver


def machine_info(device: torch.device) -> dict:
    info = dict(
        device=device.type,
        python=platform.python_version(),
        torch=torch.__version__,
        numpy=np.__version__,
        torch_threads=torch.get_num_threads(),
        cpu_count=os.cpu_count(),
        cpu=_cpu_model(),
        loadavg_start=_loadavg(),
        nvtx=NVTX_BACKEND,
        built_with_cuda=bool(canonical_ops.BUILT_WITH_CUDA),
    )
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            sm_count=props.multi_processor_count,
            cuda_runtime=torch.version.cuda,
        )
    return info


def _loadavg() -> list[float] | None:
    with contextlib.suppress(OSError, AttributeError):
        return [round(x, 2) for x in os.getloadavg()]
    return None


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring), with ``--device auto`` resolved.

    Parameters
    ----------
    argv
        Arguments without the program name; None: ``sys.argv[1:]``.

    Returns
    -------
    argparse.Namespace
        ``device`` is ``"cpu"`` or ``"cuda"``; exits with a message when CUDA is asked for but
        there is no GPU or canonical_ops has no CUDA kernels.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--quick", action="store_true", help="small sweep (< 2 min on 2 cores)")
    parser.add_argument("--out", default=None, help="output folder (default bench/results/DEV)")
    parser.add_argument(
        "--sections",
        default="fragments,blocks,layers,sms",
        help="comma list of fragments, blocks, layers, sms (sms: CUDA only)",
    )
    parser.add_argument("--only", default=None, help="fragment sweep: cases containing this")
    parser.add_argument(
        "--sweep-case", default="split NHD TP8", help="case of the blocks / layers sweeps"
    )
    parser.add_argument("--sm-budget", type=int, default=8, help="CUDA SM budget (ours, UVA)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--time-budget", type=float, default=None, help="seconds; skip the rest")
    parser.add_argument("--no-verify", action="store_true")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--huge-pages",
        action="store_true",
        help="CPU pools on transparent huge pages (madvise), as SharedOffloadRegion asks",
    )
    parser.add_argument("--build-dir", default=None, help="where the CUDA baseline shim builds")
    parser.add_argument("--preflight", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--preflight-methods", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU available")
    if args.device == "cuda" and not canonical_ops.BUILT_WITH_CUDA:
        raise SystemExit("--device cuda: canonical_ops was built without CUDA kernels")
    return args


@dataclass
class Run:
    """One benchmark run: its settings, its cases, the measuring :class:`Bench`, the results.

    The sections (:func:`verify_methods`, :func:`fragment_sweep`, :func:`blocks_sweep`,
    :func:`layers_sweep`, :func:`sm_budget_sweep`) append to ``results`` and call
    :meth:`save`; :func:`write_outputs` finishes.
    """

    args: argparse.Namespace
    cfg: Config
    device: torch.device
    sections: set[str]  # of fragments, blocks, layers, sms
    out: Path  # --out: the JSON, markdown and plots
    started: float  # perf_counter at the start (elapsed_s, --time-budget)
    frag_cases: list[Case]  # fragment sweep
    sweep_case: Case  # blocks and layers sweeps
    sm_cases: list[Case]  # SM-budget sweep
    verify_cases: list[Case]
    results: dict  # in memory: sweep points and verification keyed by MethodKey
    bench: Bench | None = None  # made by prepare()

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def json_path(self) -> Path:
        return self.out / f"bench_{self.device.type}.json"

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def over_budget(self) -> bool:
        """Past --time-budget: the sections skip (and list) the cases they have not started."""
        return self.args.time_budget is not None and self.elapsed_s() > self.args.time_budget

    def save(self) -> None:
        """Write the JSON and the markdown as they stand.

        Called after every case, so that a run killed at its time limit keeps what it measured.
        """
        meta = self.results["meta"]
        meta["elapsed_s"] = round(self.elapsed_s(), 1)
        meta["loadavg_end"] = _loadavg()
        self.results["goals"] = report.evaluate_goals(self.results)
        text = json.dumps(results_to_json(self.results), indent=1, default=_json_default)
        self.json_path.write_text(text)
        report.write_markdown(self.results, self.json_path.with_suffix(".md"))


def new_run(args: argparse.Namespace, argv: list[str] | None = None) -> Run:
    """The run ``args`` ask for: configuration, cases, output folder, empty results.

    Parameters
    ----------
    args
        From :func:`parse_args`.
    argv
        The arguments as given (recorded in the results' ``meta.command``).

    Returns
    -------
    Run
        Without a :class:`Bench` yet (see :func:`prepare`); nothing measured.
    """
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    cfg = make_config(args.quick, cuda)
    if args.repeats:
        cfg.repeats = args.repeats
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    if args.preflight:
        sections = set()
    out = Path(args.out or Path(__file__).resolve().parent / "results" / device.type)
    if not args.preflight:
        out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    frag_cases = real_cases() + dense_references(cfg.dense_sizes)
    if args.only:
        frag_cases = [c for c in frag_cases if args.only.lower() in c.name.lower()]
    if args.preflight:
        frag_cases = []
    results: dict = dict(
        meta=dict(
            machine_info(device),
            mode="quick" if args.quick else "full",
            date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            config=cfg.__dict__,
            sm_budget=args.sm_budget if cuda else None,
            command=" ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        ),
        verification={},
        fragment_sweep=[],
        blocks_sweep=[],
        layers_sweep=[],
        sm_sweep=[],
        skipped=[],
    )
    return Run(
        args=args,
        cfg=cfg,
        device=device,
        sections=sections,
        out=out,
        started=started,
        frag_cases=frag_cases,
        sweep_case=case_by_name(args.sweep_case),
        sm_cases=[case_by_name("split NHD TP8"), case_by_name("packed NHD TP8")],
        verify_cases=[
            case_by_name("split NHD TP8"),
            case_by_name("packed HND TP2"),
            case_by_name("MLA 576 TP1"),
            dense_references((256,))[0],
        ],
        results=results,
    )


def pool_sizes(run: Run) -> tuple[int, int, int]:
    """Bytes of the kv and pages pools and int64 words of the descriptor pool that every
    case this run may build fits in (the pools are allocated once, before any timing)."""
    cfg, sections = run.cfg, run.sections
    plans = [(c, frag_blocks(c, cfg), cfg.frag_layers) for c in run.frag_cases]
    plans += [(c, cfg.verify_blocks, cfg.verify_layers) for c in run.verify_cases]
    if "sms" in sections and run.cuda:
        plans += [(c, frag_blocks(c, cfg), cfg.frag_layers) for c in run.sm_cases]
    if "blocks" in sections:
        plans += [(run.sweep_case, n, cfg.sweep_blocks_layers) for n in cfg.sweep_blocks]
    if "layers" in sections:
        plans += [(run.sweep_case, cfg.sweep_layers_blocks, n) for n in cfg.sweep_layers]
    kv_bytes, pages_bytes, desc_words = (max(v) for v in zip(*(needs(*p) for p in plans)))
    return kv_bytes, pages_bytes, desc_words


def prepare(run: Run) -> None:
    """Make the run's :class:`Bench` (baselines built or marked unavailable) and its pools.

    Records in ``meta`` which methods are unavailable and why, and the shim / ABI in use.
    """
    meta = run.results["meta"]
    bench = run.bench = Bench(run.args, run.cfg, run.device)
    meta["unavailable"] = dict(bench.unavailable)
    if bench.shim is not None:
        meta["shim"] = bench.shim.path
    if bench.batch is not None:
        meta["batch_abi"] = bench.batch.abi
    kv_bytes, pages_bytes, desc_words = pool_sizes(run)
    print(
        f"[bench] {run.device.type} ({'quick' if run.args.quick else 'full'}): pools kv "
        f"{kv_bytes / 2**20:.0f} MiB, pages {pages_bytes / 2**20:.0f} MiB, "
        f"descriptors {desc_words // 3} -> {run.out}",
        flush=True,
    )
    bench.ws = Workspace(
        run.device, kv_bytes, pages_bytes, desc_words, huge_pages=run.args.huge_pages
    )
    if run.args.huge_pages:
        meta["huge_pages_bytes"] = anon_huge_page_bytes()
        print(
            f"[bench] --huge-pages: {meta['huge_pages_bytes'] / 2**20:.0f} MiB of this "
            "process on transparent huge pages",
            flush=True,
        )
    if run.cuda:
        bench.check_uva()
        meta["unavailable"] = dict(bench.unavailable)


# ----------------------------------------------------------------------------- sections


def verify_methods(run: Run) -> None:
    """Verification: every method's bytes against canonical_ops on small cases.

    A method that moves wrong bytes (or raises) is not measured afterwards. On CUDA the
    checks run in child processes (:func:`cuda_preflight`), so that a baseline that faults
    cannot take this process down with it.
    """
    bench = run.bench
    with nvtx_range("verify"):
        if run.cuda:
            run.results["verification"] = cuda_preflight(run.args, bench)
        else:
            run.results["verification"] = bench.verify(run.verify_cases)
    disable_failed(bench, run.results["verification"])
    run.results["meta"]["unavailable"] = dict(bench.unavailable)
    run.save()


def preflight_child(run: Run) -> int:
    """The --preflight child of :func:`cuda_preflight`: verify, print the result, exit.

    Returns
    -------
    int
        The exit status (0): the verification goes to stdout after :data:`PREFLIGHT_TAG`.
    """
    bench = run.bench
    if run.args.preflight_methods is not None:
        keep = set(run.args.preflight_methods.split(","))
        for name in RISKY_CUDA:
            if name not in keep:
                bench.unavailable.setdefault(name, "not in this preflight")
    verification = verification_to_json(bench.verify(run.verify_cases))
    print(PREFLIGHT_TAG + json.dumps(verification), flush=True)
    return 0


def fragment_sweep(run: Run) -> None:
    """Fragment sweep: GB/s of every method on each case of ``run.frag_cases``.

    A case that moves exactly the fragments of a case already measured is recorded as an
    alias of it instead of being measured again.
    """
    results = run.results
    seen: dict[tuple, str] = {}
    for case in run.frag_cases:
        if run.over_budget():
            results["skipped"].append(f"fragment case {case.name}: time budget")
            continue
        m = case.mapping()
        key = (case.fragments().tobytes(), m.local_page_size_bytes, m.canonical_page_size_bytes)
        if key in seen:  # identical bytes moved: report, do not re-measure
            results["fragment_sweep"].append(
                dict(
                    case=case.name,
                    kind=case.kind,
                    tp=case.tp,
                    fragment_bytes=case.fragment_bytes,
                    alias_of=seen[key],
                )
            )
            continue
        seen[key] = case.name
        with nvtx_range(f"case {case.name}"):
            row = run.bench.fragment_case(case)
        results["fragment_sweep"].append(row)
        print(report.fragment_line(row), flush=True)
        run.save()


def blocks_sweep(run: Run) -> None:
    """Blocks sweep: host time per call vs the number of blocks (``run.sweep_case``, a fixed
    number of layers): is canonical's enqueue flat in N, what does the expansion cost."""
    _host_time_sweep(run, "blocks")


def layers_sweep(run: Run) -> None:
    """Layers sweep: host time per call vs the number of layers (``run.sweep_case``, a fixed
    number of blocks)."""
    _host_time_sweep(run, "layers")


def _host_time_sweep(run: Run, section: str) -> None:
    """The blocks or layers sweep: one :meth:`Bench.host_point` per swept value."""
    cfg, results = run.cfg, run.results
    values = cfg.sweep_blocks if section == "blocks" else cfg.sweep_layers
    for value in values:
        if run.over_budget():
            results["skipped"].append(f"{section} sweep {value}: time budget")
            continue
        blocks = value if section == "blocks" else cfg.sweep_layers_blocks
        layers = value if section == "layers" else cfg.sweep_blocks_layers
        with nvtx_range(f"{section} sweep N={blocks} L={layers}"):
            point = run.bench.host_point(run.sweep_case, blocks, layers)
        results[f"{section}_sweep"].append(point)
        print(report.host_line(point), flush=True)
        run.save()


def sm_budget_sweep(run: Run) -> None:
    """SM-budget sweep (CUDA): GB/s of canonical and the UVA kernel per SM budget, with the
    copy-engine limit beside them, on each of ``run.sm_cases``."""
    results = run.results
    for case in run.sm_cases:
        for budget in run.cfg.sm_budgets:
            if run.over_budget():
                results["skipped"].append(f"sm sweep {case.name} {budget}: time budget")
                continue
            results["sm_sweep"].append(run.bench.sm_point(case, budget))
        run.save()


def write_outputs(run: Run) -> None:
    """Output: the final JSON and markdown, then (unless --no-plots) the PNG plots."""
    run.save()
    if not run.args.no_plots:
        written = report.write_plots(run.results, run.out)
        print("[bench] plots: " + (", ".join(map(str, written)) if written else "none"))
    print(
        f"[bench] wrote {run.json_path} and {run.json_path.with_suffix('.md')} "
        f"in {run.elapsed_s():.0f} s"
    )


# ----------------------------------------------------------------------------- CUDA preflight


RISKY_CUDA = ("vllm_batch", "uva_kernel", "per_fragment")
PREFLIGHT_TAG = "PREFLIGHT-JSON "


def _preflight(args: argparse.Namespace, methods: str | None, timeout_s: float):
    cmd = [sys.executable, str(Path(__file__).resolve()), "--device", "cuda", "--preflight"]
    cmd += ["--sm-budget", str(args.sm_budget), "--no-plots"]
    if args.build_dir:
        cmd += ["--build-dir", args.build_dir]
    if methods is not None:
        cmd += ["--preflight-methods", methods]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout_s:.0f} s"
    found = None
    for line in proc.stdout.splitlines():
        if line.startswith(PREFLIGHT_TAG):
            found = verification_from_json(json.loads(line[len(PREFLIGHT_TAG) :]))
        else:
            print(f"  [preflight] {line}", flush=True)
    if found is None:
        tail = (proc.stderr or proc.stdout or "").strip()[-600:]
        return None, f"rc={proc.returncode}: {tail}"
    return found, ""


def cuda_preflight(args: argparse.Namespace, bench: Bench) -> dict:
    """Verify every method in a child process; a crash there disables the culprit here."""
    verification, why = _preflight(args, None, 300)
    errors = [
        f"{case}: {key}: {status}"
        for case, checks in (verification or {}).items()
        for key, status in checks.items()
        if status.startswith("error")
    ]
    if verification is not None and not errors:
        return verification
    # A CUDA fault is sticky: it fails every later call in that process, so isolate.
    why = why or "; ".join(errors)[:600]
    print(f"[bench] preflight failed ({why}); checking each CUDA baseline alone", flush=True)
    verification = {}
    for name in RISKY_CUDA:
        if name in bench.unavailable:
            continue
        checks, why = _preflight(args, name, 150)
        if checks is None:
            bench.unavailable[name] = f"preflight crashed: {why}"
            continue
        for case, results in checks.items():
            verification.setdefault(case, {}).update(results)
    return verification


def disable_failed(bench: Bench, verification: dict) -> None:
    """Methods that moved wrong bytes (or raised) on any verified case are not measured."""
    for case, checks in verification.items():
        for (name, direction), status in checks.items():
            if status != "ok" and name != "canonical" and name not in bench.unavailable:
                bench.unavailable[name] = f"failed verification ({case}, {direction}): {status}"
                print(f"[bench] {name} disabled: {bench.unavailable[name]}", flush=True)


def _json_default(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, (tuple, set)):
        return list(value)
    return str(value)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, then run the sections it asks for; returns the exit status."""
    args = parse_args(argv)
    run = new_run(args, argv)
    prepare(run)
    if args.preflight:
        return preflight_child(run)
    if not args.no_verify:
        verify_methods(run)
    # The (short) blocks sweep first: a time budget then still leaves the enqueue-vs-N figures.
    if "blocks" in run.sections:
        blocks_sweep(run)
    if "fragments" in run.sections:
        fragment_sweep(run)
    if "layers" in run.sections:
        layers_sweep(run)
    if "sms" in run.sections and run.cuda:
        sm_budget_sweep(run)
    write_outputs(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
