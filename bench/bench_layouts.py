"""Time to derive and verify canonical mappings for a whole model at every rank.

Two 64-rank groups, 61 layers each (DeepSeek-V3-sized):
  * 8 KV heads, head 128, bf16, block 16, split NHD at TP=8 x PCP=8;
  * an MLA latent (576 wide, bf16, block 64) at TP=16, DCP=8, PCP=4.

Reported per case: the engine-start cost (61 layers, cold caches, every rank's
mapping derived and the group's tiling verified), and the cost of ONE group
derived and verified from scratch (the bound for a model whose 61 layers all
differ: multiply by 61). vLLM 0.33 takes ~0.5 s and ~1.1 s for the model-level
derivation of these two cases on a 2-core dev machine; the goal is < 100 ms.

Usage: python bench/bench_layouts.py [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

from layouts import LayerSpec, derive_group_mappings
from layouts.derive import _verified_group_mappings

NUM_LAYERS = 61
CASES = {
    "gqa8_split_nhd_tp8_pcp8": dict(
        spec=LayerSpec("full", 16, 1, 128, "bfloat16", "split", "NHD"),
        topology=dict(tp_size=8, total_kv_heads=8, dcp_size=1, pcp_size=8, interleave=1),
    ),
    "mla576_b64_tp16_dcp8_pcp4": dict(
        spec=LayerSpec("mla", 64, 1, 576, "bfloat16", "packed", "NHD"),
        topology=dict(tp_size=16, total_kv_heads=1, dcp_size=8, pcp_size=4, interleave=1),
    ),
}


def model_start(spec: LayerSpec, topology: dict) -> float:
    """Seconds to derive + verify all layers at all ranks, caches cold."""
    _verified_group_mappings.cache_clear()
    start = time.perf_counter()
    for layer in range(NUM_LAYERS):
        mappings = derive_group_mappings(spec, **topology, layer_name=f"layers.{layer}.attn")
        assert len(mappings) == topology["tp_size"] * topology["pcp_size"]
    return time.perf_counter() - start


def one_group(spec: LayerSpec, topology: dict) -> float:
    _verified_group_mappings.cache_clear()
    start = time.perf_counter()
    derive_group_mappings(spec, **topology)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="write results here")
    args = parser.parse_args()
    results = {}
    print(
        f"{'case':<28} {'ranks':>5} {'frags/rank':>10} {'61 layers':>11} {'1 group cold':>13}"
        f" {'61 distinct (bound)':>20}"
    )
    for name, case in CASES.items():
        spec, topology = case["spec"], case["topology"]
        start = min(model_start(spec, topology) for _ in range(args.repeats))
        group = min(one_group(spec, topology) for _ in range(args.repeats))
        mappings = derive_group_mappings(spec, **topology)
        frags = len(mappings[0].fragments())
        results[name] = dict(
            ranks=len(mappings),
            fragments_per_rank=frags,
            model_start_s=start,
            one_group_cold_s=group,
            distinct_layers_bound_s=group * NUM_LAYERS,
        )
        print(
            f"{name:<28} {len(mappings):>5} {frags:>10} {start * 1e3:>9.1f}ms"
            f" {group * 1e3:>11.2f}ms {group * NUM_LAYERS * 1e3:>18.1f}ms"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
