"""The demo's command line: its flags, their limits and the value parsers."""

from __future__ import annotations

import argparse

from layouts.cli import CliParser, float_in, int_in, lower, upper

from .presets import DTYPES, PRESETS

PROG = "python -m canonical_ops demo"
MAX_RANKS = 64  # TP and PP: processes per group on one node
MAX_PROMPT_TOKENS = 1 << 24  # beyond any model's context; /dev/shm bounds it further


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
    presets = "\n".join(f"  {name:<15} {p.describe()}" for name, p in PRESETS.items())
    epilog = f"presets:\n{presets}\n\nChoices are case-insensitive."
    parser = CliParser(prog=PROG, description=description, epilog=epilog)
    ranks = int_in(1, MAX_RANKS)
    tp_help = "must divide the KV heads or be a multiple of them"
    pp_help = "(vLLM's layer split; at most the layer count)"
    flags = [
        (
            "--preset",
            dict(type=lower, choices=list(PRESETS), default="llama3-8b"),
            "model shape (the hybrid ones, with Mamba / GDN state, run with --store)",
        ),
        ("--layers", dict(type=int_in(1, 1024)), "override the preset's layer count"),
        (
            "--kv-heads",
            dict(type=int_in(1, 1024)),
            "override the preset's KV head count (full attention; MLA has one latent)",
        ),
        ("--dtype", dict(type=lower, choices=list(DTYPES)), "override the preset's KV dtype"),
        (
            "--packing",
            dict(type=lower, choices=["packed", "split"], default="packed"),
            "KV cache packing (packed: K and V adjacent per head; split: two halves)",
        ),
        ("--order", dict(type=upper, choices=["NHD", "HND"], default="NHD"), "stride order"),
        (
            "--writer-tp",
            dict(type=ranks, default=4),
            f"TP of the writers; {tp_help} (--phase read ignores it)",
        ),
        (
            "--reader-tp",
            dict(type=ranks, default=2),
            f"TP of the readers; {tp_help} (--phase write ignores it)",
        ),
        ("--writer-pp", dict(type=ranks, default=1), f"pipeline stages of the writers {pp_help}"),
        ("--reader-pp", dict(type=ranks, default=1), f"pipeline stages of the readers {pp_help}"),
        (
            "--prompt-tokens",
            dict(type=int_in(1, MAX_PROMPT_TOKENS), default=2048),
            "prompt length (rounded up to whole blocks)",
        ),
        (
            "--store",
            dict(action="append", metavar="DIR|URL"),
            "persist to and read from the file store at DIR (created, private to you, when "
            "missing) or a Redis / Valkey server (redis://[USER:PASSWORD@]HOST:PORT/DB, rediss://, "
            "unix://PATH, redis+cluster://); twice for both (files looked up first)",
        ),
        (
            "--phase",
            dict(type=lower, choices=["write", "read", "both"], default="both"),
            "with --store: write (store, persist, exit), read (a new engine loads from the store "
            "and verifies) or both, one after the other",
        ),
        (
            "--store-capacity",
            dict(type=_size, metavar="BYTES"),
            "bytes of unit files the file store keeps (least recently used evicted first, tails "
            "first), e.g. 512M; default unbounded",
        ),
        (
            "--no-promote",
            dict(action="store_true"),
            "with a directory and a URL: do not copy units the read engine got from Redis into "
            "the directory",
        ),
        (
            "--model-name",
            dict(type=_name),
            "model identity persisted units are namespaced by (default: canonical-kv-demo/PRESET)",
        ),
        ("--model-revision", dict(default=""), "weights revision in the model identity"),
        (
            "--device",
            dict(type=lower, choices=["auto", "cpu", "cuda"], default="auto"),
            "where the KV caches live (auto: cuda when a GPU and the CUDA kernels are present)",
        ),
        (
            "--timeout",
            dict(type=float_in(0.0, 86400.0), default=600.0),
            "seconds each process group (and each store phase) may take",
        ),
        (
            "--seed",
            dict(type=int_in(0, (1 << 32) - 1), default=0),
            "seed of the prompt's tokens and KV and of the block tables",
        ),
        (
            "--json",
            dict(action="store_true"),
            "print one JSON summary object on stdout (progress and report go to stderr)",
        ),
    ]
    for flag, kwargs, text in flags:
        parser.add_argument(flag, help=text, **kwargs)
    return parser
