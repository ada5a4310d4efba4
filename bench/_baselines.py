"""Baselines of bench_transfer.py: what a user would otherwise run to move the same bytes.

Every baseline moves exactly the fragments canonical_store / canonical_load move (same
(local, canonical, size) table per layer, same block and page ids), so GB/s compare like for
like.

* :class:`DescriptorExpander`: the vLLM-style host path (the idea of vLLM 0.33's
  ``_fill_canonical_ops``; our own code): per call, numpy turns block / page ids into one
  (src, dst, size) descriptor per (block, layer, fragment) in preallocated arrays (block base +
  fragment offsets, broadcast). ``expand`` is the strongest numpy form we know (templates
  hoisted to init, one broadcast over all layers: 2 adds and a copy per call); ``expand_per_layer``
  follows vLLM's structure (a loop over layers, bases then a broadcast add per layer).
* :class:`TorchBaseline`: plain PyTorch a user would write: per layer and per fragment run, a
  strided view of each side, then ``dst[ids] = src[ids]`` (gather + scatter; on CUDA the
  gathered tensor crosses devices with ``.cpu()`` / ``.to(device)``).
* :class:`CpuShim`: the canonical CPU kernel's fragment copy (kernels/include/canonical/
  cpu_copy.h) driven by expanded descriptors (``shims/cpu_descriptor_copy.cpp``, compiled with
  the host compiler): the vLLM-style path on CPU (expansion + this loop) and a pre-expanded
  run of it (no expansion at all: what the access pattern allows with our copy).
* CUDA only (UNVERIFIED: written on a machine without a GPU): :class:`BatchMemcpy` calls
  ``cuMemcpyBatchAsync`` (driver entry point fetched through cuda-python, called with the raw
  descriptor arrays as vLLM's C++ op does, no per-descriptor Python objects);
  :class:`CudaShim` is a small nvcc-compiled library (``shims/cuda_baselines.cu``) with a
  per-fragment ``cudaMemcpyAsync`` loop (in C, so Python overhead is not measured) and a
  descriptor-driven copy kernel that reads host-expanded descriptors from device memory and
  moves bytes through UVA (vLLM's Triton loader idea, with the same lane/vector scheme as our
  kernel).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# ----------------------------------------------------------------------------- fragment tables


def split_fragments(frags: np.ndarray, limit: int | None) -> np.ndarray:
    """Cut (local, canonical, size) rows into pieces of at most ``limit`` bytes (in order)."""
    frags = np.asarray(frags, dtype=np.int64)
    if not limit or frags.size == 0 or frags[:, 2].max() <= limit:
        return frags
    rows = []
    for local, canonical, size in frags.tolist():
        for start in range(0, size, limit):
            rows.append((local + start, canonical + start, min(limit, size - start)))
    return np.asarray(rows, dtype=np.int64)


@dataclass(frozen=True)
class Run:
    """``count`` fragments of ``size`` bytes at constant strides on both sides."""

    local: int
    canonical: int
    size: int
    count: int
    local_stride: int
    canonical_stride: int


def fragment_runs(frags: np.ndarray) -> list[Run]:
    """Group a fragment table into maximal constant-stride runs (a user's strided views)."""
    rows = np.asarray(frags, dtype=np.int64).tolist()
    runs: list[Run] = []
    i = 0
    while i < len(rows):
        local, canonical, size = rows[i]
        j = i + 1
        local_stride = canonical_stride = size
        if j < len(rows) and rows[j][2] == size:
            ls, cs = rows[j][0] - local, rows[j][1] - canonical
            if ls > 0 and cs > 0:
                local_stride, canonical_stride = ls, cs
                while (
                    j < len(rows)
                    and rows[j][2] == size
                    and rows[j][0] - rows[j - 1][0] == ls
                    and rows[j][1] - rows[j - 1][1] == cs
                ):
                    j += 1
        runs.append(Run(local, canonical, size, j - i, local_stride, canonical_stride))
        i = j
    return runs


@dataclass(frozen=True)
class Geometry:
    """Where every layer's bytes live, as plain addresses (device or UVA-usable host)."""

    frags: tuple[np.ndarray, ...]  # per layer: (F_l, 3) local, canonical, size
    kv_ptrs: tuple[int, ...]  # per layer: kv_caches[l].data_ptr()
    block_strides: tuple[int, ...]  # per layer: bytes between blocks
    pages_ptr: int  # cpu_pages.data_ptr()
    row_bytes: int  # cpu_pages.stride(0) (pages_per_row = 1)
    area_offsets: tuple[int, ...]  # per layer

    @property
    def fragments_per_pair(self) -> int:
        return sum(len(f) for f in self.frags)

    @property
    def bytes_per_pair(self) -> int:
        return sum(int(f[:, 2].sum()) for f in self.frags)


# ----------------------------------------------------------------------------- vLLM-style host path


class DescriptorExpander:
    """vLLM-style host expansion of (block, page) ids into copy descriptors.

    Descriptors go into one preallocated int64 buffer (pinned on CUDA, so a kernel can
    upload it with one copy): ``count`` source addresses, then ``count`` destination
    addresses, then ``count`` sizes. Store: source = kv block, destination = canonical page;
    load: the reverse. Pages per row = 1 (canonical page p is row p).
    """

    def __init__(self, geo: Geometry, max_pairs: int, *, store: bool, buffer: np.ndarray):
        self.geo, self.store = geo, store
        per_pair = geo.fragments_per_pair
        self.capacity = max_pairs * per_pair
        if buffer.dtype != np.int64 or buffer.size < 3 * self.capacity:
            raise ValueError(f"descriptor buffer: need {3 * self.capacity} int64 words")
        self.buffer = buffer
        self.per_pair = per_pair
        # Hoisted to init (tensors never move): absolute per-fragment addresses of block 0 /
        # page 0, all layers concatenated; the sizes already tiled for the largest call.
        self.tmpl_kv = np.concatenate(
            [ptr + f[:, 0] for ptr, f in zip(geo.kv_ptrs, geo.frags)]
        ).astype(np.int64)
        self.tmpl_cpu = np.concatenate(
            [geo.pages_ptr + area + f[:, 1] for area, f in zip(geo.area_offsets, geo.frags)]
        ).astype(np.int64)
        sizes = np.concatenate([f[:, 2] for f in geo.frags]).astype(np.int64)
        self.sizes_tiled = np.tile(sizes, max_pairs)
        self.uniform_stride = len(set(geo.block_strides)) == 1
        self.block_scratch = np.empty(max_pairs, dtype=np.int64)
        self.page_scratch = np.empty(max_pairs, dtype=np.int64)
        self.layers = [
            (
                ptr,
                stride,
                geo.pages_ptr + area,
                np.ascontiguousarray(f[:, 0]),
                np.ascontiguousarray(f[:, 1]),
                np.ascontiguousarray(f[:, 2]),
            )
            for ptr, stride, area, f in zip(
                geo.kv_ptrs, geo.block_strides, geo.area_offsets, geo.frags
            )
        ]

    def views(self, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(src, dst, sizes) descriptor arrays of a call that filled ``count`` entries."""
        b = self.buffer
        return b[:count], b[count : 2 * count], b[2 * count : 3 * count]

    def _sides(self, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        src, dst, sizes = self.views(count)
        return (src, dst, sizes) if self.store else (dst, src, sizes)

    def expand(self, block_ids: np.ndarray, page_ids: np.ndarray) -> int:
        """Fill descriptors for the pairs, ordered (pair, layer, fragment); returns the count."""
        if not self.uniform_stride:
            return self.expand_per_layer(block_ids, page_ids)
        n = block_ids.shape[0]
        count = n * self.per_pair
        kv, cpu, sizes = self._sides(count)
        blocks = self.block_scratch[:n]
        np.multiply(block_ids, self.geo.block_strides[0], out=blocks)
        np.add(blocks[:, None], self.tmpl_kv[None, :], out=kv.reshape(n, self.per_pair))
        pages = self.page_scratch[:n]
        np.multiply(page_ids, self.geo.row_bytes, out=pages)
        np.add(pages[:, None], self.tmpl_cpu[None, :], out=cpu.reshape(n, self.per_pair))
        np.copyto(sizes, self.sizes_tiled[:count])
        return count

    def expand_per_layer(self, block_ids: np.ndarray, page_ids: np.ndarray) -> int:
        """vLLM's structure: per layer, block / page bases, then bases + fragment offsets."""
        n = block_ids.shape[0]
        count = n * self.per_pair
        kv, cpu, sizes = self._sides(count)
        kv_bases, cpu_bases = self.block_scratch[:n], self.page_scratch[:n]
        op = 0
        for kv_ptr, stride, cpu_ptr, local, canonical, size in self.layers:
            frags = local.shape[0]
            end = op + n * frags
            np.multiply(block_ids, stride, out=kv_bases)
            kv_bases += kv_ptr
            np.multiply(page_ids, self.geo.row_bytes, out=cpu_bases)
            cpu_bases += cpu_ptr
            np.add(kv_bases[:, None], local[None, :], out=kv[op:end].reshape(n, frags))
            np.add(cpu_bases[:, None], canonical[None, :], out=cpu[op:end].reshape(n, frags))
            sizes[op:end].reshape(n, frags)[:] = size
            op = end
        return count

    def execute_on_host(self, count: int) -> None:
        """Run the descriptors with memmove (CPU verification of the expansion only)."""
        src, dst, sizes = self.views(count)
        for s, d, z in zip(src.tolist(), dst.tolist(), sizes.tolist()):
            ctypes.memmove(d, s, z)


# ----------------------------------------------------------------------------- plain PyTorch


class TorchBaseline:
    """Plain PyTorch: per layer and fragment run, ``dst_view[ids] = src_view[ids]``.

    ``kv_caches`` are uint8 (blocks, block_bytes) tensors; ``cpu_pages`` is the uint8
    (rows, row_bytes) CPU tensor. Each run is viewed with the widest integer dtype its offsets,
    strides and size allow (int64 for head-aligned runs), as a user indexing the caches in
    their own dtype would, only better. With CUDA kv caches the gathered run crosses devices
    the way a user would write it (``.cpu()`` for stores, ``.to(device)`` for loads).
    """

    WIDTHS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        cpu_pages: torch.Tensor,
        frags: Sequence[np.ndarray],
        area_offsets: Sequence[int],
    ):
        self.device = kv_caches[0].device
        self.cross = self.device.type != "cpu"
        self.views: list[tuple[torch.Tensor, torch.Tensor]] = []
        rows, row_bytes = cpu_pages.shape[0], cpu_pages.stride(0)
        for kv, table, area in zip(kv_caches, frags, area_offsets):
            if kv.dtype != torch.uint8 or kv.dim() != 2 or kv.stride(1) != 1:
                raise ValueError("TorchBaseline: expected uint8 (blocks, block_bytes) kv caches")
            for run in fragment_runs(table):
                kv_off = kv.storage_offset() + run.local
                cpu_off = cpu_pages.storage_offset() + area + run.canonical
                every = (run.size, run.local_stride, run.canonical_stride, kv.stride(0))
                every += (row_bytes, kv_off, cpu_off, kv.shape[1], cpu_pages.shape[1])
                width, dtype = next(
                    (w, d) for w, d in self.WIDTHS if all(v % w == 0 for v in every)
                )
                kv_w = kv.view(dtype) if width > 1 else kv
                pages_w = cpu_pages.view(dtype) if width > 1 else cpu_pages
                kv_view = kv_w.as_strided(
                    (kv.shape[0], run.count, run.size // width),
                    (kv.stride(0) // width, run.local_stride // width, 1),
                    kv_off // width,
                )
                cpu_view = pages_w.as_strided(
                    (rows, run.count, run.size // width),
                    (row_bytes // width, run.canonical_stride // width, 1),
                    cpu_off // width,
                )
                self.views.append((kv_view, cpu_view))

    def store(self, block_ids: torch.Tensor, page_ids: torch.Tensor) -> None:
        """``block_ids`` on the kv device, ``page_ids`` on the CPU."""
        for kv_view, cpu_view in self.views:
            gathered = kv_view[block_ids]
            if self.cross:
                gathered = gathered.cpu()
            cpu_view[page_ids] = gathered

    def load(self, block_ids: torch.Tensor, page_ids: torch.Tensor) -> None:
        for kv_view, cpu_view in self.views:
            gathered = cpu_view[page_ids]
            if self.cross:
                gathered = gathered.to(self.device)
            kv_view[block_ids] = gathered


# ----------------------------------------------------------------------------- CPU descriptor loop

# kernels/include of this repository: the shims share the canonical kernels' copy loops.
KERNEL_INCLUDE = Path(__file__).resolve().parent.parent / "kernels" / "include"
# The shims' C++ / CUDA sources (checked by clang-format like the kernels).
SHIM_SOURCES = Path(__file__).resolve().parent / "shims"


class CpuShim:
    """The canonical CPU kernel's copy driven by host-expanded descriptors (a C++ library).

    Two baselines use it: the vLLM-style path on CPU (numpy expansion, then this loop) and the
    same loop over descriptors expanded once before timing ("pre-expanded"): the very copy of
    our CPU kernel with no expansion at all, so its GB/s is what the access pattern itself
    allows. Built from ``shims/cpu_descriptor_copy.cpp`` once per content (with the headers it
    includes) into ``build_dir`` (default ``$XDG_CACHE_HOME/canonical-kv/bench``) with
    ``$CXX`` (default ``c++``) and -fopenmp.
    """

    SOURCE = SHIM_SOURCES / "cpu_descriptor_copy.cpp"

    def __init__(self, build_dir: str | os.PathLike | None = None, timeout_s: float = 120):
        cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        if cxx is None:
            raise RuntimeError("no C++ compiler (set CXX)")

        def command(src: Path, out: Path) -> list[str]:
            return [
                cxx, "-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", f"-I{KERNEL_INCLUDE}",
                str(src), "-o", str(out),
            ]  # fmt: skip

        self.path = _built_library(build_dir, self.SOURCE, command, timeout_s)
        so = ctypes.CDLL(self.path)
        so.shim_cpu_descriptor_copy.argtypes = (
            [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_int, ctypes.c_int]
        )
        so.shim_cpu_descriptor_copy.restype = None
        self.so = so

    def copier(
        self, geo: Geometry, sides: tuple[np.ndarray, np.ndarray, np.ndarray], *, store: bool
    ):
        """A zero-argument call copying ``count`` descriptors from the (src, dst, size) arrays
        (prefetching ahead as the canonical kernel does)."""
        src, dst, sizes = sides
        count = int(src.shape[0])
        total = count // geo.fragments_per_pair * geo.bytes_per_pair
        ptrs = (src.ctypes.data, dst.ctypes.data, sizes.ctypes.data)
        geometry = (geo.bytes_per_pair, geo.fragments_per_pair)
        fn = self.so.shim_cpu_descriptor_copy

        def copy(keep_alive=sides) -> None:  # the closure owns the arrays behind ptrs
            fn(*ptrs, count, total, *geometry, torch.get_num_threads(), int(store))

        return copy


def _built_library(
    build_dir: str | os.PathLike | None,
    source: Path,
    command: Callable[[Path, Path], list[str]],
    timeout_s: float,
) -> str:
    """Compile ``source`` into a shared library once per content, in the bench build cache.

    Parameters
    ----------
    build_dir
        Cache folder; None: ``$XDG_CACHE_HOME/canonical-kv/bench``.
    source
        The C++ / CUDA file (``bench/shims/...``).
    command
        ``command(src, out)``: the compiler command line building ``out`` from ``src``.
    timeout_s
        Limit of the compiler run.

    Returns
    -------
    str
        Path of the library, ``<source stem>_<digest>.so``. The digest covers the source, every
        header it includes with quotes (from ``bench/shims`` or ``kernels/include``, followed
        recursively) and the command line (compiler, flags, GPU arch), so a change to any of
        them builds a new library instead of loading a stale one.
    """
    digest = hashlib.sha1()
    for path in [source, *_quoted_includes(source)]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update("\0".join(command(Path("SOURCE"), Path("LIBRARY"))).encode())
    cache = _cache_dir(build_dir)
    name = f"{source.stem}_{digest.hexdigest()[:12]}"
    lib = cache / f"{name}.so"
    if not lib.exists():
        tmp = cache / f"{name}.{os.getpid()}.so"  # then renamed: concurrent builds never clash
        cmd = command(source, tmp)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode:
            raise RuntimeError(f"{cmd[0]} failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
        os.replace(tmp, lib)
    return str(lib)


_QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def _quoted_includes(source: Path) -> list[Path]:
    """Headers ``source`` includes with quotes, recursively, in first-seen order.

    Looked up as the compiler does for these sources: next to the including file, then in
    ``kernels/include``. Angle-bracket (system) headers are left out.
    """
    found: list[Path] = []
    pending = [source]
    while pending:
        current = pending.pop(0)
        for name in _QUOTED_INCLUDE.findall(current.read_text()):
            for folder in (current.parent, KERNEL_INCLUDE):
                header = (folder / name).resolve()
                if header.is_file():
                    if header not in found:
                        found.append(header)
                        pending.append(header)
                    break
    return found


def _cache_dir(build_dir: str | os.PathLike | None) -> Path:
    cache = Path(
        build_dir
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "canonical-kv" / "bench"
    )
    cache.mkdir(parents=True, exist_ok=True)
    return cache


# ----------------------------------------------------------------------------- CUDA (unverified)


class BatchMemcpy:
    """``cuMemcpyBatchAsync`` with raw descriptor arrays. UNVERIFIED (no GPU where written).

    The entry point comes from cuda-python's ``cuGetProcAddress`` for the CUDA 13.0 ABI
    (no ``failIdx``), falling back to the 12.8 ABI; it is called through ctypes with the
    addresses of the numpy descriptor arrays, as vLLM's C++ ``swap_blocks_batch`` passes its
    arrays (cuda-python's own wrapper wants one CUdeviceptr object per descriptor, which would
    measure Python object churn, not the API).
    """

    def __init__(self) -> None:
        from cuda.bindings import driver

        self._driver = driver
        flags = driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
        self.fn = None
        errors = []
        for version, fail_idx in ((13000, False), (12080, True)):
            result = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", version, flags)
            err, pfn = result[0], result[1]
            if err != driver.CUresult.CUDA_SUCCESS or not int(pfn):
                errors.append(f"{version}: {err}, status {result[2:]}")
                continue
            args = [ctypes.c_void_p] * 3 + [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p]
            args += [ctypes.c_size_t] + ([ctypes.c_void_p] if fail_idx else []) + [ctypes.c_void_p]
            self.fn = ctypes.CFUNCTYPE(ctypes.c_int, *args)(int(pfn))
            self.abi = version
            self.fail_idx = fail_idx
            break
        if self.fn is None:
            raise RuntimeError(f"cuMemcpyBatchAsync not available: {'; '.join(errors)}")
        # One CUmemcpyAttributes for the whole batch: srcAccessOrder = STREAM (1), no location
        # hints, no flags. The struct is 6 x 4 bytes in the 12.8/13.0 headers; zero padding
        # beyond it is harmless with numAttrs = 1.
        self._attrs = (ctypes.c_uint32 * 16)()
        self._attrs[0] = int(driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)
        self._attr_idx = (ctypes.c_size_t * 1)(0)
        self._fail = ctypes.c_size_t(0)

    def __call__(self, dst_ptr: int, src_ptr: int, sizes_ptr: int, count: int, stream: int):
        args = [dst_ptr, src_ptr, sizes_ptr, count, ctypes.addressof(self._attrs)]
        args += [ctypes.addressof(self._attr_idx), 1]
        args += [ctypes.addressof(self._fail)] if self.fail_idx else []
        rc = self.fn(*args, stream)
        if rc != 0:
            _, name = self._driver.cuGetErrorName(self._driver.CUresult(rc))
            raise RuntimeError(f"cuMemcpyBatchAsync failed: {rc} {name!r}")


def _nvcc() -> str | None:
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception:  # pragma: no cover - torch without cpp_extension
        CUDA_HOME = None
    if CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return os.path.join(CUDA_HOME, "bin", "nvcc")
    return shutil.which("nvcc")


class CudaShim:
    """The nvcc-compiled baseline library (per-fragment cudaMemcpyAsync, descriptor kernel).

    UNVERIFIED: compiled and run only on a GPU machine. Built from ``shims/cuda_baselines.cu``
    once per content (with the headers it includes) and GPU arch into ``build_dir`` (default
    ``$XDG_CACHE_HOME/canonical-kv/bench``).
    """

    SOURCE = SHIM_SOURCES / "cuda_baselines.cu"

    def __init__(self, build_dir: str | os.PathLike | None = None, timeout_s: float = 180):
        nvcc = _nvcc()
        if nvcc is None:
            raise RuntimeError("nvcc not found (set CUDA_HOME)")
        major, minor = torch.cuda.get_device_capability()
        arch = f"{major}{minor}"

        def command(src: Path, out: Path) -> list[str]:
            return [
                nvcc, "-O3", "-shared", "-Xcompiler", "-fPIC", "-lineinfo", f"-I{KERNEL_INCLUDE}",
                f"-gencode=arch=compute_{arch},code=sm_{arch}", str(src), "-o", str(out),
            ]  # fmt: skip

        self.path = _built_library(build_dir, self.SOURCE, command, timeout_s)
        so = ctypes.CDLL(self.path)
        i64p = ctypes.c_void_p
        so.shim_threads.restype = ctypes.c_int
        so.shim_blocks_per_sm.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        so.shim_blocks_per_sm.restype = ctypes.c_int
        so.shim_descriptor_copy.argtypes = [
            i64p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
        ]  # fmt: skip
        so.shim_descriptor_copy.restype = ctypes.c_int
        so.shim_memcpy_each.argtypes = [i64p, i64p, i64p, ctypes.c_int64, ctypes.c_void_p]
        so.shim_memcpy_each.restype = ctypes.c_int
        so.shim_device_address.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
        so.shim_device_address.restype = ctypes.c_int
        so.shim_error_string.argtypes = [ctypes.c_int]
        so.shim_error_string.restype = ctypes.c_char_p
        self.so = so
        self._occupancy: dict[int, int] = {}

    def _check(self, rc: int, what: str) -> None:
        if rc:
            raise RuntimeError(f"{what}: CUDA error {rc} ({self.so.shim_error_string(rc)!r})")

    @staticmethod
    def group_for(max_fragment_bytes: int) -> int:
        """Lanes per descriptor, as our kernel picks lanes per fragment."""
        if max_fragment_bytes <= 128:
            return 8
        return 16 if max_fragment_bytes <= 256 else 32

    def blocks_per_sm(self, group: int) -> int:
        if group not in self._occupancy:
            value = ctypes.c_int(0)
            self._check(self.so.shim_blocks_per_sm(group, ctypes.byref(value)), "occupancy")
            self._occupancy[group] = max(1, value.value)
        return self._occupancy[group]

    def grid(self, count: int, group: int, sm_budget: int) -> int:
        """Thread blocks for ``count`` descriptors within ``sm_budget`` SMs (as our kernel)."""
        per_block = self.so.shim_threads() // group
        needed = -(-count // per_block)
        return max(1, min(needed, sm_budget * self.blocks_per_sm(group)))

    def descriptor_copy(self, desc_ptr: int, count: int, grid: int, group: int, stream: int):
        rc = self.so.shim_descriptor_copy(desc_ptr, count, grid, group, stream)
        self._check(rc, "descriptor_copy launch")

    def device_address(self, host_ptr: int) -> int:
        """Device address of pinned host memory; raises if it is not pinned / registered."""
        out = ctypes.c_void_p(0)
        rc = self.so.shim_device_address(host_ptr, ctypes.byref(out))
        if rc == -1:
            raise RuntimeError(f"{host_ptr:#x} is not pinned host memory")
        self._check(rc, "cudaPointerGetAttributes")
        return int(out.value or 0)

    def memcpy_each(self, src_ptr: int, dst_ptr: int, sizes_ptr: int, count: int, stream: int):
        self._check(self.so.shim_memcpy_each(src_ptr, dst_ptr, sizes_ptr, count, stream), "memcpy")
