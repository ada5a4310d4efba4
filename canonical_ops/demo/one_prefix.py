"""What every engine's side of the one-prefix phase (:mod:`.fleet`) shares: the model's demo
configuration, the one line each engine prints, and the standalone engine's side (the demo's
read engine)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from dataclasses import dataclass

from layouts.cli import escape_text

from .presets import PRESETS

MODEL_NAME = "canonical-kv-demo/one-prefix"


@dataclass
class Outcome:
    """What one engine's side did: units stored (of asked) and loaded / missed / wrong bytes."""

    stored: int = 0
    store_asked: int = 0
    loaded: int = 0
    load_asked: int = 0
    bytes_wrong: int = 0
    bytes_checked: int = 0
    note: str = ""

    @property
    def ok(self) -> bool:
        return (
            self.stored == self.store_asked
            and self.loaded == self.load_asked
            and self.bytes_wrong == 0
        )

    def line(self, engine: str, tp: int, where: str) -> str:
        parts = []
        if self.load_asked:
            parts.append(
                f"loaded {self.loaded}/{self.load_asked} pages, missed "
                f"{self.load_asked - self.loaded}, bytes wrong {self.bytes_wrong} of "
                f"{self.bytes_checked} checked"
            )
        if self.store_asked:
            parts.append(f"stored {self.stored}/{self.store_asked} units")
        note = f" ({self.note})" if self.note else ""
        verdict = "ok" if self.ok else "FAIL"
        return escape_text(f"{engine:<10} TP={tp}: {'; '.join(parts)} via {where}{note}: {verdict}")


def _demo_argv(args, units: int, tp: int) -> list[str]:
    """The demo's flags for this model with a prompt of ``units`` units at TP ``tp``: split NHD
    pages (what vLLM's FlashAttention caches and SGLang's host pools both hold)."""
    shared = [n for n, p in PRESETS.items() if p.attention == "full" and not p.kinds]
    shared = [n for n in shared if not PRESETS[n].kv_scales and PRESETS[n].dtype != "float32"]
    if args.preset not in shared:
        raise ValueError(
            f"--preset {args.preset}: this phase shares full-attention KV in float16 or "
            "bfloat16 (vLLM's tiers share no quantised KV; MLA and hybrid state are not in "
            f"it); expected one of {shared}"
        )
    argv = ["--preset", args.preset, "--layers", str(args.layers), "--seed", str(args.seed)]
    argv += ["--packing", "split", "--order", "NHD", "--model-name", args.model_name]
    tokens = units * PRESETS[args.preset].block_size
    return [*argv, "--prompt-tokens", str(tokens), "--writer-tp", str(tp), "--reader-tp", str(tp)]


def demo_config(args, units: int, tp: int = 1):
    """The demo's configuration of this model (:func:`_demo_argv`)."""
    from .cli import build_parser as demo_parser
    from .config import build_config

    return build_config(demo_parser().parse_args(_demo_argv(args, units, tp)), "cpu")


def standalone_load(args) -> Outcome:
    """The standalone engine (the demo's read phase at TP=``args.tp``: empty regions filled
    from verified units, rank processes load and compare every byte with the truth)."""
    from . import main as demo_main

    argv = [*_demo_argv(args, args.load, args.tp), "--json", "--store", args.store]
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = demo_main([*argv, "--phase", "read"])
    except SystemExit:  # its usage error (an unusable store): one line, ours to print
        lines = err.getvalue().strip().splitlines() or ["the demo's read phase refused"]
        raise ValueError(lines[-1].split("error: ", 1)[-1].removesuffix(" (see --help)")) from None
    try:
        summary = json.loads(out.getvalue())
    except ValueError:
        sys.stderr.write(err.getvalue())
        raise RuntimeError(f"the demo's read phase gave no summary (exit {status})") from None
    if summary["verdict"] != "PASS":
        sys.stderr.write(err.getvalue())
    return Outcome(
        loaded=summary["pages_loaded"] or 0,
        load_asked=args.load,
        bytes_wrong=summary["bytes_wrong"],
        bytes_checked=summary["bytes_checked"],
        note=f"namespace {summary['namespace'][:16]}",
    )
