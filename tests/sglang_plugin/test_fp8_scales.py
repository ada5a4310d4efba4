"""fp8 KV's per-tensor scales in the SGLang backend's namespace.

An fp8 byte means ``byte * scale``: two deployments of one model with other k/v scales (a
recalibrated checkpoint, ``--quantization-param-path``, SGLang's default 1.0 against a
checkpoint's) hold the same bytes for other values. SGLang 0.5.23 hands a storage backend no
scale (they live on the model's attention layers, ``RadixAttention.k_scale_float``), so the
backend takes them from ``extra_config.kv_scales``, refuses fp8 without them, and names its
namespace with them as the standalone engine does (``canonical_ops.demo``'s fp8 presets): the
same model and scales share units across engines, other scales never do.
"""

from __future__ import annotations

import pytest
import torch
from sglang_harness import Model, check_pages, group, make_backend, make_pool, sglang_keys, write

from canonical_ops.demo.config import DemoConfig
from canonical_ops.sglang import BackendSetupError
from canonical_ops.units import FileStore

FP8 = Model(name="test/tiny-fp8", dtype=torch.uint8)  # SGLang's host pools hold fp8 as uint8
SCALES = [0.0234375, 0.015625]  # the llama3-8b-fp8 preset's (exact in float32)


def fp8(extra: dict, scales=SCALES, kv_quant: str = "fp8_e4m3") -> dict:
    return {**extra, "kv_quant": kv_quant, "kv_scales": scales}


def refusal(extra: dict, model: Model = FP8) -> str:
    pool = make_pool(model, 1, 0, "page_first")
    with pytest.raises(BackendSetupError) as error:
        make_backend(pool, 1, 0, extra, model_name=model.name)
    return str(error.value)


@pytest.mark.parametrize("kv_quant", ["fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz"])
def test_fp8_without_scales_is_refused_in_one_line(extra, kv_quant):
    message = refusal({**extra, "kv_quant": kv_quant})
    assert message.startswith("extra_config.kv_scales: expected ")
    assert "k_scale_float" in message and "\n" not in message


@pytest.mark.parametrize(
    "scales",
    [
        [0.0, 1.0],
        [1.0, -0.5],
        [float("inf"), 1.0],
        [1.0, float("nan")],
        [1e39, 1.0],  # overflows float32
        [10**400, 1.0],  # a JSON integer beyond any float
        [0.1, 1.0],  # not exact in float32: SGLang holds float32(0.1), another number
        [True, 1.0],
        ["0.5", 1.0],
        [1.0],
        [1.0, 1.0, 1.0],
        1.0,
        {"k": 1.0, "v": 1.0},
        [],
        [[1.0, 1.0]] * 2,  # per layer: the model has 3
        [[1.0, 1.0], [1.0, 1.0], [1.0]],
    ],
)
def test_bad_scales_are_refused_in_one_line(extra, scales):
    message = refusal(fp8(extra, scales))
    assert message.startswith("extra_config.kv_scales: expected "), message
    assert "\n" not in message


def test_scales_without_fp8_are_refused(extra):
    message = refusal({**extra, "kv_scales": SCALES}, Model())
    assert message.startswith("extra_config.kv_scales: ") and "kv_quant" in message
    # fp8 declared over a 2-byte pool: its bytes are not fp8
    message = refusal(fp8(extra), Model())
    assert message.startswith("extra_config.kv_quant: ") and "bfloat16" in message


def test_other_scales_never_share_units(extra):
    ((_, writer),) = group(FP8, 1, "page_first", fp8(extra))
    keys = sglang_keys(FP8)  # hashed by the engine once its backend is attached
    assert write(FP8, [(_, writer)], 1, keys) == [[True] * 3]
    for other in ([SCALES[0], 0.03125], [0.046875, SCALES[1]], [1.0, 1.0]):
        ((_, reader),) = group(FP8, 1, "page_first", fp8(extra, other))
        sglang_keys(FP8)
        assert reader.core.namespace.hex != writer.core.namespace.hex
        assert reader.batch_exists(keys) == 0
    # Another layer's scales differ: another namespace too.
    per_layer = [SCALES, SCALES, [SCALES[0], 0.03125]]
    ((_, reader),) = group(FP8, 1, "page_first", fp8(extra, per_layer))
    assert reader.core.namespace.hex != writer.core.namespace.hex
    # The same scales, as one pair or one per layer: the same units, loaded bit exact.
    for same in (SCALES, [SCALES] * FP8.layers):
        ((pool, reader),) = group(FP8, 1, "layer_first", fp8(extra, same))
        sglang_keys(FP8)
        assert reader.core.namespace.hex == writer.core.namespace.hex
        slots = pool.alloc(len(keys) * FP8.page_size)
        assert reader.batch_get_v1(keys, slots) == [True] * 3
        check_pages(FP8, pool, 1, 0, slots)


def demo_namespace(model: Model, dtype: str, scales, tp: int = 1):
    """The namespace the standalone engine (``canonical_ops.demo``) shares for ``model`` in
    fp8 ``dtype`` with per-tensor ``scales``: split NHD pages, as SGLang's host pools hold."""
    heads, page, dim = model.total_heads, model.page_size, model.head_dim
    cfg = DemoConfig("full", model.layers, heads, dim, dtype, page, "split", "NHD", tp, tp,
                     prompt_blocks=1, device="cpu", model_name=model.name,
                     kv_scales=tuple(scales))  # fmt: skip
    return cfg.namespace("writer")


@pytest.mark.parametrize(
    ("kv_quant", "dtype"),
    [("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2"),
     ("fp8_e4m3fnuz", "float8_e4m3fnuz")],
)  # fmt: skip
def test_the_standalone_engines_fp8_namespace_is_sglangs(extra, kv_quant, dtype):
    engine = demo_namespace(FP8, dtype, SCALES)
    for tp in (1, 2):
        for _, backend in group(FP8, tp, "page_first", fp8(extra, SCALES, kv_quant)):
            assert backend.core.namespace.hex == engine.hex, (tp, kv_quant)
    assert demo_namespace(FP8, dtype, [1.0, 1.0]).hex != engine.hex
    other = "float8_e5m2" if dtype != "float8_e5m2" else "float8_e4m3fn"
    assert demo_namespace(FP8, other, SCALES).hex != engine.hex


def test_sglang_fp8_units_are_the_standalone_engines(extra, store_dir):
    """What SGLang stores at TP=2 is found in the standalone engine's namespace of the same
    scales (the store's own lookup), and in none of other scales."""
    ranks = group(FP8, 2, "page_head", fp8(extra))
    keys = sglang_keys(FP8)
    assert write(FP8, ranks, 2, keys) == [[True] * 3] * 2
    ckeys = [ranks[0][1].core.index.canonical(k) for k in keys]
    with FileStore(str(store_dir), demo_namespace(FP8, "float8_e4m3fn", SCALES)) as store:
        assert store.lookup(ckeys, 0, FP8.layers) == 3
    with FileStore(str(store_dir), demo_namespace(FP8, "float8_e4m3fn", [1.0, 1.0])) as store:
        assert store.lookup(ckeys, 0, FP8.layers) == 0
