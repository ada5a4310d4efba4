"""`python -m layouts explain ...`: which rank writes which bytes of a canonical page.

Every argument is checked before any work: a user error is one line on stderr and
exit status 2, never a traceback. Topologies are bounded (at most ``MAX_RANKS``
ranks, at most ``MAX_FRAGMENTS`` copy fragments to derive), so an answer takes
seconds, not minutes. A topology vLLM would not certify is still explained: the
report says why it falls back to the opaque layout.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from .cli import CliParser, int_in, lower, run_console, upper
from .explain import explain
from .spec import ATTENTION_KINDS, ORDERS, PACKINGS, LayerSpec, dtype_name

MAX_RANKS = 1024  # TP x PCP: more ranks than any deployment, and explained in ~1 s
MAX_FRAGMENTS = 1 << 18  # copy fragments of all ranks (~3 s to derive and verify)
MAX_HEADS = 1024
MAX_HEAD_SIZE = 1 << 16
MAX_BLOCK_SIZE = 1 << 16
MAX_WIDTH = 1024


def dtype_arg(text: str) -> str:
    """argparse ``type``: a KV cache dtype name or alias, case-insensitive."""
    try:
        return dtype_name(text.lower())
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("dtype: ")) from None


def estimated_fragments(args, heads_per_rank: int) -> int:
    """Upper bound of the copy fragments ``derive_group_mappings`` builds for the group.

    One region per (K/V half, head) that is not contiguous across tokens; with
    context parallelism one fragment per chunk of ``interleave`` tokens of each.
    """
    if args.attention == "mla" or (args.packing == "packed" and args.order == "NHD"):
        regions = 1
    elif args.packing == "packed":
        regions = heads_per_rank
    else:
        regions = 2 * (heads_per_rank if args.order == "HND" else 1)
    chunks = 1 if args.dcp * args.pcp == 1 else -(-args.block_size // args.interleave)
    return args.tp * args.pcp * regions * chunks


def build_parser() -> tuple[CliParser, CliParser]:
    """The top-level parser and its ``explain`` subparser."""
    parser = CliParser(
        prog="python -m layouts",
        description="Canonical KV page layouts (format v1). `explain --help` for its flags.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{explain}")
    p = sub.add_parser(
        "explain",
        help="picture one canonical page of one layer",
        description=textwrap.fill(
            "Which rank of a TP x PCP group (DCP inside TP) writes which bytes of one "
            "canonical page of one layer, whether the layout is certified (parallelism "
            f"agnostic) and, if not, why. Choices are case-insensitive. At most {MAX_RANKS} "
            f"ranks (TP x PCP) and {MAX_FRAGMENTS} copy fragments are explained.",
            width=88,
        ),
    )
    p.add_argument(
        "--attention",
        type=lower,
        choices=ATTENTION_KINDS,
        default="full",
        help="full attention (K and V per head) or MLA (one latent per token)",
    )
    bounded = [  # (flag, maximum, default, help): integers in [1, maximum]
        (
            "--total-kv-heads",
            MAX_HEADS,
            None,
            "KV heads (default: 8 for full attention, 1 for MLA)",
        ),
        ("--head-size", MAX_HEAD_SIZE, 128, "elements per head / latent width"),
        ("--block-size", MAX_BLOCK_SIZE, 16, "tokens per block on each rank"),
    ]
    for flag, maximum, default, text in bounded:
        p.add_argument(flag, type=int_in(1, maximum), default=default, help=text)
    p.add_argument(
        "--dtype",
        type=dtype_arg,
        default="bfloat16",
        help="KV cache dtype (float32, float16, bfloat16, float8_e4m3fn, ..., or bf16, fp8, ...)",
    )
    p.add_argument("--packing", type=lower, choices=PACKINGS, default="packed", help="page packing")
    p.add_argument("--order", type=upper, choices=ORDERS, default="NHD", help="stride order")
    bounded = [
        ("--tp", MAX_RANKS, 1, "tensor parallel size"),
        ("--dcp", MAX_RANKS, 1, "decode context parallel size"),
        ("--pcp", MAX_RANKS, 1, "prefill context parallel size"),
        ("--interleave", MAX_BLOCK_SIZE, 1, "tokens per context-parallel chunk"),
        (
            "--heads-per-rank",
            MAX_HEADS,
            None,
            "override (default: max(1, total // tp)); a wrong value fails closed",
        ),
    ]
    for flag, maximum, default, text in bounded:
        p.add_argument(flag, type=int_in(1, maximum), default=default, help=text)
    p.add_argument(
        "--per-token-head-scales",
        action="store_true",
        help="quantised with per-(token, head) scales (never certified)",
    )
    p.add_argument(
        "--page-id",
        type=int_in(0, (1 << 63) - 1),
        default=0,
        help="which page (writer rotation)",
    )
    p.add_argument("--width", type=int_in(1, MAX_WIDTH), default=64, help="columns of the picture")
    return parser, p


def main(argv: list[str] | None = None) -> int:
    parser, explain_parser = build_parser()
    args = parser.parse_args(argv)

    if args.attention == "mla":
        if args.total_kv_heads not in (None, 1):
            explain_parser.fail(
                f"argument --total-kv-heads: MLA has one latent (1 KV head), got "
                f"{args.total_kv_heads}"
            )
        total = 1
    else:
        total = 8 if args.total_kv_heads is None else args.total_kv_heads
    ranks = args.tp * args.pcp
    if ranks > MAX_RANKS:
        explain_parser.fail(
            f"--tp {args.tp} x --pcp {args.pcp} = {ranks} ranks; at most {MAX_RANKS} are explained"
        )
    heads = args.heads_per_rank or (1 if args.attention == "mla" else max(1, total // args.tp))
    fragments = estimated_fragments(args, heads)
    if fragments > MAX_FRAGMENTS:
        explain_parser.fail(
            f"this topology has up to {fragments} copy fragments over its {ranks} ranks "
            f"(at most {MAX_FRAGMENTS} are explained): use fewer ranks, a smaller "
            f"--block-size or a larger --interleave"
        )
    try:
        spec = LayerSpec(
            args.attention,
            args.block_size,
            heads,
            args.head_size,
            args.dtype,
            args.packing,
            args.order,
            per_token_head_scales=args.per_token_head_scales,
        )
        ctx = dict(
            tp_size=args.tp,
            total_kv_heads=total,
            dcp_size=args.dcp,
            pcp_size=args.pcp,
            interleave=args.interleave,
        )
        text = explain(spec, ctx, page_id=args.page_id, width=args.width)
    except ValueError as error:  # LayerSpec / RankContext / TilingError: one line
        explain_parser.fail(str(error))
    print(text)
    return 0


def run() -> int:
    """``main`` for the console (``run_console``: ``| head`` is no error)."""
    return run_console(main)


if __name__ == "__main__":
    sys.exit(run())
