"""Fixed cost of a CPU canonical_store call: every check, with few or no bytes to move.

A TP=8 rank's split HND pages (1 of 8 heads, block 16, head 128, bf16), 4 and 32 layers;
calls of 0, 1 and 16 pairs; best of 7 rounds of many calls. ``--repo DIR`` runs another
checkout's build (e.g. a worktree of an older commit built in place) for a side-by-side
comparison: run both alternately and keep the best of each, since a shared VM is noisy.

Usage:
  python bench/bench_call_cost.py                 # this checkout
  python bench/bench_call_cost.py --repo /tmp/old # another built checkout
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def measure(layers: int, pairs: int) -> float:
    """Best seconds per call of canonical_store moving ``pairs`` blocks of ``layers`` layers."""
    import torch

    import canonical_ops
    from layouts import LayerSpec, derive_group_mappings

    spec = LayerSpec("full", 16, 1, 128, "bfloat16", "split", "HND")
    mapping = derive_group_mappings(spec, 8, 8)[0]
    blocks = 64
    kv = [torch.zeros(blocks, 2, 1, 16, 128, dtype=torch.bfloat16).transpose(2, 3)] * layers
    kv = [t.clone().transpose(2, 3).contiguous().transpose(2, 3) for t in kv]
    pages = torch.zeros(blocks, layers * mapping.canonical_page_size_bytes, dtype=torch.uint8)
    plan = canonical_ops.make_plan([mapping] * layers, kv, pages)
    ids = torch.arange(pairs, dtype=torch.int64)
    op = torch.ops.canonical.canonical_store
    for _ in range(200):
        op(kv, pages, plan, ids, ids)
    reps = 2000 if pairs < 16 else 300
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(reps):
            op(kv, pages, plan, ids, ids)
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", default=None, help="a built checkout to import instead")
    args = parser.parse_args(argv)
    if args.repo:
        sys.path.insert(0, args.repo)
    import torch

    torch.set_num_threads(2)
    result = {
        f"layers{layers}_pairs{pairs}_us": round(measure(layers, pairs) * 1e6, 2)
        for layers in (4, 32)
        for pairs in (0, 1, 16)
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
