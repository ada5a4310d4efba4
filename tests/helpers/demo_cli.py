"""Running `python -m canonical_ops demo` as a real process, from the repository root."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--preset", "tiny", "--prompt-tokens", "32"]
# tiny: 4 layers, 8 KV heads x 64, fp16, block 16: 32 KiB pages, 128 KiB per whole-model unit
PROMPT = ["--preset", "tiny", "--prompt-tokens", "128"]  # 8 blocks
BLOCKS = 8


def prompt_keys(*args: str) -> list[bytes]:
    """The block keys of the prompt the demo runs with these flags (preset, tokens, seed)."""
    from canonical_ops.demo import build_config, build_parser
    from canonical_ops.demo.truth import block_hashes

    return block_hashes(build_config(build_parser().parse_args(list(args)), "cpu"))


def demo_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "canonical_ops", "demo", *args]


def run_demo(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        demo_command(*args), cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def demo_json(*args: str, expect: int | None = None, timeout: float = 300) -> dict:
    """Run the demo with ``--json``; its whole stdout is one object (exit status checked)."""
    result = run_demo(*args, "--json", timeout=timeout)
    if expect is not None:
        assert result.returncode == expect, (result.returncode, result.stderr[-4000:])
    assert "Traceback" not in result.stderr, result.stderr
    summary = json.loads(result.stdout)
    summary["_stderr"] = result.stderr
    summary["_returncode"] = result.returncode
    return summary


def assert_usage_error(result: subprocess.CompletedProcess, *words: str) -> str:
    """Exit 2, nothing on stdout, one line on stderr naming ``words``; returns that line."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert result.stdout == ""
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]
