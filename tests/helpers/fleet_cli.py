"""Running one engine's side of the demo's one-prefix phase (``canonical_ops.demo.fleet``) as a
real process, as `make demo-engines` does, and reading its one line."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from helpers.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["--preset", "tiny", "--layers", "2"]  # 2 fp16 layers of 8 KV heads x 64: 64 KiB units
LINE = re.compile(
    r"^(?P<engine>\w+) +TP=(?P<tp>\d+): (?:loaded (?P<loaded>\d+)/(?P<asked>\d+) pages, missed "
    r"(?P<missed>\d+), bytes wrong (?P<wrong>\d+) of (?P<checked>\d+) checked)?(?:; )?"
    r"(?:stored (?P<stored>\d+)/(?P<store_asked>\d+) units)? via .*: (?P<verdict>ok|FAIL)$"
)


def run_fleet(*args: str, env: dict | None = None, timeout: float = 300) -> dict:
    """One side's run: its line's fields (ints), ``returncode`` and ``stderr``."""
    command = [sys.executable, "-m", "canonical_ops.demo.fleet", *args, *MODEL]
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )
    lines = result.stdout.splitlines()
    assert len(lines) == 1, (result.returncode, result.stdout, result.stderr[-4000:])
    match = LINE.match(lines[0])
    assert match, lines[0]
    out = {k: int(v) if v and v.isdigit() else v for k, v in match.groupdict().items()}
    out.update(returncode=result.returncode, stderr=result.stderr, line=lines[0])
    assert (out["verdict"] == "ok") == (result.returncode == 0), (lines[0], result.stderr[-4000:])
    return out


@contextlib.contextmanager
def store_location(kind: str, tmp_path: Path) -> Iterator[str]:
    """Where the engines' processes share one store: a directory (``"files"``), or the url of a
    Redis server started under ``tmp_path`` and stopped on exit (``"redis"``)."""
    if kind == "files":
        yield str(tmp_path / "store")
        return
    with RedisServer(str(tmp_path / "redis")) as server:
        yield server.url
