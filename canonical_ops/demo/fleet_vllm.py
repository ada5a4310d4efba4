"""vLLM 0.33's side of the demo's one-prefix phase (:mod:`.fleet`), in vLLM's own venv.

A whole engine on CPU without weights: a ``VllmConfig`` of a local config.json with the demo
model's shape, vLLM's ``OffloadingConnector`` on the scheduler side (its
``TieringOffloadingManager``, CPU primary tier and one secondary tier, ``canonical_fs`` or
``canonical_redis`` with ``shared_prefix``) and one worker connector per TP rank running
canonical-kv's worker over the real KV tensors (split NHD, as FlashAttention holds them). Keys
are vLLM's own: ``init_none_hash`` and ``hash_block_tokens`` of the prompt's token ids, then
``make_offload_key``. The connectors are driven as vLLM's scheduler and model runner drive them.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import uuid
from pathlib import Path

from ..units import FileStore, RedisStore
from ..units.token_keys import store_key
from . import truth
from .one_prefix import Outcome, demo_config

_SETTLE_S = 120.0  # a transfer still in flight after this is a failure


def _model_dir(cfg, work: Path) -> Path:
    """A Llama config.json of the demo model's shape (no weights, no tokenizer: nothing runs)."""
    work.mkdir(parents=True, exist_ok=True)
    heads = cfg.total_kv_heads * 4
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype=cfg.dtype)
    config.update(hidden_size=heads * cfg.head_size, num_attention_heads=heads)
    config.update(num_key_value_heads=cfg.total_kv_heads, head_dim=cfg.head_size)
    config.update(num_hidden_layers=cfg.layers, intermediate_size=1024, vocab_size=truth.VOCAB)
    config.update(max_position_embeddings=1 << 16, rms_norm_eps=1e-5, tie_word_embeddings=False)
    (work / "config.json").write_text(json.dumps(config))
    return work


def _tier(args) -> dict:
    if "://" in args.store:
        tier = {"type": "canonical_redis", "url": args.store}
    else:
        tier = {"type": "canonical_fs", "root_dir": os.path.abspath(args.store)}
    return dict(tier, model_name=args.model_name)


class VllmEngine:
    """One vLLM engine: the scheduler connector and ``tp`` worker connectors (their KV)."""

    def __init__(self, args, cfg, num_blocks: int, work: Path) -> None:
        import torch
        import vllm.plugins
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector,
        )
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
        )

        vllm.plugins.load_general_plugins()  # canonical-kv's entry point: CanonicalOffloadingSpec
        self.cfg, tp, dtype = cfg, args.tp, getattr(torch, cfg.dtype)
        model = ModelConfig(
            model=str(_model_dir(cfg, work / "model")), skip_tokenizer_init=True,
            dtype=cfg.dtype, max_model_len=max(4096, cfg.prompt_tokens),
        )  # fmt: skip
        shared = dict(total_kv_heads=cfg.total_kv_heads, head_size=cfg.head_size, packing="split")
        extra = dict(spec_name="CanonicalOffloadingSpec", canonical_layout=True)
        extra.update(cpu_bytes_to_use=max(64 << 20, 4 * num_blocks * cfg.layers * cfg.page_bytes))
        extra["secondary_tiers"] = [dict(_tier(args), shared_prefix=shared)]
        self.config = VllmConfig(
            model_config=model,
            cache_config=CacheConfig(block_size=cfg.block_size),
            device_config=DeviceConfig(device="cpu"),
            parallel_config=ParallelConfig(tensor_parallel_size=tp),
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector", kv_role="kv_both",
                engine_id=f"ckv-demo-{uuid.uuid4().hex[:10]}", kv_connector_extra_config=extra,
            ),
        )  # fmt: skip
        self.config.cache_config.kv_cache_layout = "LBNHC"  # what the engine core resolves
        heads = cfg.heads_per_rank(tp)
        spec = FullAttentionSpec(
            block_size=cfg.block_size, num_kv_heads=heads, head_size=cfg.head_size, dtype=dtype
        )
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(cfg.layers)]
        page = spec.page_size_bytes
        tensor = KVCacheTensor(
            size=page * num_blocks * cfg.layers, layers=list(self.names),
            layer_stride=page * num_blocks, block_stride=page,
        )  # fmt: skip
        kcc = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[tensor],
            kv_cache_groups=[KVCacheGroupSpec(list(self.names), spec)],
        )
        self.scheduler = OffloadingConnector(self.config, KVConnectorRole.SCHEDULER, kcc)
        self.manager = self.scheduler.scheduler.manager
        self.tier = self.manager.secondary_tiers[0]
        self.workers, self.kv, self._jobs = [], [], 0
        shape = (num_blocks, 2, cfg.block_size, heads, cfg.head_size)  # FlashAttention's, split
        try:
            for rank in range(tp):
                self.config.parallel_config.rank = rank
                connector = OffloadingConnector(self.config, KVConnectorRole.WORKER, kcc)
                self.kv.append({name: torch.zeros(shape, dtype=dtype) for name in self.names})
                connector.register_kv_caches(self.kv[-1])
                self.workers.append(connector)
        except BaseException:
            self.shutdown()
            raise

    def fill(self, units: range) -> None:
        """Each rank's blocks ``units`` hold its shard of those units' KV (GPU block j = unit j)."""
        cfg, tp = self.cfg, len(self.workers)
        for layer, name in enumerate(self.names):
            full = truth.truth_layer(cfg, layer, units.stop)
            for rank in range(tp):
                shard = truth.shard_of(cfg, full, tp, rank)[units.start :]
                self.kv[rank][name][units.start : units.stop].view(shard.dtype).copy_(shard)

    def compare(self, into: int, count: int) -> tuple[int, int]:
        """(bytes wrong, bytes checked) of blocks ``[into, into + count)`` against units
        ``[0, count)`` of the truth, every rank and layer."""
        import torch

        cfg, tp, wrong, checked = self.cfg, len(self.workers), 0, 0
        for layer, name in enumerate(self.names):
            full = truth.truth_layer(cfg, layer, count)
            for rank in range(tp):
                want = truth.shard_of(cfg, full, tp, rank).contiguous().view(torch.uint8)
                got = self.kv[rank][name][into : into + count].contiguous().view(torch.uint8)
                wrong += int((got != want).sum())
                checked += want.numel()
        return wrong, checked

    def _run(self, store: bool, chunks, blocks: list[int]) -> bool:
        """One transfer job on every worker (as the model runner submits it)."""
        from vllm.v1.kv_offload.base import GPULoadStoreSpec
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

        ok = True
        for connector in self.workers:
            worker = connector.connector_worker.worker
            self._jobs += 1
            gpu = GPULoadStoreSpec(list(blocks), group_sizes=[len(blocks)], block_indices=[0])
            cpu = CPULoadStoreSpec([int(c) for c in chunks])
            submit = worker.submit_store if store else worker.submit_load
            ok = (submit(self._jobs, gpu, cpu) if store else submit(self._jobs, cpu, gpu)) and ok
            worker.wait({self._jobs})
            ok = all(result.success for result in worker.get_finished()) and ok
        return ok

    def _step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self) -> None:
        """Scheduler steps until no transfer is in flight (store cascades to the tier)."""
        end = time.monotonic() + _SETTLE_S
        while True:
            with self.manager.lock:
                pending = self.manager.has_pending_work()
                self._step()
            if not pending:
                return
            if time.monotonic() > end:
                raise RuntimeError(f"vLLM's transfers still in flight after {_SETTLE_S:.0f} s")
            time.sleep(0.005)

    def _request(self):
        from vllm.v1.kv_offload.base import ReqContext

        ctx = ReqContext(req_id=f"demo-{uuid.uuid4().hex[:8]}")
        self.manager.on_new_request(ctx)
        return ctx

    def store(self, keys: list[bytes], span: range) -> bool:
        """A request whose blocks ``span`` were computed: vLLM stores them to its CPU tier
        (the workers copy GPU blocks to rows) and cascades them to the secondary tier."""
        with self.manager.lock:
            ctx = self._request()
            for i, key in enumerate(keys[: span.stop]):
                ctx.set_offload_key_position(key, self.cfg.block_size * (i + 1))
            out = self.manager.prepare_store(keys[span.start : span.stop], ctx)
            ok = out is not None
            if ok and out.keys_to_store:
                blocks = [keys.index(key) for key in out.keys_to_store]
                ok = self._run(True, out.store_spec.chunk_ids, blocks)
                self.manager.complete_store(out.keys_to_store, ctx)
            self.manager.on_request_finished(ctx)
        self.settle()
        return ok

    def load(self, keys: list[bytes], into: int) -> int:
        """A new request of the prompt: lookups (the tier promotes its hits to the CPU tier)
        until resolved, then the prefix of hits loaded into blocks ``into..``; how many."""
        from vllm.v1.kv_offload.base import LookupResult

        pending = (LookupResult.RETRY, LookupResult.HIT_PENDING)
        with self.manager.lock:
            ctx = self._request()
        end = time.monotonic() + _SETTLE_S
        while True:
            with self.manager.lock:
                results = [self.manager.lookup(key, ctx) for key in keys]
                self._step()
            if not any(result in pending for result in results):
                break
            if time.monotonic() > end:
                raise RuntimeError(f"vLLM's lookups unresolved after {_SETTLE_S:.0f} s")
            time.sleep(0.005)
        hits = next((i for i, r in enumerate(results) if r is not LookupResult.HIT), len(keys))
        loaded = True
        with self.manager.lock:
            if hits:
                spec = self.manager.prepare_load(keys[:hits], ctx)
                loaded = self._run(False, spec.chunk_ids, list(range(into, into + hits)))
                self.manager.complete_load(keys[:hits], ctx)
            self.manager.on_request_finished(ctx)
        return hits if loaded else 0

    def shutdown(self) -> None:
        for connector in self.workers:
            connector.shutdown()
        self.workers = []
        self.scheduler.shutdown()


def vllm_keys(engine: VllmEngine, tokens) -> list[bytes]:
    """vLLM's offload keys of the prompt: its own NONE_HASH (the configured hash algorithm and
    seed, as the engine core sets it) and ``hash_block_tokens`` chain, group 0."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_offload.base import make_offload_key

    block, ids = engine.cfg.block_size, [int(t) for t in tokens]
    hash_fn = get_hash_fn_by_name(engine.config.cache_config.prefix_caching_hash_algo)
    kv_cache_utils.init_none_hash(hash_fn)
    parent, keys = None, []
    for at in range(0, len(ids) - block + 1, block):
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, ids[at : at + block])
        keys.append(make_offload_key(parent, 0))
    return keys


def _units_in_store(args, namespace, keys: list[bytes]) -> int:
    """The leading ``keys`` the store holds in ``namespace`` (what another engine finds)."""
    opener = RedisStore if "://" in args.store else FileStore
    with opener(args.store, namespace) as store:
        return store.lookup([store_key(key) for key in keys], 0, len(namespace.layers))


def run_vllm(args) -> Outcome:
    """``--write A:B``: a vLLM engine at ``--tp`` computes (fills) blocks A..B-1 and stores
    them; ``--load N``: a fresh engine, empty KV, loads the first N units and checks them."""
    units = max(args.write[1] if args.write else 0, args.load or 0)
    cfg = demo_config(args, units, args.tp)
    load, outcome = args.load or 0, Outcome()
    with contextlib.ExitStack() as scratch:
        work = args.work_dir or scratch.enter_context(tempfile.TemporaryDirectory())
        engine = VllmEngine(args, cfg, units + load + 1, Path(work))
        scratch.callback(engine.shutdown)
        keys = vllm_keys(engine, truth.prompt_tokens(cfg))
        with engine.manager.lock:
            engine._step()  # the tier checks vLLM's NONE_HASH once the engine core set it
        ns = engine.tier.namespace
        shared = bool(ns.key_scheme) and ns.hex == cfg.namespace("writer").hex
        outcome.note = (
            f"namespace {ns.hex[:16]}, keys vLLM's own block hashes"
            if shared
            else f"NOT SHARED: the tier's namespace is {ns.hex[:16]}, not the fleet's"
        )
        if args.write:
            span = range(*args.write)
            outcome.store_asked = len(span)
            engine.fill(span)
            if engine.store(keys, span) and shared:
                found = _units_in_store(args, ns, keys[: span.stop])
                outcome.stored = max(0, found - span.start)
        if load:
            outcome.load_asked = load
            outcome.loaded = engine.load(keys[:load], into=units + 1)
            wrong, checked = engine.compare(units + 1, outcome.loaded)
            outcome.bytes_wrong, outcome.bytes_checked = wrong, checked
    return outcome
