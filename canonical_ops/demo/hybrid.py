"""The demo's hybrid presets: a request's attention pages AND its Mamba / GDN state, across TP.

``--preset qwen3-next-like`` (or ``tiny-hybrid``) with ``--store DIR``: a writer
engine (TP x PP ranks) stores the prompt's KV blocks of the attention layers
and the request's state of the state layers (conv window and SSM / delta-rule
matrix, one slot per request) into its stages' regions through the ops,
then persists both into the file store: KV units under the model's
namespace, state units under its state namespace. A new engine of another
topology, regions empty, looks the prompt up, fetches both kinds from the
files (every unit verified), loads them into its own, differently sharded
caches and state slots, and compares every byte with the unsharded truth
sliced by vLLM's sharding rule (numpy, independent of the mappings).

The ranks of an engine run in this process one after another (on CPU), each
with its own tensors, plans and workers; what they share is exactly what
separate processes would share: the stage's region rows and page manager.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from layouts import LayerSpec, RankContext, certification_failure
from layouts.state import StateSpec, state_certification_failure

from .hybrid_presets import HYBRID_PRESETS, HybridPreset

__all__ = ["run_hybrid"]

_BITS = {2: np.int16, 4: np.int32}


class HybridUsageError(ValueError):
    """A flag the hybrid demo cannot honour (a usage error: exit status 2)."""


@dataclass
class _Setup:
    preset: HybridPreset
    name: str
    blocks: int
    seed: int
    model_name: str
    revision: str

    @property
    def attention_layers(self) -> int:
        return self.preset.layer_kinds.count("attn")

    def attn_spec(self, tp: int) -> LayerSpec:
        heads = max(1, self.preset.kv_heads // tp)
        p = self.preset
        return LayerSpec("full", p.block_size, heads, p.head_size, p.dtype, "packed", "NHD")

    def global_heads(self, tp: int, rank: int) -> list[int]:
        total = self.preset.kv_heads
        if total >= tp:
            per = total // tp
            return list(range(rank * per, (rank + 1) * per))
        return [rank // (tp // total)]


def _check_flags(parser_args: Any, preset: HybridPreset) -> list[str]:
    """What the hybrid demo refuses, as usage errors; returns the store directories."""
    args = parser_args
    for flag, value in (("--layers", args.layers), ("--kv-heads", args.kv_heads)):
        if value is not None:
            raise HybridUsageError(f"{flag}: not supported with a hybrid preset")
    if args.dtype is not None and args.dtype != preset.dtype:
        raise HybridUsageError(f"--dtype: the hybrid presets run in {preset.dtype}")
    if (args.packing, args.order) != ("packed", "NHD"):
        raise HybridUsageError("--packing/--order: the hybrid presets run packed NHD")
    if args.device == "cuda":
        raise HybridUsageError("--device cuda: the hybrid demo runs its ranks on CPU")
    stores = args.store or []
    if not stores:
        raise HybridUsageError(
            "--store DIR: a hybrid preset runs through the file store (write, then read)"
        )
    if len(stores) != 1 or "://" in stores[0]:
        raise HybridUsageError("--store: a hybrid preset takes one directory (no Redis)")
    for role, tp, pp in (
        ("writer", args.writer_tp, args.writer_pp),
        ("reader", args.reader_tp, args.reader_pp),
    ):
        total = preset.kv_heads
        if total % tp and tp % total:
            spec = LayerSpec(
                "full", preset.block_size, 1, preset.head_size, preset.dtype, "packed", "NHD"
            )
            raise HybridUsageError(
                f"--{role}-tp {tp}: neither divides the {total} KV heads nor is a multiple "
                f"of them ({certification_failure(spec, RankContext(tp, total, 0))})"
            )
        for spec in dict(preset.states).values():
            reason = state_certification_failure(spec, tp)
            if reason:
                raise HybridUsageError(f"--{role}-tp {tp}: the state cannot be resharded: {reason}")
        if pp > preset.layers:
            raise HybridUsageError(f"--{role}-pp {pp}: more stages than the {preset.layers} layers")
    return [os.path.abspath(stores[0])]


# --------------------------------------------------------------------------- truth


def _kv_truth(setup: _Setup, layer: int) -> np.ndarray:
    """Attention layer ``layer``: (blocks, tokens, heads, 2 * head) as bit patterns."""
    p = setup.preset
    rng = np.random.default_rng([setup.seed, 0xA77, layer])
    bits = _BITS[setup.attn_spec(1).element_size]
    shape = (setup.blocks, p.block_size, p.kv_heads, 2 * p.head_size)
    return rng.integers(np.iinfo(bits).min, np.iinfo(bits).max, size=shape, dtype=bits)


def _state_truth(setup: _Setup, layer: int, spec: StateSpec) -> dict[str, np.ndarray]:
    """State layer ``layer`` of the request: each segment (outer, channels, inner), as bits."""
    rng = np.random.default_rng([setup.seed, 0x57A7E, layer])
    out = {}
    for name, dtype, shape, _ in spec.canonical_layout():
        bits = _BITS[np.dtype(np.float32).itemsize if dtype == "float32" else 2]
        out[name] = rng.integers(np.iinfo(bits).min, np.iinfo(bits).max, size=shape, dtype=bits)
    return out


def _state_shard(spec: StateSpec, full: dict[str, np.ndarray], tp: int, rank: int):
    """(conv, ssm) of one slot at ``rank``, sliced as vLLM shards: per conv segment its own
    1/tp of the units side by side (a single Mamba2 group whole on every rank), SSM heads."""
    parts: list[list[np.ndarray]] = [[], []]
    for seg in spec.segments:
        data = full[seg.name]
        if seg.units % tp:  # the one group, replicated
            parts[seg.tensor].append(data)
        else:
            per = seg.channels // tp
            parts[seg.tensor].append(data[:, rank * per : (rank + 1) * per])
    conv = np.concatenate(parts[0], axis=1)
    ssm = np.concatenate(parts[1], axis=1)
    conv = conv[0] if spec.conv_layout == "DS" else conv[:, :, 0]
    return conv, ssm[0].reshape(ssm.shape[1], *spec.ssm_head_shape())


def _prompt_keys(setup: _Setup) -> list[bytes]:
    """Block hashes of the prompt (a sha256 chain over deterministic token ids)."""
    parent = hashlib.sha256(b"canonical-kv hybrid demo prompt").digest()
    out = []
    for block in range(setup.blocks):
        tokens = np.random.default_rng([setup.seed, 0x70C, block]).integers(
            0, 1 << 17, setup.preset.block_size, dtype=np.int64
        )
        parent = hashlib.sha256(parent + tokens.astype("<i8").tobytes()).digest()
        out.append(parent)
    return out


# --------------------------------------------------------------------------- engines


class _Engine:
    """An engine of tp x pp ranks: per stage a KV and a state StageCache over the files."""

    def __init__(self, setup: _Setup, root: str, tp: int, pp: int) -> None:
        import torch

        from layouts import derive_group_mappings

        from ..engine.cache import StageCache, pp_layer_range
        from ..engine.hybrid import (
            StateWorker,
            hybrid_namespace,
            split_stage_layers,
            state_page_manager,
        )
        from ..engine.pages import PageManager
        from ..units import FileStore
        from ..units.namespace import ModelIdentity

        self.setup, self.tp, self.pp = setup, tp, pp
        p = setup.preset
        self.specs = p.state_specs()
        model = ModelIdentity(setup.model_name, setup.revision)
        attn = setup.attn_spec(tp)
        self.namespace = hybrid_namespace(
            model, [attn] * setup.attention_layers, self.specs, RankContext(tp, p.kv_heads, 0)
        )
        self.state_namespace = self.namespace.state_units()
        self.stages: list[dict] = []
        self.stores: list[Any] = []
        pages = setup.blocks + 1
        for stage in range(pp):
            (a0, a1), (s0, s1) = split_stage_layers(
                p.is_state, *pp_layer_range(p.layers, stage, pp)
            )
            entry: dict[str, Any] = dict(attn=(a0, a1), state=(s0, s1))
            if a1 > a0:
                store = FileStore(root, self.namespace, queue_depth=max(64, 2 * pages))
                self.stores.append(store)
                groups = [derive_group_mappings(attn, tp, p.kv_heads) for _ in range(a0, a1)]
                manager = PageManager.from_mappings(pages, groups)
                rows = torch.zeros(pages, self.namespace.layer_bytes(a0, a1), dtype=torch.uint8)
                caches = []
                for _ in range(tp):
                    physical = (pages, p.block_size, attn.num_kv_heads, 2 * p.head_size)
                    caches.append(
                        [
                            torch.zeros(physical, dtype=torch.bfloat16).permute(0, 2, 1, 3)
                            for _ in range(a0, a1)
                        ]
                    )
                plans = [_make_plan([g[r] for g in groups], caches[r], rows) for r in range(tp)]
                entry.update(
                    kv_manager=manager,
                    kv_caches=caches,
                    kv_plans=plans,
                    kv_rows=rows,
                    kv_cache=StageCache(manager, rows, (a0, a1), self.namespace, [store]),
                )
            if s1 > s0:
                store = FileStore(root, self.state_namespace)
                self.stores.append(store)
                rows = torch.zeros(2, self.state_namespace.layer_bytes(s0, s1), dtype=torch.uint8)
                workers = []
                for rank in range(tp):
                    caches = [
                        tuple(
                            torch.zeros((2, *shape), dtype=getattr(torch, dtype))
                            for shape, dtype in zip(spec.local_shapes(tp), spec.dtypes)
                        )
                        for spec in self.specs[s0:s1]
                    ]
                    ctx = RankContext(tp, p.kv_heads, rank)
                    workers.append(StateWorker(caches, self.specs[s0:s1], ctx, rows))
                manager = state_page_manager(2, workers[0].groups)
                entry.update(
                    state_manager=manager,
                    workers=workers,
                    state_cache=StageCache(manager, rows, (s0, s1), self.state_namespace, [store]),
                )
            self.stages.append(entry)

    def close(self) -> None:
        for stage in self.stages:
            for name in ("kv_cache", "state_cache"):
                if name in stage:
                    stage[name].close()
        for store in self.stores:
            store.close()


def _make_plan(mappings, caches, rows):
    import canonical_ops

    return canonical_ops.make_plan(mappings, caches, rows)


def _bits_view(tensor):
    import torch

    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def _write(engine: _Engine, keys: list[bytes]) -> dict:
    import torch

    import canonical_ops

    setup = engine.setup
    state_key = keys[-1]  # the request's state after its prompt's last block
    kv_units = state_units = 0
    failures: list[str] = []
    block_ids = torch.arange(1, setup.blocks + 1)
    for stage in engine.stages:
        if "kv_cache" in stage:
            a0, a1 = stage["attn"]
            manager = stage["kv_manager"]
            pages = manager.allocate(keys)
            for rank in range(engine.tp):
                heads = setup.global_heads(engine.tp, rank)
                caches = stage["kv_caches"][rank]
                for layer, cache in zip(range(a0, a1), caches):
                    truth = _kv_truth(setup, layer)[:, :, heads]  # (blocks, tokens, heads, 2hs)
                    physical = _bits_view(cache.permute(0, 2, 1, 3))
                    physical[1 : setup.blocks + 1] = torch.from_numpy(np.ascontiguousarray(truth))
                canonical_ops.store(
                    caches, stage["kv_rows"], stage["kv_plans"][rank], block_ids, pages
                )
                for page in pages:
                    if rank in manager.writer_ranks(page):
                        manager.complete_store(page, rank, generation=manager.generation(page))
            stage["kv_cache"].persist(keys)
        if "state_cache" in stage:
            s0, s1 = stage["state"]
            manager = stage["state_manager"]
            [page] = manager.allocate([state_key])
            for rank, worker in enumerate(stage["workers"]):
                for layer, pair in zip(range(s0, s1), worker.state_caches):
                    spec = engine.specs[layer]
                    shard = _state_shard(spec, _state_truth(setup, layer, spec), engine.tp, rank)
                    for tensor, data in zip(pair, shard):
                        _bits_view(tensor[1])[:] = torch.from_numpy(np.ascontiguousarray(data))
                worker.store(slot_ids=[1], page_ids=[page])
                if rank in manager.writer_ranks(page):
                    manager.complete_store(page, rank, generation=manager.generation(page))
            stage["state_cache"].persist([state_key], [setup.blocks - 1])
    for stage in engine.stages:
        for name in ("kv_cache", "state_cache"):
            if name not in stage:
                continue
            for event in stage[name].drain():
                if event.status != "ok":
                    failures.append(
                        f"{name} store of {event.block_hash.hex()[:12]}: {event.detail}"
                    )
                elif name == "kv_cache":
                    kv_units += 1
                else:
                    state_units += 1
    return dict(kv_units_stored=kv_units, state_units_stored=state_units, failures=failures)


def _read(engine: _Engine, keys: list[bytes]) -> dict:
    import torch

    import canonical_ops

    setup = engine.setup
    state_key = keys[-1]
    kv_found = state_found = kv_checked = state_checked = kv_wrong = state_wrong = 0
    failures: list[str] = []
    for stage in engine.stages:
        for name, wanted in (("kv_cache", keys), ("state_cache", [state_key])):
            if name in stage:
                found = stage[name].lookup(wanted)
                stage[name].fetch(wanted, found)
                if name == "kv_cache":
                    kv_found += found.from_tiers
                else:
                    state_found += found.from_tiers
    for stage in engine.stages:
        for name in ("kv_cache", "state_cache"):
            for event in stage[name].drain() if name in stage else ():
                if event.status != "ok":
                    failures.append(f"{name} fill: {event.status} {event.detail}")
    for index, stage in enumerate(engine.stages):
        if "kv_cache" in stage:
            a0, a1 = stage["attn"]
            manager = stage["kv_manager"]
            if manager.lookup(keys) != setup.blocks:
                failures.append(f"stage {index}: {manager.lookup(keys)}/{setup.blocks} KV blocks")
            else:
                pages = [manager.page_of(k) for k in keys]
                block_ids = torch.arange(setup.blocks)
                for rank in range(engine.tp):
                    heads = setup.global_heads(engine.tp, rank)
                    caches = stage["kv_caches"][rank]
                    canonical_ops.load(
                        caches, stage["kv_rows"], stage["kv_plans"][rank], block_ids, pages
                    )
                    for layer, cache in zip(range(a0, a1), caches):
                        want = _kv_truth(setup, layer)[:, :, heads]
                        got = _bits_view(cache.permute(0, 2, 1, 3))[: setup.blocks].numpy()
                        kv_wrong += int((got != want).sum()) * got.itemsize
                        kv_checked += want.nbytes
        if "state_cache" in stage:
            s0, s1 = stage["state"]
            manager = stage["state_manager"]
            if manager.lookup([state_key]) != 1:
                failures.append(f"stage {index}: the request's state was not fetched")
                continue
            page = manager.page_of(state_key)
            for rank, worker in enumerate(stage["workers"]):
                worker.load(slot_ids=[0], page_ids=[page])
                for layer, pair in zip(range(s0, s1), worker.state_caches):
                    spec = engine.specs[layer]
                    shard = _state_shard(spec, _state_truth(setup, layer, spec), engine.tp, rank)
                    for tensor, want in zip(pair, shard):
                        got = _bits_view(tensor[0]).numpy()
                        state_wrong += int((got != want).sum()) * got.itemsize
                        state_checked += want.nbytes
    if kv_wrong or state_wrong:
        failures.append(f"bytes wrong: KV {kv_wrong}, state {state_wrong}")
    return dict(
        kv_blocks_from_files=kv_found,
        state_units_from_files=state_found,
        kv_bytes_checked=kv_checked,
        kv_bytes_wrong=kv_wrong,
        state_bytes_checked=state_checked,
        state_bytes_wrong=state_wrong,
        failures=failures,
    )


def run_hybrid(args: Any, out: TextIO) -> dict:
    """Run the hybrid scenario of ``args`` (parsed demo flags); the JSON summary.

    Raises
    ------
    HybridUsageError
        A flag the hybrid presets do not support (checked before any work).
    """
    preset = HYBRID_PRESETS[args.preset]
    [root] = _check_flags(args, preset)
    if not os.path.isdir(root):
        raise HybridUsageError(f"--store {root}: expected an existing directory")
    blocks = -(-args.prompt_tokens // preset.block_size)
    setup = _Setup(
        preset,
        args.preset,
        blocks,
        args.seed,
        args.model_name or f"canonical-kv-demo/{args.preset}",
        args.model_revision,
    )
    keys = _prompt_keys(setup)
    summary: dict[str, Any] = dict(
        preset=args.preset, model=preset.describe(), prompt_blocks=blocks, store=root
    )
    print(f"preset {args.preset}: {preset.describe()}", file=out)
    print(
        f"prompt: {blocks} blocks of {preset.block_size} tokens; ranks run in this process "
        "(CPU), one after another",
        file=out,
        flush=True,
    )
    failures: list[str] = []
    if args.phase in ("write", "both"):
        start = time.perf_counter()
        engine = _Engine(setup, root, args.writer_tp, args.writer_pp)
        try:
            written = _write(engine, keys)
        finally:
            engine.close()
        state_bytes = engine.state_namespace.total_bytes
        written.update(
            tp=args.writer_tp,
            pp=args.writer_pp,
            state_unit_bytes=state_bytes,
            seconds=round(time.perf_counter() - start, 3),
        )
        summary["write"] = written
        failures += written["failures"]
        expected_kv = blocks * sum("kv_cache" in s for s in engine.stages)
        expected_state = sum("state_cache" in s for s in engine.stages)
        if (written["kv_units_stored"], written["state_units_stored"]) != (
            expected_kv,
            expected_state,
        ):
            failures.append(
                f"write: stored {written['kv_units_stored']}/{expected_kv} KV units and "
                f"{written['state_units_stored']}/{expected_state} state units"
            )
        print(
            f"write: TP={args.writer_tp} x PP={args.writer_pp} stored "
            f"{written['kv_units_stored']} KV units ({setup.attention_layers} attention layers) "
            f"and {written['state_units_stored']} state unit(s) ({len(engine.specs)} state "
            f"layers, {state_bytes / 2**20:.1f} MiB canonical) into {root}",
            file=out,
            flush=True,
        )
    if args.phase in ("read", "both"):
        start = time.perf_counter()
        engine = _Engine(setup, root, args.reader_tp, args.reader_pp)
        try:
            read = _read(engine, keys)
        finally:
            engine.close()
        read.update(
            tp=args.reader_tp, pp=args.reader_pp, seconds=round(time.perf_counter() - start, 3)
        )
        summary["read"] = read
        failures += read["failures"]
        if read["kv_bytes_checked"] == 0 or read["state_bytes_checked"] == 0:
            failures.append("read: nothing was checked")
        if not read["failures"] and read["state_units_from_files"] == 0:
            failures.append("read: no state unit found")
        print(
            f"read: TP={args.reader_tp} x PP={args.reader_pp}, empty regions: "
            f"{read['kv_blocks_from_files']} KV blocks and {read['state_units_from_files']} "
            f"state unit(s) from the files; KV {read['kv_bytes_checked']} bytes checked, "
            f"{read['kv_bytes_wrong']} wrong; state {read['state_bytes_checked']} bytes "
            f"checked, {read['state_bytes_wrong']} wrong",
            file=out,
            flush=True,
        )
    summary["failures"] = failures
    summary["verdict"] = "FAIL" if failures else "PASS"
    for failure in failures:
        print(f"FAIL: {failure}", file=out)
    print(summary["verdict"], file=out, flush=True)
    return summary


def main_hybrid(args: Any, out: TextIO, parser: Any) -> int:
    """Entry point from ``demo.main`` for a hybrid preset: exit status (0 PASS, 1 FAIL)."""
    try:
        summary = run_hybrid(args, out)
    except HybridUsageError as error:
        parser.fail(str(error))
    if args.json:
        print(json.dumps(summary, indent=2), flush=True)
    return 0 if summary["verdict"] == "PASS" else 1
