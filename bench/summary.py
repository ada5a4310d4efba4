"""One screen of every benchmark goal: what it asks, what was measured, met or not.

Reads the ``goals`` list of each benchmark JSON in a results folder (what ``make bench``
writes): ``bench_cpu.json`` / ``bench_cuda.json`` (bench_transfer.py: ``measured`` is a
sentence), ``bench_store.json``, ``redis.json``, ``fp8.json`` and ``vllm_tiers.json``
(bench_vllm_tiers.py, in the vLLM venv: throughput, and a load's p50 / p99 latency while
stores stream) (``measured`` and ``target`` are ratios). A benchmark that did not run is
listed as such, so a missing figure never reads as a met goal.

Usage:
  python bench/summary.py bench/results
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

# Result files in the order they are shown, with the benchmark that writes them.
SOURCES = (
    ("bench_cpu.json", "transfer (CPU)"),
    ("bench_cuda.json", "transfer (CUDA)"),
    ("fp8.json", "fp8 vs bf16"),
    ("bench_store.json", "file tier"),
    ("redis.json", "Redis tier"),
    ("vllm_tiers.json", "vLLM fs vs canonical_fs"),
)
OPTIONAL = {"bench_cuda.json"}  # only where a GPU ran it


def _measured(goal: dict) -> str:
    value = goal.get("measured")
    if isinstance(value, (int, float)):
        return f"{value:.0%}" if "%" in str(goal.get("goal", "")) else f"{value:.2f}×"
    return str(value) if value is not None else "-"


def _verdict(goal: dict) -> str:
    met = goal.get("met")
    if met is None:
        return "(reference)"
    return "met" if met else "NOT MET"


def _grouped(goals: list[dict]) -> list[tuple[str, str, str]]:
    """(goal, measured, verdict) with the cases of one goal on one row.

    A goal measured on several cases names them after a ``;`` (``... >= 0.95x plain files;
    llama3-8b-like, fsync off``): those rows become one, showing the worst case (the one
    furthest below or above its target, whichever way the goal reads) and how many met.
    """
    groups: dict[str, list[dict]] = {}
    for goal in goals:
        text = str(goal.get("goal", goal.get("id", "?")))
        head, _, case = text.partition(";")
        groups.setdefault(head.strip() if case else text, []).append({**goal, "case": case.strip()})
    out = []
    for head, cases in groups.items():
        if len(cases) == 1 or not all(isinstance(c.get("measured"), (int, float)) for c in cases):
            out.extend((str(c.get("goal", head)), _measured(c), _verdict(c)) for c in cases)
            continue
        sign = 1.0 if ("<=" in head or "≤" in head) else -1.0  # an upper bound: above is worse
        worst = max(
            cases, key=lambda c: sign * (float(c["measured"]) - float(c.get("target", 0.0)))
        )
        met = sum(bool(c.get("met")) for c in cases)
        verdict = "met" if met == len(cases) else f"NOT MET ({met}/{len(cases)} cases)"
        out.append((head, f"worst {_measured(worst)} ({worst['case']})", verdict))
    return out


def rows(folder: Path) -> list[tuple[str, str, str, str]]:
    """(benchmark, goal, measured, verdict) for every goal found under ``folder``."""
    out = []
    for name, label in SOURCES:
        path = folder / name
        if not path.exists():
            if name not in OPTIONAL:
                out.append((label, f"({name} not found: benchmark not run)", "-", "NOT RUN"))
            continue
        try:
            goals = json.loads(path.read_text()).get("goals", [])
        except (OSError, ValueError) as error:
            out.append((label, f"({name} unreadable: {error})", "-", "NOT RUN"))
            continue
        out.extend((label, *row) for row in _grouped(goals))
    return out


def render(table: list[tuple[str, str, str, str]], width: int) -> str:
    """A plain-text table fitting ``width`` columns (goal and measured texts are cut)."""
    bench_w = max(len("benchmark"), *(len(r[0]) for r in table))
    verdict_w = max(len("verdict"), *(len(r[3]) for r in table))
    room = max(40, width - bench_w - verdict_w - 6)
    goal_w = min(max(len(r[1]) for r in table), room * 3 // 5)
    measured_w = max(10, room - goal_w)

    def cut(text: str, n: int) -> str:
        return text if len(text) <= n else text[: n - 1] + "…"

    lines = [
        f"{'benchmark':<{bench_w}}  {'goal':<{goal_w}}  {'measured':<{measured_w}}  verdict",
        "-" * min(width, bench_w + goal_w + measured_w + verdict_w + 6),
    ]
    for bench, goal, measured, verdict in table:
        lines.append(
            f"{bench:<{bench_w}}  {cut(goal, goal_w):<{goal_w}}  "
            f"{cut(measured, measured_w):<{measured_w}}  {verdict}"
        )
    met = sum(r[3] == "met" for r in table)
    judged = sum(r[3] == "met" or r[3].startswith("NOT MET") for r in table)
    lines.append(f"{met} of {judged} goals met; ratios are from one run on this machine")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="the benchmarks' --out folder")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        parser.error(f"folder: expected a directory of benchmark results, got {args.folder}")
    width = shutil.get_terminal_size((160, 40)).columns
    print(render(rows(args.folder), width))
    return 0


if __name__ == "__main__":
    sys.exit(main())
