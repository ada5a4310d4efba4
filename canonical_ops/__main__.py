"""Command line of canonical_ops: `python -m canonical_ops demo [...]`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: python -m canonical_ops {demo,store} [--help]\n\n"
            "  demo   TP=4 writers store a prompt's KV in canonical pages, TP=2 readers load "
            "and verify it\n"
            "  store  stats|verify|gc DIR: inspect and maintain a persistent file store"
        )
        return 0 if argv else 2
    if argv[0] == "demo":
        from .demo import main as demo_main

        return demo_main(argv[1:])
    if argv[0] == "store":
        from .frontend.store.cli import main as store_main

        return store_main(argv[1:])
    print(f"unknown command {argv[0]!r}; try `python -m canonical_ops --help`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
