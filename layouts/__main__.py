"""`python -m layouts explain ...`: which rank writes which bytes of a canonical page."""

from __future__ import annotations

import argparse
import sys

from .explain import explain
from .spec import LayerSpec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m layouts")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("explain", help="picture one canonical page of one layer")
    p.add_argument("--attention", choices=["full", "mla"], default="full")
    p.add_argument(
        "--total-kv-heads", type=int, default=8, help="KV heads of the model (1 for MLA)"
    )
    p.add_argument("--head-size", type=int, default=128, help="elements per head / latent width")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block on each rank")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--packing", choices=["packed", "split"], default="packed")
    p.add_argument("--order", choices=["NHD", "HND"], default="NHD")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dcp", type=int, default=1)
    p.add_argument("--pcp", type=int, default=1)
    p.add_argument("--interleave", type=int, default=1)
    p.add_argument(
        "--heads-per-rank",
        type=int,
        default=None,
        help="override (default: max(1, total // tp)); a wrong value fails closed",
    )
    p.add_argument("--per-token-head-scales", action="store_true")
    p.add_argument("--page-id", type=int, default=0, help="which page (writer rotation)")
    p.add_argument("--width", type=int, default=64, help="columns of the picture")
    args = parser.parse_args(argv)

    total = 1 if args.attention == "mla" else args.total_kv_heads
    heads = args.heads_per_rank or (1 if args.attention == "mla" else max(1, total // args.tp))
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
        print(explain(spec, ctx, page_id=args.page_id, width=args.width))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
