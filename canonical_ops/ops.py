"""Typed wrappers and fake (meta) kernels of torch.ops.canonical.canonical_store / _load."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import _extension  # noqa: F401  (registers torch.ops.canonical)
from .checks import check_ids, check_int

__all__ = ["CanonicalTransferError", "check_device_errors", "load", "set_sm_budget", "store"]


class CanonicalTransferError(RuntimeError):
    """A CUDA transfer refused work items (out-of-range device ids); nothing was touched for them."""


IdsLike = torch.Tensor | Sequence[int] | np.ndarray


def _as_ids(name: str, ids: IdsLike, device: torch.device) -> torch.Tensor:
    """Integer ids as an int64 tensor (lists and arrays moved to ``device``); floats,
    bools and strings raise TypeError rather than being rounded."""
    checked = check_ids(name, ids)
    if isinstance(checked, torch.Tensor):
        return checked
    return torch.from_numpy(np.ascontiguousarray(checked)).to(device)


def store(
    kv_caches: Sequence[torch.Tensor],
    cpu_pages: torch.Tensor,
    plan: torch.Tensor,
    block_ids: IdsLike,
    page_ids: IdsLike,
) -> None:
    """Copy blocks ``block_ids`` of every layer into canonical pages ``page_ids``.

    Only the bytes this rank is an elected writer of (``mapping.is_writer(page)``)
    are written. Asynchronous on CUDA (current stream).

    Parameters
    ----------
    kv_caches : sequence of torch.Tensor, one per layer, (num_blocks, ...).
    cpu_pages : torch.Tensor, uint8 (num_rows, row_bytes); pinned for CUDA kv caches.
    plan : torch.Tensor from :func:`canonical_ops.make_plan` for these tensors.
    block_ids, page_ids : int64 (n,), on the kv device (or pinned CPU for CUDA).
    """
    device = plan.device
    torch.ops.canonical.canonical_store(
        list(kv_caches),
        cpu_pages,
        plan,
        _as_ids("block_ids", block_ids, device),
        _as_ids("page_ids", page_ids, device),
    )


def load(
    kv_caches: Sequence[torch.Tensor],
    cpu_pages: torch.Tensor,
    plan: torch.Tensor,
    block_ids: IdsLike,
    page_ids: IdsLike,
) -> None:
    """Copy canonical pages ``page_ids`` into blocks ``block_ids`` of every layer.

    Every byte of each block's local page is written; see :func:`store` for the
    arguments.
    """
    device = plan.device
    torch.ops.canonical.canonical_load(
        list(kv_caches),
        cpu_pages,
        plan,
        _as_ids("block_ids", block_ids, device),
        _as_ids("page_ids", page_ids, device),
    )


def check_device_errors(plan: torch.Tensor) -> None:
    """Raise if a CUDA kernel using ``plan`` refused an out-of-range device id.

    Call after synchronising with the transfers (e.g. when a job is waited
    on); clears the error. A no-op for CPU plans (their ids are checked before
    the copy).
    """
    code, pair, block_id, page_id = torch.ops.canonical._plan_error(plan)
    if code:
        what = " and ".join(name for bit, name in ((1, "block id"), (2, "page id")) if code & bit)
        raise CanonicalTransferError(
            f"a canonical transfer refused out-of-range {what}(s); first: pair {pair - 1} "
            f"(block_ids = {block_id}, page_ids = {page_id}). The refused fragments were not "
            f"copied; other pairs of that call were."
        )


def set_sm_budget(sms: int) -> int:
    """Limit CUDA transfers to ``sms`` SMs' worth of thread blocks; returns the previous budget.

    Default 8 (or the CANONICAL_KV_SM_BUDGET environment variable).
    """
    return int(torch.ops.canonical._set_sm_budget(check_int("sms", sms, minimum=1, maximum=4096)))


def _check_fake(kv_caches, cpu_pages, plan, block_ids, page_ids) -> None:
    # Metadata-only checks, mirroring the eager kernels' exception types, so a
    # traced call fails like an eager one. Runs for fake tensors while tracing
    # and for real meta tensors (which must not silently skip a device check).
    if not kv_caches:
        raise ValueError("kv_caches: expected one tensor per layer, got none")
    device = kv_caches[0].device
    all_meta = all(
        t.device.type == "meta" for t in (*kv_caches, cpu_pages, plan, block_ids, page_ids)
    )
    if not all_meta:
        for layer, kv in enumerate(kv_caches):
            if kv.device != device:
                raise ValueError(
                    f"kv_caches[{layer}]: expected a tensor on {device} like kv_caches[0], "
                    f"got {kv.device}"
                )
        if plan.device != device:
            raise ValueError(
                f"plan: expected a tensor on {device} (the kv_caches device), got {plan.device}"
            )
        if cpu_pages.device.type != "cpu":
            raise ValueError(f"cpu_pages: expected a CPU tensor, got {cpu_pages.device}")
        for name, ids in (("block_ids", block_ids), ("page_ids", page_ids)):
            if ids.device != device and ids.device.type != "cpu":
                raise ValueError(f"{name}: expected a tensor on {device} or CPU, got {ids.device}")
    if cpu_pages.dtype != torch.uint8:
        raise TypeError(f"cpu_pages: expected dtype uint8, got {cpu_pages.dtype}")
    if cpu_pages.dim() != 2:
        raise ValueError(
            f"cpu_pages: expected a 2-D (rows, row_bytes) tensor, got {cpu_pages.dim()}-D"
        )
    if plan.dtype != torch.int64:
        raise TypeError(f"plan: expected dtype int64, got {plan.dtype}")
    if plan.dim() != 1:
        raise ValueError("plan: expected a 1-D tensor from canonical_ops.make_plan")
    for name, ids in (("block_ids", block_ids), ("page_ids", page_ids)):
        if ids.dtype != torch.int64:
            raise TypeError(f"{name}: expected dtype int64, got {ids.dtype}")
        if ids.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor, got {ids.dim()}-D")
    if block_ids.shape[0] != page_ids.shape[0]:
        raise ValueError(
            f"page_ids: expected as many ids as block_ids ({block_ids.shape[0]}), "
            f"got {page_ids.shape[0]}"
        )


@torch.library.register_fake("canonical::canonical_store")
def _canonical_store_fake(kv_caches, cpu_pages, plan, block_ids, page_ids) -> None:
    _check_fake(kv_caches, cpu_pages, plan, block_ids, page_ids)


@torch.library.register_fake("canonical::canonical_load")
def _canonical_load_fake(kv_caches, cpu_pages, plan, block_ids, page_ids) -> None:
    _check_fake(kv_caches, cpu_pages, plan, block_ids, page_ids)
