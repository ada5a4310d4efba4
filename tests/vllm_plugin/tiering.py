"""Scheduler-side vLLM 0.33 engines for the tier tests (a helper module, no tests here).

:class:`SchedulerEngine` is a real ``OffloadingConnector`` (scheduler role) over a real
``VllmConfig`` (tiny local Llama config, CPU): vLLM's ``TieringOffloadingManager`` with its
CPU primary tier in /dev/shm and the secondary tiers of the config. It is driven the way
vLLM's scheduler drives it (lookups until resolved, ``on_schedule_end`` once per step,
``prepare_store`` / ``complete_store``, ``prepare_load`` / ``complete_load``, all under the
manager's lock); the worker's part (GPU <-> primary rows) is played by the test, which
writes and reads primary rows directly.
"""

from __future__ import annotations

import hashlib
import time
import uuid

import numpy as np
from helpers.vllm_harness import Layer, Model, make_vllm_config
from vllm.config import KVEventsConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)

LAYERS = [Layer(f"model.layers.{i}.self_attn.attn", "packed_nhd") for i in range(6)]
NUM_BLOCKS = 64
PENDING = (LookupResult.RETRY, LookupResult.HIT_PENDING)
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def chunk_keys(n: int, salt: str = "") -> list[bytes]:
    """``n`` offload keys (sha256 block hash + group 0), as vLLM's would look."""
    return [make_offload_key(hashlib.sha256(f"{salt}/{i}".encode()).digest(), 0) for i in range(n)]


class SchedulerEngine:
    """One engine's scheduler side: vLLM's tiering manager and its primary rows."""

    def __init__(
        self,
        model_config,
        tiers: list[dict],
        *,
        tp: int = 1,
        pp: int = 1,
        spec: str = "TieringOffloadingSpec",
        events: bool = False,
        extra: dict | None = None,
        layers: list[Layer] = LAYERS,
        seed: int = 0,
    ) -> None:
        config = make_vllm_config(
            model_config,
            tp,
            pp=pp,
            extra={"spec_name": spec, "secondary_tiers": tiers, **(extra or {})},
            engine_id=f"ckv-tiers-{uuid.uuid4().hex[:10]}",
        )
        config.cache_config.kv_cache_layout = "LBNHC"  # resolved by the engine core in a run
        if events:
            config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        # The model's KV: what the worker connectors a test adds to this engine hold.
        self.config, self.tp = config, tp
        self.model = Model(layers, total_heads=8, num_blocks=NUM_BLOCKS, seed=seed)
        self.connector = OffloadingConnector(
            config, KVConnectorRole.SCHEDULER, self.model.kv_cache_config(tp)
        )
        self.manager = self.connector.scheduler.manager
        view = self.manager.primary_tier.get_kv_memoryview()
        self.rows: np.ndarray | None = np.frombuffer(view.cast("B"), np.uint8).reshape(view.shape)
        self.tiers = list(self.manager.secondary_tiers)
        self._requests = 0

    @property
    def row_bytes(self) -> int:
        return self.rows.shape[1]

    def random_rows(self, keys: list[bytes], seed: int = 0) -> dict[bytes, bytes]:
        rng = np.random.default_rng(seed)
        return {k: rng.integers(0, 256, self.row_bytes, dtype=np.uint8).tobytes() for k in keys}

    def _request(self) -> ReqContext:
        self._requests += 1
        ctx = ReqContext(req_id=f"req-{self._requests}")
        self.manager.on_new_request(ctx)
        return ctx

    def step(self) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(STEP)

    def settle(self, timeout: float = 30.0) -> None:
        """Step until no transfer is in flight (store cascades, promotions)."""
        end = time.monotonic() + timeout
        while True:
            with self.manager.lock:
                pending = self.manager.has_pending_work()
                self.manager.on_schedule_end(STEP)
            if not pending:
                return
            assert time.monotonic() < end, "transfers still in flight"
            time.sleep(0.005)

    def store(self, rows: dict[bytes, bytes], timeout: float = 30.0) -> None:
        """A request stores ``rows`` into the primary tier; vLLM cascades them to its tiers."""
        keys = list(rows)
        with self.manager.lock:
            ctx = self._request()
            for i, key in enumerate(keys):
                ctx.set_offload_key_position(key, 16 * (i + 1))
            out = self.manager.prepare_store(keys, ctx)
            assert out is not None, "primary tier full"
            for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids):
                self.rows[chunk] = np.frombuffer(rows[key], dtype=np.uint8)
            self.manager.complete_store(out.keys_to_store, ctx)
            self.manager.on_request_finished(ctx)
        self.settle(timeout)

    def lookup(self, keys: list[bytes], timeout: float = 30.0):
        """Each key's lookup, repeated step by step until none is RETRY / HIT_PENDING;
        returns the results and the still-open request."""
        ctx = self._request_locked()
        end = time.monotonic() + timeout
        while True:
            with self.manager.lock:
                results = [self.manager.lookup(key, ctx) for key in keys]
                self.manager.on_schedule_end(STEP)
            if not any(r in PENDING for r in results):
                return results, ctx
            assert time.monotonic() < end, f"lookups unresolved: {results}"
            time.sleep(0.005)

    def _request_locked(self) -> ReqContext:
        with self.manager.lock:
            return self._request()

    def load(self, keys: list[bytes], timeout: float = 30.0) -> dict[bytes, bytes | None]:
        """What a request reads back: each hit's primary row, None for a miss."""
        results, ctx = self.lookup(keys, timeout)
        hits = [k for k, r in zip(keys, results) if r is LookupResult.HIT]
        with self.manager.lock:
            loaded = {}
            if hits:
                spec = self.manager.prepare_load(hits, ctx)
                loaded = {k: self.rows[c].tobytes() for k, c in zip(hits, spec.chunk_ids)}
                self.manager.complete_load(hits, ctx)
            self.manager.on_request_finished(ctx)
        return {k: loaded.get(k) for k in keys}

    def events(self) -> list:
        with self.manager.lock:
            return list(self.manager.take_events())

    def stats(self) -> dict:
        with self.manager.lock:
            stats = self.manager.get_stats()
        return {} if stats is None else stats.reduce()

    def shutdown(self) -> None:
        """Release the region (our view of it first, so vLLM can unmap it) and the tiers."""
        if self.rows is not None:
            self.rows = None
            self.connector.shutdown()


def engine_factory():
    """Engines made by a test (``engines(model_config, tiers, **kwargs)``), shut down after it
    (regions and tiers released): a test module's fixture, ``engines =
    pytest.fixture(engine_factory)``."""
    made: list[SchedulerEngine] = []

    def make(model_config, tiers: list[dict], **kwargs) -> SchedulerEngine:
        engine = SchedulerEngine(model_config, tiers, **kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()
