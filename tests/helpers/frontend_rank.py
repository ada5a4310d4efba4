"""Body of one rank process in the multi-process frontend tests.

Each process attaches the shared region, builds its own caches (raw bytes with
the typed cache view over them, tests/helpers/ops.py), and either fills its
blocks from the first-principles truth (tests/helpers/layout_truth.py) and stores
them with an OffloadWorker, or loads pages and compares every byte of its
local pages with that truth. Nothing here uses the mappings to build
expectations.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from dataclasses import dataclass

import numpy as np
import torch

from helpers.layout_truth import Topology as Topo


@dataclass(frozen=True)
class Model:
    attention: str
    total_heads: int
    packing: str
    order: str
    layers: tuple = ((16, "bfloat16"), (8, "float32"))  # (head_size, dtype) per layer
    canonical_tokens: int = 8
    pages_per_row: int = 2
    num_rows: int = 3
    num_blocks: int = 9
    seed: int = 0

    def specs(self, topo: Topo):
        from layouts import LayerSpec

        mla = self.attention == "mla"
        heads = 1 if mla else max(1, self.total_heads // topo.tp)
        # An MLA latent cache has one layout, which LayerSpec.from_tensor (and the worker's
        # check) calls packed NHD, whatever the model's packing and order for full attention.
        packing, order = ("packed", "NHD") if mla else (self.packing, self.order)
        return [
            LayerSpec(
                self.attention, self.canonical_tokens // topo.cp, heads, hs, dtype, packing, order
            )
            for hs, dtype in self.layers
        ]

    def truth(self, layer: int, page: int, spec) -> np.ndarray:
        from helpers.layout_truth import random_truth

        rng = np.random.default_rng([self.seed, layer, page])
        head_bytes = self.layers[layer][0] * spec.element_size
        return random_truth(
            rng, self.attention, self.total_heads, self.canonical_tokens, head_bytes
        )

    def block_ids(self, pages, salt: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 99, salt])
        return rng.permutation(self.num_blocks)[: len(pages)].astype(np.int64)


def run_rank(task: dict) -> dict:
    """task: role, model, topo, rank, region args, page_ids, salt, [kill_before_store]."""
    try:
        from canonical_ops import OffloadWorker, SharedOffloadRegion
        from helpers.layout_truth import local_page
        from helpers.ops import make_kv_cache
        from layouts import RankContext

        torch.set_num_threads(1)
        model, topo, rank = task["model"], task["topo"], task["rank"]
        region = SharedOffloadRegion(**task["region"])
        specs = model.specs(topo)
        rng = np.random.default_rng([model.seed, 7, rank, task["salt"]])
        caches = [make_kv_cache(spec, model.num_blocks, rng) for spec in specs]
        ctx = RankContext(topo.tp, model.total_heads, rank, topo.dcp, topo.pcp, topo.interleave)
        pages = list(task["page_ids"])
        blocks = model.block_ids(pages, task["salt"])

        def expected(layer: int, page: int) -> np.ndarray:
            spec = specs[layer]
            return local_page(model.truth(layer, page, spec), spec, topo, model.total_heads, rank)

        worker = OffloadWorker(
            [c.tensor for c in caches], specs, ctx, region, pages_per_row=model.pages_per_row
        )
        result = dict(role=task["role"], rank=rank, pid=os.getpid())
        if task["role"] == "writer":
            for layer, cache in enumerate(caches):
                for page, block in zip(pages, blocks):
                    data = expected(layer, page)
                    cache.base[block, : len(data)] = torch.from_numpy(data)
            if task.get("kill_before_store"):
                # Announce, then die part-way: the test SIGKILLs this process while it sleeps
                # between layers' worth of work, so it never reports.
                task["announce"].put(os.getpid())
                time.sleep(60)
            job = worker.wait(worker.store(block_ids=blocks, page_ids=pages))
            result.update(bytes=job.num_bytes)
        else:
            job = worker.wait(worker.load(block_ids=blocks, page_ids=pages))
            bad = []
            for layer, cache in enumerate(caches):
                got = cache.host_bytes()
                for page, block in zip(pages, blocks):
                    want = expected(layer, page)
                    if not np.array_equal(got[block, : len(want)], want):
                        bad.append((layer, int(page)))
            result.update(bytes=job.num_bytes, mismatches=bad)
        del worker, caches
        region.close()
        return result
    except BaseException:  # the parent asserts on the traceback
        return dict(role=task.get("role"), rank=task.get("rank"), error=traceback.format_exc())


def rank_entry(task: dict, results) -> None:
    results.put(run_rank(task))


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
