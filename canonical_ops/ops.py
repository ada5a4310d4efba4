"""Typed wrappers and fake (meta) kernels of torch.ops.canonical.canonical_store / _load."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import _extension  # noqa: F401  (registers torch.ops.canonical)

__all__ = ["CanonicalTransferError", "check_device_errors", "load", "set_sm_budget", "store"]


class CanonicalTransferError(RuntimeError):
    """A CUDA transfer refused work items (out-of-range device ids); nothing was touched for them."""


IdsLike = torch.Tensor | Sequence[int] | np.ndarray


def _as_ids(ids: IdsLike, device: torch.device) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        return ids
    return torch.as_tensor(np.asarray(ids, dtype=np.int64)).to(device)


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
        list(kv_caches), cpu_pages, plan, _as_ids(block_ids, device), _as_ids(page_ids, device)
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
        list(kv_caches), cpu_pages, plan, _as_ids(block_ids, device), _as_ids(page_ids, device)
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
    return int(torch.ops.canonical._set_sm_budget(sms))


def _check_fake(kv_caches, cpu_pages, plan, block_ids, page_ids) -> None:
    # Metadata-only checks: what can be known without data (tracing, meta tensors).
    if not kv_caches:
        raise ValueError("kv_caches: expected one tensor per layer, got none")
    if cpu_pages.dtype != torch.uint8 or cpu_pages.dim() != 2:
        raise ValueError("cpu_pages: expected a uint8 (rows, row_bytes) tensor")
    if plan.dtype != torch.int64 or plan.dim() != 1:
        raise ValueError("plan: expected a 1-D int64 tensor from canonical_ops.make_plan")
    for name, ids in (("block_ids", block_ids), ("page_ids", page_ids)):
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D int64 tensor")


@torch.library.register_fake("canonical::canonical_store")
def _canonical_store_fake(kv_caches, cpu_pages, plan, block_ids, page_ids) -> None:
    _check_fake(kv_caches, cpu_pages, plan, block_ids, page_ids)


@torch.library.register_fake("canonical::canonical_load")
def _canonical_load_fake(kv_caches, cpu_pages, plan, block_ids, page_ids) -> None:
    _check_fake(kv_caches, cpu_pages, plan, block_ids, page_ids)
