"""CPU throughput of canonical_store / canonical_load vs a contiguous copy of the same bytes.

Cases are real fragment sizes of a 128-dim bf16 model with block 16:
split NHD TP=8 (256 B), packed NHD TP=8 (512 B), packed NHD TP=4 (1 KiB),
packed NHD TP=2 (2 KiB), split HND TP=8 (4 KiB). For each, ``--blocks`` blocks
of ``--layers`` layers are stored into (and loaded from) canonical pages with
random page ids; the baseline copies the same number of bytes with one
contiguous ``copy_`` in the same run. Reported: GB/s and the ratio.

Usage: python bench/bench_ops_cpu.py [--blocks 2048] [--layers 4] [--repeats 7]
"""

from __future__ import annotations

import argparse
import time

import torch

import canonical_ops
from layouts import LayerSpec, derive_group_mappings

CASES = {  # name: (packing, order, tp)
    "256B split NHD TP8": ("split", "NHD", 8),
    "512B packed NHD TP8": ("packed", "NHD", 8),
    "1KiB packed NHD TP4": ("packed", "NHD", 4),
    "2KiB packed NHD TP2": ("packed", "NHD", 2),
    "4KiB split HND TP8": ("split", "HND", 8),
}


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm up (page faults, thread pool)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run_case(packing: str, order: str, tp: int, blocks: int, layers: int, repeats: int) -> dict:
    heads = 8 // tp
    spec = LayerSpec("full", 16, heads, 128, "bfloat16", packing, order)
    mapping = derive_group_mappings(spec, tp, 8)[0]
    shape = (blocks, 2, 16, heads, 128) if packing == "split" else (blocks, heads, 16, 256)
    kv = [torch.randn(shape).to(torch.bfloat16) for _ in range(layers)]
    pages_total = blocks
    cpu_pages = torch.zeros(
        pages_total, layers * mapping.canonical_page_size_bytes, dtype=torch.uint8
    )
    plan = canonical_ops.make_plan([mapping] * layers, kv, cpu_pages)
    gen = torch.Generator().manual_seed(0)
    block_ids = torch.randperm(blocks, generator=gen)
    page_ids = torch.randperm(pages_total, generator=gen)
    moved = blocks * layers * mapping.local_page_size_bytes
    src = torch.empty(moved, dtype=torch.uint8).random_(generator=gen)
    dst = torch.empty(moved, dtype=torch.uint8)
    fragment = int(mapping.fragments()[:, 2].max())

    t_store = best_seconds(
        lambda: canonical_ops.store(kv, cpu_pages, plan, block_ids, page_ids), repeats
    )
    t_load = best_seconds(
        lambda: canonical_ops.load(kv, cpu_pages, plan, block_ids, page_ids), repeats
    )
    t_copy = best_seconds(lambda: dst.copy_(src), repeats)
    return dict(
        fragment_bytes=fragment,
        bytes=moved,
        store_gbps=moved / t_store / 1e9,
        load_gbps=moved / t_load / 1e9,
        copy_gbps=moved / t_copy / 1e9,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"torch threads: {torch.get_num_threads()}, blocks {args.blocks}, layers {args.layers}")
    print(
        f"{'case':<22} {'MiB':>6} {'store GB/s':>10} {'load GB/s':>10} {'copy GB/s':>10}"
        f" {'store/copy':>10} {'load/copy':>10}"
    )
    for name, (packing, order, tp) in CASES.items():
        r = run_case(packing, order, tp, args.blocks, args.layers, args.repeats)
        print(
            f"{name:<22} {r['bytes'] / 2**20:>6.0f} {r['store_gbps']:>10.2f} "
            f"{r['load_gbps']:>10.2f} {r['copy_gbps']:>10.2f} "
            f"{r['store_gbps'] / r['copy_gbps']:>10.2f} {r['load_gbps'] / r['copy_gbps']:>10.2f}"
        )


if __name__ == "__main__":
    main()
