"""A hostile name for the output tests: a newline, a forged report line, an ANSI erase-line
escape and a bidi override. Human-readable outputs must show it escaped on one line; JSON
outputs must keep it exactly."""

from __future__ import annotations

import dataclasses

from canonical_ops.units import ModelIdentity, StoreNamespace

FORGED = "FAKE: every unit verified"
HOSTILE = f"evil\n{FORGED}\x1b[2K\u202e"
ESCAPED = rf"evil\n{FORGED}\x1b[2K\u202e"  # how a human-readable output shows HOSTILE


def assert_no_forgery(text: str) -> None:
    """``text`` (lines of a human-readable output) holds no control, format or separator
    character but the newlines ending its lines, and no line that starts the forged one."""
    raw = sorted({c for c in text if not c.isprintable() and c != "\n"})
    assert not raw, f"raw non-printable characters {raw} in {text!r}"
    forged = [line for line in text.splitlines() if line.lstrip().startswith(FORGED)]
    assert not forged, f"forged line(s) {forged} in {text!r}"


def hostile_namespace(namespace: StoreNamespace) -> StoreNamespace:
    """``namespace`` of a model whose name, revision and an extra field are :data:`HOSTILE`."""
    model = ModelIdentity(HOSTILE, HOSTILE, {"adapter": HOSTILE})
    return dataclasses.replace(namespace, model=model)
