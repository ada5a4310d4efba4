"""engine.misses.explain_miss: a reader that misses units another topology of the same model
stored (a layer pinned to the writer's topology, or one this reader cannot certify) is told
which layer and which topologies in one line; other misses are not blamed on the topology."""

from __future__ import annotations

import dataclasses

import pytest

from canonical_ops.engine import explain_miss
from canonical_ops.units import FileStore, ModelIdentity, StoreNamespace
from canonical_ops.units.geometry import LayerTopologyError
from layouts import LayerSpec, RankContext

HEADS, TOKENS, HEAD_SIZE = 8, 16, 32
MODEL = ModelIdentity("test/explain-miss", "r1")


def spec(tp: int, scaled: bool = False) -> LayerSpec:
    """A rank's page at TP=``tp``; per-token-head scales in the page are never certified."""
    return LayerSpec(
        "full", TOKENS, HEADS // tp, HEAD_SIZE, "bfloat16", "packed", "NHD",
        per_token_head_scales=scaled,
    )  # fmt: skip


def namespace(tp: int, model: ModelIdentity = MODEL) -> StoreNamespace:
    """Layer 0 certified, layer 1 stored opaque (pinned to ``tp``)."""
    return StoreNamespace.from_specs(model, [spec(tp), spec(tp, True)], RankContext(tp, HEADS, 0))


def store_one(root, ns: StoreNamespace) -> None:
    with FileStore(root, ns, fsync=False) as store:
        assert store.store(7, 0, bytes(ns.layer_bytes(0, ns.num_layers)), 0).ok


def test_units_pinned_to_the_writers_topology_are_explained_in_one_line(tmp_path):
    store_one(tmp_path, namespace(4))
    reader, ctx = namespace(2), RankContext(2, HEADS, 0)
    with FileStore(tmp_path, reader, fsync=False) as store:
        assert store.lookup([7], 0, 2) == 0  # a miss, never a load
    error = explain_miss(tmp_path, reader, ctx)
    assert isinstance(error, LayerTopologyError)
    assert error.layer == 1 and error.topology == (4, 1, 1, 1)
    message = str(error)
    assert "\n" not in message and message.startswith("layer 1 is stored opaque")
    assert "tp=4, dcp=1, pcp=1, interleave=1" in message and "not at tp=2" in message
    with pytest.raises(LayerTopologyError, match="layer 1 is stored opaque"):
        namespace(4).check_kv_readable(ctx)
    namespace(4).check_kv_readable(RankContext(4, HEADS, 1))  # the writer's topology reads it
    assert explain_miss(tmp_path, namespace(4), RankContext(4, HEADS, 0)) is None  # its own
    # another model, or units never stored anywhere: not a topology issue
    assert explain_miss(tmp_path, namespace(2, ModelIdentity("other")), ctx) is None
    assert explain_miss(tmp_path / "nowhere", reader, ctx) is None


def test_a_reader_that_cannot_certify_a_layer_stored_certified_is_told_why(tmp_path):
    """The other direction: the writer certified layer 1 (parallelism free); the reader's
    topology cannot, so its namespace stores the layer opaque and misses."""
    writer = StoreNamespace.from_specs(MODEL, [spec(2), spec(2)], RankContext(2, HEADS, 0))
    store_one(tmp_path, writer)
    certified = writer.layers[1]
    pinned = dataclasses.replace(certified, opaque=True, topology=(2, 1, 1, 2))
    reader = dataclasses.replace(writer, layers=(writer.layers[0], pinned))
    error = explain_miss(tmp_path, reader, RankContext(2, HEADS, 0, interleave=2))
    assert isinstance(error, LayerTopologyError) and error.layer == 1 and error.topology is None
    assert str(error) == (
        "layer 1 is not parallelism free at tp=2, dcp=1, pcp=1, interleave=2: its units are "
        "stored certified by another topology, readable only where the layer certifies"
    )
    # another dtype of the same model is another model's KV, not a topology issue
    other = dataclasses.replace(pinned, dtype="float16")
    reader = dataclasses.replace(writer, layers=(writer.layers[0], other))
    assert explain_miss(tmp_path, reader, RankContext(2, HEADS, 0, interleave=2)) is None
