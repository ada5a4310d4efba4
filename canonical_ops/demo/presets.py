"""Model shapes the demo runs (``--preset``): add a row to :data:`PRESETS` for a new one.
Pure data (no torch). A hybrid preset names every layer's kind: ``"attn"`` (full attention
of ``kv_heads`` x ``head_size``) or the key of one of its Mamba / GDN state specs."""

from __future__ import annotations

from typing import NamedTuple

from layouts.state import StateSpec


class Preset(NamedTuple):
    attention: str
    layers: int
    kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    kv_scales: tuple[float, float] | None = None  # per-tensor (k, v) of fp8: in the namespace
    kinds: tuple[str, ...] = ()  # hybrid: every layer's kind (() = every layer attention)
    states: tuple[tuple[str, StateSpec], ...] = ()  # hybrid: (kind, its state spec) pairs

    def describe(self) -> str:
        heads = "1 latent" if self.attention == "mla" else f"{self.kv_heads} KV heads"
        if self.kinds:  # "hybrid, 48 layers: 36 gdn, 12 full attention (2 KV heads x 256); ..."
            attn = f"full attention ({heads} x {self.head_size})"
            count = {kind: self.kinds.count(kind) for kind in dict.fromkeys(self.kinds)}
            parts = ", ".join(f"{n} {attn if k == 'attn' else k}" for k, n in count.items())
            return f"hybrid, {self.layers} layers: {parts}; {self.dtype}, block {self.block_size}"
        k, v = self.kv_scales or (0, 0)
        scales = f" (per-tensor scales k={k:g}, v={v:g})" if self.kv_scales else ""
        return (
            f"{self.attention} attention, {self.layers} layers, {heads} x {self.head_size}, "
            f"{self.dtype}{scales}, block {self.block_size}"
        )


def _hybrid(pattern: tuple[str, ...], repeat: int, kv_heads: int, head: int, **states) -> Preset:
    """A bf16, block-16 hybrid model whose layers repeat ``pattern``."""
    kinds, states = pattern * repeat, tuple(states.items())
    return Preset("full", len(kinds), kv_heads, head, "bfloat16", 16, None, kinds, states)


def _gdn(k_heads: int, v_heads: int, head: int, ssm_dtype: str) -> StateSpec:
    return StateSpec.gdn(
        num_k_heads=k_heads,
        num_v_heads=v_heads,
        head_k_dim=head,
        head_v_dim=head,
        conv_kernel=4,
        conv_dtype="bfloat16",
        ssm_dtype=ssm_dtype,
    )


_MAMBA2 = StateSpec.mamba2(
    num_heads=16,
    head_dim=8,
    n_groups=1,
    state_size=16,
    conv_kernel=4,
    conv_dtype="bfloat16",
    ssm_dtype="float32",
)

_QWEN_GDN, _GDN = _gdn(16, 32, 128, "bfloat16"), _gdn(8, 16, 16, "float32")

PRESETS = {
    "llama3-8b": Preset("full", 32, 8, 128, "bfloat16", 16),
    "llama3-8b-fp8": Preset("full", 32, 8, 128, "float8_e4m3fn", 16, (0.0234375, 0.015625)),
    "llama3-70b": Preset("full", 80, 8, 128, "bfloat16", 16),
    "qwen2-7b": Preset("full", 28, 4, 128, "bfloat16", 16),
    "deepseek-v3": Preset("mla", 61, 1, 576, "bfloat16", 64),
    "tiny": Preset("full", 4, 8, 64, "float16", 16),
    # Qwen3-Next-80B-A3B's shape: 48 layers, every 4th full attention (2 KV heads of 256),
    # the others gated delta nets (16 key / 32 value heads of 128, conv kernel 4).
    "qwen3-next-like": _hybrid(("gdn",) * 3 + ("attn",), 12, 2, 256, gdn=_QWEN_GDN),
    # Small and mixed: GDN, Mamba2 with one B/C group (replicated on every rank), attention.
    "tiny-hybrid": _hybrid(("gdn", "mamba2", "gdn", "attn"), 2, 4, 32, gdn=_GDN, mamba2=_MAMBA2),
}

DTYPES = ("float16", "bfloat16", "float32")
