"""The prompt and its unsharded KV (deterministic in the preset and --seed), the ranks'
caches, and the byte-by-byte comparison of loaded caches with that truth."""

from __future__ import annotations

from collections.abc import Sequence

from layouts import LayerSpec

from ..units.token_keys import block_keys
from .config import DemoConfig

VOCAB = 128256  # token ids of the prompt are drawn from a Llama-3-sized vocabulary


def prompt_token_ids(cfg: DemoConfig, block: int):
    """Token ids of block ``block`` of the prompt: deterministic in (seed, block)."""
    import numpy as np

    rng = np.random.default_rng([cfg.seed, 0x70C, block])
    return rng.integers(0, VOCAB, cfg.block_size, dtype=np.int64)


def block_hashes(cfg: DemoConfig) -> list[bytes]:
    """The prompt's block keys: the store's engine-independent chain over the token ids.

    ``token_keys.block_keys`` (``h[i] = sha256(h[i-1] || token ids of block i)``,
    little-endian int64, from the documented root), so a block's key names its whole
    prefix and any engine computing keys from the same tokens (the SGLang backend,
    ``canonical_ops.sglang``) finds what this demo persisted. Model-independent: the
    store's namespace keeps models apart.
    """
    import numpy as np

    tokens = np.concatenate([prompt_token_ids(cfg, block) for block in range(cfg.prompt_blocks)])
    return block_keys(tokens, cfg.block_size)


def _bits_dtype(cfg: DemoConfig):
    """The integer dtype whose bit patterns stand for the KV dtype's values."""
    import torch

    elem = LayerSpec("full", 1, 1, 1, cfg.dtype, "packed", "NHD").element_size
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[elem]


def truth_layer(cfg: DemoConfig, layer: int, num_blocks: int | None = None):
    """The unsharded KV of the prompt's first ``num_blocks`` blocks for one layer, as bits.

    Full attention: (blocks, tokens, heads, 2 * head_size) with K then V in the
    last dim; MLA: (blocks, tokens, latent). Each block's KV is deterministic in
    (seed, layer, block) alone, as a real model's is in the block's prefix: a
    shorter or longer prompt has the same KV for the blocks it shares.
    """
    import torch

    bits = _bits_dtype(cfg)
    blocks = cfg.prompt_blocks if num_blocks is None else num_blocks
    if cfg.attention == "mla":
        shape = (cfg.block_size, cfg.head_size)
    else:
        shape = (cfg.block_size, cfg.total_kv_heads, 2 * cfg.head_size)
    info = torch.iinfo(bits)
    low, high = (0, 256) if bits == torch.uint8 else (info.min, info.max)
    truth = torch.empty((blocks, *shape), dtype=bits)
    gen = torch.Generator()
    for block in range(blocks):
        gen.manual_seed(((cfg.seed * 1000003 + layer) * 1000033 + block) % (1 << 63))
        truth[block] = torch.randint(low, high, shape, generator=gen, dtype=bits)
    return truth


def allocate_kv(cfg: DemoConfig, tp: int, device, num_layers: int | None = None) -> list:
    """Per-layer caches in the physical layout of (packing, order), as int bit patterns."""
    import torch

    heads, bs, hs = cfg.heads_per_rank(tp), cfg.block_size, cfg.head_size
    bits = _bits_dtype(cfg)
    caches = []
    for _ in range(cfg.layers if num_layers is None else num_layers):
        n = cfg.gpu_blocks
        if cfg.attention == "mla":
            t = torch.zeros(n, bs, hs, dtype=bits, device=device)
        elif cfg.packing == "packed":
            physical = (n, bs, heads, 2 * hs) if cfg.order == "NHD" else (n, heads, bs, 2 * hs)
            t = torch.zeros(physical, dtype=bits, device=device)
            t = t.permute(0, 2, 1, 3) if cfg.order == "NHD" else t
        else:
            physical = (n, 2, bs, heads, hs) if cfg.order == "NHD" else (n, 2, heads, bs, hs)
            t = torch.zeros(physical, dtype=bits, device=device)
            t = t if cfg.order == "NHD" else t.permute(0, 1, 3, 2, 4)
        caches.append(t)
    return caches


def to_cache_blocks(cfg: DemoConfig, logical):
    """(blocks, tokens, heads, 2 * hs) -> the cache's logical block shape (MLA: unchanged)."""
    import torch

    if cfg.attention == "mla":
        return logical
    if cfg.packing == "packed":
        return logical.permute(0, 2, 1, 3)  # (blocks, heads, tokens, 2 * hs)
    hs = cfg.head_size
    return torch.stack(
        [logical[..., :hs], logical[..., hs:]], dim=1
    )  # (blocks, 2, tokens, heads, hs)


def from_cache_blocks(cfg: DemoConfig, blocks):
    """Inverse of :func:`to_cache_blocks`: cache blocks -> (blocks, tokens, heads, 2 * hs)."""
    import torch

    if cfg.attention == "mla":
        return blocks
    if cfg.packing == "packed":
        return blocks.permute(0, 2, 1, 3)
    return torch.cat([blocks[:, 0], blocks[:, 1]], dim=-1)


def shard_of(cfg: DemoConfig, truth, tp: int, rank: int):
    """This rank's logical view of the truth: its KV heads, shaped like its cache blocks."""
    if cfg.attention == "mla":
        return truth
    return to_cache_blocks(cfg, truth[:, :, cfg.global_heads(tp, rank)])


def compare_with_truth(
    cfg: DemoConfig, tp: int, rank: int, kv: Sequence, blocks, first_layer: int = 0
) -> dict:
    """Every byte of the rank's loaded blocks, every layer it holds, against the truth.

    ``kv[i]`` is layer ``first_layer + i``. Returns what was checked (the layer
    range, blocks, tokens, the global heads of every local head slot) and the
    differing bytes per (global) layer; the coordinator checks that the readers
    together covered every layer and head.
    """
    import torch

    heads = cfg.global_heads(tp, rank)
    wrong: dict[int, int] = {}
    checked = 0
    slots = set()
    for index, cache in enumerate(kv):
        layer = first_layer + index
        got = from_cache_blocks(cfg, cache[blocks])
        truth = truth_layer(cfg, layer, len(blocks)).to(got.device)
        expected = truth if cfg.attention == "mla" else truth[:, :, heads]
        slots.add(1 if cfg.attention == "mla" else got.shape[2])
        nbytes = expected.numel() * expected.element_size()
        checked += nbytes
        if got.shape != expected.shape:
            wrong[layer] = nbytes
            continue
        a = got.contiguous().view(torch.uint8)
        b = expected.contiguous().view(torch.uint8)
        differing = int((a != b).sum())
        if differing:
            wrong[layer] = differing
    return dict(
        first_layer=first_layer,
        end_layer=first_layer + len(kv),
        layers=len(kv),
        blocks=len(blocks),
        tokens=len(blocks) * cfg.block_size,
        heads=heads,
        local_head_slots=sorted(slots),
        bytes_checked=checked,
        bytes_wrong_by_layer=wrong,
    )


def block_table(cfg: DemoConfig, salt: int):
    """Scattered cache block ids holding the prompt's blocks (one permutation per group)."""
    import torch

    gen = torch.Generator().manual_seed(cfg.seed + 7919 * salt)
    return torch.randperm(cfg.gpu_blocks, generator=gen)[: cfg.prompt_blocks]
