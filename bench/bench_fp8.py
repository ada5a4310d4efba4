"""Throughput of quantised (fp8) KV through canonical_ops.store / load vs bf16, on CPU.

Goal (issue #19, quantised KV): the fp8 path at least as fast per byte as bf16,
i.e. fp8 GB/s >= 1.0x bf16 GB/s for the same tokens, layout and topology, in
both directions. The JSON's ``goals`` lists each one per case and direction:
``{goal, measured, target, met}``.

What is timed, per case (llama3-8b-like layers seen from one TP=4 rank: 2 of 8
KV heads, head 128, block 16), side by side and round-robin, best of
``--repeats``, on the same random block and page ids:
  * bf16            the layers' bf16 caches;
  * fp8             the same tokens as float8_e4m3fn (half the bytes): what a
                    layer with per-tensor scales moves (its scales are namespace
                    values, no bytes);
  * fp8 same bytes  fp8 with twice the blocks: the same bytes per call as bf16,
                    so that per-call costs weigh alike (the per-byte goal);
  * fp8 + scales    fp8 data plus each layer's per-token-head float32 scale page
                    (``layouts.KVScales``, the split companion tensor), in the
                    same plan: what a per-token-head layer moves.
Each is one ``canonical_ops.store`` (all layers, one call) into page-aligned
rows, then one ``load`` back into scattered blocks. GB/s = bytes this rank moves
/ seconds. "per byte" compares GB/s of fp8 same bytes with bf16 (the goal); the
same-token GB/s ratios and "same tokens" (bf16 seconds / fp8 seconds: how much
sooner the same prompt moves) are reported alongside.

Usage: python bench/bench_fp8.py [--quick] [--out DIR] [--blocks N] [--layers N]
       [--repeats N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import zlib

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from _results import goal_row  # noqa: E402

import canonical_ops  # noqa: E402
from layouts import (  # noqa: E402
    KVScales,
    LayerSpec,
    derive_group_mappings,
    derive_scaled_group_mappings,
)

TP, TOTAL_HEADS, HEADS, HEAD_SIZE, BLOCK = 4, 8, 2, 128, 16
RANK = 1
CASES = [("packed", "NHD"), ("split", "NHD"), ("split", "HND")]
TARGET = 1.0
SCALES = KVScales("per-token-head")


def make_cache(blocks: int, packing: str, order: str, dtype, head_size: int, gen) -> torch.Tensor:
    """A cache of that layout (the physical order allocated, the logical view returned)."""
    phys = {
        ("packed", "NHD"): (blocks, BLOCK, HEADS, 2 * head_size),
        ("packed", "HND"): (blocks, HEADS, BLOCK, 2 * head_size),
        ("split", "NHD"): (blocks, 2, BLOCK, HEADS, head_size),
        ("split", "HND"): (blocks, 2, HEADS, BLOCK, head_size),
    }[packing, order]
    nbytes = torch.Size(phys).numel() * torch.empty((), dtype=dtype).element_size()
    bits = torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)
    t = bits.view(dtype).view(phys)
    if packing == "packed" and order == "NHD":
        return t.permute(0, 2, 1, 3)
    if packing == "split" and order == "HND":
        return t.permute(0, 1, 3, 2, 4)
    return t


def page_aligned_rows(rows: int, row_bytes: int) -> torch.Tensor:
    """uint8 (rows, row_bytes) starting on a 4 KiB boundary, as a /dev/shm region does."""
    raw = torch.empty(rows * row_bytes + 4096, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % 4096
    return raw[shift : shift + rows * row_bytes].view(rows, row_bytes)


def build(method: str, packing: str, order: str, blocks: int, layers: int):
    """(kv tensors, rows, plan, bytes this rank moves per store/load) of one method."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{method} {packing} {order}".encode()))
    dtype = torch.bfloat16 if method == "bf16" else torch.float8_e4m3fn
    blocks = 2 * blocks if method == "fp8 same bytes" else blocks
    spec = LayerSpec("full", BLOCK, HEADS, HEAD_SIZE, str(dtype), packing, order)
    tensors, mappings = [], []
    for _ in range(layers):
        tensors.append(make_cache(blocks, packing, order, dtype, HEAD_SIZE, gen))
        if method == "fp8 + scales":
            data, scale = derive_scaled_group_mappings(spec, SCALES, TP, TOTAL_HEADS)
            mappings += [data[RANK], scale[RANK]]
            scale_cache = make_cache(blocks, SCALES.packing, order, torch.float32, 1, gen)
            tensors.append(scale_cache)
        else:
            mappings.append(derive_group_mappings(spec, TP, TOTAL_HEADS)[RANK])
    row_bytes = sum(m.canonical_page_size_bytes for m in mappings)
    rows = page_aligned_rows(blocks, row_bytes)
    plan = canonical_ops.make_plan(mappings, tensors, rows)
    moved = blocks * sum(m.local_page_size_bytes for m in mappings)
    return tensors, rows, plan, moved


def measure(args) -> dict:
    methods = ("bf16", "fp8", "fp8 same bytes", "fp8 + scales")
    gen = torch.Generator().manual_seed(7)
    ids = {
        blocks: (torch.randperm(blocks, generator=gen), torch.randperm(blocks, generator=gen))
        for blocks in (args.blocks, 2 * args.blocks)
    }
    results = []
    for packing, order in CASES:
        built = {m: build(m, packing, order, args.blocks, args.layers) for m in methods}
        best = {(m, d): float("inf") for m in methods for d in ("store", "load")}
        for _ in range(args.repeats):
            for m in methods:  # round-robin: drift of the machine hits every method alike
                tensors, rows, plan, _ = built[m]
                block_ids, page_ids = ids[rows.size(0)]
                start = time.perf_counter()
                canonical_ops.store(tensors, rows, plan, block_ids, page_ids)
                best[m, "store"] = min(best[m, "store"], time.perf_counter() - start)
                start = time.perf_counter()
                canonical_ops.load(tensors, rows, plan, block_ids, page_ids)
                best[m, "load"] = min(best[m, "load"], time.perf_counter() - start)
        row = dict(case=f"{packing} {order}", bytes={m: built[m][3] for m in methods})
        for direction in ("store", "load"):
            gbps = {m: built[m][3] / best[m, direction] / 1e9 for m in methods}
            row[direction] = dict(
                seconds={m: best[m, direction] for m in methods},
                gbps=gbps,
                per_byte_fp8_vs_bf16=gbps["fp8 same bytes"] / gbps["bf16"],
                same_tokens_gbps_fp8_vs_bf16=gbps["fp8"] / gbps["bf16"],
                per_byte_fp8_scales_vs_bf16=gbps["fp8 + scales"] / gbps["bf16"],
                same_tokens_fp8_speedup=best["bf16", direction] / best["fp8", direction],
                same_tokens_fp8_scales_speedup=best["bf16", direction]
                / best["fp8 + scales", direction],
            )
        results.append(row)
        print(
            f"{row['case']:<12}"
            + "".join(
                f" | {d}: bf16 {row[d]['gbps']['bf16']:.2f} fp8 {row[d]['gbps']['fp8']:.2f} "
                f"fp8x2 {row[d]['gbps']['fp8 same bytes']:.2f} "
                f"fp8+scales {row[d]['gbps']['fp8 + scales']:.2f} GB/s "
                f"(per byte {row[d]['per_byte_fp8_vs_bf16']:.2f}x; same tokens "
                f"{row[d]['same_tokens_fp8_speedup']:.2f}x sooner)"
                for d in ("store", "load")
            ),
            flush=True,
        )
    return dict(results=results)


def goals(report: dict) -> list[dict]:
    """fp8 per-byte throughput >= 1.0x bf16, per case and direction."""
    out = []
    for row in report["results"]:
        for direction in ("store", "load"):
            measured = row[direction]["per_byte_fp8_vs_bf16"]
            goal = (
                f"fp8 {direction} GB/s >= {TARGET}x bf16 (same bytes); {row['case']}, "
                f"TP={TP} rank, {report['layers']} layers x {report['blocks']} blocks"
            )
            out.append(goal_row(goal, measured, TARGET))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks and repeats")
    parser.add_argument("--out", help="directory for fp8.json")
    parser.add_argument("--blocks", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    if args.quick:
        args.blocks, args.repeats = min(args.blocks, 512), min(args.repeats, 5)
    report = dict(
        bench="bench_fp8",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command="python " + " ".join([os.path.relpath(__file__, REPO), *sys.argv[1:]]),
        machine=f"{platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} "
        f"torch threads",
        device="cpu",
        blocks=args.blocks,
        layers=args.layers,
        repeats=args.repeats,
        tokens=args.blocks * BLOCK,
    )
    report.update(measure(args))
    report["goals"] = goals(report)
    for g in report["goals"]:
        print(f"{'met' if g['met'] else 'NOT met'}: {g['goal']}: {g['measured']:.2f}x")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8.json"), "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
