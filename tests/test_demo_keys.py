"""The demo keys the prompt's blocks with the store's engine-independent token-key chain, so
units it persists are found by any engine hashing the same tokens (the SGLang backend)."""

from __future__ import annotations

import numpy as np

from canonical_ops import demo
from canonical_ops.demo import truth
from canonical_ops.units.token_keys import block_keys


def test_demo_block_keys_are_token_keys():
    cfg = demo.build_config(demo.build_parser().parse_args(["--prompt-tokens", "128"]), "cpu")
    tokens = np.concatenate(
        [truth.prompt_token_ids(cfg, block) for block in range(cfg.prompt_blocks)]
    )
    keys = truth.block_hashes(cfg)
    assert len(keys) == cfg.prompt_blocks == 128 // cfg.block_size
    assert keys == block_keys(tokens.tolist(), cfg.block_size)
    assert keys[0] != block_keys(tokens.tolist(), cfg.block_size, salt=b"tenant")[0]
