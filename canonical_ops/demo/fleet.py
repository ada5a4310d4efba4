"""One prefix, every engine: the demo phase where vLLM, SGLang and the standalone engine share
one prompt's KV through one store, each at its own TP, each in its own process (and venv).

``python -m canonical_ops.demo.fleet ENGINE --store DIR|URL --tp N [--load N] [--write A:B]``
runs one engine's side: ``vllm`` (vLLM 0.33's OffloadingConnector, TieringOffloadingManager and
a ``canonical_fs`` / ``canonical_redis`` tier with ``shared_prefix``; :mod:`.fleet_vllm`),
``sglang`` (SGLang's HiCache storage factory, host pools and page hashing with canonical-kv's
backend; :mod:`.fleet_sglang`) or ``standalone`` (the demo's read engine: regions, StageCache,
rank processes). ``--write A:B`` stores the prompt's units ``[A, B)`` from the engine's KV cache;
``--load N`` looks the first N up in a fresh engine, loads the prefix found and compares every
byte with the truth. The prompt, its KV and the model follow from the model flags alone
(:mod:`.truth`), so each process checks what another wrote. One line per engine; exit 0 when
every unit asked for was stored or loaded bit-exact, 1 otherwise, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from layouts.cli import CliParser, int_in, lower

from .cli import MAX_RANKS
from .one_prefix import MODEL_NAME, Outcome, standalone_load
from .presets import PRESETS

PROG = "python -m canonical_ops.demo.fleet"
ENGINES = ("vllm", "sglang", "standalone")


def _span(text: str) -> tuple[int, int]:
    first, sep, end = text.partition(":")
    try:
        span = (int(first), int(end))
    except ValueError:
        span = None
    if not sep or span is None or not 0 <= span[0] < span[1]:
        raise argparse.ArgumentTypeError(
            f"expected A:B with 0 <= A < B (the units [A, B)), got {text!r}"
        )
    return span


def build_parser() -> CliParser:
    parser = CliParser(prog=PROG, description=__doc__)
    parser.add_argument("engine", type=lower, choices=ENGINES, help="which engine runs")
    parser.add_argument("--store", required=True, metavar="DIR|URL", help="the shared store")
    parser.add_argument("--tp", type=int_in(1, MAX_RANKS), default=1, help="tensor parallelism")
    parser.add_argument("--load", type=int_in(1, 1 << 16), help="load and check the first N units")
    parser.add_argument("--write", type=_span, metavar="A:B", help="store the units [A, B)")
    parser.add_argument("--preset", type=lower, choices=list(PRESETS), default="llama3-8b")
    parser.add_argument("--layers", type=int_in(1, 1024), default=8, help="override the preset's")
    parser.add_argument("--seed", type=int_in(0, (1 << 32) - 1), default=0)
    parser.add_argument("--model-name", default=MODEL_NAME, help="the model identity")
    parser.add_argument("--work-dir", help="private scratch (SGLang's staging; vLLM's config)")
    return parser


_NEEDS = {
    "vllm": ("vllm", "vLLM 0.33", ".venv-vllm"),
    "sglang": ("sglang", "SGLang 0.5", ".venv-sglang"),
}


def run(args) -> Outcome:
    """One engine's side; ValueError (a usage error) for what it cannot run."""
    if args.engine == "standalone":
        if args.write is not None or args.load is None:
            raise ValueError("standalone: expected --load N (it stores in `make demo`'s phases)")
        return standalone_load(args)
    if args.load is None and args.write is None:
        raise ValueError(f"{args.engine}: expected --load N, --write A:B or both")
    module, what, venv = _NEEDS[args.engine]
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its start-up INFO lines: noise here
    try:
        importlib.import_module(module)
    except ImportError as error:
        raise ValueError(
            f"{args.engine}: needs {what} in this Python ({error}); run it with {venv}/bin/python "
            "as `make demo-engines` does"
        ) from None
    if args.engine == "vllm":
        from .fleet_vllm import run_vllm

        return run_vllm(args)
    from .fleet_sglang import run_sglang

    return run_sglang(args)


def main(argv: list[str] | None = None) -> int:
    """One engine's side and its line; exit 0 (every unit asked for), 1, or 2 (usage)."""
    from ..units.redis_url import redact_url
    from .config import UsageError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        outcome = run(args)
    except (ValueError, UsageError) as error:
        parser.fail(str(error))
    print(outcome.line(args.engine, args.tp, redact_url(args.store)), flush=True)
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
