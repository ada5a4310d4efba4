"""What a benchmark's figures depend on besides the code: how the guest's free memory is backed.

A virtio-balloon device with free page reporting (VIRTIO_BALLOON_F_REPORTING, feature bit 5)
hands free blocks of ``2**page_reporting_order`` pages back to the host. A page allocated from
such a block faults on the host when it is first written, so a buffered write into new
page-cache pages runs several times slower than one into pages freed a moment before (on this
project's Firecracker VM a plain ``pwrite`` of 192 MiB into new files: 0.26-0.39 against
3.2-4.3 GB/s; docs/design.md, round 5 session 11). Both tiers of a benchmark pay it, in turns
that depend on what ran just before: the reports name it so that store figures are read with it.
"""

from __future__ import annotations

from pathlib import Path

VIRTIO_ID_BALLOON = 5
VIRTIO_BALLOON_F_REPORTING = 5


def free_page_reporting(sysfs: Path = Path("/sys")) -> dict | None:
    """``{"order": int | None, "reported_kib": int | None}`` where a virtio-balloon device
    reports free pages to the host, else None. ``reported_kib`` (a running total) exists only
    on kernels that export it; compare two readings to see what a run gave back."""
    reporting = False
    for device in sorted((sysfs / "bus/virtio/devices").glob("*")):
        try:
            kind = int((device / "device").read_text().strip(), 16)
            features = (device / "features").read_text().strip()
        except (OSError, ValueError):
            continue
        if (
            kind == VIRTIO_ID_BALLOON
            and features[VIRTIO_BALLOON_F_REPORTING : VIRTIO_BALLOON_F_REPORTING + 1] == "1"
        ):
            reporting = True
    if not reporting:
        return None
    params = sysfs / "module/page_reporting/parameters"
    return {
        "order": _read_int(params / "page_reporting_order"),
        "reported_kib": _read_int(params / "reported_kib"),
    }


def reporting_note(before: dict | None, after: dict | None) -> str:
    """One sentence for a report: whether this guest gave memory back during the run."""
    if before is None or after is None:
        return (
            "This guest reports no free memory to a host (no virtio-balloon free page reporting)."
        )
    given = ""
    if before["reported_kib"] is not None and after["reported_kib"] is not None:
        given = f"; {(after['reported_kib'] - before['reported_kib']) / 2**20:.1f} GiB given back during the run"
    return (
        f"This guest hands free memory back to its host (virtio-balloon free page reporting, "
        f"order {after['order']}{given}): a buffered store into new page-cache pages may fault "
        f"on the host, so store figures swing with what ran just before (docs/design.md)."
    )


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None
