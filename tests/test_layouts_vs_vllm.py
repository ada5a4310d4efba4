"""Differential test: ``layouts`` against vLLM 0.33's own canonical-mapping derivation.

vLLM is not a dependency: its wheel is only *read* at test time (located by
``$CANONICAL_KV_VLLM_WHEEL`` or ``.cache/vllm-wheel/vllm-0.33.0-*.whl``, which
``make vllm-wheel`` downloads; the tests skip without it). The isolation trick:
the source of ``canonical_mapping.py`` is taken from the wheel with ``zipfile``
and ``exec``-ed into a fresh module whose builtins carry a private
``__import__``. That hook answers the file's two vLLM imports
(``vllm.v1.kv_cache_interface`` and ``vllm.v1.kv_offload.base``) with stub
modules built here (and ``torch`` too when it is not installed), passing every
other import through. ``sys.modules`` is never touched, so no fake ``vllm`` package leaks
into other tests. The stubs carry only what the file reads from its specs
(``block_size``, ``num_kv_heads``, ``head_size``, page sizes, ``tokens_per_state``,
``kv_quant_mode.is_per_token_head``); ``CopyRun`` and ``CanonicalPageMapping``
are ours (the field names are checked against the wheel's), so results compare
with ``==``. ``KVCacheLayout`` is the wheel's own leaf module, loaded the same way.

Tensors live on torch's ``meta`` device (shape, strides and dtype without
storage); without torch a small stand-in plays ``torch.Tensor``.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import glob
import itertools
import os
import types
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layouts import (
    CanonicalPageMapping,
    CopyRun,
    LayerSpec,
    RankContext,
    TilingError,
    canonical_format_id,
    derive_group_mappings,
    derive_layer_mapping,
    opaque_fallback_mapping,
    verify_tiling,
)
from layouts.spec import element_size

try:
    import torch
except ImportError:  # the stand-in tensor below takes over
    torch = None

VLLM_VERSION = "0.33.0"
REPO_ROOT = Path(__file__).resolve().parents[1]
CANONICAL_MAPPING_PATH = (
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/canonical_mapping.py"
)
KV_CACHE_LAYOUT_PATH = "vllm/v1/kv_cache_layout.py"
KV_OFFLOAD_BASE_PATH = "vllm/v1/kv_offload/base.py"

DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "float32")
FULL_LAYOUTS = (("packed", "NHD"), ("packed", "HND"), ("split", "NHD"), ("split", "HND"))
TP_SIZES = (1, 2, 4, 8, 16)
HEAD_COUNTS = (1, 2, 4, 8, 16)
CP_SIZES = (1, 2, 4)
INTERLEAVES = (1, 2, 4, 8, 16, 32)
NUM_BLOCKS = 3


# --------------------------------------------------------------------------- stubs


@dataclasses.dataclass(frozen=True)
class _QuantMode:
    """Stand-in for vLLM's KVQuantMode: only the property the derivation reads."""

    is_per_token_head: bool = False


class _KVCacheSpec:
    """Stand-in base of vLLM's KV cache specs (isinstance checks only)."""


@dataclasses.dataclass(frozen=True)
class _AttentionSpec(_KVCacheSpec):
    """Stand-in for vLLM's AttentionSpec; page sizes follow vLLM's definition.

    unpadded = heads * (block_size // tokens_per_state) * (head_size + head_size_v) * elem,
    with head_size_v = head_size for full attention and 0 for MLA.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    element_size: int
    per_token_head: bool = False
    tokens_per_state: int | Fraction = 1
    head_size_v: int | None = None

    @property
    def kv_quant_mode(self) -> _QuantMode:
        return _QuantMode(self.per_token_head)

    @property
    def unpadded_page_size_bytes(self) -> int:
        states = self.block_size // self.tokens_per_state if self.tokens_per_state > 0 else 1
        value_size = self.head_size if self.head_size_v is None else self.head_size_v
        return int(self.num_kv_heads * states * (self.head_size + value_size) * self.element_size)

    @property
    def real_page_size_bytes(self) -> int:
        return self.unpadded_page_size_bytes


@dataclasses.dataclass(frozen=True)
class _MLAAttentionSpec(_AttentionSpec):
    """Stand-in for vLLM's MLAAttentionSpec: one latent per state, no separate V."""

    head_size_v: int | None = 0


class _MambaSpec(_KVCacheSpec):
    """Stand-in for vLLM's MambaSpec (isinstance checks only)."""


@dataclasses.dataclass
class _UniformTypeKVCacheSpecs(_KVCacheSpec):
    """Stand-in for vLLM's UniformTypeKVCacheSpecs: per-layer specs of one group."""

    kv_cache_specs: dict[str, _KVCacheSpec]


@dataclasses.dataclass
class _KVCacheGroup:
    layer_names: list[str]
    kv_cache_spec: _KVCacheSpec


@dataclasses.dataclass
class _KVCacheConfig:
    """Stand-in for vLLM's KVCacheConfig: what derive_canonical_mappings reads."""

    num_blocks: int
    kv_cache_groups: list[_KVCacheGroup]


@dataclasses.dataclass
class _FakeTensor:
    """Plays ``torch.Tensor`` when torch is missing: shape, strides, dtype only."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str

    def stride(self) -> tuple[int, ...]:
        return self.strides

    def element_size(self) -> int:
        return element_size(self.dtype)


def _vllm_config(tp: int, dcp: int, pcp: int, interleave: int, total: int, rank: int) -> Any:
    """Stand-in VllmConfig: the parallel and model fields derive_canonical_mappings reads."""
    parallel = types.SimpleNamespace(
        tensor_parallel_size=tp,
        prefill_context_parallel_size=pcp,
        decode_context_parallel_size=dcp,
        cp_kv_cache_interleave_size=interleave,
        world_size=tp * pcp,
        rank=rank,
    )
    model = types.SimpleNamespace(get_total_num_kv_heads=lambda: total)
    return types.SimpleNamespace(parallel_config=parallel, model_config=model)


# ----------------------------------------------------------------- loading the wheel


def _find_wheel() -> Path:
    """The vLLM wheel to read, or skip the module saying where it was looked for."""
    configured = os.environ.get("CANONICAL_KV_VLLM_WHEEL")
    if configured:
        if not Path(configured).is_file():
            pytest.skip(f"CANONICAL_KV_VLLM_WHEEL={configured} is not a file")
        return Path(configured)
    pattern = REPO_ROOT / ".cache" / "vllm-wheel" / f"vllm-{VLLM_VERSION}-*.whl"
    found = sorted(glob.glob(str(pattern)))
    if not found:
        pytest.skip(
            f"vllm=={VLLM_VERSION} wheel not found: set CANONICAL_KV_VLLM_WHEEL to its path or "
            f"run `make vllm-wheel` (downloads it to .cache/vllm-wheel/)"
        )
    return Path(found[-1])


def _exec_isolated(name: str, source: str, stubs: dict[str, types.ModuleType]) -> types.ModuleType:
    """Execute ``source`` as module ``name``; its imports of ``stubs`` resolve to them."""

    def private_import(
        target: str,
        globals_: Any = None,
        locals_: Any = None,
        fromlist: Sequence[str] = (),
        level: int = 0,
    ) -> types.ModuleType:
        if level == 0 and target in stubs:
            if fromlist or "." not in target:
                return stubs[target]
            raise ImportError(f"only 'from {target} import ...' is stubbed")
        return builtins.__import__(target, globals_, locals_, fromlist, level)

    module = types.ModuleType(name)
    module.__dict__["__builtins__"] = {**vars(builtins), "__import__": private_import}
    filename = f"<wheel>/{name.replace('.', '/')}.py"
    # dont_inherit: this file's `from __future__ import annotations` must not leak in
    exec(compile(source, filename, "exec", dont_inherit=True), module.__dict__)
    return module


def _dataclass_fields(source: str, class_name: str) -> list[str]:
    """Annotated field names of class ``class_name`` in ``source``, in order."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return [
                stmt.target.id
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            ]
    raise LookupError(class_name)


@pytest.fixture(scope="module")
def vllm() -> types.ModuleType:
    """vLLM 0.33's canonical_mapping module, executed against stubs."""
    wheel = _find_wheel()
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"vllm-{VLLM_VERSION}.dist-info/METADATA").decode()
        source = archive.read(CANONICAL_MAPPING_PATH).decode()
        layout_source = archive.read(KV_CACHE_LAYOUT_PATH).decode()
        base_source = archive.read(KV_OFFLOAD_BASE_PATH).decode()
    assert f"\nVersion: {VLLM_VERSION}\n" in metadata, f"{wheel} is not vllm {VLLM_VERSION}"
    for ours, theirs in ((CopyRun, "CopyRun"), (CanonicalPageMapping, "CanonicalPageMapping")):
        # Our descriptive extras (CanonicalPageMapping.derived_for, fallback_reason) take no
        # part in ==, and vLLM's code builds ours with its own fields (they have defaults).
        compared = [f.name for f in dataclasses.fields(ours) if f.compare]
        assert compared == _dataclass_fields(base_source, theirs), (
            f"vLLM's {theirs} fields differ from ours: comparing with == would be meaningless"
        )

    kv_cache_layout = _exec_isolated("vllm.v1.kv_cache_layout", layout_source, {})
    interface = types.ModuleType("vllm.v1.kv_cache_interface")
    interface.__dict__.update(
        AttentionSpec=_AttentionSpec,
        MLAAttentionSpec=_MLAAttentionSpec,
        KVCacheConfig=_KVCacheConfig,
        KVCacheLayout=kv_cache_layout.KVCacheLayout,
        KVCacheSpec=_KVCacheSpec,
        MambaSpec=_MambaSpec,
        UniformTypeKVCacheSpecs=_UniformTypeKVCacheSpecs,
    )
    base = types.ModuleType("vllm.v1.kv_offload.base")
    base.__dict__.update(CopyRun=CopyRun, CanonicalPageMapping=CanonicalPageMapping)
    stubs = {"vllm.v1.kv_cache_interface": interface, "vllm.v1.kv_offload.base": base}
    if torch is None:
        stubs["torch"] = types.ModuleType("torch")
        stubs["torch"].Tensor = _FakeTensor  # type: ignore[attr-defined]
    name = CANONICAL_MAPPING_PATH.removesuffix(".py").replace("/", ".")
    return _exec_isolated(name, source, stubs)


# ------------------------------------------------------------------------- tensors


def _make_tensor(
    logical_shape: tuple[int, ...], physical_order: Sequence[int], dtype: str, pad: int = 0
) -> Any:
    """A tensor of ``logical_shape`` whose dims are laid out in memory in ``physical_order``
    (outermost first), like ``torch.empty(physical shape).permute(...)``; ``pad`` extra
    elements after every innermost row (a padded layout nobody may certify)."""
    strides = [0] * len(logical_shape)
    step = 1
    for position, dim in enumerate(reversed(physical_order)):
        strides[dim] = step
        step *= logical_shape[dim] + (pad if position == 0 else 0)
    if torch is None:
        return _FakeTensor(tuple(logical_shape), tuple(strides), dtype)
    return torch.empty_strided(logical_shape, strides, dtype=getattr(torch, dtype), device="meta")


def full_kv_cache(
    packing: str, order: str, block_size: int, heads: int, head_size: int, dtype: str
) -> Any:
    """A full-attention KV cache in one of the four recognised layouts.

    packed NHD = empty(nb, bs, heads, 2hs).permute(0, 2, 1, 3); packed HND = contiguous
    (nb, heads, bs, 2hs); split NHD = contiguous (nb, 2, bs, heads, hs); split HND =
    empty(nb, 2, heads, bs, hs).permute(0, 1, 3, 2, 4).
    """
    if packing == "packed":
        shape = (NUM_BLOCKS, heads, block_size, 2 * head_size)
        physical = (0, 2, 1, 3) if order == "NHD" else (0, 1, 2, 3)
    else:
        shape = (NUM_BLOCKS, 2, block_size, heads, head_size)
        physical = (0, 1, 2, 3, 4) if order == "NHD" else (0, 1, 3, 2, 4)
    tensor = _make_tensor(shape, physical, dtype)
    if torch is not None:  # cross-check the strides against the documented construction
        if packing == "packed" and order == "NHD":
            reference = torch.empty(NUM_BLOCKS, block_size, heads, 2 * head_size, device="meta")
            reference = reference.permute(0, 2, 1, 3)
        elif packing == "split" and order == "HND":
            reference = torch.empty(NUM_BLOCKS, 2, heads, block_size, head_size, device="meta")
            reference = reference.permute(0, 1, 3, 2, 4)
        else:
            reference = torch.empty(shape, device="meta")
        assert tuple(reference.shape) == shape and reference.stride() == tensor.stride()
    return tensor


def mla_kv_cache(block_size: int, head_size: int, dtype: str) -> Any:
    """An MLA latent cache (num_blocks, block_size, latent width), contiguous."""
    return _make_tensor((NUM_BLOCKS, block_size, head_size), (0, 1, 2), dtype)


# ---------------------------------------------------------------------- comparisons


@dataclasses.dataclass(frozen=True)
class Case:
    """One layer on one topology; the same facts handed to vLLM and to us."""

    attention: str
    kv_cache: Any
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    tp: int
    total_kv_heads: int
    dcp: int = 1
    pcp: int = 1
    interleave: int = 1
    per_token_head: bool = False
    tokens_per_state: int | Fraction = 1

    @property
    def group_size(self) -> int:
        return self.tp * self.pcp

    def vllm_spec(self) -> _AttentionSpec:
        cls = _MLAAttentionSpec if self.attention == "mla" else _AttentionSpec
        return cls(
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            element_size=element_size(self.dtype),
            per_token_head=self.per_token_head,
            tokens_per_state=self.tokens_per_state,
        )

    def vllm_ctx(self, vllm: types.ModuleType, rank: int) -> Any:
        return vllm._RankContext(
            tp_size=self.tp,
            dcp_size=self.dcp,
            pcp_size=self.pcp,
            interleave=self.interleave,
            total_kv_heads=self.total_kv_heads,
            rank=rank,
        )

    def our_spec(self) -> LayerSpec | None:
        return LayerSpec.from_tensor(
            self.kv_cache,
            attention=self.attention,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            per_token_head_scales=self.per_token_head,
            tokens_per_state=self.tokens_per_state,
        )

    def our_ctx(self, rank: int) -> RankContext:
        return RankContext(self.tp, self.total_kv_heads, rank, self.dcp, self.pcp, self.interleave)

    def __str__(self) -> str:
        shape = tuple(self.kv_cache.shape)
        return (
            f"{self.attention} kv_cache shape={shape} stride={tuple(self.kv_cache.stride())} "
            f"dtype={self.dtype} bs={self.block_size} heads={self.num_kv_heads} "
            f"hs={self.head_size} tp={self.tp} total_heads={self.total_kv_heads} "
            f"dcp={self.dcp} pcp={self.pcp} interleave={self.interleave} "
            f"per_token_head={self.per_token_head} tokens_per_state={self.tokens_per_state}"
        )


def full_case(
    packing: str,
    order: str,
    block_size: int,
    heads: int,
    head_size: int,
    dtype: str,
    **topology: Any,
) -> Case:
    """Full attention in one of the four recognised layouts; ``topology``: Case fields."""
    kv_cache = full_kv_cache(packing, order, block_size, heads, head_size, dtype)
    return Case("full", kv_cache, block_size, heads, head_size, dtype, **topology)


def mla_case(block_size: int, head_size: int, dtype: str, **topology: Any) -> Case:
    """MLA with a (num_blocks, block_size, latent width) cache; ``topology``: Case fields."""
    kv_cache = mla_kv_cache(block_size, head_size, dtype)
    return Case("mla", kv_cache, block_size, 1, head_size, dtype, **topology)


def ranks_to_check(group_size: int, exhaustive: bool = True) -> Iterator[int]:
    if exhaustive or group_size <= 4:
        yield from range(group_size)
    else:
        yield from sorted({0, 1, group_size // 2, group_size - 1})


def compare_layer(vllm: types.ModuleType, case: Case, ranks: Iterable[int]) -> int:
    """Assert vLLM's ``_layer_mapping`` == our ``derive_layer_mapping`` at ``ranks``."""
    vllm_spec, our_spec = case.vllm_spec(), case.our_spec()
    count = 0
    for rank in ranks:
        theirs = vllm._layer_mapping(
            vllm_spec, case.kv_cache, case.kv_cache.shape[0], case.vllm_ctx(vllm, rank)
        )
        ours = derive_layer_mapping(our_spec, case.our_ctx(rank))
        assert ours == theirs, f"rank {rank} of {case}:\n vLLM: {theirs}\n ours: {ours}"
        count += 1
    return count


def compare_group(vllm: types.ModuleType, case: Case, exhaustive: bool = True) -> int:
    """Assert vLLM's full per-worker derivation (certify or opaque fallback, then
    tiling verification) == our ``derive_group_mappings``, rank by rank."""
    our_spec = case.our_spec()
    ours: tuple[CanonicalPageMapping, ...] | None = None
    if our_spec is not None:
        ours = derive_group_mappings(
            our_spec, case.tp, case.total_kv_heads, case.dcp, case.pcp, case.interleave
        )
    kv_cache_config = _KVCacheConfig(
        num_blocks=case.kv_cache.shape[0],
        kv_cache_groups=[_KVCacheGroup(["layer.0"], case.vllm_spec())],
    )
    count = 0
    for rank in ranks_to_check(case.group_size, exhaustive):
        config = _vllm_config(
            case.tp, case.dcp, case.pcp, case.interleave, case.total_kv_heads, rank
        )
        theirs = vllm.derive_canonical_mappings(
            config, kv_cache_config, {"layer.0": case.kv_cache}
        )["layer.0"]
        if ours is None:
            # We cannot describe an unrecognised page, so vLLM must have fallen back.
            assert theirs == vllm._opaque_fallback_mapping(
                case.vllm_spec().unpadded_page_size_bytes, case.group_size, rank
            ), f"rank {rank} of {case}: vLLM certified a layout we do not recognise"
        else:
            assert ours[rank] == theirs, (
                f"rank {rank} of {case}:\n vLLM: {theirs}\n ours: {ours[rank]}"
            )
        count += 1
    return count


def topologies(interleaves: Sequence[int] = INTERLEAVES) -> Iterator[dict[str, int]]:
    """Case topology fields over the whole grid; the interleave only matters with
    context parallelism, so without it one value stands in."""
    for tp, total, dcp, pcp in itertools.product(TP_SIZES, HEAD_COUNTS, CP_SIZES, CP_SIZES):
        for interleave in interleaves if dcp * pcp > 1 else (1,):
            yield dict(tp=tp, total_kv_heads=total, dcp=dcp, pcp=pcp, interleave=interleave)


def sharded_heads(topology: dict[str, int]) -> int:
    """KV heads per rank as a model shards them: max(1, total // tp)."""
    return max(1, topology["total_kv_heads"] // topology["tp"])


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize(("packing", "order"), FULL_LAYOUTS)
@pytest.mark.parametrize("block_size", [1, 4, 16, 24])
def test_full_attention_layer_grid(
    vllm: types.ModuleType, packing: str, order: str, block_size: int
) -> None:
    """Every rank of every topology of the grid, per-rank heads as the model shards them."""
    count = 0
    for topology in topologies():
        heads = sharded_heads(topology)
        case = full_case(packing, order, block_size, heads, 8, "bfloat16", **topology)
        count += compare_layer(vllm, case, range(case.group_size))
    assert count > 5000


@pytest.mark.parametrize("block_size", [1, 4, 16, 24, 64])
@pytest.mark.parametrize("tokens_per_state", [1, 2])
def test_mla_layer_grid(vllm: types.ModuleType, block_size: int, tokens_per_state: int) -> None:
    """MLA: one TP-replicated latent; certified only with tokens_per_state == 1."""
    count = 0
    for topology in topologies():
        case = mla_case(
            block_size, 72, "float8_e4m3fn", tokens_per_state=tokens_per_state, **topology
        )
        count += compare_layer(vllm, case, range(case.group_size))
    assert count > 5000


@pytest.mark.parametrize(("packing", "order"), [*FULL_LAYOUTS, ("mla", "")])
def test_group_grid(vllm: types.ModuleType, packing: str, order: str) -> None:
    """vLLM's whole derive_canonical_mappings (fallback and _verify_tiling included)
    against derive_group_mappings, on a coarser grid of topologies, cycling dtypes."""
    for index, topology in enumerate(topologies(interleaves=(1, 4, 32))):
        dtype = DTYPES[index % len(DTYPES)]
        if packing == "mla":
            case = mla_case(8, 64, dtype, **topology)
        else:
            case = full_case(packing, order, 8, sharded_heads(topology), 16, dtype, **topology)
        compare_group(vllm, case, exhaustive=False)


@st.composite
def cases(draw: Callable[..., Any]) -> Case:
    """Random layers and topologies, skewed toward the edges: wrong head counts,
    non-dividing interleaves, quantisation scales, compressed states, odd tensors."""
    tp = draw(st.sampled_from(TP_SIZES))
    total = draw(st.sampled_from((*HEAD_COUNTS, 3, 6, 12, 24, 32)))
    dcp, pcp = draw(st.sampled_from(CP_SIZES)), draw(st.sampled_from(CP_SIZES))
    interleave = draw(st.sampled_from((*INTERLEAVES, 3, 5, 64)))
    block_size = draw(st.one_of(st.integers(1, 64), st.sampled_from((16, 32, 64))))
    dtype = draw(st.sampled_from(DTYPES))
    per_token_head = draw(st.integers(0, 7)) == 0
    tokens_per_state = draw(st.sampled_from((1, 1, 1, 1, 1, 1, 2, 4, Fraction(1, 2))))
    common = dict(
        dtype=dtype,
        tp=tp,
        total_kv_heads=total,
        dcp=dcp,
        pcp=pcp,
        interleave=interleave,
        per_token_head=per_token_head,
        tokens_per_state=tokens_per_state,
    )
    if draw(st.integers(0, 3)) == 0:
        head_size = draw(st.sampled_from((64, 72, 512, 576)))
        kv_cache = mla_kv_cache(block_size, head_size, dtype)
        return Case("mla", kv_cache, block_size, 1, head_size, **common)
    head_size = draw(st.sampled_from((8, 64, 80, 128)))
    heads = max(1, total // tp)
    if draw(st.integers(0, 4)) == 0:  # deliberately wrong head count for this topology
        heads = draw(st.sampled_from((total, heads + 1, heads * 2, max(1, heads // 2))))
    packing, order = draw(st.sampled_from(FULL_LAYOUTS))
    if draw(st.integers(0, 3)):
        kv_cache = full_kv_cache(packing, order, block_size, heads, head_size, dtype)
    else:  # any physical order of the page dims, maybe padded: mostly unrecognisable
        if packing == "packed":
            shape: tuple[int, ...] = (NUM_BLOCKS, heads, block_size, 2 * head_size)
        else:
            shape = (NUM_BLOCKS, 2, block_size, heads, head_size)
        inner = draw(st.permutations(range(1, len(shape))))
        pad = draw(st.sampled_from((0, 0, 8)))
        kv_cache = _make_tensor(shape, (0, *inner), dtype, pad)
    return Case("full", kv_cache, block_size, heads, head_size, **common)


@settings(
    max_examples=1500,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=cases())
def test_random_layers(vllm: types.ModuleType, case: Case) -> None:
    """Per-rank and whole-group agreement on random edge cases."""
    compare_layer(vllm, case, ranks_to_check(case.group_size))
    compare_group(vllm, case, exhaustive=False)


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("page_size", [1, 576, 65536, 3 * 1152])
def test_opaque_fallback(vllm: types.ModuleType, num_ranks: int, page_size: int) -> None:
    for rank in range(num_ranks):
        theirs = vllm._opaque_fallback_mapping(page_size, num_ranks, rank)
        assert opaque_fallback_mapping(page_size, num_ranks, rank) == theirs


def _tiling_accepted(
    verify: Callable[[list[CanonicalPageMapping]], None],
    rejections: tuple[type[Exception], ...],
    mappings: list[CanonicalPageMapping],
) -> bool:
    try:
        verify(mappings)
    except rejections:
        return False
    return True


def _perturbations(
    mappings: tuple[CanonicalPageMapping, ...],
) -> Iterator[list[CanonicalPageMapping]]:
    """The group itself, then variants with one defect each (a gap, an overlap, a
    missing or doubled run, a lost writer)."""
    yield list(mappings)
    last = len(mappings) - 1
    victim = mappings[last]
    run = victim.runs[-1]

    def with_runs(runs: tuple[CopyRun, ...]) -> list[CanonicalPageMapping]:
        return [*mappings[:last], dataclasses.replace(victim, runs=runs)]

    shifted = dataclasses.replace(run, canonical_offset=run.canonical_offset + 1)
    yield with_runs((*victim.runs[:-1], shifted))
    shifted = dataclasses.replace(run, local_offset=run.local_offset + run.fragment_size)
    yield with_runs((*victim.runs[:-1], shifted))
    yield with_runs(victim.runs[:-1])
    yield with_runs((*victim.runs, run))
    if run.fragment_size > 1:
        yield with_runs(
            (*victim.runs[:-1], dataclasses.replace(run, fragment_size=run.fragment_size - 1))
        )
    yield [*mappings[:last], dataclasses.replace(victim, num_writers=victim.num_writers + 1)]
    if victim.num_writers > 1:
        moved = (victim.writer_index + 1) % victim.num_writers
        yield [*mappings[:last], dataclasses.replace(victim, writer_index=moved)]
    yield [
        *mappings[:last],
        dataclasses.replace(victim, canonical_page_size_bytes=victim.canonical_page_size_bytes + 1),
    ]


@pytest.mark.parametrize(("packing", "order"), [*FULL_LAYOUTS, ("mla", "")])
@pytest.mark.parametrize(
    ("tp", "total", "dcp", "pcp", "interleave"),
    [
        (1, 8, 1, 1, 1),
        (4, 8, 1, 1, 1),
        (8, 2, 2, 1, 1),
        (8, 2, 4, 2, 2),
        (4, 4, 1, 2, 4),
        (16, 1, 4, 4, 1),
    ],
)
def test_tiling_verification_agrees(
    vllm: types.ModuleType,
    packing: str,
    order: str,
    tp: int,
    total: int,
    dcp: int,
    pcp: int,
    interleave: int,
) -> None:
    """vLLM's _verify_tiling and our verify_tiling accept and reject the same groups."""
    if packing == "mla":
        spec = LayerSpec("mla", 8, 1, 64, "bfloat16", "packed", "NHD")
    else:
        spec = LayerSpec("full", 8, max(1, total // tp), 16, "bfloat16", packing, order)
    group = derive_group_mappings(spec, tp, total, dcp, pcp, interleave)
    for index, mappings in enumerate(_perturbations(group)):
        theirs = _tiling_accepted(
            lambda ms: vllm._verify_tiling("layer", ms), (AssertionError,), mappings
        )
        ours = _tiling_accepted(verify_tiling, (TilingError,), mappings)
        assert ours == theirs, f"perturbation {index}: vLLM accepts={theirs}, ours={ours}"
        assert theirs == (index == 0), f"perturbation {index} not caught by vLLM"


def test_uniform_type_group(vllm: types.ModuleType) -> None:
    """Layers of one UniformTypeKVCacheSpecs group keep their own specs and tensors."""
    tp, total = 4, 8
    full = full_case("split", "HND", 16, 2, 64, "float16", tp=tp, total_kv_heads=total)
    mla = mla_case(16, 576, "bfloat16", tp=tp, total_kv_heads=total)
    heads_outside_halves = _make_tensor((NUM_BLOCKS, 2, 16, 2, 64), (0, 3, 1, 2, 4), "float16")
    odd = dataclasses.replace(full, kv_cache=heads_outside_halves)
    layers = {"full": full, "mla": mla, "odd": odd}
    group = _KVCacheGroup(
        list(layers), _UniformTypeKVCacheSpecs({n: c.vllm_spec() for n, c in layers.items()})
    )
    kv_caches = {name: case.kv_cache for name, case in layers.items()}
    assert odd.our_spec() is None
    for rank in range(tp):
        theirs = vllm.derive_canonical_mappings(
            _vllm_config(tp, 1, 1, 1, total, rank), _KVCacheConfig(NUM_BLOCKS, [group]), kv_caches
        )
        for name, case in layers.items():
            spec = case.our_spec()
            expected = (
                derive_group_mappings(spec, tp, total)[rank]
                if spec is not None
                else opaque_fallback_mapping(case.vllm_spec().unpadded_page_size_bytes, tp, rank)
            )
            assert theirs[name] == expected, f"layer {name}, rank {rank}"


def test_page_without_states(vllm: types.ModuleType) -> None:
    """A block too short for one compressed state (block_size 1, tokens_per_state 2)."""
    case = mla_case(1, 64, "bfloat16", tp=2, total_kv_heads=1, tokens_per_state=2)
    compare_group(vllm, case)


@pytest.mark.parametrize(("ours", "layout"), [("NHD", "LBNHC"), ("HND", "LBHNC")])
def test_canonical_format_id(vllm: types.ModuleType, ours: str, layout: str) -> None:
    """vLLM names the family by its KVCacheLayout enum; the ids must match byte for byte."""
    assert canonical_format_id(ours) == vllm.canonical_format_id(layout)
    assert canonical_format_id(layout) == vllm.canonical_format_id(layout)
    assert vllm.CANONICAL_FORMAT_VERSION == 1
