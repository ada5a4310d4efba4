"""The prompt and its unsharded KV and state (deterministic in the preset and --seed), the
ranks' caches, and the byte-by-byte comparison of what a rank loaded with that truth."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from layouts.spec import element_size

from ..engine.hybrid import state_shard
from .config import DemoConfig

VOCAB = 128256  # token ids of the prompt are drawn from a Llama-3-sized vocabulary


def prompt_token_ids(cfg: DemoConfig, block: int):
    """Token ids of block ``block`` of the prompt: deterministic in (seed, block)."""
    rng = np.random.default_rng([cfg.seed, 0x70C, block])
    return rng.integers(0, VOCAB, cfg.block_size, dtype=np.int64)


def prompt_tokens(cfg: DemoConfig) -> np.ndarray:
    """Every token id of the prompt, first block first."""
    return np.concatenate([prompt_token_ids(cfg, block) for block in range(cfg.prompt_blocks)])


def block_hashes(cfg: DemoConfig) -> list[bytes]:
    """The prompt's unit keys: key scheme v2 (``cfg.key_scheme``, vLLM's block hash of the
    token ids), so vLLM, SGLang and any engine keying the same tokens find what the demo
    persisted, and the reverse. Model-independent: the namespace keeps models apart."""
    return cfg.key_scheme.unit_keys(prompt_tokens(cfg), cfg.block_size)


def _bits_dtype(cfg: DemoConfig):
    """The integer dtype whose bit patterns stand for the KV dtype's values."""
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[element_size(cfg.dtype)]


def truth_layer(cfg: DemoConfig, layer: int, num_blocks: int | None = None):
    """The unsharded KV of the prompt's first ``num_blocks`` blocks of KV layer ``layer``,
    as bits: (blocks, tokens, heads, 2 * head_size), K then V; MLA (blocks, tokens, latent).
    A block's KV depends on (seed, layer, block) alone, as a real model's on its prefix."""
    bits, blocks = _bits_dtype(cfg), cfg.prompt_blocks if num_blocks is None else num_blocks
    shape = (cfg.block_size, cfg.head_size)  # MLA: the latent
    if cfg.attention != "mla":
        shape = (cfg.block_size, cfg.total_kv_heads, 2 * cfg.head_size)
    low, high = (0, 256) if bits == torch.uint8 else (torch.iinfo(bits).min, torch.iinfo(bits).max)
    truth = torch.empty((blocks, *shape), dtype=bits)
    gen = torch.Generator()
    for block in range(blocks):
        gen.manual_seed(((cfg.seed * 1000003 + layer) * 1000033 + block) % (1 << 63))
        truth[block] = torch.randint(low, high, shape, generator=gen, dtype=bits)
    return truth


def allocate_kv(cfg: DemoConfig, tp: int, device, num_layers: int | None = None) -> list:
    """Per-layer caches in the physical layout of (packing, order), as int bit patterns."""
    heads, bs, hs, n = cfg.heads_per_rank(tp), cfg.block_size, cfg.head_size, cfg.gpu_blocks
    layout = "mla" if cfg.attention == "mla" else f"{cfg.packing} {cfg.order}"
    physical, order = {  # the physical shape, and the permutation to the logical one
        "mla": ((n, bs, hs), (0, 1, 2)),
        "packed NHD": ((n, bs, heads, 2 * hs), (0, 2, 1, 3)),
        "packed HND": ((n, heads, bs, 2 * hs), (0, 1, 2, 3)),
        "split NHD": ((n, 2, bs, heads, hs), (0, 1, 2, 3, 4)),
        "split HND": ((n, 2, heads, bs, hs), (0, 1, 3, 2, 4)),
    }[layout]
    layers = cfg.kv_layers if num_layers is None else num_layers
    bits = _bits_dtype(cfg)
    return [torch.zeros(physical, dtype=bits, device=device).permute(order) for _ in range(layers)]


def from_cache_blocks(cfg: DemoConfig, blocks):
    """Inverse of :func:`shard_of`'s reshape: cache blocks -> (blocks, tokens, heads, 2 * hs)."""
    if cfg.attention == "mla":
        return blocks
    if cfg.packing == "packed":
        return blocks.permute(0, 2, 1, 3)
    return torch.cat([blocks[:, 0], blocks[:, 1]], dim=-1)


def shard_of(cfg: DemoConfig, truth, tp: int, rank: int):
    """This rank's logical view of the truth: its KV heads, shaped like its cache blocks."""
    if cfg.attention == "mla":
        return truth
    logical = truth[:, :, cfg.global_heads(tp, rank)]  # (blocks, tokens, heads, 2 * hs)
    if cfg.packing == "packed":
        return logical.permute(0, 2, 1, 3)  # (blocks, heads, tokens, 2 * hs)
    return torch.stack(logical.split(cfg.head_size, dim=-1), dim=1)  # (blocks, 2, t, h, hs)


def compare_with_truth(cfg: DemoConfig, tp: int, rank: int, kv: Sequence, blocks, first=0) -> dict:
    """Every byte of the rank's loaded blocks of its KV layers (``kv[i]``: layer
    ``first_layer + i``) against the truth: what was checked and the wrong bytes per layer."""
    heads, wrong, checked, slots = cfg.global_heads(tp, rank), {}, 0, set()
    for layer, cache in enumerate(kv, first):
        got = from_cache_blocks(cfg, cache[blocks])
        truth = truth_layer(cfg, layer, len(blocks)).to(got.device)
        expected = truth if cfg.attention == "mla" else truth[:, :, heads]
        slots.add(1 if cfg.attention == "mla" else got.shape[2])
        nbytes = expected.numel() * expected.element_size()
        checked += nbytes
        if got.shape != expected.shape:
            wrong[layer] = nbytes
        elif n := int((got.contiguous().view(torch.uint8) != expected.view(torch.uint8)).sum()):
            wrong[layer] = n
    return dict(
        first_layer=first,
        end_layer=first + len(kv),
        layers=len(kv),
        blocks=len(blocks),
        heads=heads,
        local_head_slots=sorted(slots),
        bytes_checked=checked,
        bytes_wrong_by_layer=wrong,
    )


def block_table(cfg: DemoConfig, salt: int):
    """Scattered cache block ids holding the prompt's blocks (one permutation per group)."""
    gen = torch.Generator().manual_seed(cfg.seed + 7919 * salt)
    return torch.randperm(cfg.gpu_blocks, generator=gen)[: cfg.prompt_blocks]


def state_pairs(cfg: DemoConfig, tp: int, rank: int, states, slot: int) -> list:
    """(slot bytes, truth bytes) of each state tensor of every (StateWorker, source) of
    ``states``: a view of the request's slot ``slot`` and the unsharded state of the layer
    (deterministic in seed and layer) sliced by vLLM's rule (``engine.hybrid.state_shard``)."""
    out, layers = [], [zip(range(s.first, s.end), w.state_caches) for w, s in states]
    for layer, pair in (each for layer_pairs in layers for each in layer_pairs):
        spec, rng = cfg.state_specs()[layer], np.random.default_rng([cfg.seed, 0x57A7E, layer])
        full = {}
        for name, dtype, shape, _ in spec.canonical_layout():
            size = element_size(dtype)
            raw = rng.bytes(size * shape[0] * shape[1] * shape[2])
            full[name] = np.frombuffer(raw, dtype=f"<u{size}").reshape(shape)
        for tensor, data in zip(pair, state_shard(spec, full, tp, rank)):
            want = torch.from_numpy(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
            out.append((tensor[slot].view(torch.uint8).view(-1), want))
    return out


def state_slots(cfg: DemoConfig, tp: int, first: int, end: int) -> list:
    """A rank's state tensors of state layers ``[first, end)``: (conv, ssm), two slots each."""
    pairs = [zip(spec.local_shapes(tp), spec.dtypes) for spec in cfg.state_specs()[first:end]]
    return [tuple(torch.zeros((2, *s), dtype=getattr(torch, d)) for s, d in p) for p in pairs]
