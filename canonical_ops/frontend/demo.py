"""`python -m canonical_ops demo`: KV stored by one TP group, read bit-exact by another.

A Llama-3-8B-like model (32 layers, 8 KV heads, head 128, bf16, block 16,
packed NHD) by default. TP=4 writer processes each hold their KV-head shard of a
prompt's KV (filled deterministically from the unsharded truth) and store it
into one shared /dev/shm region in the canonical layout; the scheduler-side
PageManager marks a page ready once every elected writer reported it; then
TP=2 reader processes load the pages into their own (differently sharded)
caches and compare them bit for bit against the unsharded truth.

Runs on CUDA when a GPU is present (pinned region, side streams), on CPU
otherwise.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
import traceback
import uuid
from dataclasses import asdict, dataclass

import torch

from layouts import LayerSpec, RankContext, canonical_format_id
from layouts.explain import picture

PRESETS = {
    # name: (attention, layers, total kv heads, head size, dtype, block size)
    "llama3-8b": ("full", 32, 8, 128, "bfloat16", 16),
    "llama3-70b": ("full", 80, 8, 128, "bfloat16", 16),
    "qwen2-7b": ("full", 28, 4, 128, "bfloat16", 16),
    "deepseek-v3": ("mla", 61, 1, 576, "bfloat16", 64),
    "tiny": ("full", 4, 8, 64, "float16", 16),
}
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class DemoConfig:
    attention: str
    layers: int
    total_kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    packing: str
    order: str
    writer_tp: int
    reader_tp: int
    prompt_blocks: int
    device: str
    seed: int = 0

    def heads_per_rank(self, tp: int) -> int:
        return 1 if self.attention == "mla" else max(1, self.total_kv_heads // tp)

    def spec(self, tp: int) -> LayerSpec:
        return LayerSpec(
            self.attention,
            self.block_size,
            self.heads_per_rank(tp),
            self.head_size,
            self.dtype,
            self.packing,
            self.order,
        )

    @property
    def gpu_blocks(self) -> int:
        return self.prompt_blocks + 8  # the prompt's blocks land at scattered block ids


def truth_layer(cfg: DemoConfig, layer: int) -> torch.Tensor:
    """The unsharded KV of the prompt for one layer, as int16/uint8 bit patterns.

    Full attention: (blocks, tokens, heads, 2 * head_size) with K then V in the
    last dim; MLA: (blocks, tokens, latent). Deterministic in (seed, layer).
    """
    gen = torch.Generator().manual_seed(cfg.seed * 1000003 + layer)
    elem = torch.empty(0, dtype=TORCH_DTYPES[cfg.dtype]).element_size()
    bits = {2: torch.int16, 4: torch.int32}[elem]
    if cfg.attention == "mla":
        shape = (cfg.prompt_blocks, cfg.block_size, cfg.head_size)
    else:
        shape = (cfg.prompt_blocks, cfg.block_size, cfg.total_kv_heads, 2 * cfg.head_size)
    info = torch.iinfo(bits)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=bits)


def allocate_kv(cfg: DemoConfig, tp: int, device: torch.device) -> list[torch.Tensor]:
    """Per-layer caches in the physical layout of (packing, order), as int bit patterns."""
    heads, bs, hs = cfg.heads_per_rank(tp), cfg.block_size, cfg.head_size
    elem = torch.empty(0, dtype=TORCH_DTYPES[cfg.dtype]).element_size()
    bits = {2: torch.int16, 4: torch.int32}[elem]
    caches = []
    for _ in range(cfg.layers):
        n = cfg.gpu_blocks
        if cfg.attention == "mla":
            t = torch.zeros(n, bs, hs, dtype=bits, device=device)
        elif cfg.packing == "packed":
            physical = (n, bs, heads, 2 * hs) if cfg.order == "NHD" else (n, heads, bs, 2 * hs)
            t = torch.zeros(physical, dtype=bits, device=device)
            t = t.permute(0, 2, 1, 3) if cfg.order == "NHD" else t
        else:
            physical = (n, 2, bs, heads, hs) if cfg.order == "NHD" else (n, 2, heads, bs, hs)
            t = torch.zeros(physical, dtype=bits, device=device)
            t = t if cfg.order == "NHD" else t.permute(0, 1, 3, 2, 4)
        caches.append(t)
    return caches


def shard_of(cfg: DemoConfig, truth: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This rank's logical view of the truth: its KV heads, shaped like its cache tensor."""
    if cfg.attention == "mla":
        return truth
    heads = cfg.heads_per_rank(tp)
    first = rank * heads if cfg.total_kv_heads >= tp else rank // (tp // cfg.total_kv_heads)
    part = truth[:, :, first : first + heads]  # (blocks, tokens, heads, 2 * hs)
    if cfg.packing == "packed":
        return part.permute(0, 2, 1, 3)  # (blocks, heads, tokens, 2 * hs)
    hs = cfg.head_size
    return torch.stack([part[..., :hs], part[..., hs:]], dim=1)  # (blocks, 2, tokens, heads, hs)


def block_table(cfg: DemoConfig, salt: int) -> torch.Tensor:
    """Scattered cache block ids holding the prompt's blocks (one permutation per group)."""
    gen = torch.Generator().manual_seed(cfg.seed + 7919 * salt)
    return torch.randperm(cfg.gpu_blocks, generator=gen)[: cfg.prompt_blocks]


def plain_copy_seconds(num_bytes: int, device: torch.device) -> float:
    """Time of one contiguous copy of the same bytes between the same memories."""
    if device.type == "cuda":
        src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        dst = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    else:
        src = torch.ones(num_bytes, dtype=torch.uint8)
        dst = torch.zeros(num_bytes, dtype=torch.uint8)
    dst.copy_(src, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def rank_main(
    role: str, cfg_dict: dict, rank: int, region_args: dict, page_ids: list[int], results
) -> None:
    """One writer or reader process."""
    try:
        from canonical_ops.frontend import OffloadWorker, SharedOffloadRegion

        torch.set_num_threads(1)
        cfg = DemoConfig(**cfg_dict)
        tp = cfg.writer_tp if role == "writer" else cfg.reader_tp
        device = torch.device(cfg.device)
        if device.type == "cuda":
            torch.cuda.set_device(0)
        region = SharedOffloadRegion(**region_args)
        kv = allocate_kv(cfg, tp, device)
        blocks = block_table(cfg, salt=1 if role == "writer" else 2)
        if role == "writer":
            for layer in range(cfg.layers):
                kv[layer][blocks.to(device)] = shard_of(cfg, truth_layer(cfg, layer), tp, rank).to(
                    device
                )
        ctx = RankContext(tp, cfg.total_kv_heads, rank)
        typed = [t.view(TORCH_DTYPES[cfg.dtype]) for t in kv]  # the worker checks the dtype
        worker = OffloadWorker(typed, [cfg.spec(tp)] * cfg.layers, ctx, region)
        # Transfers are idempotent: the first warms page tables and caches, the
        # second is the one timed.
        if role == "writer":
            worker.wait(worker.store(block_ids=blocks, page_ids=page_ids))
            job = worker.wait(worker.store(block_ids=blocks, page_ids=page_ids))
            report = dict(mismatched_layers=[])
        else:
            worker.wait(worker.load(block_ids=blocks, page_ids=page_ids))
            job = worker.wait(worker.load(block_ids=blocks, page_ids=page_ids))
            bad = []
            for layer in range(cfg.layers):
                expected = shard_of(cfg, truth_layer(cfg, layer), tp, rank)
                if not torch.equal(kv[layer][blocks.to(device)].cpu(), expected):
                    bad.append(layer)
            report = dict(mismatched_layers=bad)
        copy_s = plain_copy_seconds(max(job.num_bytes, 1), device)
        results.put(
            dict(
                role=role,
                rank=rank,
                bytes=job.num_bytes,
                seconds=job.seconds,
                copy_seconds=copy_s,
                **report,
            )
        )
        del worker, kv
        region.close()
    except BaseException:  # reported to the coordinator, which prints FAIL
        results.put(dict(role=role, rank=rank, error=traceback.format_exc()))


def run_group(
    ctx_mp,
    role: str,
    cfg: DemoConfig,
    tp: int,
    first_rank: int,
    region_args: dict,
    page_ids: list[int],
    timeout_s: float,
) -> list[dict]:
    results = ctx_mp.Queue()
    procs = []
    for rank in range(tp):
        args = dict(region_args, rank=first_rank + rank)
        p = ctx_mp.Process(
            target=rank_main, args=(role, asdict(cfg), rank, args, page_ids, results)
        )
        p.start()
        procs.append(p)
    out = []
    deadline = time.monotonic() + timeout_s
    while len(out) < tp and time.monotonic() < deadline:
        try:
            out.append(results.get(timeout=1.0))
        except Exception:  # queue.Empty: keep waiting until the deadline
            if not any(p.is_alive() for p in procs) and results.empty():
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    missing = tp - len(out)
    out += [dict(role=role, rank=-1, error="process died or timed out")] * missing
    return sorted(out, key=lambda r: r["rank"])


def gbps(results: list[dict]) -> tuple[float, float]:
    """Aggregate GB/s (all ranks run concurrently) and the ratio to a plain copy."""
    total = sum(r["bytes"] for r in results)
    seconds = max(r["seconds"] for r in results)
    copy = sum(r["bytes"] / r["copy_seconds"] for r in results) / len(results)
    ours = sum(r["bytes"] / r["seconds"] for r in results) / len(results)
    return total / seconds / 1e9, ours / copy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m canonical_ops demo", description=__doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    parser.add_argument("--layers", type=int, default=None, help="override the preset")
    parser.add_argument("--packing", choices=["packed", "split"], default="packed")
    parser.add_argument("--order", choices=["NHD", "HND"], default="NHD")
    parser.add_argument("--writer-tp", type=int, default=4)
    parser.add_argument("--reader-tp", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per process group")
    args = parser.parse_args(argv)

    from canonical_ops.frontend import PageManager, SharedOffloadRegion
    from canonical_ops.frontend.worker import canonical_row_bytes, group_layer_mappings

    attention, layers, heads, head_size, dtype, block_size = PRESETS[args.preset]
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = DemoConfig(
        attention,
        args.layers or layers,
        heads,
        head_size,
        dtype,
        block_size,
        args.packing,
        args.order,
        args.writer_tp,
        args.reader_tp,
        max(1, -(-args.prompt_tokens // block_size)),
        device,
    )

    w_ctx = RankContext(cfg.writer_tp, cfg.total_kv_heads, 0)
    r_ctx = RankContext(cfg.reader_tp, cfg.total_kv_heads, 0)
    w_groups = group_layer_mappings([cfg.spec(cfg.writer_tp)] * cfg.layers, w_ctx)
    r_groups = group_layer_mappings([cfg.spec(cfg.reader_tp)] * cfg.layers, r_ctx)
    row_bytes = canonical_row_bytes([g[0] for g in w_groups])
    if row_bytes != canonical_row_bytes([g[0] for g in r_groups]):
        print("FAIL: writer and reader canonical pages differ in size", file=sys.stderr)
        return 1
    w0 = w_groups[0][0]
    print(
        f"model: {args.preset} ({cfg.attention}, {cfg.layers} layers, {cfg.total_kv_heads} KV "
        f"heads x {cfg.head_size}, {cfg.dtype}, block {cfg.block_size}, {cfg.packing} "
        f"{cfg.order}); device: {device}"
    )
    print(
        f"topologies: writers TP={cfg.writer_tp} -> readers TP={cfg.reader_tp}; format id: "
        f"{canonical_format_id(cfg.order)}; parallelism agnostic: {w0.parallelism_agnostic}"
    )
    print(
        f"prompt: {cfg.prompt_blocks * cfg.block_size} tokens = {cfg.prompt_blocks} pages; "
        f"canonical page {w0.canonical_page_size_bytes} B per layer, region "
        f"{cfg.prompt_blocks * row_bytes / 2**20:.1f} MiB"
    )
    print("writers of layer 0, page 0:")
    print(picture(w_groups[0], page_id=0, width=64))

    manager = PageManager.from_mappings(cfg.prompt_blocks, w_groups)
    hashes = [f"prompt-block-{i}".encode() for i in range(cfg.prompt_blocks)]
    page_ids = manager.allocate(hashes)
    generations = [manager.generation(page) for page in page_ids]
    engine_id = f"demo-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    world = 1 + cfg.writer_tp + cfg.reader_tp
    region_args = dict(
        engine_id=engine_id, num_rows=cfg.prompt_blocks, row_bytes=row_bytes, world_size=world
    )
    ctx_mp = mp.get_context("spawn")
    region = SharedOffloadRegion(**region_args, rank=0)
    ok = True
    try:
        start = time.perf_counter()
        writers = run_group(
            ctx_mp, "writer", cfg, cfg.writer_tp, 1, region_args, page_ids, args.timeout
        )
        for r in writers:
            if "error" in r:
                ok = False
                print(f"writer {r['rank']} failed:\n{r['error']}", file=sys.stderr)
            else:
                for page, generation in zip(page_ids, generations):
                    if r["rank"] in manager.writer_ranks(page):
                        manager.complete_store(page, r["rank"], generation=generation)
        ready = manager.lookup(hashes)
        print(
            f"stored: {ready}/{cfg.prompt_blocks} pages ready "
            f"({time.perf_counter() - start:.1f} s with process start-up)"
        )
        ok = ok and ready == cfg.prompt_blocks
        if ok:
            rate, ratio = gbps(writers)
            print(
                f"store: {sum(r['bytes'] for r in writers) / 2**20:.1f} MiB by "
                f"{cfg.writer_tp} ranks at {rate:.2f} GB/s ({ratio:.2f}x a plain copy of the "
                f"same bytes)"
            )
            loaded = manager.acquire(hashes)
            readers = run_group(
                ctx_mp,
                "reader",
                cfg,
                cfg.reader_tp,
                1 + cfg.writer_tp,
                region_args,
                loaded,
                args.timeout,
            )
            manager.release(loaded)
            for r in readers:
                if "error" in r:
                    ok = False
                    print(f"reader {r['rank']} failed:\n{r['error']}", file=sys.stderr)
                elif r["mismatched_layers"]:
                    ok = False
                    print(
                        f"reader {r['rank']}: layers {r['mismatched_layers']} differ from the "
                        f"truth",
                        file=sys.stderr,
                    )
            if all("error" not in r for r in readers):
                rate, ratio = gbps(readers)
                print(
                    f"load:  {sum(r['bytes'] for r in readers) / 2**20:.1f} MiB by "
                    f"{cfg.reader_tp} ranks at {rate:.2f} GB/s ({ratio:.2f}x a plain copy of "
                    f"the same bytes)"
                )
                print(
                    f"verified: every reader's {cfg.layers} layers x {cfg.prompt_blocks} "
                    f"blocks bit-exact against the unsharded truth"
                )
    finally:
        region.close()
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1
