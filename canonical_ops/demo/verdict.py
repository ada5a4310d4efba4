"""The verdict: what the groups and the store phases reported, against what PASS requires."""

from __future__ import annotations

from dataclasses import dataclass

from .config import DemoConfig
from .ranks import GroupRun


def _last_line(text: str) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "unknown error"


@dataclass
class Verification:
    failures: list[str]
    pages_loaded: int | None
    pages_missed: int | None
    bytes_wrong: int
    bytes_checked: int


def verify(
    cfg: DemoConfig,
    writers: GroupRun | None,
    ready: int,
    readers: GroupRun | None,
    *,
    from_store: bool = False,
) -> Verification:
    """The verdict against the unsharded truth: every prompt page loaded by every reader,
    every layer, block, token and KV head checked by some reader, no byte different.

    ``ready`` is the number of leading prompt pages the readers were given (ready
    in the writers' regions, or, ``from_store``, found in the store and verified).
    """
    failures = []
    for run in (writers, readers):
        if run is None:
            continue
        for index, error in sorted(run.errors.items()):
            failures.append(f"{run.role} rank {index} failed: {_last_line(error)}")
    total = cfg.prompt_blocks
    if ready < total:
        if from_store:
            failures.append(
                f"only {ready}/{total} prompt pages were found in the store and verified; "
                f"the other {total - ready} are missing (never stored, evicted, corrupt or "
                "of another namespace: each a miss, none loaded)"
            )
        else:
            failures.append(
                f"only {ready}/{total} prompt pages became ready (a writer did not store its share)"
            )
    if readers is None:
        failures.append("no reader ran (no page was " + ("found)" if from_store else "ready)"))
        return Verification(failures, 0, total, 0, 0)
    loaded = min((r["pages"] for r in readers.reports.values()), default=0) if readers.ok else 0
    if loaded < ready and readers.ok:
        failures.append(f"the readers loaded {loaded} of the {ready} ready pages")
    bytes_wrong = bytes_checked = 0
    stages = cfg.stages("reader")
    covered: dict[tuple[int, int], set[int]] = {stage: set() for stage in stages}
    for index, r in sorted(readers.reports.items()):
        bytes_checked += r["bytes_checked"]
        layers = (r["first_layer"], r["end_layer"])
        if (
            layers not in covered
            or r["layers"] != layers[1] - layers[0]
            or (r["blocks"] != r["pages"])
        ):
            failures.append(
                f"reader rank {index} checked layers [{layers[0]}, {layers[1]}) "
                f"({r['layers']} layers) of {r['blocks']}/{r['pages']} loaded blocks; "
                f"expected one of the stages {stages}"
            )
        else:
            covered[layers].update(r["heads"])
        if r["local_head_slots"] != [len(r["heads"])]:
            failures.append(
                f"reader rank {index} holds {r['local_head_slots']} head slots but "
                f"{len(r['heads'])} heads were checked"
            )
        wrong = {int(k): v for k, v in r["bytes_wrong_by_layer"].items()}
        if wrong:
            bytes_wrong += sum(wrong.values())
            failures.append(
                f"reader rank {index}: layers {sorted(wrong)} differ from the unsharded truth "
                f"({sum(wrong.values())} bytes)"
            )
    expected_heads = 1 if cfg.attention == "mla" else cfg.total_kv_heads
    if readers.reports:
        for (first, end), heads in covered.items():
            missing = sorted(set(range(expected_heads)) - heads)
            if missing:
                where = f" for layers [{first}, {end})" if len(stages) > 1 else ""
                failures.append(
                    f"KV heads {missing} were held by no reader rank{where}: never verified"
                )
    return Verification(failures, loaded, total - loaded, bytes_wrong, bytes_checked)


def verify_persistent(cfg: DemoConfig, phase: str, out: dict) -> Verification:
    """The verdict of the persistent phases: every unit persisted (write), every prompt page
    loaded from the store and bit-exact (read)."""
    failures: list[str] = []
    persist = out.get("persist")
    writers = out.get("writers")
    if phase in ("write", "both"):
        for index, error in sorted(writers.errors.items()) if writers else ():
            failures.append(f"writer rank {index} failed: {_last_line(error)}")
        ready = out.get("ready", 0)
        if ready < cfg.prompt_blocks:
            failures.append(
                f"only {ready}/{cfg.prompt_blocks} prompt pages became ready (a writer did not "
                "store its share)"
            )
        if persist is not None and persist["units_ok"] < persist["units_expected"]:
            why = "; ".join(persist["errors"][:2])
            failures.append(
                f"{persist['units_expected'] - persist['units_ok']} of "
                f"{persist['units_expected']} units were not persisted "
                f"({persist['units_failed']} failed, {persist['units_refused']} refused"
                f"{': ' + why if why else ''})"
            )
    if phase == "write":
        return Verification(failures, None, None, 0, 0)
    fill = out["fill"]
    result = verify(cfg, None, fill["pages_filled"], out["readers"], from_store=True)
    result.failures = failures + result.failures
    return result
