"""Shared helpers of the canonical_ops tests.

* Byte-addressable KV caches: every layer is a contiguous uint8 base buffer
  (num_blocks, block_stride_bytes) with the typed, possibly permuted, cache
  tensor as a view over it, so the tests see every raw byte (padding included).
* cpu_pages over a flat uint8 buffer (optional leading bytes and row padding),
  so the tests see bytes the ops must never touch.
* An INDEPENDENT numpy reference of canonical_store / canonical_load, built
  only from ``mapping.fragments()``, ``is_writer`` and the page-address rule of
  the API contract; it shares no code with canonical_ops.
* A seeded generator of random configurations over every layouts family.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

import canonical_ops
from layouts import CanonicalPageMapping, LayerSpec, derive_group_mappings

# dtype name -> torch dtype; the ops move bytes, so all of these must work.
TORCH_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}

FAMILIES = [(p, o) for p in ("packed", "split") for o in ("NHD", "HND")]


# --------------------------------------------------------------------------- tensors


@dataclass
class KVCache:
    """One layer's cache: raw bytes ``base`` and the typed view ``tensor`` over them."""

    base: torch.Tensor  # uint8 (num_blocks, block_stride_bytes), contiguous
    tensor: torch.Tensor  # typed cache view, leading dim = blocks
    spec: LayerSpec

    @property
    def num_blocks(self) -> int:
        return self.base.shape[0]

    @property
    def block_stride_bytes(self) -> int:
        return self.base.shape[1]

    def host_bytes(self) -> np.ndarray:
        """A numpy copy of the raw bytes (num_blocks, block_stride_bytes)."""
        return self.base.cpu().numpy().copy()


def typed_view(base: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
    """The cache tensor of ``spec`` over a uint8 (num_blocks, stride) buffer, page at offset 0."""
    dtype = TORCH_DTYPES[spec.dtype]
    elem = spec.element_size
    nb, stride = base.shape
    assert stride % elem == 0 and spec.page_size_bytes <= stride
    flat = base.view(dtype)[:, : spec.page_size_bytes // elem]  # (nb, page elements)
    bs, heads, hs = spec.block_size, spec.num_kv_heads, spec.head_size
    if spec.attention == "mla":
        return flat.view(nb, bs, hs)
    if spec.packing == "packed":
        if spec.order == "NHD":
            return flat.view(nb, bs, heads, 2 * hs).permute(0, 2, 1, 3)
        return flat.view(nb, heads, bs, 2 * hs)
    if spec.order == "NHD":
        return flat.view(nb, 2, bs, heads, hs)
    return flat.view(nb, 2, heads, bs, hs).permute(0, 1, 3, 2, 4)


def random_bytes(rng: np.random.Generator, shape) -> torch.Tensor:
    return torch.from_numpy(rng.integers(0, 256, size=shape, dtype=np.uint8))


def make_kv_cache(
    spec: LayerSpec,
    num_blocks: int,
    rng: np.random.Generator,
    *,
    pad_bytes: int = 0,
    device: str | torch.device = "cpu",
) -> KVCache:
    """A cache of ``num_blocks`` blocks of random bytes; blocks are ``page + pad_bytes`` apart."""
    assert pad_bytes % spec.element_size == 0
    stride = spec.page_size_bytes + pad_bytes
    base = random_bytes(rng, (num_blocks, stride)).to(device)
    return KVCache(base, typed_view(base, spec), spec)


@dataclass
class Pages:
    """cpu_pages over a flat buffer: ``lead`` bytes, then rows ``row_stride`` bytes apart."""

    flat: torch.Tensor  # uint8 1-D, the whole allocation
    tensor: torch.Tensor  # uint8 (num_rows, row_bytes), stride (row_stride, 1)
    lead: int
    row_stride: int

    @property
    def num_rows(self) -> int:
        return self.tensor.shape[0]

    def host_bytes(self) -> np.ndarray:
        return self.flat.numpy().copy()


def make_pages(
    num_rows: int,
    row_bytes: int,
    rng: np.random.Generator,
    *,
    row_pad: int = 0,
    lead: int = 0,
    pin: bool = False,
) -> Pages:
    """Random-filled (poisoned) cpu_pages; ``row_pad`` bytes after each row, ``lead`` before."""
    row_stride = row_bytes + row_pad
    total = lead + num_rows * row_stride
    flat = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    flat.copy_(random_bytes(rng, (total,)))
    tensor = flat.as_strided((num_rows, row_bytes), (row_stride, 1), lead)
    return Pages(flat, tensor, lead, row_stride)


# --------------------------------------------------------------------------- reference


def fragment_indices(mapping: CanonicalPageMapping) -> tuple[np.ndarray, np.ndarray]:
    """Byte-level (local_index, canonical_index) pairs of every fragment of ``mapping``."""
    frags = np.asarray(mapping.fragments(), dtype=np.int64).reshape(-1, 3)
    sizes = frags[:, 2]
    total = int(sizes.sum())
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    return np.repeat(frags[:, 0], sizes) + within, np.repeat(frags[:, 1], sizes) + within


@dataclass
class PageLayout:
    """Where each layer's canonical pages live in cpu_pages (the API contract's rule)."""

    mappings: list[CanonicalPageMapping]
    pages_per_row: int
    area_offsets: list[int]
    _indices: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._indices = [fragment_indices(m) for m in self.mappings]

    @classmethod
    def default(cls, mappings, pages_per_row: int) -> PageLayout:
        offsets, position = [], 0
        for m in mappings:
            offsets.append(position)
            position += pages_per_row * m.canonical_page_size_bytes
        return cls(list(mappings), pages_per_row, offsets)

    @property
    def row_bytes(self) -> int:
        """Bytes of a row the layer areas reach."""
        return max(
            off + self.pages_per_row * m.canonical_page_size_bytes
            for off, m in zip(self.area_offsets, self.mappings)
        )

    def page_start(self, pages: Pages, layer: int, page_id: int) -> int:
        """Offset in ``pages.flat`` of layer ``layer``'s canonical page ``page_id``."""
        row, slot = divmod(int(page_id), self.pages_per_row)
        cps = self.mappings[layer].canonical_page_size_bytes
        return pages.lead + row * pages.row_stride + self.area_offsets[layer] + slot * cps


def ref_store(layout, kv_bytes, pages_flat, pages, block_ids, page_ids) -> None:
    """Reference store into the numpy copy ``pages_flat`` of ``pages.flat`` (in place)."""
    for layer, mapping in enumerate(layout.mappings):
        local_idx, canonical_idx = layout._indices[layer]
        for b, p in zip(block_ids, page_ids):
            if not mapping.is_writer(int(p)):
                continue
            start = layout.page_start(pages, layer, p)
            pages_flat[start + canonical_idx] = kv_bytes[layer][int(b), local_idx]


def ref_load(layout, kv_bytes, pages_flat, pages, block_ids, page_ids) -> None:
    """Reference load into the numpy copies ``kv_bytes`` of the layers' raw bytes (in place)."""
    for layer in range(len(layout.mappings)):
        local_idx, canonical_idx = layout._indices[layer]
        for b, p in zip(block_ids, page_ids):
            start = layout.page_start(pages, layer, p)
            kv_bytes[layer][int(b), local_idx] = pages_flat[start + canonical_idx]


def ids_tensor(values, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.as_tensor(np.asarray(values, dtype=np.int64)).to(device)


def assert_bytes_equal(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    if np.array_equal(actual, expected):
        return
    diff = np.flatnonzero(actual.reshape(-1) != expected.reshape(-1))
    raise AssertionError(
        f"{what}: {diff.size} bytes differ (shape {actual.shape}); first flat offsets "
        f"{diff[:8].tolist()}: got {actual.reshape(-1)[diff[:8]].tolist()}, "
        f"expected {expected.reshape(-1)[diff[:8]].tolist()}"
    )


# --------------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class LayerConfig:
    """One layer of a case: the group's per-rank spec and its total KV heads."""

    attention: str
    packing: str
    order: str
    head_size: int
    dtype: str
    total_heads: int
    pad_elems: int = 0


@dataclass(frozen=True)
class Case:
    """A random transfer: layers of one rank of a TP x PCP (DCP inside TP) group."""

    layers: tuple[LayerConfig, ...]
    tp: int
    block_size: int  # local tokens per block (this rank)
    dcp: int = 1
    pcp: int = 1
    interleave: int = 1
    rank: int = 0
    num_blocks: int = 8
    num_rows: int = 4
    pages_per_row: int = 1
    row_pad: int = 0
    lead: int = 0
    custom_areas: bool = False
    max_fragment_bytes: int | None = None
    num_pairs: int = 4
    seed: int = 0

    def spec(self, layer: LayerConfig) -> LayerSpec:
        heads = 1 if layer.attention == "mla" else max(1, layer.total_heads // self.tp)
        return LayerSpec(
            layer.attention,
            self.block_size,
            heads,
            layer.head_size,
            layer.dtype,
            layer.packing,
            layer.order,
        )

    def mappings(self) -> list[CanonicalPageMapping]:
        return [
            derive_group_mappings(
                self.spec(layer), self.tp, layer.total_heads, self.dcp, self.pcp, self.interleave
            )[self.rank]
            for layer in self.layers
        ]


def _total_heads_choices(attention: str, tp: int, dcp: int) -> list[int]:
    if attention == "mla":
        return [1]
    if dcp == 1:
        return sorted({d for d in range(1, tp + 1) if tp % d == 0} | {tp, 2 * tp, 3 * tp})
    # DCP splits tokens among ranks that replicate a head: total must divide tp / dcp.
    return [d for d in range(1, tp // dcp + 1) if (tp // dcp) % d == 0]


def full_and_mla_case(num_blocks: int, seed: int) -> Case:
    """Two small layers, full attention (HND, padded rows) then MLA: the error-path tests'
    model, on CPU (emulated kernel) and on CUDA alike."""
    return Case(
        layers=(
            LayerConfig("full", "packed", "HND", 16, "bfloat16", 8, pad_elems=8),
            LayerConfig("mla", "packed", "NHD", 24, "float16", 1),
        ),
        tp=1,
        block_size=4,
        num_blocks=num_blocks,
        num_rows=3,
        pages_per_row=2,
        seed=seed,
    )


def random_case(seed: int) -> Case:
    """A random case over every family, topology and tensor-geometry knob."""
    rng = np.random.default_rng(seed)
    pick = lambda seq: seq[int(rng.integers(len(seq)))]  # noqa: E731
    tp = pick([1, 2, 4, 8])
    cp_kind = pick(["none", "none", "dcp", "pcp"])
    dcp = pick([d for d in (2, 4) if tp % d == 0] or [1]) if cp_kind == "dcp" else 1
    pcp = 2 if cp_kind == "pcp" else 1
    block_size = pick([1, 2, 4, 8, 16])
    interleave = pick([i for i in (1, 2, 4) if block_size % i == 0])
    layers = []
    for _ in range(int(rng.integers(1, 4))):
        attention = pick(["full", "full", "full", "mla", "opaque"])
        packing, order = pick(FAMILIES)
        if attention == "mla":
            packing, order = "packed", "NHD"
        if attention == "opaque":
            # 3*tp/2 heads over TP (tp >= 2) does not divide: derive falls back to opaque
            # (tp 1 always certifies, which keeps the layer plain).
            attention, total = "full", max(3, 3 * tp // 2)
        else:
            total = pick(_total_heads_choices(attention, tp, dcp))
        dtype = pick(list(TORCH_DTYPES))
        head_size = pick([1, 3, 8, 16, 24, 64])
        pad_elems = pick([0, 0, 1, 8, 13])
        layers.append(LayerConfig(attention, packing, order, head_size, dtype, total, pad_elems))
    num_blocks = int(rng.integers(2, 12))
    num_rows = int(rng.integers(1, 6))
    pages_per_row = pick([1, 1, 4, 3])
    num_pages = num_rows * pages_per_row
    return Case(
        layers=tuple(layers),
        tp=tp,
        block_size=block_size,
        dcp=dcp,
        pcp=pcp,
        interleave=interleave if dcp * pcp > 1 else 1,
        rank=int(rng.integers(tp * pcp)),
        num_blocks=num_blocks,
        num_rows=num_rows,
        pages_per_row=pages_per_row,
        row_pad=pick([0, 0, 16, 5]),
        lead=pick([0, 0, 64, 3]),
        custom_areas=bool(rng.integers(2)),
        max_fragment_bytes=pick([None, None, 16, 48, 256]),
        num_pairs=int(rng.integers(1, min(num_blocks, num_pages) + 1)),
        seed=seed,
    )


@dataclass
class Setup:
    """Tensors, plan and reference layout of one case."""

    case: Case
    kv: list[KVCache]
    pages: Pages
    layout: PageLayout
    plan: torch.Tensor

    @property
    def kv_tensors(self) -> list[torch.Tensor]:
        return [c.tensor for c in self.kv]


def build_setup(case: Case, device: str | torch.device = "cpu", pin: bool = False) -> Setup:
    rng = np.random.default_rng(case.seed + 1_000_003)
    mappings = case.mappings()
    kv = [
        make_kv_cache(
            case.spec(layer),
            case.num_blocks,
            rng,
            pad_bytes=layer.pad_elems * case.spec(layer).element_size,
            device=device,
        )
        for layer in case.layers
    ]
    if case.custom_areas:
        # Layers in reverse order with a 7-byte gap before each area.
        offsets, position = [0] * len(mappings), 0
        for layer in reversed(range(len(mappings))):
            position += 7
            offsets[layer] = position
            position += case.pages_per_row * mappings[layer].canonical_page_size_bytes
        layout = PageLayout(mappings, case.pages_per_row, offsets)
    else:
        layout = PageLayout.default(mappings, case.pages_per_row)
    pages = make_pages(
        case.num_rows, layout.row_bytes, rng, row_pad=case.row_pad, lead=case.lead, pin=pin
    )
    plan = canonical_ops.make_plan(
        mappings,
        [c.tensor for c in kv],
        pages.tensor,
        pages_per_row=case.pages_per_row,
        area_offsets=layout.area_offsets if case.custom_areas else None,
        max_fragment_bytes=case.max_fragment_bytes,
    )
    return Setup(case, kv, pages, layout, plan)


def random_pairs(rng: np.random.Generator, num_blocks: int, num_pages: int, n: int):
    """``n`` distinct block ids and ``n`` distinct page ids."""
    blocks = rng.choice(num_blocks, size=n, replace=False).astype(np.int64)
    pages = rng.choice(num_pages, size=n, replace=False).astype(np.int64)
    return blocks, pages


def check_store_and_load(setup: Setup, ids_device: str | torch.device | None = None) -> None:
    """Store then load random pairs of ``setup``; compare every byte with the reference."""
    case = setup.case
    rng = np.random.default_rng(case.seed + 7)
    device = setup.plan.device if ids_device is None else ids_device
    num_pages = case.num_rows * case.pages_per_row
    blocks, page_ids = random_pairs(rng, case.num_blocks, num_pages, case.num_pairs)
    b, p = ids_tensor(blocks, device), ids_tensor(page_ids, device)
    if ids_device is not None and torch.device(ids_device).type == "cpu" and setup.plan.is_cuda:
        b, p = b.pin_memory(), p.pin_memory()

    # Store: only writer pages' fragment bytes change in cpu_pages; kv untouched.
    kv_before = [c.host_bytes() for c in setup.kv]
    expected_pages = setup.pages.host_bytes()
    ref_store(setup.layout, kv_before, expected_pages, setup.pages, blocks, page_ids)
    canonical_ops.store(setup.kv_tensors, setup.pages.tensor, setup.plan, b, p)
    if setup.plan.is_cuda:
        torch.cuda.synchronize()
        canonical_ops.check_device_errors(setup.plan)
    assert_bytes_equal(setup.pages.host_bytes(), expected_pages, f"store cpu_pages ({case})")
    for layer, c in enumerate(setup.kv):
        assert_bytes_equal(c.host_bytes(), kv_before[layer], f"store kv_caches[{layer}]")

    # Load fresh random pages (every byte differs from the caches with high probability).
    fresh = random_bytes(rng, tuple(setup.pages.flat.shape))
    setup.pages.flat.copy_(fresh)
    pages_before = setup.pages.host_bytes()
    expected_kv = [c.host_bytes() for c in setup.kv]
    ref_load(setup.layout, expected_kv, pages_before, setup.pages, blocks, page_ids)
    canonical_ops.load(setup.kv_tensors, setup.pages.tensor, setup.plan, b, p)
    if setup.plan.is_cuda:
        torch.cuda.synchronize()
        canonical_ops.check_device_errors(setup.plan)
    for layer, c in enumerate(setup.kv):
        assert_bytes_equal(c.host_bytes(), expected_kv[layer], f"load kv_caches[{layer}] ({case})")
    assert_bytes_equal(setup.pages.host_bytes(), pages_before, "load cpu_pages")


def family_cases() -> list[Case]:
    """Explicit coverage of every family and topology kind, all ranks of each group."""
    cases: list[Case] = []

    def full(packing, order, total, head_size=16, dtype="bfloat16"):
        return LayerConfig("full", packing, order, head_size, dtype, total, pad_elems=8)

    def add(layers, tp, block_size=4, dcp=1, pcp=1, interleave=1):
        for rank in range(tp * pcp):
            cases.append(
                Case(
                    layers=tuple(layers),
                    tp=tp,
                    block_size=block_size,
                    dcp=dcp,
                    pcp=pcp,
                    interleave=interleave,
                    rank=rank,
                    num_blocks=6,
                    num_rows=2,
                    pages_per_row=4,
                    num_pairs=5,
                    seed=len(cases),
                )
            )

    mla = LayerConfig("mla", "packed", "NHD", 40, "float16", 1, pad_elems=4)
    for packing, order in FAMILIES:
        for tp in (1, 2, 4, 8):
            add([full(packing, order, 8)], tp)
        add([full(packing, order, 2)], 4)  # replicated GQA: 2 heads over TP 4
        add([full(packing, order, 1, dtype="float8_e4m3fn")], 8)  # one head over TP 8
        add([full(packing, order, 2)], 8, dcp=2, interleave=2)  # DCP inside replication
        add([full(packing, order, 4)], 2, pcp=2, interleave=1)  # PCP
        add([full(packing, order, 6)], 4)  # 6 heads / TP 4: opaque fallback
        # Mixed page sizes: different head_size and dtype per layer.
        add(
            [
                full(packing, order, 8, 16, "bfloat16"),
                full(packing, order, 8, 8, "float32"),
                full(packing, order, 8, 24, "uint8"),
            ],
            2,
        )
    for tp in (1, 2, 4, 8):
        add([mla], tp)
    add([mla], 4, dcp=2, interleave=2)
    add([mla], 4, dcp=4)
    add([mla, full("split", "HND", 2)], 4, dcp=2)  # MLA and full layers side by side
    return cases


# --------------------------------------------------------------------------- cross-topology


def run_cross_topology(
    attention: str,
    total_heads: int,
    writer,
    reader,
    packing: str,
    order: str,
    *,
    layers=((16, "bfloat16"), (8, "float32")),
    canonical_tokens: int = 8,
    seed: int = 0,
    device: str | torch.device = "cpu",
    pin: bool = False,
) -> None:
    """Ranks of topology ``writer`` store into ONE cpu_pages, ranks of ``reader`` load it.

    ``writer`` and ``reader`` are ``layout_truth.Topology``. Expected bytes come from
    ``layout_truth`` (first principles, no mappings): after the stores every canonical
    page must equal ``canonical_page``, after the loads every reader block must equal
    ``local_page``, and nothing else may change.
    """
    from helpers.layout_truth import canonical_page, local_page, random_truth

    rng = np.random.default_rng(seed)
    pages_per_row, num_rows, num_blocks = 2, 3, 9
    num_pages = pages_per_row * num_rows
    page_ids = rng.choice(num_pages, size=5, replace=False).astype(np.int64)

    def specs(topo) -> list[LayerSpec]:
        heads = 1 if attention == "mla" else max(1, total_heads // topo.tp)
        return [
            LayerSpec(attention, canonical_tokens // topo.cp, heads, hs, dtype, packing, order)
            for hs, dtype in layers
        ]

    def group(topo) -> list[list[CanonicalPageMapping]]:
        """[rank][layer] mappings; all certified."""
        per_layer = [
            derive_group_mappings(spec, topo.tp, total_heads, topo.dcp, topo.pcp, topo.interleave)
            for spec in specs(topo)
        ]
        for maps in per_layer:
            assert all(m.num_writers >= 1 for m in maps)
        return [[maps[rank] for maps in per_layer] for rank in range(topo.ranks)]

    w_specs, r_specs = specs(writer), specs(reader)
    w_group, r_group = group(writer), group(reader)
    # truths[layer][page]: the unsharded KV of one canonical page.
    truths = [
        {
            int(p): random_truth(
                rng, attention, total_heads, canonical_tokens, hs * w_specs[i].element_size
            )
            for p in page_ids
        }
        for i, (hs, _) in enumerate(layers)
    ]
    canonical = [
        {p: canonical_page(t, w_specs[i]) for p, t in truths[i].items()} for i in range(len(layers))
    ]
    for i, maps in enumerate(zip(*w_group)):
        assert {m.canonical_page_size_bytes for m in maps} == {canonical[i][int(page_ids[0])].size}
    layout = PageLayout.default(w_group[0], pages_per_row)
    pages = make_pages(num_rows, layout.row_bytes, rng, row_pad=16, pin=pin)
    expected_pages = pages.host_bytes()
    for i in range(len(layers)):
        for p in page_ids:
            start = layout.page_start(pages, i, p)
            page = canonical[i][int(p)]
            expected_pages[start : start + page.size] = page

    for rank, maps in enumerate(w_group):
        blocks = rng.choice(num_blocks, size=page_ids.size, replace=False).astype(np.int64)
        kv = []
        for i, spec in enumerate(w_specs):
            cache = make_kv_cache(spec, num_blocks, rng, pad_bytes=2 * spec.element_size)
            raw = cache.host_bytes()
            for b, p in zip(blocks, page_ids):
                page = local_page(truths[i][int(p)], spec, writer, total_heads, rank)
                raw[b, : page.size] = page
            base = torch.from_numpy(raw).to(device)
            kv.append(KVCache(base, typed_view(base, spec), spec))
        plan = canonical_ops.make_plan(
            maps, [c.tensor for c in kv], pages.tensor, pages_per_row=pages_per_row
        )
        canonical_ops.store(
            [c.tensor for c in kv],
            pages.tensor,
            plan,
            ids_tensor(blocks, device),
            ids_tensor(page_ids, device),
        )
        if plan.is_cuda:
            torch.cuda.synchronize()
    assert_bytes_equal(
        pages.host_bytes(),
        expected_pages,
        f"cpu_pages after TP={writer} stores ({attention} {packing} {order})",
    )

    for rank, maps in enumerate(r_group):
        blocks = rng.choice(num_blocks, size=page_ids.size, replace=False).astype(np.int64)
        kv = [
            make_kv_cache(spec, num_blocks, rng, pad_bytes=3 * spec.element_size, device=device)
            for spec in r_specs
        ]
        expected = [c.host_bytes() for c in kv]
        for i, spec in enumerate(r_specs):
            for b, p in zip(blocks, page_ids):
                page = local_page(truths[i][int(p)], spec, reader, total_heads, rank)
                assert page.size == maps[i].local_page_size_bytes
                expected[i][b, : page.size] = page
        plan = canonical_ops.make_plan(
            maps, [c.tensor for c in kv], pages.tensor, pages_per_row=pages_per_row
        )
        canonical_ops.load(
            [c.tensor for c in kv],
            pages.tensor,
            plan,
            ids_tensor(blocks, device),
            ids_tensor(page_ids, device),
        )
        if plan.is_cuda:
            torch.cuda.synchronize()
        for i, c in enumerate(kv):
            assert_bytes_equal(
                c.host_bytes(),
                expected[i],
                f"reader TP={reader} rank {rank} layer {i} ({attention} {packing} {order})",
            )
    assert_bytes_equal(pages.host_bytes(), expected_pages, "cpu_pages after loads")
