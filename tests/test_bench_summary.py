"""bench/summary.py: every goal of every benchmark on one screen, never a missing figure
read as a met goal."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import summary


def write(folder: Path, name: str, goals: list[dict]) -> None:
    (folder / name).write_text(json.dumps({"goals": goals}))


def test_cases_of_a_goal_fold_into_its_worst(tmp_path):
    write(
        tmp_path,
        "bench_cpu.json",
        [{"goal": "canonical ≥ 1× torch", "measured": "store 0.9×", "met": False}],
    )
    write(
        tmp_path,
        "fp8.json",
        [{"goal": "fp8 >= 1.0x bf16; a", "measured": 1.1, "target": 1.0, "met": True}],
    )
    write(
        tmp_path,
        "bench_store.json",
        [
            {"goal": "warm >= 0.95x plain; llama", "measured": 0.97, "target": 0.95, "met": True},
            {
                "goal": "warm >= 0.95x plain; deepseek",
                "measured": 0.80,
                "target": 0.95,
                "met": False,
            },
            {
                "goal": "checksum <= 10% of load; llama",
                "measured": 0.12,
                "target": 0.1,
                "met": False,
            },
            {
                "goal": "checksum <= 10% of load; deepseek",
                "measured": 0.05,
                "target": 0.1,
                "met": True,
            },
        ],
    )
    rows = summary.rows(tmp_path)
    by_goal = {goal: (measured, verdict) for _, goal, measured, verdict in rows}
    assert by_goal["warm >= 0.95x plain"] == ("worst 0.80× (deepseek)", "NOT MET (1/2 cases)")
    assert by_goal["checksum <= 10% of load"] == ("worst 12% (llama)", "NOT MET (1/2 cases)")
    assert by_goal["canonical ≥ 1× torch"] == ("store 0.9×", "NOT MET")
    assert by_goal["fp8 >= 1.0x bf16; a"] == ("1.10×", "met")
    # redis.json was not written: listed as not run, not silently absent.
    assert ("Redis tier", "(redis.json not found: benchmark not run)", "-", "NOT RUN") in rows
    text = summary.render(rows, 120)
    assert text.splitlines()[-1].startswith("1 of 4 goals met")
    assert all(len(line) <= 120 for line in text.splitlines())


def test_vllm_tier_goals_join_the_screen(tmp_path):
    """bench_vllm_tiers.py's goals (one per operation and model) fold like the others, and a
    run without it (no vLLM venv) reads NOT RUN, never met."""
    assert ("vLLM fs vs canonical_fs", "(vllm_tiers.json not found: benchmark not run)", "-",
            "NOT RUN") in summary.rows(tmp_path)  # fmt: skip
    goal = "load warm: canonical_fs >= 0.85x vLLM fs (better of O_DIRECT, buffered)"
    write(
        tmp_path,
        "vllm_tiers.json",
        [
            {"goal": f"{goal}; llama3-8b-like", "measured": 0.9, "target": 0.85, "met": True},
            {
                "goal": f"{goal}; deepseek-v3-like-mla",
                "measured": 0.7,
                "target": 0.85,
                "met": False,
            },
        ],
    )
    rows = [r for r in summary.rows(tmp_path) if r[0] == "vLLM fs vs canonical_fs"]
    assert rows == [
        (
            "vLLM fs vs canonical_fs",
            goal,
            "worst 0.70× (deepseek-v3-like-mla)",
            "NOT MET (1/2 cases)",
        )
    ]
