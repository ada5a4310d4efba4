"""The demo keys the prompt's blocks with key scheme v2 (vLLM's block hash of the token ids) in
the namespace every engine shares, so units it persists are found by vLLM's tiers and the SGLang
backend keying the same tokens, and the reverse."""

from __future__ import annotations

import numpy as np

from canonical_ops import demo
from canonical_ops.demo import truth
from canonical_ops.units.token_keys import TokenKeyScheme


def _config(*flags: str):
    return demo.build_config(
        demo.build_parser().parse_args(["--prompt-tokens", "128", *flags]), "cpu"
    )


def test_demo_block_keys_are_key_scheme_v2(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    cfg = _config()
    tokens = np.concatenate(
        [truth.prompt_token_ids(cfg, block) for block in range(cfg.prompt_blocks)]
    )
    keys = truth.block_hashes(cfg)
    assert len(keys) == cfg.prompt_blocks == 128 // cfg.block_size
    assert keys == TokenKeyScheme("sha256", cfg.block_size).unit_keys(tokens, cfg.block_size)
    monkeypatch.setenv("PYTHONHASHSEED", "7")  # vLLM's seed rule: other keys
    assert truth.block_hashes(cfg)[0] != keys[0]


def test_demo_namespace_is_the_shared_one():
    cfg = _config("--packing", "split")
    scheme = TokenKeyScheme("sha256", cfg.block_size)
    for role in ("writer", "reader"):
        assert cfg.namespace(role).key_scheme == scheme.describe()
    assert cfg.namespace("writer").hex == cfg.namespace("reader").hex  # TP=4 and TP=2
    hybrid = _config("--preset", "qwen3-next-like", "--store", "/nonexistent")
    assert hybrid.namespace("writer").key_scheme == ""  # state units: the demo's own
