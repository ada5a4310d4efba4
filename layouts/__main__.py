"""`python -m layouts explain ...`: which rank writes which bytes of a canonical page. Arguments
are checked first (a user error is one line, exit 2) and topologies bounded, so an answer takes
seconds; an uncertified topology is explained too (the report says why)."""

from __future__ import annotations

import argparse
import sys
import textwrap

from .cli import CliParser, int_in, lower, run_console, upper
from .explain import explain
from .spec import ATTENTION_KINDS, ORDERS, PACKINGS, LayerSpec, RankContext, dtype_name

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
    """Upper bound of the copy fragments ``derive_group_mappings`` builds for the group: one
    region per non-contiguous (K/V half, head), times the chunks of context parallelism."""
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

    def bounded(flag: str, maximum: int, default: int | None, text: str, minimum: int = 1):
        p.add_argument(flag, type=int_in(minimum, maximum), default=default, help=text)

    kinds = "full attention (K and V per head) or MLA (one latent per token)"
    p.add_argument("--attention", type=lower, choices=ATTENTION_KINDS, default="full", help=kinds)
    total = "KV heads (default: 8 for full attention, 1 for MLA)"
    bounded("--total-kv-heads", MAX_HEADS, None, total)
    bounded("--head-size", MAX_HEAD_SIZE, 128, "elements per head / latent width")
    bounded("--block-size", MAX_BLOCK_SIZE, 16, "tokens per block on each rank")
    dtypes = "KV cache dtype (float32, float16, bfloat16, float8_e4m3fn, ..., or bf16, fp8, ...)"
    p.add_argument("--dtype", type=dtype_arg, default="bfloat16", help=dtypes)
    p.add_argument("--packing", type=lower, choices=PACKINGS, default="packed", help="page packing")
    p.add_argument("--order", type=upper, choices=ORDERS, default="NHD", help="stride order")
    bounded("--tp", MAX_RANKS, 1, "tensor parallel size")
    bounded("--dcp", MAX_RANKS, 1, "decode context parallel size")
    bounded("--pcp", MAX_RANKS, 1, "prefill context parallel size")
    bounded("--interleave", MAX_BLOCK_SIZE, 1, "tokens per context-parallel chunk")
    override = "override (default: max(1, total // tp)); a wrong value fails closed"
    bounded("--heads-per-rank", MAX_HEADS, None, override)
    scales = "quantised with per-(token, head) scales (never certified)"
    p.add_argument("--per-token-head-scales", action="store_true", help=scales)
    bounded("--page-id", (1 << 63) - 1, 0, "which page (writer rotation)", minimum=0)
    bounded("--width", MAX_WIDTH, 64, "columns of the picture")
    return parser, p


def main(argv: list[str] | None = None) -> int:
    parser, explain_parser = build_parser()
    args = parser.parse_args(argv)
    mla = args.attention == "mla"
    if mla and args.total_kv_heads not in (None, 1):
        explain_parser.fail(
            f"argument --total-kv-heads: MLA has one latent (1 KV head), got {args.total_kv_heads}"
        )
    total = 1 if mla else 8 if args.total_kv_heads is None else args.total_kv_heads
    ranks = args.tp * args.pcp
    if ranks > MAX_RANKS:
        explain_parser.fail(
            f"--tp {args.tp} x --pcp {args.pcp} = {ranks} ranks; at most {MAX_RANKS} are explained"
        )
    heads = args.heads_per_rank or (1 if mla else max(1, total // args.tp))
    fragments = estimated_fragments(args, heads)
    if fragments > MAX_FRAGMENTS:
        explain_parser.fail(
            f"this topology has up to {fragments} copy fragments over its {ranks} ranks "
            f"(at most {MAX_FRAGMENTS} are explained): use fewer ranks, a smaller "
            f"--block-size or a larger --interleave"
        )
    fields = ("attention", "block_size", "head_size", "dtype", "packing", "order")
    try:
        spec = LayerSpec(
            num_kv_heads=heads,
            per_token_head_scales=args.per_token_head_scales,
            **{name: getattr(args, name) for name in fields},
        )
        ctx = RankContext(args.tp, total, 0, args.dcp, args.pcp, args.interleave)
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
