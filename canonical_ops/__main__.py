"""Command line of canonical_ops: `python -m canonical_ops demo|store [...]`; a usage error
is one line on stderr and exit status 2."""

from __future__ import annotations

import importlib
import sys

from layouts.cli import run_console

PROG = "python -m canonical_ops"
COMMANDS = {"demo": ".demo", "store": ".units.cli"}  # command -> module with main(argv)
USAGE = (
    f"usage: {PROG} {{demo,store}} [--help] [flags]\n\n"
    "commands:\n"
    "  demo   TP=4 writers store a prompt's KV in canonical pages, TP=2 readers load it and\n"
    "         verify it bit for bit against the unsharded truth (`demo --help`: flags, presets)\n"
    "  store  stats|verify|gc DIR|URL: inspect and maintain a unit store (files or Redis)"
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv:
        print(f"{PROG}: error: a command is required: demo or store (see --help)", file=sys.stderr)
        return 2
    if argv[0] in COMMANDS:  # a command's modules load on first use
        return importlib.import_module(COMMANDS[argv[0]], __package__).main(argv[1:])
    print(f"{PROG}: error: unknown command {argv[0]!r}; try `{PROG} --help`", file=sys.stderr)
    return 2


def run() -> int:
    """``main`` for the console (``| head`` is no error)."""
    return run_console(main)


if __name__ == "__main__":
    sys.exit(run())
