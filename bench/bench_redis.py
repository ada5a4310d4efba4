"""Redis tier throughput and lookup latency vs redis-py's own pipelined SET/GET.

Starts its own ``redis-server`` (no persistence, loopback; the launcher of the
tests, ``tests/helpers/redis_server.py``) and, for realistic unit sizes:

* ``llama3-8b``: 32 layers x 64 KiB canonical pages = 2 MiB units (8 KV heads,
  head 128, bf16, block 16);
* ``deepseek-v3``: MLA, 61 layers x 72 KiB pages = 4.3 MiB units (latent 576,
  bf16, block 64);

measures, with ``--batch`` units per batch (one job, run in the calling thread):

* ``store``: ``RedisStore.stores`` (encode + checksum + SET NX + index) vs a
  redis-py pipeline of plain SETs of values of the same size;
* ``load``: ``RedisStore.loads`` (GET + index, full verification, copy into
  the destination) vs a redis-py pipeline of plain GETs;
  both baselines twice: redis-py as it comes, and with the 1 MiB socket reads
  the tier configures (the fair measure of the tier's own cost);
* ``lookup``: ``RedisStore.lookup`` latency for 1, 16 and 128 keys (one
  pipelined round trip) vs redis-py pipelines of the same commands (ZRANGE of
  the index + EXISTS of the unit, per key) and of EXISTS alone (the floor).

Methods run round-robin (the first of each pair alternates), ``--repeats``
times. The goals (issues #18, #30): for every model and op, the median of the
run's tier times against the median of the faster redis-py baseline, tier /
redis-py >= 0.95 for stores and >= 1.5 for loads. Writes ``redis.json`` (with
``goals``: one
``{"goal", "measured", "target", "met"}`` per model and op) and ``redis.md``
to ``--out`` and prints the table.

Usage: python bench/bench_redis.py [--quick] [--out DIR] [--repeats N] [--batch N]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "tests"))

from _machine import free_page_reporting, reporting_note  # noqa: E402
from _results import goal_row  # noqa: E402
from helpers.redis_server import RedisServer  # noqa: E402

from canonical_ops.units import (  # noqa: E402
    LoadItem,
    ModelIdentity,
    RedisStore,
    StoreItem,
    StoreNamespace,
    header_length,
)
from layouts import LayerSpec, RankContext  # noqa: E402

GOALS = {"store": 0.95, "load": 1.5}  # tier / redis-py, medians of the run (issue 30)
MODELS = {
    "llama3-8b": dict(
        layers=32, spec=LayerSpec("full", 16, 8, 128, "bfloat16", "packed", "NHD"), heads=8
    ),
    "deepseek-v3": dict(
        layers=61, spec=LayerSpec("mla", 64, 1, 576, "bfloat16", "packed", "NHD"), heads=1
    ),
}
LOOKUP_BATCHES = (1, 16, 128)


def namespace(name: str) -> StoreNamespace:
    model = MODELS[name]
    ctx = RankContext(1, model["heads"], 0)
    return StoreNamespace.from_specs(ModelIdentity(name), [model["spec"]] * model["layers"], ctx)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_model(server: RedisServer, name: str, batch: int, repeats: int) -> dict:
    """Seconds of each method over ``repeats`` runs (and lookup latencies) for one model."""
    ns = namespace(name)
    admin = server.client(socket_timeout=60)
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, ns.total_bytes, dtype=np.uint8) for _ in range(batch)]
    value_bytes = header_length(b"k" * 8) + ns.total_bytes
    values = [rng.integers(0, 256, value_bytes, dtype=np.uint8).tobytes() for _ in range(batch)]
    outs = [np.empty(ns.total_bytes, np.uint8) for _ in range(batch)]
    times: dict[str, list[float]] = {}
    # redis-py as it comes, and with the tier's read size (1 MiB instead of 64 KiB): the
    # second isolates what the tier itself costs.
    clients = {
        "redis-py": server.client(socket_timeout=60),
        "redis-py-1MiB": server.client(socket_timeout=60, socket_read_size=1 << 20),
    }
    with RedisStore(server.url, ns, socket_timeout_s=60) as store:

        def redis_set(client, rep: int) -> None:
            pipe = client.pipeline(transaction=False)
            for i, value in enumerate(values):
                pipe.set(f"plain:{rep}:{i}", value)
            assert all(pipe.execute())

        def redis_get(client, rep: int) -> None:
            pipe = client.pipeline(transaction=False)
            for i in range(batch):
                pipe.get(f"plain:{rep}:{i}")
            assert all(v is not None for v in pipe.execute())

        def tier_store(rep: int) -> None:
            items = [StoreItem(rep * batch + i, 0, p, i) for i, p in enumerate(payloads)]
            job = store.stores(items)
            assert job.ok and job.nbytes == batch * ns.total_bytes, job.detail

        def tier_load(rep: int) -> None:
            items = [LoadItem(rep * batch + i, 0, ns.num_layers, o) for i, o in enumerate(outs)]
            job = store.loads(items)
            assert job.ok, job.detail

        for rep in range(repeats):
            for what, baseline, tier in (
                ("store", redis_set, tier_store),
                ("load", redis_get, tier_load),
            ):
                methods = [(m, functools.partial(baseline, c)) for m, c in clients.items()]
                methods.append(("tier", tier))
                shift = rep % len(methods)  # round-robin: each method leads in turn
                if what == "load":  # every method's data in place, untimed
                    admin.flushall()
                    redis_set(clients["redis-py"], rep)
                    tier_store(rep)
                for method, fn in methods[shift:] + methods[:shift]:
                    if what == "store":
                        # Each store meets the same server: empty, its memory freed. (A
                        # store after another one pays the server's page faults for
                        # fresh memory, and which method that hits would decide the race.)
                        admin.flushall()
                    seconds = timed(functools.partial(fn, rep))
                    times.setdefault(f"{what}/{method}", []).append(seconds)
        for i, out in enumerate(outs):  # the last load really is the last rep's units
            assert np.array_equal(out, payloads[i])

        # Lookup latency, keys present: the tier (ZRANGE of each index + EXISTS of the
        # unit, ranges parsed, cover computed) vs the same commands raw, and EXISTS alone.
        admin.flushall()
        keys = list(range(max(LOOKUP_BATCHES)))
        store.stores([StoreItem(k, 0, payloads[0], k) for k in keys])
        plain = clients["redis-py"]
        lookups: dict[str, dict[str, float]] = {}
        for count in LOOKUP_BATCHES:
            indexes = [store.index_key(k) for k in keys[:count]]

            def tier_lookup(c: int = count) -> None:
                assert store.lookup(keys[:c], 0, ns.num_layers) == c

            units = [store.unit_key(k, 0, ns.num_layers) for k in keys[:count]]

            def zrange(indexes: list[str] = indexes, units: list[str] = units) -> None:
                pipe = plain.pipeline(transaction=False)
                for index, unit in zip(indexes, units):
                    pipe.execute_command("ZRANGE", index, "0", "+inf", "BYSCORE")
                    pipe.execute_command("EXISTS", unit)
                pipe.execute()

            def exists(indexes: list[str] = indexes) -> None:
                pipe = plain.pipeline(transaction=False)
                for index in indexes:
                    pipe.exists(index)
                pipe.execute()

            found = {"tier_us": float("inf"), "zrange_us": float("inf"), "exists_us": float("inf")}
            for _ in range(max(30, repeats * 10)):
                for label, fn in (
                    ("tier_us", tier_lookup),
                    ("zrange_us", zrange),
                    ("exists_us", exists),
                ):
                    found[label] = min(found[label], timed(fn) * 1e6)
            lookups[str(count)] = found
        admin.flushall()
    for client in clients.values():
        client.close()
    admin.close()
    nbytes = batch * ns.total_bytes
    rows = {}
    for what in ("store", "load"):
        best = {m: nbytes / min(times[f"{what}/{m}"]) / 1e9 for m in ("tier", *clients)}
        median = {
            m: nbytes / statistics.median(times[f"{what}/{m}"]) / 1e9 for m in ("tier", *clients)
        }
        rows[what] = {
            "tier_gbs": best["tier"],
            "redis_py_gbs": best["redis-py"],
            "redis_py_1mib_gbs": best["redis-py-1MiB"],
            # Against the faster of the two baselines: the tier's own cost, not redis-py's.
            "ratio": best["tier"] / max(best["redis-py"], best["redis-py-1MiB"]),
            "ratio_median": median["tier"] / max(median["redis-py"], median["redis-py-1MiB"]),
            "seconds": {m: times[f"{what}/{m}"] for m in ("tier", *clients)},
        }
    return {
        "unit_bytes": ns.total_bytes,
        "layers": ns.num_layers,
        "page_bytes": ns.layer_bytes(0, 1),
        "batch": batch,
        "throughput": rows,
        "lookup": lookups,
    }


def goals(models: dict) -> list[dict]:
    """One goal per model and op: the median ratio of the run against :data:`GOALS`."""
    out = []
    for name, r in models.items():
        for what, t in r["throughput"].items():
            goal = f"{name} {what}: tier / redis-py pipelined, median >= {GOALS[what]}"
            out.append(goal_row(goal, t["ratio_median"], GOALS[what], digits=4))
    return out


def markdown(results: dict) -> str:
    lines = [
        f"Redis tier vs redis-py pipelines, one redis-server {results['redis_version']} on "
        f"loopback, {results['cpus']} CPUs, load average {results['load_average']:.1f} "
        f"({results['repeats']} runs, {results['batch']} units per batch). GB/s: best run. "
        f"Ratio: tier / the faster redis-py (as shipped, or with 1 MiB reads), of the best "
        f"runs and of the medians; goal: median ratio >= {GOALS['store']} (store), "
        f">= {GOALS['load']} (load). "
        + reporting_note(*results.get("free_page_reporting_before_after", (None, None))),
        "",
        "| model | unit | op | tier GB/s | redis-py GB/s | redis-py 1 MiB reads GB/s "
        "| ratio (best) | ratio (median) | goal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results["models"].items():
        unit = f"{r['unit_bytes'] / 2**20:.2f} MiB"
        for what, t in r["throughput"].items():
            verdict = "pass" if t["ratio_median"] >= GOALS[what] else "FAIL"
            lines.append(
                f"| {name} | {unit} | {what} | {t['tier_gbs']:.2f} | {t['redis_py_gbs']:.2f} "
                f"| {t['redis_py_1mib_gbs']:.2f} | {t['ratio']:.2f} | {t['ratio_median']:.2f} "
                f"| {verdict} |"
            )
    lines += [
        "",
        "| model | keys per lookup | tier (us) | redis-py pipeline of the same ZRANGE + EXISTS (us) "
        "| redis-py pipeline of EXISTS only (us) |",
        "|---|---|---|---|---|",
    ]
    for name, r in results["models"].items():
        for count, t in r["lookup"].items():
            lines.append(
                f"| {name} | {count} | {t['tier_us']:.0f} | {t['zrange_us']:.0f} "
                f"| {t['exists_us']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 repeats, 8 units per batch")
    parser.add_argument("--repeats", type=int, default=None, help="runs per method (default 9)")
    parser.add_argument("--batch", type=int, default=None, help="units per batch (default 16)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out", default=None, help="write redis.json and redis.md here")
    args = parser.parse_args()
    repeats = args.repeats or (5 if args.quick else 9)
    batch = args.batch or (8 if args.quick else 16)
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as tmp:
        server = RedisServer(os.path.join(tmp, "redis")).start()
        reporting_before = free_page_reporting()
        try:
            version = server.client().info("server")["redis_version"]
            results = {
                "bench": "redis",
                "redis_version": version,
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "repeats": repeats,
                "load_average": os.getloadavg()[0],
                "batch": batch,
                "models": {m: bench_model(server, m, batch, repeats) for m in args.models},
            }
            results["goals"] = goals(results["models"])
            results["free_page_reporting_before_after"] = [reporting_before, free_page_reporting()]
        finally:
            server.stop()
    table = markdown(results)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "redis.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(args.out, "redis.md"), "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
