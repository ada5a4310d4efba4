"""Typed wrappers and fake (meta) kernels of torch.ops.canonical.canonical_store / _load."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import _extension  # noqa: F401  (registers torch.ops.canonical)
from .checks import check_ids, check_int

__all__ = [
    "CanonicalTransferError",
    "check_device_errors",
    "check_unique_ids",
    "load",
    "set_sm_budget",
    "store",
    "transfer_error",
]

# Words of a device-error record (plan.h ErrorRecordField): block-id flag, page-id flag,
# index + 1 of one refused pair, reserved.
ERROR_RECORD_WORDS = 4


class CanonicalTransferError(RuntimeError):
    """A CUDA transfer refused pairs (out-of-range device ids); nothing was touched for them."""


IdsLike = torch.Tensor | Sequence[int] | np.ndarray


def check_unique_ids(name: str, ids: np.ndarray, what: str) -> None:
    """Raise ValueError if an id appears twice in ``ids`` (host int64, 1-D).

    The destinations of one call (page ids of a store, block ids of a load) must be
    distinct: two copies into one destination would leave an undefined mix of two
    sources. Sources may repeat.
    """
    if ids.size < 2:
        return
    order = np.argsort(ids, kind="stable")
    same = np.flatnonzero(ids[order[1:]] == ids[order[:-1]])
    if same.size:
        first, second = int(order[same[0]]), int(order[same[0] + 1])
        raise ValueError(
            f"{name}[{first}] and {name}[{second}] are both {int(ids[first])}: expected "
            f"distinct {what}"
        )


def _as_ids(name: str, ids: IdsLike, device: torch.device, destination: str | None) -> torch.Tensor:
    """Integer ids as an int64 tensor (lists and arrays moved to ``device``); floats,
    bools and strings raise TypeError rather than being rounded. ``destination``: ids
    that must be distinct (checked here for lists and arrays; the op checks host
    tensors; device tensors cannot be checked without a sync)."""
    checked = check_ids(name, ids)
    if isinstance(checked, torch.Tensor):
        return checked
    if destination is not None:
        check_unique_ids(name, checked, destination)
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
        Integer ids only (floats, bools, strings raise TypeError). Page ids must be
        distinct (ValueError); device-resident page ids cannot be checked without a
        sync: a repeated one leaves that page an undefined mix of its sources.
    """
    _call(True, kv_caches, cpu_pages, plan, block_ids, page_ids)


def load(
    kv_caches: Sequence[torch.Tensor],
    cpu_pages: torch.Tensor,
    plan: torch.Tensor,
    block_ids: IdsLike,
    page_ids: IdsLike,
) -> None:
    """Copy canonical pages ``page_ids`` into blocks ``block_ids`` of every layer.

    Every byte of each block's local page is written; see :func:`store` for the
    arguments. Block ids must be distinct (the destinations); page ids may repeat.
    """
    _call(False, kv_caches, cpu_pages, plan, block_ids, page_ids)


def _call(store: bool, kv_caches, cpu_pages, plan, block_ids, page_ids) -> None:
    op = torch.ops.canonical.canonical_store if store else torch.ops.canonical.canonical_load
    blocks = None if store else "block ids in a load (destinations)"
    pages = "page ids in a store (destinations)" if store else None
    block_ids = _as_ids("block_ids", block_ids, plan.device, blocks)
    op(
        list(kv_caches),
        cpu_pages,
        plan,
        block_ids,
        _as_ids("page_ids", page_ids, plan.device, pages),
    )


def transfer_error(
    record: Sequence[int],
    block_ids: np.ndarray | None = None,
    page_ids: np.ndarray | None = None,
) -> CanonicalTransferError | None:
    """The error a device-error record describes (None if it records nothing).

    ``record``: the ERROR_RECORD_WORDS words (block-id flag, page-id flag, refused pair
    + 1, reserved). ``block_ids`` / ``page_ids``: the call's ids on the host, when known,
    to name the refused pair's ids.
    """
    block_flag, page_flag, pair_plus_one = (int(v) for v in record[:3])
    if not (block_flag or page_flag):
        return None
    what = " and ".join(
        name for flag, name in ((block_flag, "block id"), (page_flag, "page id")) if flag
    )
    pair = pair_plus_one - 1
    ids = ""
    if block_ids is not None and page_ids is not None and 0 <= pair < len(block_ids):
        ids = f" (block_ids[{pair}] = {int(block_ids[pair])}, page_ids[{pair}] = {int(page_ids[pair])})"
    return CanonicalTransferError(
        f"a canonical transfer refused out-of-range {what}(s); one refused pair: {pair}{ids}. "
        f"Refused pairs were not copied (in any layer); the other pairs of that call were."
    )


def check_device_errors(plan: torch.Tensor) -> None:
    """Raise if a CUDA kernel using ``plan`` refused an out-of-range device id.

    Call after synchronising with the transfers (e.g. ``torch.cuda.synchronize()``):
    the record lives in mapped pinned host memory, so this is a plain host read (no
    CUDA call, nothing queued on any stream); it then clears the record. One record
    per plan, shared by every stream using the plan: the offload workers give each
    kernel its own record instead (:class:`canonical_ops.transfer.ErrorRecords`). A no-op for CPU plans (their
    ids are checked before the copy).
    """
    error = transfer_error(torch.ops.canonical._plan_error(plan))
    if error is not None:
        raise error


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
