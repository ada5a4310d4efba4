"""The demo's configuration: the model and both topologies, from the flags, checked."""

from __future__ import annotations

from dataclasses import dataclass

from layouts import KVScales, LayerSpec, RankContext, certification_failure
from layouts.quant import QUANTISED_KV_DTYPES

from ..engine.cache import pp_layer_ranges
from .presets import PRESETS


class UsageError(Exception):
    """A user error: reported as one line on stderr, exit status 2."""


@dataclass(frozen=True)
class DemoConfig:
    attention: str
    layers: int
    total_kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    packing: str
    order: str
    writer_tp: int
    reader_tp: int
    prompt_blocks: int
    device: str
    seed: int = 0
    preset: str = "custom"
    writer_pp: int = 1
    reader_pp: int = 1
    model_name: str = ""
    model_revision: str = ""
    kv_scales: tuple[float, float] | None = None  # per-tensor (k, v) of a quantised KV dtype

    @property
    def prompt_tokens(self) -> int:
        return self.prompt_blocks * self.block_size

    @property
    def gpu_blocks(self) -> int:
        return self.prompt_blocks + 8  # the prompt's blocks land at scattered block ids

    def tp(self, role: str) -> int:
        return self.writer_tp if role == "writer" else self.reader_tp

    def pp(self, role: str) -> int:
        return self.writer_pp if role == "writer" else self.reader_pp

    def stages(self, role: str) -> list[tuple[int, int]]:
        """Layers ``[first, end)`` of each pipeline stage of ``role``'s engine (vLLM's split)."""
        return pp_layer_ranges(self.layers, self.pp(role))

    def identity(self):
        """The model identity persisted units are namespaced by (with every layer's geometry)."""
        from ..units import ModelIdentity

        return ModelIdentity(
            self.model_name or f"canonical-kv-demo/{self.preset}", self.model_revision
        )

    def global_heads(self, tp: int, rank: int) -> list[int]:
        """The model's KV heads held by ``rank`` of a TP group, in its cache's head order.

        As vLLM shards them: TP divides the heads (each rank holds a contiguous
        slice) or is a multiple of them (each head replicated on ``tp // heads``
        consecutive ranks). MLA: the one latent, on every rank.
        """
        total = self.total_kv_heads
        if self.attention == "mla":
            return [0]
        if total >= tp:
            per_rank = total // tp
            return list(range(rank * per_rank, (rank + 1) * per_rank))
        return [rank // (tp // total)]

    def heads_per_rank(self, tp: int) -> int:
        return len(self.global_heads(tp, 0))

    def spec(self, tp: int) -> LayerSpec:
        # An MLA latent has one layout, (blocks, tokens, latent): described as packed NHD.
        mla = self.attention == "mla"
        return LayerSpec(
            self.attention,
            self.block_size,
            self.heads_per_rank(tp),
            self.head_size,
            self.dtype,
            "packed" if mla else self.packing,
            "NHD" if mla else self.order,
        )

    def namespace(self, role: str):
        """The StoreNamespace an engine of ``role``'s topology builds from ALL layers."""
        from ..units import StoreNamespace

        tp = self.tp(role)
        ctx = RankContext(tp, self.total_kv_heads, 0)
        if self.kv_scales is None:
            return StoreNamespace.from_specs(self.identity(), [self.spec(tp)] * self.layers, ctx)
        # fp8 with per-tensor scales: a reader of other scales (or dtype) misses, never misreads.
        scales = KVScales("per-tensor", k_scale=self.kv_scales[0], v_scale=self.kv_scales[1])
        return StoreNamespace.from_specs(
            self.identity(),
            [self.spec(tp)] * self.layers,
            ctx,
            kv_quant=f"{self.dtype} per-tensor",
            scales=[scales] * self.layers,
        )

    def topology_problem(self, tp: int) -> str | None:
        """Why the model cannot run at TP=``tp`` with certified canonical pages, or None."""
        total = self.total_kv_heads
        if self.attention != "mla" and total % tp and tp % total:
            return (
                f"TP={tp} neither divides the model's {total} KV heads nor is a multiple of "
                f"them, as vLLM requires (certification: "
                f"{certification_failure(self.spec(tp), RankContext(tp, total, 0))})"
            )
        for rank in range(tp):
            reason = certification_failure(self.spec(tp), RankContext(tp, total, rank))
            if reason is not None:
                return f"TP={tp} is not certified: {reason}"
        return None


def build_config(args, device: str) -> DemoConfig:
    """The demo's configuration from parsed flags; UsageError for a topology the model lacks."""
    preset = PRESETS[args.preset]
    heads = getattr(args, "kv_heads", None)
    if heads is not None and preset.attention == "mla" and heads != 1:
        raise UsageError(f"--kv-heads {heads}: {args.preset} is MLA (one latent per token)")
    writer = (args.writer_tp, getattr(args, "writer_pp", 1))
    reader = (args.reader_tp, getattr(args, "reader_pp", 1))
    # A persistent phase runs one engine: the other role's flags are not used (a reader
    # neither knows nor needs the topology that wrote the store), so they mirror it.
    phase = getattr(args, "phase", "both") if getattr(args, "store", None) else "both"
    if phase == "write":
        reader = writer
    elif phase == "read":
        writer = reader
    dtype = getattr(args, "dtype", None) or preset.dtype
    cfg = DemoConfig(
        attention=preset.attention,
        layers=args.layers or preset.layers,
        total_kv_heads=heads or preset.kv_heads,
        head_size=preset.head_size,
        dtype=dtype,
        block_size=preset.block_size,
        packing=args.packing,
        order=args.order,
        writer_tp=writer[0],
        reader_tp=reader[0],
        prompt_blocks=-(-args.prompt_tokens // preset.block_size),
        device=device,
        seed=args.seed,
        preset=args.preset,
        writer_pp=writer[1],
        reader_pp=reader[1],
        model_name=getattr(args, "model_name", None) or "",
        model_revision=getattr(args, "model_revision", ""),
        # --dtype of an unquantised type on an fp8 preset: a model without scales
        kv_scales=preset.kv_scales if dtype in QUANTISED_KV_DTYPES else None,
    )
    for flag, tp in (("--writer-tp", cfg.writer_tp), ("--reader-tp", cfg.reader_tp)):
        problem = cfg.topology_problem(tp)
        if problem is not None:
            raise UsageError(f"{flag} {tp}: {args.preset} cannot run there: {problem}")
    for flag, pp in (("--writer-pp", cfg.writer_pp), ("--reader-pp", cfg.reader_pp)):
        if pp > cfg.layers:
            raise UsageError(
                f"{flag} {pp}: the model has {cfg.layers} layers; a pipeline stage needs at "
                f"least one (expected at most {cfg.layers})"
            )
    return cfg
