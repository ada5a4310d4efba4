"""Shared pieces of the store tests: small namespaces, payloads, child processes."""

from __future__ import annotations

import ctypes
import json
import os
import struct
import subprocess
import sys
import tempfile
import textwrap

import numpy as np

from canonical_ops.units import FileStore, ModelIdentity, StoreNamespace
from layouts import LayerSpec, RankContext

# tests/helpers/store.py -> the repository root (children must import THIS checkout's
# canonical_ops, not whatever an editable install of another checkout points at).
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def small_namespace(
    num_layers: int = 32,
    *,
    head_size: int = 8,
    tp: int = 2,
    total_heads: int = 4,
    block_size: int = 4,
    dtype: str = "bfloat16",
    name: str = "test-model",
) -> StoreNamespace:
    """A certified full-attention model; canonical page = heads*tokens*2*head_size*2 bytes."""
    spec = LayerSpec("full", block_size, total_heads // tp, head_size, dtype, "packed", "NHD")
    ctx = RankContext(tp, total_heads, 0)
    return StoreNamespace.from_specs(ModelIdentity(name, "r1"), [spec] * num_layers, ctx)


def row(namespace: StoreNamespace, key: int, first: int = 0, end: int | None = None) -> np.ndarray:
    """Deterministic canonical bytes of ``key``'s layers [first, end) (a region row)."""
    end = namespace.num_layers if end is None else end
    full = np.random.default_rng([key, 7]).integers(0, 256, namespace.total_bytes, dtype=np.uint8)
    start, stop = namespace.layer_span(first, end)
    return full[start:stop].copy()


def unit_files(store: FileStore) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(store.directory):
        rel = os.path.relpath(dirpath, store.directory)
        if rel.split(os.sep)[0] in ("tmp", "quarantine"):
            continue
        out += [os.path.join(dirpath, n) for n in names if n.endswith(".ckv")]
    return sorted(out)


def child_env() -> dict[str, str]:
    """Environment making children import this checkout (not another install)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "tests")])
    return env


def start_child(body: str, *args: str) -> subprocess.Popen:
    """Run ``body`` (Python source) in a child; ``sys.argv[1:]`` = ``args``; stdout piped."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(body), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_env(),
        cwd=REPO,
        text=True,
    )


def run_child(body: str, *args: str, timeout: float = 120) -> dict:
    """Run a child to completion; it must print one JSON object as its last line."""
    proc = start_child(body, *args)
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{out}\n{err}"
    return json.loads(out.strip().splitlines()[-1])


EXT4 = 0xEF53  # statfs f_type of ext2/3/4


def preallocates(directory) -> bool:
    """Whether a store should preallocate here: on ext4, where fallocate works (statfs and
    fallocate through libc: Python has neither)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    info = ctypes.create_string_buffer(256)
    assert libc.statfs(os.fsencode(directory), info) == 0
    if struct.unpack_from("l", info)[0] != EXT4:
        return False
    fd, probe = tempfile.mkstemp(dir=directory)
    try:
        return libc.fallocate(fd, 0, 0, 1 << 16) == 0
    finally:
        os.close(fd)
        os.unlink(probe)
