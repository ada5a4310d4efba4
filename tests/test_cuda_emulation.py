"""The REAL CUDA kernel, emulated thread by thread on the CPU, against the CPU op, byte for byte.

g++ compiles ``kernels/cuda/canonical_kernel.cu`` (with ``copy.cuh``, ``plan.h`` and the
launch code: the project's sources, never a copy) against ``tests/emulation/cuda_emulation.h``
and the driver ``tests/emulation/emulate_kernel.cpp``; ctypes runs it. The kernel has no
barriers, shared memory or warp collectives, so running its threads one after the other is
exact: every thread reads inputs no other thread writes and writes bytes no other thread
touches (checked here by running the threads forward and in reverse). The build refuses
(compile error, and a source scan here) constructs sequential emulation cannot honour.

What this covers that no CPU test can: the kernel's index math (grid-stride loop, pair /
fragment split, expansion), group widths of 8 / 16 / 32 lanes and every kernel variant, the
16 / 8 / 4 / 2 / 1-byte copy paths, elected writers, wrapped grids, launch sizing, and the
error path (out-of-range device ids: pairs skipped in every layer, error record). What it
cannot cover: the hardware (memory model, PCIe / UVA access, occupancy, timing) and nvcc's
code generation; those need a GPU (bench/device_check.sh).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.ops import (
    Case,
    LayerConfig,
    build_setup,
    full_and_mla_case,
    random_bytes,
    random_case,
    random_pairs,
)

import canonical_ops
from canonical_ops.ops import transfer_error
from canonical_ops.plan import FRAGMENT_WORDS, HEADER_WORDS, LAYER_WORDS

ROOT = Path(__file__).resolve().parents[1]
EMULATION = ROOT / "tests" / "emulation"
KERNEL = ROOT / "kernels" / "cuda" / "canonical_kernel.cu"
MUST_INCLUDE = {
    KERNEL,
    ROOT / "kernels" / "include" / "canonical" / "copy.cuh",
    ROOT / "kernels" / "include" / "canonical" / "plan.h",
    ROOT / "kernels" / "include" / "canonical" / "launch.h",
}
FLAGS = [
    "-std=c++17",
    "-O2",
    "-fPIC",
    "-fno-strict-aliasing",  # the kernel reads bytes through vector types, as CUDA allows
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-unknown-pragmas",  # #pragma unroll
    f"-I{EMULATION / 'include'}",
    f"-I{ROOT / 'kernels' / 'include'}",
    "-include",
    str(EMULATION / "cuda_emulation.h"),
]
VARIANTS = 4  # kernels/include/canonical/launch.h kNumKernelVariants
CUDA_DEFAULT_SPLIT = 2048  # canonical_ops.plan.CUDA_MAX_FRAGMENT_BYTES

# Constructs the emulation refuses (cuda_emulation.h makes each a compile error; the scan
# below names the file and line).
UNSUPPORTED = re.compile(
    r"__syncthreads\w*|__shared__|__syncwarp|__barrier_sync|__shfl\w*|__ballot\w*|__any_sync"
    r"|__all_sync|__uni_sync|__activemask|__match_\w+_sync|__reduce_\w+_sync|__threadfence\w*"
    r"|__nanosleep|cooperative_groups|\bcg::|\basm\b|cudaLaunchCooperativeKernel"
)


def _compiler() -> str:
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++")
    if cxx is None:
        pytest.fail("the CUDA kernel emulation needs g++ (as the extension build does)")
    return cxx


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def unsupported_constructs(paths) -> list[str]:
    """``file:line: construct`` for every construct sequential emulation cannot honour."""
    found = []
    for path in paths:
        for number, line in enumerate(_strip_comments(Path(path).read_text()).splitlines(), 1):
            found += [f"{path}:{number}: {m.group(0)}" for m in UNSUPPORTED.finditer(line)]
    return found


@functools.cache
def kernel_sources() -> tuple[Path, ...]:
    """The project files the kernel translation unit includes (g++ -MM), the .cu first."""
    out = subprocess.run(
        [_compiler(), *FLAGS, "-MM", "-x", "c++", str(KERNEL)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    deps = [Path(p).resolve() for p in out.replace("\\\n", " ").split(":", 1)[1].split()]
    return tuple(p for p in deps if ROOT / "kernels" in p.parents)


@functools.cache
def emulator() -> ctypes.CDLL:
    """The emulated kernel as a shared library, built once per source content (cached)."""
    sources = kernel_sources()
    missing = MUST_INCLUDE - set(sources)
    assert not missing, f"the kernel no longer includes {sorted(map(str, missing))}"
    found = unsupported_constructs(sources)
    if found:
        pytest.fail(
            "the kernel uses constructs the CPU emulation cannot honour:\n" + "\n".join(found)
        )
    inputs = [*sources, EMULATION / "cuda_emulation.h", EMULATION / "emulate_kernel.cpp"]
    digest = hashlib.sha256(" ".join(FLAGS).encode())
    for path in sorted(set(inputs) | set((EMULATION / "include").iterdir())):
        digest.update(str(path).encode() + path.read_bytes())
    folder = Path(tempfile.gettempdir()) / f"canonical-kv-emulation-{digest.hexdigest()[:20]}"
    library = folder / "libemulated_kernel.so"
    if not library.exists():
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f"build-{os.getpid()}.so"
        result = subprocess.run(
            [
                *(_compiler(), *FLAGS, "-shared", "-x", "c++", str(KERNEL), "-x", "c++"),
                *(str(EMULATION / "emulate_kernel.cpp"), "-o", str(partial)),
            ],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            pytest.fail(f"emulation build failed:\n{result.stderr[-4000:]}")
        partial.replace(library)  # atomic: concurrent test runs never load a partial file
    lib = ctypes.CDLL(str(library))
    i64p = ctypes.POINTER(ctypes.c_int64)
    lib.canonical_emulate.restype = ctypes.c_int
    lib.canonical_emulate.argtypes = [
        i64p, i64p, i64p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32, ctypes.c_int32, i64p,
        ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, i64p,
    ]  # fmt: skip
    return lib


# --------------------------------------------------------------------------- device memory


class Buffer:
    """A byte copy of ``data`` at a chosen address modulo 16 (``misalign``)."""

    def __init__(self, data: np.ndarray, misalign: int) -> None:
        self._raw = np.zeros(data.size + 32, dtype=np.uint8)
        start = (-self._raw.ctypes.data) % 16 + misalign
        self.array = self._raw[start : start + data.size]
        self.array[:] = data.reshape(-1)

    @property
    def address(self) -> int:
        return self.array.ctypes.data


@dataclasses.dataclass
class Launch:
    variant: int = 0
    sm_budget: int = 8
    blocks_per_sm: int = 1
    reverse: bool = False
    kv_misalign: int = 0
    pages_misalign: int = 0


def _ptr(array: np.ndarray):
    return array.ctypes.data_as(ctypes.POINTER(ctypes.c_int64))


def run_emulated(setup, store: bool, blocks, page_ids, launch: Launch, kv_bytes, pages_bytes):
    """Run the emulated kernel on copies of ``kv_bytes`` / ``pages_bytes`` (as the CUDA op
    would be called: same plan words, ids, num_pages); returns (kv, pages, record, info)."""
    plan = setup.plan.numpy()
    kv = [Buffer(b, launch.kv_misalign) for b in kv_bytes]
    pages = Buffer(pages_bytes, launch.pages_misalign)
    blocks = np.ascontiguousarray(blocks, dtype=np.int64)
    page_ids = np.ascontiguousarray(page_ids, dtype=np.int64)
    layer_ptrs = (ctypes.c_void_p * len(kv))(*(b.address for b in kv))
    record = np.zeros(4, dtype=np.int64)
    info = np.zeros(4, dtype=np.int64)
    num_pages = setup.pages.num_rows * setup.case.pages_per_row
    status = emulator().canonical_emulate(
        _ptr(plan),
        _ptr(blocks),
        _ptr(page_ids),
        len(blocks),
        num_pages,
        pages.address + setup.pages.lead,
        layer_ptrs,
        len(kv),
        int(store),
        _ptr(record),
        launch.sm_budget,
        launch.variant,
        launch.blocks_per_sm,
        int(launch.reverse),
        _ptr(info),
    )
    assert status == 0, f"emulated launch returned cudaError {status}"
    return [b.array.reshape(k.shape) for b, k in zip(kv, kv_bytes)], pages.array, record, info


def cuda_plan_case(case: Case) -> Case:
    """``case`` with the fragment split a CUDA plan gets by default."""
    if case.max_fragment_bytes is None:
        return dataclasses.replace(case, max_fragment_bytes=CUDA_DEFAULT_SPLIT)
    return case


def expected_by_cpu_op(setup, store: bool, blocks, page_ids):
    """Bytes before, and after the CPU op (canonical_ops on CPU tensors)."""
    kv_before = [c.host_bytes() for c in setup.kv]
    pages_before = setup.pages.host_bytes()
    fn = canonical_ops.store if store else canonical_ops.load
    fn(setup.kv_tensors, setup.pages.tensor, setup.plan, blocks, page_ids)
    kv_after = [c.host_bytes() for c in setup.kv]
    pages_after = setup.pages.host_bytes()
    # Restore, so the next call starts from the same bytes.
    for c, b in zip(setup.kv, kv_before):
        c.base.copy_(torch.from_numpy(b))
    setup.pages.flat.copy_(torch.from_numpy(pages_before))
    return kv_before, pages_before, kv_after, pages_after


def assert_same(actual, expected, what):
    if np.array_equal(actual, expected):
        return
    diff = np.flatnonzero(actual.reshape(-1) != expected.reshape(-1))
    raise AssertionError(
        f"{what}: emulated CUDA kernel differs from the CPU op in {diff.size} bytes; first at "
        f"flat offsets {diff[:6].tolist()}: kernel {actual.reshape(-1)[diff[:6]].tolist()}, "
        f"CPU op {expected.reshape(-1)[diff[:6]].tolist()}"
    )


def check_case(case: Case, launch: Launch, num_pairs: int | None = None) -> np.ndarray:
    """Store and load random distinct pairs of ``case`` on the emulated kernel and the CPU
    op; every byte of kv and cpu_pages must match. Returns the launch info of the load."""
    setup = build_setup(cuda_plan_case(case))
    rng = np.random.default_rng(case.seed + 99)
    num_pages = case.num_rows * case.pages_per_row
    n = num_pairs if num_pairs is not None else case.num_pairs
    blocks, page_ids = random_pairs(rng, case.num_blocks, num_pages, n)
    info = None
    for store in (True, False):
        if not store:  # fresh pages to load from
            setup.pages.flat.copy_(random_bytes(rng, tuple(setup.pages.flat.shape)))
        kv_before, pages_before, kv_after, pages_after = expected_by_cpu_op(
            setup, store, blocks, page_ids
        )
        kv, pages, record, info = run_emulated(
            setup, store, blocks, page_ids, launch, kv_before, pages_before
        )
        op = "store" if store else "load"
        assert_same(pages, pages_after, f"{op} cpu_pages ({case}, {launch})")
        for layer, (got, want) in enumerate(zip(kv, kv_after)):
            assert_same(got, want, f"{op} kv_caches[{layer}] ({case}, {launch})")
        assert not record.any(), f"valid ids reported an error: {record}"
        assert info[0] == (1 if n else 0)
    return info


# --------------------------------------------------------------------------- the build


def test_emulation_builds_from_the_real_kernel_sources():
    emulator()
    assert KERNEL in kernel_sources()
    assert unsupported_constructs(kernel_sources()) == []


def test_scan_finds_constructs_the_emulation_cannot_honour(tmp_path):
    planted = tmp_path / "kernel.cu"
    planted.write_text(
        "// __syncthreads() in a comment is fine\n"
        "__global__ void k() {\n  __shared__ int s[4];\n  __syncthreads();\n"
        "  int v = __shfl_down_sync(0xffffffff, 1, 1);\n}\n"
    )
    found = unsupported_constructs([planted])
    assert [f.rsplit(": ", 1)[1] for f in found] == [
        "__shared__",
        "__syncthreads",
        "__shfl_down_sync",
    ]


@pytest.mark.parametrize(
    "construct",
    [
        "__syncthreads();",
        "__shared__ int cache[32];",
        "int v = __shfl_down_sync(0xffffffffu, 1, 1); (void)v;",
        "unsigned b = __ballot_sync(0xffffffffu, 1); (void)b;",
        "__syncwarp();",
        "__threadfence();",
        "namespace cg = cooperative_groups;",
    ],
)
def test_emulation_header_refuses_construct(tmp_path, construct):
    """Each construct is a compile error in the emulation (not silently run serially)."""
    source = tmp_path / "kernel.cu"
    source.write_text(f"__global__ void kernel() {{ {construct} }}\n")
    result = subprocess.run(
        [_compiler(), *FLAGS, "-fsyntax-only", "-x", "c++", str(source)],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0, construct
    assert "tests/emulation" in result.stderr or "cooperative_groups" in result.stderr


# --------------------------------------------------------------------------- byte for byte

# Random cases over every layout family, topology and geometry knob (helpers.ops), each
# with a kernel variant, an SM budget, misaligned device buffers and a thread order.
RANDOM_SEEDS = range(80)


def _random_launch(seed: int) -> Launch:
    rng = np.random.default_rng(10_000 + seed)
    return Launch(
        variant=seed % VARIANTS,
        sm_budget=int(rng.choice([1, 2, 8, 132])),
        blocks_per_sm=int(rng.choice([1, 2])),
        reverse=bool(seed % 2),
        kv_misalign=int(rng.choice([0, 1, 2, 4, 8])),
        pages_misalign=int(rng.choice([0, 0, 2, 8])),
    )


@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_emulated_kernel_matches_cpu_op_random(seed):
    case = random_case(seed)
    if seed % 3 == 0:  # CUDA's default split (2048 B) rather than the case's
        case = dataclasses.replace(case, max_fragment_bytes=None)
    check_case(case, _random_launch(seed))


def _layers(count: int) -> tuple[LayerConfig, ...]:
    kinds = [
        LayerConfig("full", "packed", "HND", 16, "bfloat16", 8, pad_elems=8),
        LayerConfig("full", "split", "NHD", 8, "float32", 8),
        LayerConfig("mla", "packed", "NHD", 24, "float16", 1, pad_elems=1),
        LayerConfig("full", "split", "HND", 3, "int8", 2, pad_elems=13),
    ]
    return tuple(kinds[i % len(kinds)] for i in range(count))


@pytest.mark.parametrize("variant", range(VARIANTS))
def test_many_layers_pages_per_row_and_elected_writers(variant):
    """40 layers of 4 kinds, 3 pages per row, TP 4 rank 2 (2-head layers: 2 writers)."""
    case = Case(
        layers=_layers(40),
        tp=4,
        block_size=4,
        rank=2,
        num_blocks=9,
        num_rows=4,
        pages_per_row=3,
        row_pad=5,
        lead=3,
        custom_areas=True,
        num_pairs=7,
        seed=400 + variant,
    )
    setup = build_setup(cuda_plan_case(case))
    assert any(m.num_writers > 1 for m in setup.layout.mappings)
    check_case(case, Launch(variant=variant, sm_budget=2, kv_misalign=2, reverse=variant % 2 == 1))


@pytest.mark.parametrize("variant", range(VARIANTS))
def test_grid_stride_loop_wraps_many_times(variant):
    """One SM's worth of one block: every group walks many work items."""
    case = Case(
        layers=_layers(3),
        tp=2,
        block_size=16,
        rank=1,
        num_blocks=64,
        num_rows=32,
        pages_per_row=2,
        num_pairs=60,
        max_fragment_bytes=32,
        seed=500 + variant,
    )
    info = check_case(case, Launch(variant=variant, sm_budget=1, blocks_per_sm=1))
    setup = build_setup(cuda_plan_case(case))
    total = case.num_pairs * int(setup.plan[3])
    groups = info[1] * info[2] // info[3]
    assert info[1] == 1 and total >= 20 * groups, (total, groups)


def _fragment_case(fragment_bytes: int, seed: int) -> Case:
    """One layer whose plan fragments are ``fragment_bytes`` long (MLA rows, split)."""
    return Case(
        layers=(LayerConfig("mla", "packed", "NHD", 1024, "uint8", 1),),
        tp=1,
        block_size=4,
        num_blocks=6,
        num_rows=3,
        pages_per_row=2,
        num_pairs=5,
        max_fragment_bytes=fragment_bytes,
        seed=seed,
    )


def test_group_widths_and_vector_widths_are_all_exercised():
    """Every group width (8 / 16 / 32 lanes) under every variant, and every copy path
    (16 / 8 / 4 / 2 / 1-byte vectors, chosen from the addresses and sizes at run time)."""
    widths_seen = set()
    for variant in range(VARIANTS):
        for n, fragment in enumerate((64, 256, 512, 1024, 2048)):
            case = _fragment_case(fragment, seed=600 + 10 * variant + n)
            info = check_case(case, Launch(variant=variant, kv_misalign=n % 2))
            widths_seen.add((variant, int(info[3])))
    for variant in range(VARIANTS):
        assert {w for v, w in widths_seen if v == variant} == {8, 16, 32}, widths_seen

    vectors_seen = set()
    for misalign in (0, 1, 2, 4, 8):
        case = _fragment_case(256, seed=700 + misalign)
        check_case(case, Launch(kv_misalign=misalign, pages_misalign=misalign))
        # Fragment addresses: 16-byte aligned tensors plus `misalign`, sizes of 256 bytes.
        vectors_seen.add(16 if misalign == 0 else misalign)
    odd = Case(
        layers=(LayerConfig("full", "split", "NHD", 3, "int8", 3),),
        tp=3,
        block_size=2,
        rank=1,
        num_blocks=5,
        num_rows=3,
        num_pairs=3,
        seed=710,
    )
    sizes = build_setup(odd).layout.mappings[0].fragments()[:, 2]
    assert (sizes % 2 == 1).any()  # odd sizes: the 1-byte path whatever the addresses
    check_case(odd, Launch())
    assert vectors_seen | {1} == {1, 2, 4, 8, 16}


def test_thread_order_does_not_matter():
    """Forward and reverse thread orders give the same bytes: no thread reads what another
    writes (what makes sequential emulation exact)."""
    case = random_case(11)
    for reverse in (False, True):
        check_case(case, Launch(variant=2, sm_budget=1, reverse=reverse))


# --------------------------------------------------------------------------- error path


def _two_block_counts_setup():
    """Layer 0 with 8 blocks, layer 1 with 5: block ids 5-7 exist only in layer 0."""
    case = full_and_mla_case(num_blocks=8, seed=801)
    setup = build_setup(cuda_plan_case(case))
    setup.kv[1] = dataclasses.replace(
        setup.kv[1], base=setup.kv[1].base[:5], tensor=setup.kv[1].tensor[:5]
    )
    setup.plan = canonical_ops.make_plan(
        setup.layout.mappings,
        setup.kv_tensors,
        setup.pages.tensor,
        pages_per_row=case.pages_per_row,
        max_fragment_bytes=case.max_fragment_bytes,
    )
    return setup


@pytest.mark.parametrize("store", [True, False], ids=["store", "load"])
@pytest.mark.parametrize(
    ("bad_block", "bad_page", "flags"),
    [(6, 1, (1, 0)), (-1, 1, (1, 0)), (2, 6, (0, 1)), (3, -4, (0, 1)), (1 << 40, 1 << 40, (1, 1))],
    ids=["block-in-one-layer-only", "block-negative", "page-high", "page-negative", "both"],
)
def test_bad_device_ids_skip_the_pair_in_every_layer(store, bad_block, bad_page, flags):
    """A refused pair is skipped whole (every layer, even one where its block exists); the
    other pairs are copied; the record flags the kind and names the pair."""
    setup = _two_block_counts_setup()
    assert int(setup.plan[10]) == 5  # header word 10: min_num_blocks
    blocks, page_ids = np.array([0, bad_block, 4]), np.array([5, bad_page, 2])
    valid = np.array([True, False, True])
    kv_before, pages_before, kv_after, pages_after = expected_by_cpu_op(
        setup, store, blocks[valid], page_ids[valid]
    )
    for reverse in (False, True):
        kv, pages, record, _ = run_emulated(
            setup, store, blocks, page_ids, Launch(reverse=reverse), kv_before, pages_before
        )
        assert_same(pages, pages_after, "cpu_pages with a refused pair")
        for layer, (got, want) in enumerate(zip(kv, kv_after)):
            assert_same(got, want, f"kv_caches[{layer}] with a refused pair")
        assert tuple(record[:2]) == flags and record[2] == 1 + 1, record
    error = transfer_error(record, blocks, page_ids)
    assert isinstance(error, canonical_ops.CanonicalTransferError)
    assert f"block_ids[1] = {bad_block}" in str(error)


def test_several_refused_pairs_record_one_of_them():
    setup = _two_block_counts_setup()
    blocks, page_ids = np.array([7, 0, 9, 2]), np.array([0, 99, 1, 3])
    _, pages_before, _, _ = expected_by_cpu_op(setup, True, blocks[[3]], page_ids[[3]])
    kv_before = [c.host_bytes() for c in setup.kv]
    _, _, record, _ = run_emulated(
        setup, True, blocks, page_ids, Launch(sm_budget=1), kv_before, pages_before
    )
    assert tuple(record[:2]) == (1, 1) and record[2] - 1 in (0, 1, 2), record


def test_plan_layout_constants_match_the_header():
    """The Python plan constants the emulation driver relies on agree with plan.h."""
    text = (ROOT / "kernels" / "include" / "canonical" / "plan.h").read_text()
    for name, value in (
        ("kHeaderWords", HEADER_WORDS),
        ("kLayerWords", LAYER_WORDS),
        ("kFragmentWords", FRAGMENT_WORDS),
    ):
        assert re.search(rf"{name} = {value};", text), name
