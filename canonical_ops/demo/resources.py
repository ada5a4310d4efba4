"""The device and the memory a run needs: refused up front (UsageError) when absent."""

from __future__ import annotations

import os

from .config import DemoConfig, UsageError
from .geometry import Geometry, region_bytes
from .ranks import PLAIN_COPY_CAP_BYTES

PROCESS_OVERHEAD_BYTES = 128 << 20  # private memory of one rank process beyond its tensors
SHM_DIR = "/dev/shm"


def resolve_device(requested: str) -> str:
    """``auto`` -> cuda or cpu; UsageError for cuda without a GPU or without CUDA kernels."""
    import torch

    try:
        from canonical_ops._extension import BUILT_WITH_CUDA
    except ImportError as error:
        raise UsageError(str(error)) from None
    gpu = torch.cuda.is_available()
    if requested == "auto":
        return "cuda" if gpu and BUILT_WITH_CUDA else "cpu"
    if requested == "cuda" and not gpu:
        raise UsageError(
            "--device cuda: no CUDA GPU is available (torch.cuda.is_available() is False); "
            "use --device cpu or --device auto"
        )
    if requested == "cuda" and not BUILT_WITH_CUDA:
        raise UsageError(
            "--device cuda: the extension was built without its CUDA kernels (no nvcc at "
            "build time); rebuild it with nvcc, or use --device cpu"
        )
    return requested


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def rank_tensor_bytes(cfg: DemoConfig, geometry: Geometry, tp: int, layers: int) -> tuple[int, int]:
    """(KV cache bytes, transient bytes) of one rank holding ``layers`` layers: caches, one
    layer's truth, plain copy."""
    kv = layers * cfg.gpu_blocks * cfg.spec(tp).page_size_bytes
    truth = 2 * cfg.prompt_blocks * geometry.canonical_page_bytes  # truth + its shard
    moved = layers * cfg.prompt_blocks * cfg.spec(tp).page_size_bytes
    return kv, truth + 2 * min(moved, PLAIN_COPY_CAP_BYTES)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_resources(
    cfg: DemoConfig, geometry: Geometry, shm_dir: str = SHM_DIR, persistent: bool = False
) -> None:
    """Refuse (UsageError) a run that cannot fit, before any O(pages) work.

    The regions must fit in ``shm_dir``'s free space (shared memory: the
    writers' regions, which the readers attach; persistent: one engine's at a
    time); the regions plus the larger group's caches and transients must fit
    in available memory (host memory on CPU; on CUDA the caches must fit in the
    GPU's free memory). Disk space is not checked: a full store fails stores
    cleanly (counted), which is the engine's behaviour to show.
    """
    roles = ("writer", "reader")
    size = (
        max(region_bytes(cfg, geometry, role) for role in roles)
        if persistent
        else (region_bytes(cfg, geometry, "writer"))
    )
    vfs = os.statvfs(shm_dir)
    free = vfs.f_bavail * vfs.f_frsize
    hint = "use fewer --prompt-tokens or --layers"
    if size > free:
        raise UsageError(
            f"--prompt-tokens {cfg.prompt_tokens}: the shared regions need {_gib(size)} but "
            f"{shm_dir} has only {_gib(free)} free; {hint} (docker: --shm-size)"
        )
    kv, transient = {}, {}
    for role in roles:
        tp = cfg.tp(role)
        per_kv = per_transient = 0
        for first, end in cfg.stages(role):
            stage_kv, stage_transient = rank_tensor_bytes(cfg, geometry, tp, end - first)
            per_kv += tp * stage_kv
            per_transient += tp * (stage_transient + PROCESS_OVERHEAD_BYTES)
        kv[role], transient[role] = per_kv, per_transient
    if cfg.device == "cuda":
        import torch

        gpu_free, _ = torch.cuda.mem_get_info(0)
        gpu_need = max(kv.values())
        if gpu_need > gpu_free:
            raise UsageError(
                f"--prompt-tokens {cfg.prompt_tokens}: the ranks' KV caches need "
                f"{_gib(gpu_need)} of GPU memory but only {_gib(gpu_free)} is free; {hint}"
            )
        host_need = size + max(transient.values())
    else:
        host_need = size + max(kv[role] + transient[role] for role in roles)
    available = _mem_available()
    if available is not None and host_need > available:
        raise UsageError(
            f"--prompt-tokens {cfg.prompt_tokens}: the regions and the ranks' tensors need "
            f"about {_gib(host_need)} of memory but only {_gib(available)} is available; {hint}"
        )
