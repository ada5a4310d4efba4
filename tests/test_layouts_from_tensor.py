"""LayerSpec.from_tensor recognises packing and order from shapes and strides."""

import numpy as np
import pytest

from layouts import LayerSpec

torch = pytest.importorskip("torch")

NB, HEADS, BS, HS = 3, 4, 16, 8


def tensors(dtype=torch.bfloat16):
    return {
        ("packed", "NHD"): torch.empty(NB, BS, HEADS, 2 * HS, dtype=dtype).permute(0, 2, 1, 3),
        ("packed", "HND"): torch.empty(NB, HEADS, BS, 2 * HS, dtype=dtype),
        ("split", "NHD"): torch.empty(NB, 2, BS, HEADS, HS, dtype=dtype),
        ("split", "HND"): torch.empty(NB, 2, HEADS, BS, HS, dtype=dtype).permute(0, 1, 3, 2, 4),
    }


@pytest.mark.parametrize(("packing", "order"), sorted(tensors()))
def test_recognised(packing: str, order: str) -> None:
    spec = LayerSpec.from_tensor(
        tensors()[packing, order], attention="full", block_size=BS, num_kv_heads=HEADS, head_size=HS
    )
    assert (spec.packing, spec.order, spec.dtype) == (packing, order, "bfloat16")
    assert spec.page_size_bytes == HEADS * BS * 2 * HS * 2


def test_numpy_arrays_use_byte_strides() -> None:
    array = np.empty((NB, 2, BS, HEADS, HS), dtype=np.float16)
    spec = LayerSpec.from_tensor(
        array, attention="full", block_size=BS, num_kv_heads=HEADS, head_size=HS
    )
    assert (spec.packing, spec.order, spec.dtype) == ("split", "NHD", "float16")


@pytest.mark.parametrize(
    "tensor",
    [
        torch.empty(NB, HEADS, BS, 2 * HS + 2)[..., : 2 * HS],  # padded rows
        torch.empty(NB, BS, 2 * HS, HEADS).permute(0, 3, 1, 2),  # head dim innermost
        torch.empty(NB, 2 * HS, BS, HEADS).permute(0, 3, 2, 1),  # inner stride != 1
        torch.empty(NB, BS, 2, HEADS, HS).permute(0, 2, 1, 3, 4),  # halves not outermost
        torch.empty(NB, HEADS, BS, HS),  # wrong shape
    ],
)
def test_unrecognised_returns_none(tensor) -> None:
    assert (
        LayerSpec.from_tensor(
            tensor, attention="full", block_size=BS, num_kv_heads=HEADS, head_size=HS
        )
        is None
    )


def test_mla_latent_rows() -> None:
    latent = torch.empty(NB, BS, 576, dtype=torch.bfloat16)
    spec = LayerSpec.from_tensor(
        latent, attention="mla", block_size=BS, num_kv_heads=1, head_size=576
    )
    assert spec.attention == "mla" and spec.page_size_bytes == BS * 1152
    assert (
        LayerSpec.from_tensor(
            latent.transpose(1, 2), attention="mla", block_size=BS, num_kv_heads=1, head_size=576
        )
        is None
    )
