"""Typed wrappers and fake (meta) kernels of torch.ops.canonical.canonical_store / _load."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

import canonical_ops._extension  # noqa: F401  (registers torch.ops.canonical)

from .checks import check_ids, check_int

__all__ = ["CanonicalTransferError", "check_device_errors", "check_unique_ids", "load"]
__all__ += ["set_sm_budget", "store", "transfer_error"]

# Words of a device-error record (plan.h ErrorRecordField): block-id flag, page-id flag,
# index + 1 of one refused pair, reserved.
ERROR_RECORD_WORDS = 4


class CanonicalTransferError(RuntimeError):
    """A CUDA transfer refused pairs (out-of-range device ids); nothing was touched for them."""


IdsLike = torch.Tensor | Sequence[int] | np.ndarray


def check_unique_ids(name: str, ids: np.ndarray, what: str) -> None:
    """Raise ValueError if an id appears twice in ``ids`` (host int64, 1-D): the destinations
    of one call (page ids of a store, block ids of a load) must be distinct, or a destination
    would hold an undefined mix of two sources. Sources may repeat."""
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
    """Integer ids (:func:`check_ids`) as an int64 tensor, lists and arrays moved to ``device``.
    ``destination``: ids that must be distinct (checked here for lists and arrays; the op
    checks host tensors; device tensors cannot be checked without a sync)."""
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
    """Copy blocks ``block_ids`` of every layer (``kv_caches``) into canonical pages ``page_ids``
    of ``cpu_pages`` (uint8 rows, pinned for CUDA) with ``plan``: the bytes this rank is elected
    for; asynchronous on CUDA (current stream). Ids: integers, on the kv device or CPU; page ids
    distinct (ValueError; unchecked on the device: a repeat leaves that page an undefined mix).
    """
    _call(True, kv_caches, cpu_pages, plan, block_ids, page_ids)


def load(
    kv_caches: Sequence[torch.Tensor],
    cpu_pages: torch.Tensor,
    plan: torch.Tensor,
    block_ids: IdsLike,
    page_ids: IdsLike,
) -> None:
    """Copy canonical pages ``page_ids`` into blocks ``block_ids`` of every layer (every byte of
    their local pages; arguments as :func:`store`): block ids distinct, page ids may repeat."""
    _call(False, kv_caches, cpu_pages, plan, block_ids, page_ids)


def _call(store: bool, kv_caches, cpu_pages, plan, block_ids, page_ids) -> None:
    op = torch.ops.canonical.canonical_store if store else torch.ops.canonical.canonical_load
    blocks = None if store else "block ids in a load (destinations)"
    pages = "page ids in a store (destinations)" if store else None
    block_ids = _as_ids("block_ids", block_ids, plan.device, blocks)
    page_ids = _as_ids("page_ids", page_ids, plan.device, pages)
    op(list(kv_caches), cpu_pages, plan, block_ids, page_ids)


def transfer_error(
    record: Sequence[int], block_ids: np.ndarray | None = None, page_ids: np.ndarray | None = None
) -> CanonicalTransferError | None:
    """The error a device-error record (its ERROR_RECORD_WORDS words) describes, or None;
    ``block_ids`` / ``page_ids``: the call's host ids, when known, name the refused pair."""
    block_flag, page_flag, pair_plus_one = (int(v) for v in record[:3])
    if not (block_flag or page_flag):
        return None
    what = " and ".join(["block id"] * bool(block_flag) + ["page id"] * bool(page_flag))
    pair = pair_plus_one - 1
    ids = ""
    if block_ids is not None and page_ids is not None and 0 <= pair < len(block_ids):
        ids = f" (block_ids[{pair}] = {int(block_ids[pair])}, page_ids[{pair}] = {int(page_ids[pair])})"
    return CanonicalTransferError(
        f"a canonical transfer refused out-of-range {what}(s); one refused pair: {pair}{ids}. "
        f"Refused pairs were not copied (in any layer); the other pairs of that call were."
    )


def check_device_errors(plan: torch.Tensor) -> None:
    """Raise if a CUDA kernel using ``plan`` refused an out-of-range device id, then clear its
    record (one per plan, shared by every stream using it; read with no CUDA call, so call after
    synchronising). A no-op for CPU plans (their ids are checked before the copy)."""
    error = transfer_error(torch.ops.canonical._plan_error(plan))
    if error is not None:
        raise error


def set_sm_budget(sms: int) -> int:
    """Limit CUDA transfers to ``sms`` SMs' worth of thread blocks (default 8, or the
    CANONICAL_KV_SM_BUDGET environment variable); returns the previous budget."""
    return int(torch.ops.canonical._set_sm_budget(check_int("sms", sms, minimum=1, maximum=4096)))


def _check_fake(kv_caches, cpu_pages, plan, block_ids, page_ids) -> None:
    """The fake kernel: metadata-only checks with the eager kernels' exception types, so a
    traced call fails like an eager one (and a real meta tensor skips no device check)."""
    if not kv_caches:
        raise ValueError("kv_caches: expected one tensor per layer, got none")
    device = kv_caches[0].device
    tensors = (*kv_caches, cpu_pages, plan, block_ids, page_ids)
    if not all(t.device.type == "meta" for t in tensors):
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
    for name, tensor, dtype, shape in (
        ("cpu_pages", cpu_pages, "uint8", "2-D (rows, row_bytes)"),
        ("plan", plan, "int64", "1-D (from canonical_ops.make_plan)"),
        ("block_ids", block_ids, "int64", "1-D"),
        ("page_ids", page_ids, "int64", "1-D"),
    ):
        if tensor.dtype != getattr(torch, dtype):
            raise TypeError(f"{name}: expected dtype {dtype}, got {tensor.dtype}")
        if tensor.dim() != int(shape[0]):
            raise ValueError(f"{name}: expected a {shape} tensor, got {tensor.dim()}-D")
    if block_ids.shape[0] != page_ids.shape[0]:
        raise ValueError(
            f"page_ids: expected as many ids as block_ids ({block_ids.shape[0]}), "
            f"got {page_ids.shape[0]}"
        )


torch.library.register_fake("canonical::canonical_store")(_check_fake)
torch.library.register_fake("canonical::canonical_load")(_check_fake)
