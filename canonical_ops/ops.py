"""Typed wrappers and fake (meta) kernels of torch.ops.canonical.canonical_store / _load."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import _extension  # noqa: F401  (registers torch.ops.canonical)
from .checks import check_ids, check_int

__all__ = [
    "CanonicalTransferError",
    "CudaJobPools",
    "ErrorRecords",
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
    device = plan.device
    torch.ops.canonical.canonical_store(
        list(kv_caches),
        cpu_pages,
        plan,
        _as_ids("block_ids", block_ids, device, None),
        _as_ids("page_ids", page_ids, device, "page ids in a store (destinations)"),
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
    arguments. Block ids must be distinct (the destinations); page ids may repeat.
    """
    device = plan.device
    torch.ops.canonical.canonical_load(
        list(kv_caches),
        cpu_pages,
        plan,
        _as_ids("block_ids", block_ids, device, "block ids in a load (destinations)"),
        _as_ids("page_ids", page_ids, device, None),
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
    job its own record instead (:class:`ErrorRecords`). A no-op for CPU plans (their
    ids are checked before the copy).
    """
    error = transfer_error(torch.ops.canonical._plan_error(plan))
    if error is not None:
        raise error


class ErrorRecords:
    """A pool of per-job device-error records, in pinned host memory the kernel writes
    through its mapping (see ``torch.ops.canonical._canonical_store_reporting``).

    A job takes a record before its launch and gives it back once its event has
    completed (:meth:`release` reads it with plain host loads: no CUDA call, nothing on
    the compute stream). Records are never moved or freed while the pool lives: a
    kernel may hold their address.

    Parameters
    ----------
    chunk : int
        Records allocated at a time (int64 (chunk, ERROR_RECORD_WORDS)).
    pin : bool
        Pinned memory (what CUDA kernels need); False only for CPU-only tests.
    """

    def __init__(self, chunk: int = 64, *, pin: bool = True) -> None:
        self._chunk = check_int("chunk", chunk, minimum=1)
        self._pin = bool(pin)
        self._chunks: list[torch.Tensor] = []
        self._free: list[torch.Tensor] = []

    def acquire(self) -> torch.Tensor:
        """A zeroed record: an int64 (ERROR_RECORD_WORDS,) view of a pinned chunk."""
        if not self._free:
            chunk = torch.zeros(
                self._chunk, ERROR_RECORD_WORDS, dtype=torch.int64, pin_memory=self._pin
            )
            self._chunks.append(chunk)
            self._free.extend(reversed(chunk.unbind(0)))
        return self._free.pop()

    def release(
        self,
        record: torch.Tensor,
        block_ids: np.ndarray | None = None,
        page_ids: np.ndarray | None = None,
    ) -> CanonicalTransferError | None:
        """Read ``record`` (its job's kernels have completed), clear it and take it back.

        Returns the job's error (naming the refused pair's ids when ``block_ids`` /
        ``page_ids`` are the call's host ids), or None.
        """
        error = transfer_error(record.tolist(), block_ids, page_ids)
        record.zero_()
        self._free.append(record)
        return error


class CudaJobPools:
    """Reusable per-job resources of an offload worker on CUDA: events, pinned staging for
    host ids, and error records (:class:`ErrorRecords`).

    A job takes what it needs at submission and gives it back when its event has
    completed, so a steady stream of jobs allocates nothing. Nothing taken is freed while
    in use (a kernel, a copy or an event may still refer to it).

    Parameters
    ----------
    timing : bool
        Events record timing (``elapsed_time``); otherwise the cheaper untimed events.
    pin : bool
        Pinned staging and records; False only for CPU-only tests of the bookkeeping.
    """

    def __init__(self, *, timing: bool = False, pin: bool = True) -> None:
        self.timing = bool(timing)
        self.errors = ErrorRecords(pin=pin)
        self._pin = bool(pin)
        self._events: list[torch.cuda.Event] = []
        self._staging: dict[int, list[torch.Tensor]] = {}

    def event(self) -> torch.cuda.Event:
        """An event to record a job's end (or start) on its stream."""
        return self._events.pop() if self._events else torch.cuda.Event(enable_timing=self.timing)

    def release_event(self, event: torch.cuda.Event) -> None:
        self._events.append(event)

    def staging(self, count: int) -> torch.Tensor:
        """Pinned int64 (capacity,) with capacity >= ``count`` (a power of two, >= 128)."""
        capacity = max(128, 1 << max(0, int(count) - 1).bit_length())
        free = self._staging.setdefault(capacity, [])
        return (
            free.pop() if free else torch.empty(capacity, dtype=torch.int64, pin_memory=self._pin)
        )

    def release_staging(self, buffer: torch.Tensor) -> None:
        self._staging.setdefault(buffer.numel(), []).append(buffer)


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
