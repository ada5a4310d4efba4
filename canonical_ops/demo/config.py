"""The demo's configuration from the flags, checked (the model, both topologies, --store);
the device and the memory a run needs (refused up front, one line, when absent)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from layouts import KVScales, LayerSpec, RankContext, certification_failure, derive_group_mappings
from layouts.pipeline import pp_layer_ranges
from layouts.quant import QUANTISED_KV_DTYPES
from layouts.state import state_certification_failure

from ..units.redis_url import REDIS_SCHEMES
from ..units.redis_url import redact_url as redact  # every --store is printed through it
from .presets import PRESETS

PROCESS_OVERHEAD_BYTES = 128 << 20  # private memory of one rank process beyond its tensors


@functools.lru_cache(maxsize=8)
def _group_mappings(spec: LayerSpec, tp: int, heads: int) -> tuple:
    return derive_group_mappings(spec, tp, heads)


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

    @property
    def kinds(self) -> tuple[str, ...]:
        """Every layer's kind of a hybrid preset ("attn" or a state kind); () otherwise."""
        return PRESETS[self.preset].kinds if self.preset in PRESETS else ()

    @property
    def kv_layers(self) -> int:
        """Layers with paged KV (a hybrid model's attention layers)."""
        return self.kinds.count("attn") if self.kinds else self.layers

    def state_specs(self) -> list:
        """Every state layer's StateSpec, model order (empty without state)."""
        states = dict(PRESETS[self.preset].states) if self.kinds else {}
        return [states[kind] for kind in self.kinds if kind != "attn"]

    def tp(self, role: str) -> int:
        return self.writer_tp if role == "writer" else self.reader_tp

    def pp(self, role: str) -> int:
        return self.writer_pp if role == "writer" else self.reader_pp

    def stages(self, role: str) -> list[tuple[int, int]]:
        """Model layers ``[first, end)`` of each pipeline stage of ``role`` (vLLM's split)."""
        return pp_layer_ranges(self.layers, self.pp(role))

    def stage_parts(self, role: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """Per stage of ``role``: (its KV layers, its state layers), each counted among its
        own kind (``engine.hybrid.split_stage_layers``; either may be empty)."""
        if not self.kinds:
            return [(stage, (0, 0)) for stage in self.stages(role)]
        from ..engine.hybrid import split_stage_layers

        is_state = [kind != "attn" for kind in self.kinds]
        return [split_stage_layers(is_state, *stage) for stage in self.stages(role)]

    def identity(self):
        """The model identity persisted units are namespaced by (with every layer's geometry)."""
        from ..units import ModelIdentity

        name = self.model_name or f"canonical-kv-demo/{self.preset}"
        return ModelIdentity(name, self.model_revision)

    def global_heads(self, tp: int, rank: int) -> list[int]:
        """The model's KV heads ``rank`` holds, as vLLM shards them: TP divides the heads (a
        contiguous slice each) or is a multiple of them (each head on ``tp // heads``
        consecutive ranks). MLA: the one latent, on every rank."""
        total = self.total_kv_heads
        if self.attention == "mla":
            return [0]
        if total >= tp:
            return list(range(rank * (total // tp), (rank + 1) * (total // tp)))
        return [rank // (tp // total)]

    def heads_per_rank(self, tp: int) -> int:
        return len(self.global_heads(tp, 0))

    def spec(self, tp: int) -> LayerSpec:
        """One rank's KV page; an MLA latent has one layout, (blocks, tokens, latent): NHD."""
        layout = ("packed", "NHD") if self.attention == "mla" else (self.packing, self.order)
        shape = (self.block_size, self.heads_per_rank(tp), self.head_size, self.dtype)
        return LayerSpec(self.attention, *shape, *layout)

    def mappings(self, role: str) -> tuple:
        """Every ``role`` rank's verified mapping of one KV layer (all KV layers alike)."""
        return _group_mappings(self.spec(self.tp(role)), self.tp(role), self.total_kv_heads)

    @property
    def page_bytes(self) -> int:
        """Bytes of one KV layer's canonical page (the same for every certified topology)."""
        return self.mappings("writer")[0].canonical_page_size_bytes

    @property
    def parallelism_agnostic(self) -> bool:
        return all(m.parallelism_agnostic for r in ("writer", "reader") for m in self.mappings(r))

    @property
    def key_scheme(self):
        """Key scheme v2 of the prompt's units (``units.token_keys``): vLLM's sha256 block
        hash with one hash block per page, the seed vLLM's (``PYTHONHASHSEED`` or its default)."""
        from ..units.token_keys import TokenKeyScheme

        return TokenKeyScheme("sha256", self.block_size)

    def namespace(self, role: str):
        """The KV StoreNamespace an engine of ``role``'s topology builds from ALL layers: the
        one every engine shares for the model (``shared_prefix``). A hybrid model's includes
        its state layers (``.state_units()`` keys their units) and is the demo's own."""
        from ..units import StoreNamespace

        tp = self.tp(role)
        ctx, specs = RankContext(tp, self.total_kv_heads, 0), [self.spec(tp)] * self.kv_layers
        if self.kinds:
            from ..engine.hybrid import hybrid_namespace

            return hybrid_namespace(self.identity(), specs, self.state_specs(), ctx)
        if self.kv_scales is None:
            own = StoreNamespace.from_specs(self.identity(), specs, ctx)
        else:  # fp8, per-tensor scales: a reader of other scales (or dtype) misses, never misreads
            k, v = self.kv_scales
            scales = [KVScales("per-tensor", k_scale=k, v_scale=v)] * self.kv_layers
            quant = f"{self.dtype} per-tensor"
            own = StoreNamespace.from_specs(
                self.identity(), specs, ctx, kv_quant=quant, scales=scales
            )
        return own.shared_prefix(self.key_scheme)

    def topology_problem(self, tp: int) -> str | None:
        """Why the model cannot run at TP=``tp`` with certified canonical pages, or None."""
        total = self.total_kv_heads
        contexts = [RankContext(tp, total, rank) for rank in range(tp)]
        if self.attention != "mla" and total % tp and tp % total:
            return (
                f"TP={tp} neither divides the model's {total} KV heads nor is a multiple of "
                f"them, as vLLM requires (certification: "
                f"{certification_failure(self.spec(tp), contexts[0])})"
            )
        for reason in (certification_failure(self.spec(tp), ctx) for ctx in contexts):
            if reason is not None:
                return f"TP={tp} is not certified: {reason}"
        for reason in (state_certification_failure(spec, tp) for spec in self.state_specs()):
            if reason is not None:
                return f"the state cannot be resharded: {reason}"
        return None


def _check_hybrid(args, preset) -> None:
    """What a hybrid preset fixes (its attention layers' shape) or needs (a store)."""
    for flag, value in (("--layers", args.layers), ("--kv-heads", args.kv_heads)):
        if value is not None:
            raise UsageError(f"{flag}: not supported with a hybrid preset ({args.preset})")
    if args.dtype not in (None, preset.dtype):
        raise UsageError(f"--dtype {args.dtype}: the hybrid presets run in {preset.dtype}")
    if (args.packing, args.order) != ("packed", "NHD"):
        raise UsageError("--packing/--order: the hybrid presets run packed NHD")
    if args.device == "cuda":
        raise UsageError("--device cuda: the hybrid presets run their ranks on CPU")
    if not args.store:
        raise UsageError(
            f"--store DIR: a hybrid preset ({args.preset}) runs through a store (a directory "
            "or a redis:// URL): write, then read"
        )


def build_config(args, device: str) -> DemoConfig:
    """The demo's configuration from parsed flags; UsageError for a topology the model lacks."""
    preset, heads = PRESETS[args.preset], args.kv_heads
    if preset.kinds:
        _check_hybrid(args, preset)
    if heads is not None and preset.attention == "mla" and heads != 1:
        raise UsageError(f"--kv-heads {heads}: {args.preset} is MLA (one latent per token)")
    writer, reader = (args.writer_tp, args.writer_pp), (args.reader_tp, args.reader_pp)
    # A persistent phase runs one engine: the other role's flags are not used (a reader
    # neither knows nor needs the topology that wrote the store), so they mirror it.
    if args.store and args.phase != "both":
        writer = reader = writer if args.phase == "write" else reader
    dtype = args.dtype or preset.dtype
    # --dtype of an unquantised type on an fp8 preset: a model without scales
    scales = preset.kv_scales if dtype in QUANTISED_KV_DTYPES else None
    cfg = DemoConfig(
        preset.attention,
        args.layers or preset.layers,
        heads or preset.kv_heads,
        preset.head_size,
        dtype,
        preset.block_size,
        args.packing,
        args.order,
        writer[0],
        reader[0],
        prompt_blocks=-(-args.prompt_tokens // preset.block_size),
        device=device,
        seed=args.seed,
        preset=args.preset,
        writer_pp=writer[1],
        reader_pp=reader[1],
        model_name=args.model_name or "",
        model_revision=args.model_revision,
        kv_scales=scales,
    )
    for flag, tp in (("--writer-tp", cfg.writer_tp), ("--reader-tp", cfg.reader_tp)):
        if (problem := cfg.topology_problem(tp)) is not None:
            raise UsageError(f"{flag} {tp}: {args.preset} cannot run there: {problem}")
    for flag, pp in (("--writer-pp", cfg.writer_pp), ("--reader-pp", cfg.reader_pp)):
        if pp > cfg.layers:
            raise UsageError(
                f"{flag} {pp}: the model has {cfg.layers} layers; a pipeline stage needs at "
                f"least one (expected at most {cfg.layers})"
            )
    return cfg


def tier_kind(location: str) -> str:
    return "files" if "://" not in location else "redis"


@dataclass(frozen=True)
class StorePlan:
    """Where and how the persistent phases keep units (from --store, --phase, ...)."""

    locations: tuple[str, ...]  # directories (absolute) and URLs, in lookup order
    phase: str
    capacity_bytes: int | None
    promote: bool = False  # read engine: copy what came from Redis into the directory

    @property
    def enabled(self) -> bool:
        return bool(self.locations)


def plan_stores(args) -> StorePlan:
    """Check --store, --phase and --store-capacity (UsageError); nothing is opened here."""
    values, locations = args.store or [], []
    if not values and args.phase != "both":
        raise UsageError(
            f"--phase {args.phase}: needs --store DIR (without --store both engines run at "
            "once in shared memory)"
        )
    for value in values:
        scheme = value.split("://", 1)[0].lower() if "://" in value else None
        if scheme is not None and scheme not in REDIS_SCHEMES:
            raise UsageError(
                f"--store {redact(value)}: expected a directory or a redis:// URL, got a "
                f"{scheme}:// URL"
            )
        if not value.strip():
            raise UsageError("--store: expected a directory, got an empty path")
        locations.append(value if scheme else os.path.abspath(value))
    kinds = [tier_kind(location) for location in locations]
    if len(set(kinds)) < len(kinds):
        got = f"{kinds.count('files')} directories and {kinds.count('redis')} URLs"
        raise UsageError(f"--store: expected at most one directory and one redis:// URL, got {got}")
    if args.store_capacity is not None and "files" not in kinds:
        why = " (a Redis server's capacity is its own maxmemory)" if kinds else ""
        raise UsageError(f"--store-capacity: needs --store DIR{why}")
    if args.no_promote and len(kinds) != 2:
        raise UsageError("--no-promote: needs two --store, a directory and a redis:// URL")
    # Nearest first: the local directory, then the shared server (whatever the flag order).
    ordered = tuple(sorted(locations, key=lambda location: tier_kind(location) != "files"))
    promote = len(ordered) > 1 and not args.no_promote
    return StorePlan(ordered, args.phase, args.store_capacity, promote)


def state_bytes(cfg: DemoConfig, first: int, end: int) -> int:
    """Canonical bytes of one request's state in state layers ``[first, end)`` (a unit)."""
    return sum(spec.canonical_bytes for spec in cfg.state_specs()[first:end])


def region_bytes(cfg: DemoConfig, role: str = "writer") -> int:
    """/dev/shm bytes of ``role``'s regions: per stage, its KV rows and its state row."""
    from ..engine.region import HEADER_BYTES

    total = 0
    for (a0, a1), (s0, s1) in cfg.stage_parts(role):
        total += (a1 > a0) * (HEADER_BYTES + cfg.prompt_blocks * (a1 - a0) * cfg.page_bytes)
        total += (s1 > s0) * (HEADER_BYTES + state_bytes(cfg, s0, s1))
    return total


def resolve_device(requested: str) -> str:
    """``auto`` -> cuda or cpu; UsageError for cuda without a GPU or without CUDA kernels
    (and when the compiled extension cannot be loaded)."""
    import torch

    try:
        from canonical_ops._extension import BUILT_WITH_CUDA
    except ImportError as error:
        raise UsageError(str(error)) from None
    gpu = torch.cuda.is_available()
    why = "no CUDA GPU is available" if not gpu else "the extension has no CUDA kernels (no nvcc)"
    if requested == "cuda" and not (gpu and BUILT_WITH_CUDA):
        raise UsageError(f"--device cuda: {why}; use --device cpu or --device auto")
    return requested if requested != "auto" else "cuda" if gpu and BUILT_WITH_CUDA else "cpu"


def check_resources(cfg: DemoConfig, shm_dir: str = "/dev/shm", persistent: bool = False) -> None:
    """Refuse (UsageError) a run that cannot fit, before any O(pages) work: the regions in
    ``shm_dir``'s free space, regions plus the larger group's tensors in available memory (on
    CUDA the KV caches in the GPU's). Disk is not checked: a full store fails stores, counted."""
    hint = "use fewer --prompt-tokens" + ("" if cfg.kinds else " or --layers")

    def check(what: str, need: int, where: str, have: int | None, why: str = "") -> None:
        if have is not None and need > have:
            raise UsageError(
                f"--prompt-tokens {cfg.prompt_tokens}: the {what} need {need / 2**30:.2f} GiB "
                f"but {where} has only {have / 2**30:.2f} GiB free; {hint}{why}"
            )

    size = max(region_bytes(cfg, role) for role in ("writer", "reader")[: 1 + persistent])
    vfs = os.statvfs(shm_dir)
    check("shared regions", size, shm_dir, vfs.f_bavail * vfs.f_frsize, " (docker: --shm-size)")
    kv, host = {}, {}
    for role in ("writer", "reader"):
        tp, page = cfg.tp(role), cfg.spec(cfg.tp(role)).page_size_bytes
        kv[role] = host[role] = 0
        for (a0, a1), (s0, s1) in cfg.stage_parts(role):
            state = state_bytes(cfg, s0, s1)  # two slots per rank, one layer's truth
            truth = 2 * cfg.prompt_blocks * cfg.page_bytes
            kv[role] += tp * (a1 - a0) * cfg.gpu_blocks * page
            host[role] += tp * (PROCESS_OVERHEAD_BYTES + truth + 2 * state // tp) + state
    if cfg.device == "cuda":
        import torch

        check("ranks' KV caches", max(kv.values()), "the GPU", torch.cuda.mem_get_info(0)[0])
    try:  # what the kernel says can be allocated without swapping
        with open("/proc/meminfo") as f:
            line = next(line for line in f if line.startswith("MemAvailable:"))
        available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError, StopIteration):
        available = None
    total = max((0 if cfg.device == "cuda" else kv[role]) + host[role] for role in kv)
    check("regions and the ranks' tensors", size + total, "memory", available)
