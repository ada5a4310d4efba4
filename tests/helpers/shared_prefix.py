"""One prefix, every engine: the prompt, the model and the constants each engine's suite checks.

The vLLM venv has no SGLang and the SGLang venv no vLLM, so the link between the suites is
pinned here: ``UNIT_KEYS_HEX`` are the store keys vLLM 0.33 itself derives for ``PROMPT``
(its ``hash_block_tokens`` chain, sha256, default seed; asserted in
tests/vllm_plugin/test_shared_prefix.py) and ``NAMESPACE_HEX`` the namespace its tier shares;
tests/sglang_plugin/test_shared_prefix.py asserts SGLang's backend derives the same keys and
namespace for the same tokens and model, and each suite checks the bytes against its truth.
The standalone engine's side (:func:`engine_store`, :func:`engine_load`) runs in either venv:
the ops core moves a TP group's caches to and from unit rows, as ``canonical_ops.engine``'s
``OffloadWorker`` does, and a unit store keeps the rows, as its ``StageCache`` does.
"""

from __future__ import annotations

import numpy as np
import torch

import canonical_ops
from canonical_ops.units import FileStore, ModelIdentity, StoreNamespace
from canonical_ops.units.token_keys import DEFAULT_SEED, TokenKeyScheme
from layouts import LayerSpec, RankContext, derive_group_mappings

MODEL_NAME = "test/shared-llama"
LAYERS, HEADS, HEAD_SIZE, BLOCK = 6, 8, 32, 16  # vLLM's tiny llama8 (tests/vllm_plugin)
DTYPE = torch.bfloat16
UNITS = 4
PROMPT = np.random.default_rng([31, 1]).integers(0, 128256, UNITS * BLOCK).tolist()
SCHEME = TokenKeyScheme("sha256", BLOCK, DEFAULT_SEED)

# vLLM 0.33's block hashes of PROMPT (its hash_block_tokens chain, sha256, seed
# "vllm-none-hash"): a unit's key is the offload key of its block, group 0, padded.
BLOCK_HASHES_HEX = (
    "8776b77f4de6060d459aa6c7f788c1c29b29c994e8023b8c08320c5baa630cd1",
    "e7d89a4f247407c4764a2c7262613ad26a4fcd884dcbd4ff8716588fa38ec196",
    "abaaf5b879280e5d948f14a8428e9eb05ea2f2f378f205f3b9c954974b990f63",
    "762efa551c1ed6b818162fc8f6762041270d47784cefdab3184465866c6ed0b2",
)
# The namespace vLLM's canonical tiers share for this model (split NHD pages, bf16, 16 tokens).
NAMESPACE_HEX = "b64c4ff66c00f97637a37b64fb7f4d3ca6e91d5e90ee8233479426f572b05679"


def namespace(
    model_name: str = MODEL_NAME, dtype: str = "bfloat16", tp: int = 1, tokens: int = BLOCK
) -> StoreNamespace:
    """The namespace the standalone engine builds at ``tp`` for this model, shared."""
    spec = LayerSpec("full", tokens, HEADS // tp, HEAD_SIZE, dtype, "split", "NHD")
    ctx = RankContext(tp, HEADS, 0)
    own = StoreNamespace.from_specs(ModelIdentity(model_name), [spec] * LAYERS, ctx)
    return own.shared_prefix(TokenKeyScheme("sha256", BLOCK, SCHEME.seed))


def canonical_unit(truth: list[torch.Tensor], unit: int) -> np.ndarray:
    """The unit every engine stores for ``unit``: each layer's split-NHD canonical page,
    from ``truth[layer]`` of shape (units, 2, tokens, heads, head_size) (K then V)."""
    pages = [t[unit].contiguous().view(torch.uint8).reshape(-1) for t in truth]
    return torch.cat(pages).numpy()


def _heads(tp: int, rank: int) -> slice:
    per = HEADS // tp
    return slice(rank * per, (rank + 1) * per)


def _plan(tp: int, rank: int, caches, rows, tokens: int = BLOCK):
    spec = LayerSpec("full", tokens, HEADS // tp, HEAD_SIZE, "bfloat16", "split", "NHD")
    mapping = derive_group_mappings(spec, tp, HEADS)[rank]
    return canonical_ops.make_plan([mapping] * LAYERS, caches, rows)


def open_store(location: str, ns: StoreNamespace, **options):
    if "://" in location:  # the SGLang venv has no redis client: imported only here
        from canonical_ops.units import RedisStore

        return RedisStore(location, ns, **options)
    return FileStore(location, ns, **options)


def regroup(truth, tokens: int) -> list[torch.Tensor]:
    """``truth`` (units, 2, BLOCK, heads, head_size) per layer as units of ``tokens``."""
    out = []
    for t in truth:
        flat = t.transpose(0, 1).reshape(2, -1, HEADS, HEAD_SIZE)  # (2, all tokens, ...)
        out.append(flat.reshape(2, -1, tokens, HEADS, HEAD_SIZE).transpose(0, 1).contiguous())
    return out


def engine_store(
    location: str, truth, tp: int, units: int = UNITS, tokens: int = BLOCK, **options
) -> None:
    """The standalone engine at ``tp`` stores the prompt's first ``units`` units of
    ``tokens`` tokens (keyed by vLLM's block hashes of BLOCK tokens)."""
    ns = namespace(tp=tp, tokens=tokens)
    rows = torch.zeros(units, ns.total_bytes, dtype=torch.uint8)
    ids = torch.arange(units)
    for rank in range(tp):
        caches = [t[:units, :, :, _heads(tp, rank)].contiguous() for t in regroup(truth, tokens)]
        canonical_ops.store(caches, rows, _plan(tp, rank, caches, rows, tokens), ids, ids)
    keys = SCHEME.unit_keys(PROMPT, tokens)[:units]
    with open_store(location, ns, **options) as store:
        for i, key in enumerate(keys):
            assert store.store(key, 0, rows[i].numpy(), i).status == "ok"


def engine_load(location: str, tp: int, **options) -> tuple[int, list[list[torch.Tensor]]]:
    """The standalone engine at ``tp`` looks the prompt up and loads the prefix found: how
    many units, and each rank's caches (units, 2, tokens, its heads, head_size) per layer."""
    ns = namespace(tp=tp)
    keys = SCHEME.unit_keys(PROMPT, BLOCK)
    rows = torch.zeros(UNITS, ns.total_bytes, dtype=torch.uint8)
    with open_store(location, ns, **options) as store:
        found = store.lookup(keys, 0, LAYERS)
        for i in range(found):
            outcome = store.load(keys[i], 0, LAYERS, rows[i].numpy())
            if outcome.status != "ok":
                found = i
                break
    ids = torch.arange(found)
    out = []
    for rank in range(tp):
        shape = (UNITS, 2, BLOCK, HEADS // tp, HEAD_SIZE)
        caches = [torch.zeros(shape, dtype=DTYPE) for _ in range(LAYERS)]
        canonical_ops.load(caches, rows, _plan(tp, rank, caches, rows), ids, ids)
        out.append([c[:found] for c in caches])
    return found, out


def check_engine_caches(found: int, caches, truth, tp: int) -> None:
    """Each rank's loaded caches are the truth of its heads, bit for bit."""
    for rank, layers in enumerate(caches):
        for layer, got in enumerate(layers):
            want = truth[layer][:found, :, :, _heads(tp, rank)]
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (rank, layer)
