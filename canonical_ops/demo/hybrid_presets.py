"""Hybrid model shapes the demo runs (``--preset``): attention layers plus Mamba / GDN state.

Pure data (imports no torch): the flags parser lists these next to :data:`.presets.PRESETS`.
"""

from __future__ import annotations

from dataclasses import dataclass

from layouts.state import StateSpec


@dataclass(frozen=True)
class HybridPreset:
    """A hybrid model: ``layer_kinds[l]`` is ``"attn"`` or the key of a state spec."""

    layer_kinds: tuple[str, ...]
    kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    states: tuple[tuple[str, StateSpec], ...]

    @property
    def layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def is_state(self) -> list[bool]:
        return [kind != "attn" for kind in self.layer_kinds]

    def state_specs(self) -> list[StateSpec]:
        """Every state layer's spec, model order."""
        by_kind = dict(self.states)
        return [by_kind[kind] for kind in self.layer_kinds if kind != "attn"]

    def describe(self) -> str:
        counts = {kind: self.layer_kinds.count(kind) for kind in dict.fromkeys(self.layer_kinds)}
        parts = [
            f"{n} full attention ({self.kv_heads} KV heads x {self.head_size})"
            if kind == "attn"
            else f"{n} {kind}"
            for kind, n in counts.items()
        ]
        return f"hybrid, {self.layers} layers: {', '.join(parts)}; {self.dtype}, block {self.block_size}"


_QWEN3_NEXT_GDN = StateSpec.gdn(
    num_k_heads=16,
    num_v_heads=32,
    head_k_dim=128,
    head_v_dim=128,
    conv_kernel=4,
    conv_dtype="bfloat16",
    ssm_dtype="bfloat16",
)
_TINY_GDN = StateSpec.gdn(
    num_k_heads=8,
    num_v_heads=16,
    head_k_dim=16,
    head_v_dim=16,
    conv_kernel=4,
    conv_dtype="bfloat16",
    ssm_dtype="float32",
)
_TINY_MAMBA2 = StateSpec.mamba2(
    num_heads=16,
    head_dim=8,
    n_groups=1,
    state_size=16,
    conv_kernel=4,
    conv_dtype="bfloat16",
    ssm_dtype="float32",
)

HYBRID_PRESETS = {
    # Qwen3-Next-80B-A3B's shape: 48 layers, every 4th full attention (2 KV heads of 256),
    # the others gated delta nets (16 key / 32 value heads of 128, conv kernel 4).
    "qwen3-next-like": HybridPreset(
        ("gdn", "gdn", "gdn", "attn") * 12, 2, 256, "bfloat16", 16, (("gdn", _QWEN3_NEXT_GDN),)
    ),
    # Small and mixed: GDN, Mamba2 with one B/C group (replicated on every rank), attention.
    "tiny-hybrid": HybridPreset(
        ("gdn", "mamba2", "gdn", "attn") * 2,
        4,
        32,
        "bfloat16",
        16,
        (("gdn", _TINY_GDN), ("mamba2", _TINY_MAMBA2)),
    ),
}
