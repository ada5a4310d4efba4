"""SGLang 0.5's side of the demo's one-prefix phase (:mod:`.fleet`), in SGLang's own venv.

Each TP rank has SGLang's own ``MHATokenToKVPoolHost`` (CPU, ``page_first``, one page = one
vLLM block) and canonical-kv's HiCache storage backend made as SGLang's ``HiCacheController``
makes it (``StorageBackendFactory``, ``--hicache-storage-backend-extra-config``, then
``register_mem_pool_host``). Keys are SGLang's own page hashes of the prompt
(``get_storage_hash_str``); the backend learns their canonical keys (key scheme v2) as SGLang
hashes. The ranks live in this one process (SGLang runs one per rank; the backend shares
nothing between ranks but the store and the staging directory).
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from . import truth
from .one_prefix import Outcome, demo_config

BACKEND = dict(backend_name="canonical", module_path="canonical_ops.sglang")
BACKEND.update(class_name="CanonicalHiCacheStorage", interface_v1=1)
LAYOUT = "page_first"  # SGLang's HiCache layout for zero-copy storage backends


class SglangRank:
    """One TP rank: its host pool (``page_first``: (2, slots, layers, heads, head_dim)) and
    its storage backend."""

    def __init__(self, args, cfg, rank: int, tokens: int, staging: Path) -> None:
        import torch
        from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        self.cfg, self.tp, self.rank = cfg, args.tp, rank
        heads, dtype = cfg.heads_per_rank(args.tp), getattr(torch, cfg.dtype)
        shape = (tokens, heads, cfg.head_size)  # the device pool's (its size only matters)
        k = tuple(torch.zeros(shape, dtype=dtype) for _ in range(cfg.layers))
        v = tuple(torch.zeros_like(t) for t in k)

        def pointers(tensors):
            return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)

        buffers = KVBuffers(
            k=k, v=v, k_data_ptrs=pointers(k), v_data_ptrs=pointers(v), layout=KVBufferLayout.NHD
        )
        info = MHABufferInfo(
            buffers=buffers, page_size=cfg.block_size, head_num=heads, head_dim=cfg.head_size,
            v_head_dim=cfg.head_size, dtype=dtype, device=torch.device("cpu"),
        )  # fmt: skip
        self.pool = MHATokenToKVPoolHost(
            info, 2.0, 0, cfg.block_size, LAYOUT, pin_memory=False, device="cpu",
            device_capacity_tokens=tokens, start_layer=0, end_layer=cfg.layers,
        )  # fmt: skip
        extra = dict(BACKEND, store=args.store, staging_dir=str(staging))
        config = HiCacheStorageConfig(
            tp_rank=rank, tp_size=args.tp, pp_rank=0, pp_size=1, attn_cp_rank=0,
            attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
            is_page_first_layout=True, model_name=args.model_name, extra_config=extra,
        )  # fmt: skip
        self.backend = StorageBackendFactory.create_backend("dynamic", config, self.pool)
        self.backend.register_mem_pool_host(self.pool)

    def _tokens(self, layer: int, units: range):
        """(K, V) of this rank's heads for the tokens of ``units``: (tokens, heads, dim) bits."""
        full = truth.truth_layer(self.cfg, layer, units.stop)[units.start :]
        heads = self.cfg.global_heads(self.tp, self.rank)
        local = full[:, :, heads].reshape(-1, len(heads), 2 * self.cfg.head_size)
        return local.split(self.cfg.head_size, dim=-1)

    def fill(self, slots, units: range) -> None:
        """The pool's ``slots`` hold the KV of ``units`` (what the model computed)."""
        for layer in range(self.cfg.layers):
            for component, part in enumerate(self._tokens(layer, units)):
                rows = self.pool.kv_buffer[component, slots, layer]
                self.pool.kv_buffer[component, slots, layer] = part.view(rows.dtype)

    def compare(self, slots, units: range) -> tuple[int, int]:
        """(bytes wrong, bytes checked) of the pool's ``slots`` against ``units``' truth."""
        import torch

        wrong = checked = 0
        for layer in range(self.cfg.layers):
            for component, part in enumerate(self._tokens(layer, units)):
                got = self.pool.kv_buffer[component, slots, layer].contiguous()
                want = part.contiguous().view(torch.uint8)
                wrong += int((got.view(torch.uint8) != want).sum())
                checked += want.numel()
        return wrong, checked

    def close(self) -> None:
        self.backend.close()


def run_sglang(args) -> Outcome:
    """``--load N``: new ranks (empty host pools) load the first N units and check them;
    ``--write A:B``: then each rank computes (fills) units A..B-1 and stores them."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    units = max(args.write[1] if args.write else 0, args.load or 0)
    cfg = demo_config(args, units, args.tp)
    page, ranks, outcome = cfg.block_size, [], Outcome()
    with contextlib.ExitStack() as scratch:
        work = args.work_dir or scratch.enter_context(tempfile.TemporaryDirectory())
        for rank in range(args.tp):
            ranks.append(SglangRank(args, cfg, rank, 2 * units * page, Path(work) / "staging"))
            scratch.callback(ranks[-1].close)
        namespace = ranks[0].backend.core.namespace
        ok = namespace.key_scheme and namespace.hex == cfg.namespace("writer").hex
        outcome.note = (
            f"namespace {namespace.hex[:16]}, keys SGLang's own page hashes"
            if ok
            else f"NOT SHARED: the backend's namespace is {namespace.hex[:16]}, not the fleet's"
        )
        # SGLang hashes the request's pages (the backends learn each page's canonical key).
        keys = get_storage_hash_str(
            [int(t) for t in truth.prompt_tokens(cfg)], None, page_size=page
        )
        if args.load:
            outcome.load_asked, loaded = args.load, []
            for r in ranks:
                slots = r.pool.alloc(args.load * page)
                done = r.backend.batch_get_v1(keys[: args.load], slots)
                count = next((i for i, hit in enumerate(done) if not hit), len(done))
                wrong, checked = r.compare(slots[: count * page], range(count))
                outcome.bytes_wrong += wrong
                outcome.bytes_checked += checked
                loaded.append(count)
            outcome.loaded = min(loaded)
        if args.write:
            span = range(*args.write)
            outcome.store_asked = len(span)
            info = HiCacheStorageExtraInfo(prefix_keys=keys[: span.start])
            for r in ranks:  # every rank stores its share; the last one publishes a unit
                slots = r.pool.alloc(len(span) * page)
                r.fill(slots, span)
                r.backend.batch_set_v1(keys[span.start : span.stop], slots, info)
            if ok:
                found = ranks[0].backend.batch_exists(keys[: span.stop])
                outcome.stored = max(0, found - span.start)
    return outcome
