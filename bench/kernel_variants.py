"""Compare the compiled-in CUDA kernel variants (registers / occupancy / bytes in flight).

The variants (kernels/include/canonical/launch.h; ``torch.ops.canonical._kernel_variants()``):
``base`` (launch bounds 512, lanes per fragment from the largest fragment: one 16-byte vector
per lane up to 512 B), ``2blk`` (launch bounds 512 x 2: at most 64 registers, 2 blocks per SM),
``deep`` (narrower groups: up to 4 vectors in flight per lane) and ``deep2blk`` (both).

For each case (a 16-layer model on one TP rank, ids random permutations, pinned pages) and
SM budget, every variant stores and loads the same pairs; the bytes each variant writes are
checked against the ``base`` variant's, then timed with CUDA events on a side stream (best of
N after warm-up). Prints a table and writes ``kernel_variants.json`` (and ``.md``) to --out,
with each compiled kernel's registers and blocks per SM as the driver reports them. Pick the
default by these numbers (settings.cpp, CANONICAL_KV_KERNEL_VARIANT), not by guess.

Usage: python bench/kernel_variants.py --out DIR [--repeats 20] [--time-budget 60]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import canonical_ops
from canonical_ops import _extension  # noqa: F401  (registers torch.ops.canonical)
from layouts import LayerSpec, derive_group_mappings


@dataclass(frozen=True)
class Case:
    name: str
    spec: LayerSpec
    tp: int
    total_heads: int
    layers: int = 16
    pairs: int = 512


CASES = [
    # Fragments of 256 B: split NHD, one 128-dim bf16 head per rank and token (sparse).
    Case("split NHD TP8 (256 B)", LayerSpec("full", 16, 1, 128, "bfloat16", "split", "NHD"), 8, 8),
    # 512 B: packed NHD, one head (K and V) per rank and token.
    Case(
        "packed NHD TP8 (512 B)", LayerSpec("full", 16, 1, 128, "bfloat16", "packed", "NHD"), 8, 8
    ),
    # 1 KiB: packed NHD, two heads per rank and token.
    Case(
        "packed NHD TP4 (1 KiB)", LayerSpec("full", 16, 2, 128, "bfloat16", "packed", "NHD"), 4, 8
    ),
    # 2 KiB work items (pages split at 2 KiB): split HND, 4 heads per rank.
    Case("split HND TP2 (2 KiB)", LayerSpec("full", 16, 4, 128, "bfloat16", "split", "HND"), 2, 8),
]


def _kv_tensor(spec: LayerSpec, num_blocks: int, device: torch.device) -> torch.Tensor:
    bs, heads, hs = spec.block_size, spec.num_kv_heads, spec.head_size
    dtype = getattr(torch, spec.dtype)
    if spec.packing == "packed":
        if spec.order == "NHD":
            return torch.empty(num_blocks, bs, heads, 2 * hs, dtype=dtype, device=device).permute(
                0, 2, 1, 3
            )
        return torch.empty(num_blocks, heads, bs, 2 * hs, dtype=dtype, device=device)
    if spec.order == "NHD":
        return torch.empty(num_blocks, 2, bs, heads, hs, dtype=dtype, device=device)
    return torch.empty(num_blocks, 2, heads, bs, hs, dtype=dtype, device=device).permute(
        0, 1, 3, 2, 4
    )


def _time(fn, stream: torch.cuda.Stream, repeats: int) -> float:
    """Best seconds of ``repeats`` calls (CUDA events on ``stream``), after 3 warm-ups."""
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
        best = float("inf")
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1e-3)
    return best


def kernel_table(device: int) -> list[dict]:
    props = np.array(torch.ops.canonical._kernel_properties(device)).reshape(-1, 6)
    keys = ("lanes", "min_blocks", "registers", "blocks_per_sm", "binary_version", "ptx_version")
    return [dict(zip(keys, map(int, row))) for row in props]


def run_case(case: Case, budgets, repeats: int, rng: np.random.Generator) -> list[dict]:
    device = torch.device("cuda")
    mapping = derive_group_mappings(case.spec, case.tp, case.total_heads)[0]
    num_blocks = case.pairs + 16
    kv = [_kv_tensor(case.spec, num_blocks, device) for _ in range(case.layers)]
    for t in kv:
        t.view(torch.uint8 if t.element_size() == 1 else torch.int16).random_()
    row = case.layers * mapping.canonical_page_size_bytes
    pages = torch.zeros(case.pairs + 16, row, dtype=torch.uint8).pin_memory()
    plan = canonical_ops.make_plan(
        [mapping] * case.layers, kv, pages, specs=[case.spec] * case.layers
    )
    blocks = torch.from_numpy(rng.permutation(num_blocks)[: case.pairs]).to(device)
    page_ids = torch.from_numpy(rng.permutation(pages.shape[0])[: case.pairs]).to(device)
    moved = case.pairs * case.layers * mapping.local_page_size_bytes
    variants = torch.ops.canonical._kernel_variants()
    previous = torch.ops.canonical._set_kernel_variant(0)
    stream = torch.cuda.Stream()
    rows = []
    try:
        reference = None
        for v, name in enumerate(variants):
            torch.ops.canonical._set_kernel_variant(v)
            pages.zero_()
            canonical_ops.store(kv, pages, plan, blocks, page_ids)
            torch.cuda.synchronize()
            canonical_ops.check_device_errors(plan)
            if reference is None:
                reference = pages.clone()
            identical = bool(torch.equal(pages, reference))
            for sms in budgets:
                old = canonical_ops.set_sm_budget(sms)
                try:
                    store = _time(
                        lambda: canonical_ops.store(kv, pages, plan, blocks, page_ids),
                        stream,
                        repeats,
                    )
                    load = _time(
                        lambda: canonical_ops.load(kv, pages, plan, blocks, page_ids),
                        stream,
                        repeats,
                    )
                finally:
                    canonical_ops.set_sm_budget(old)
                rows.append(
                    dict(
                        case=case.name,
                        variant=name,
                        sm_budget=sms,
                        bytes=moved,
                        store_gbps=moved / store / 1e9,
                        load_gbps=moved / load / 1e9,
                        same_bytes_as_base=identical,
                    )
                )
    finally:
        torch.ops.canonical._set_kernel_variant(previous)
    return rows


def markdown(rows: list[dict], kernels: list[dict]) -> str:
    lines = [
        "| case | SMs | variant | store GB/s | load GB/s | same bytes |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['sm_budget']} | {r['variant']} | {r['store_gbps']:.1f} | "
            f"{r['load_gbps']:.1f} | {'yes' if r['same_bytes_as_base'] else 'NO'} |"
        )
    lines += [
        "",
        "| lanes | min blocks | registers | blocks/SM | SASS | PTX |",
        "|---|---|---|---|---|---|",
    ]
    for k in kernels:
        lines.append(
            f"| {k['lanes']} | {k['min_blocks']} | {k['registers']} | {k['blocks_per_sm']} | "
            f"{k['binary_version']} | {k['ptx_version']} |"
        )
    return "\n".join(lines) + "\n"


def best_variants(rows: list[dict]) -> list[str]:
    """One line per (case, SM budget): the fastest variant for store and for load."""
    out = []
    for key in sorted({(r["case"], r["sm_budget"]) for r in rows}):
        group = [r for r in rows if (r["case"], r["sm_budget"]) == key]
        store = max(group, key=lambda r: r["store_gbps"])
        load = max(group, key=lambda r: r["load_gbps"])
        base = next(r for r in group if r["variant"] == "base")
        out.append(
            f"{key[0]:<26} {key[1]:>3} SMs: store best {store['variant']:<8} "
            f"{store['store_gbps']:6.1f} GB/s (base {base['store_gbps']:6.1f}); load best "
            f"{load['variant']:<8} {load['load_gbps']:6.1f} GB/s (base {base['load_gbps']:6.1f})"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--budgets", default="8,32", help="comma list of SM budgets")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds; skip the rest")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernel_variants: needs a CUDA GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.current_device()
    torch.ops.canonical._check_cuda_kernels(device)
    kernels = kernel_table(device)
    budgets = [int(b) for b in args.budgets.split(",") if b]
    rng = np.random.default_rng(0)
    rows: list[dict] = []
    started = time.perf_counter()
    skipped = []
    for case in CASES:
        if args.time_budget is not None and time.perf_counter() - started > args.time_budget:
            skipped.append(case.name)
            continue
        rows += run_case(case, budgets, args.repeats, rng)
        (out / "kernel_variants.json").write_text(
            json.dumps(
                dict(
                    gpu=torch.cuda.get_device_name(device),
                    kernels=kernels,
                    rows=rows,
                    skipped=skipped,
                ),
                indent=1,
            )
        )
    (out / "kernel_variants.md").write_text(markdown(rows, kernels))
    print(markdown(rows, kernels))
    print("\n".join(best_variants(rows)))
    if skipped:
        print(f"skipped (time budget): {', '.join(skipped)}")
    differing = [r for r in rows if not r["same_bytes_as_base"]]
    if differing:
        print(
            f"VARIANTS DISAGREE on bytes: {sorted({(r['case'], r['variant']) for r in differing})}"
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
