"""The demo's command line: its flags, their limits and the value parsers."""

from __future__ import annotations

import argparse

from layouts.cli import CliParser, float_in, int_in, lower, upper

from .hybrid_presets import HYBRID_PRESETS
from .presets import DTYPES, PRESETS

PROG = "python -m canonical_ops demo"

MAX_TP = 64  # processes per group on one node (the region takes at most 496 ranks)
MAX_PP = 64
MAX_LAYERS = 1024
MAX_KV_HEADS = 1024
MAX_PROMPT_TOKENS = 1 << 24  # beyond any model's context; /dev/shm bounds it further
MAX_TIMEOUT_S = 86400.0
MAX_SEED = (1 << 32) - 1


def _size(text: str) -> int:
    from ..units.cli import parse_size

    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a non-empty name, got {text!r}")
    return text


def build_parser(description: str | None = None) -> CliParser:
    """The demo's flags; ``description`` heads ``--help`` (``main`` gives the package's
    docstring: what the demo does)."""
    presets = "\n".join(
        f"  {name:<12} {p.describe()}" for name, p in {**PRESETS, **HYBRID_PRESETS}.items()
    )
    parser = CliParser(
        prog=PROG,
        description=description,
        epilog=f"presets:\n{presets}\n\nChoices are case-insensitive.",
    )
    parser.add_argument(
        "--preset",
        type=lower,
        choices=[*PRESETS, *HYBRID_PRESETS],
        default="llama3-8b",
        help="model shape (hybrid ones, with Mamba / GDN state, run with --store DIR)",
    )
    parser.add_argument(
        "--layers",
        type=int_in(1, MAX_LAYERS),
        default=None,
        help="override the preset's layer count",
    )
    parser.add_argument(
        "--kv-heads",
        type=int_in(1, MAX_KV_HEADS),
        default=None,
        help="override the preset's KV head count (full attention; MLA has one latent)",
    )
    parser.add_argument(
        "--dtype",
        type=lower,
        choices=list(DTYPES),
        default=None,
        help="override the preset's KV dtype",
    )
    parser.add_argument(
        "--packing",
        type=lower,
        choices=["packed", "split"],
        default="packed",
        help="KV cache packing (packed: K and V adjacent per head; split: two halves)",
    )
    parser.add_argument(
        "--order", type=upper, choices=["NHD", "HND"], default="NHD", help="stride order"
    )
    parser.add_argument(
        "--writer-tp",
        type=int_in(1, MAX_TP),
        default=4,
        help="TP of the writers; must divide the KV heads or be a multiple of them "
        "(--phase read ignores it)",
    )
    parser.add_argument(
        "--reader-tp",
        type=int_in(1, MAX_TP),
        default=2,
        help="TP of the readers; must divide the KV heads or be a multiple of them "
        "(--phase write ignores it)",
    )
    parser.add_argument(
        "--writer-pp",
        type=int_in(1, MAX_PP),
        default=1,
        help="pipeline stages of the writers (vLLM's layer split; at most the layer count)",
    )
    parser.add_argument(
        "--reader-pp",
        type=int_in(1, MAX_PP),
        default=1,
        help="pipeline stages of the readers (vLLM's layer split; at most the layer count)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int_in(1, MAX_PROMPT_TOKENS),
        default=2048,
        help="prompt length (rounded up to whole blocks)",
    )
    parser.add_argument(
        "--store",
        action="append",
        metavar="DIR",
        default=None,
        help="persist to and read from the file store at DIR (an existing writable "
        "directory) or a Redis / Valkey server (redis://[USER:PASSWORD@]HOST:PORT/DB, "
        "rediss://, unix://PATH, redis+cluster://); twice for both (files looked up first)",
    )
    parser.add_argument(
        "--phase",
        type=lower,
        choices=["write", "read", "both"],
        default="both",
        help="with --store: write (store, persist, exit), read (a new engine loads from the "
        "store and verifies) or both, one after the other",
    )
    parser.add_argument(
        "--store-capacity",
        type=_size,
        default=None,
        metavar="BYTES",
        help="bytes of unit files the file store keeps (least recently used evicted first, "
        "tails first), e.g. 512M; default unbounded",
    )
    parser.add_argument(
        "--no-promote",
        action="store_true",
        help="with a directory and a URL: do not copy units the read engine got from Redis "
        "into the directory",
    )
    parser.add_argument(
        "--model-name",
        type=_name,
        default=None,
        help="model identity persisted units are namespaced by (default: canonical-kv-demo/PRESET)",
    )
    parser.add_argument(
        "--model-revision",
        default="",
        help="weights revision in the model identity",
    )
    parser.add_argument(
        "--device",
        type=lower,
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where the KV caches live (auto: cuda when a GPU and the CUDA kernels are present)",
    )
    parser.add_argument(
        "--timeout",
        type=float_in(0.0, MAX_TIMEOUT_S),
        default=600.0,
        help="seconds each process group (and each store phase) may take",
    )
    parser.add_argument(
        "--seed",
        type=int_in(0, MAX_SEED),
        default=0,
        help="seed of the prompt's tokens and KV and of the block tables",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON summary object on stdout (progress and report go to stderr)",
    )
    return parser
