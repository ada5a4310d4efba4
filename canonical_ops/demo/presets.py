"""Model shapes the demo runs (``--preset``): add a row to :data:`PRESETS` for a new one."""

from __future__ import annotations

from typing import NamedTuple


class Preset(NamedTuple):
    attention: str
    layers: int
    kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    # Per-tensor (k_scale, v_scale) of an fp8 model: part of the store namespace.
    kv_scales: tuple[float, float] | None = None

    def describe(self) -> str:
        heads = "1 latent" if self.attention == "mla" else f"{self.kv_heads} KV heads"
        scales = (
            f" (per-tensor scales k={self.kv_scales[0]:g}, v={self.kv_scales[1]:g})"
            if self.kv_scales
            else ""
        )
        return (
            f"{self.attention} attention, {self.layers} layers, {heads} x {self.head_size}, "
            f"{self.dtype}{scales}, block {self.block_size}"
        )


PRESETS = {
    "llama3-8b": Preset("full", 32, 8, 128, "bfloat16", 16),
    "llama3-8b-fp8": Preset("full", 32, 8, 128, "float8_e4m3fn", 16, (0.0234375, 0.015625)),
    "llama3-70b": Preset("full", 80, 8, 128, "bfloat16", 16),
    "qwen2-7b": Preset("full", 28, 4, 128, "bfloat16", 16),
    "deepseek-v3": Preset("mla", 61, 1, 576, "bfloat16", 64),
    "tiny": Preset("full", 4, 8, 64, "float16", 16),
}

DTYPES = ("float16", "bfloat16", "float32")
