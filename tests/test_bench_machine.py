"""bench/_machine.py: a guest that hands free memory back to its host is named in reports."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import _machine


def virtio(sysfs: Path, name: str, device: str, features: str) -> None:
    folder = sysfs / "bus/virtio/devices" / name
    folder.mkdir(parents=True)
    (folder / "device").write_text(device + "\n")
    (folder / "features").write_text(features + "\n")


def test_a_balloon_that_reports_free_pages_is_found_with_its_order(tmp_path):
    virtio(tmp_path, "virtio0", "0x0002", "0" * 5 + "1" + "0" * 58)  # a block device, bit 5
    assert _machine.free_page_reporting(tmp_path) is None
    virtio(tmp_path, "virtio1", "0x0005", "0110010" + "0" * 57)  # balloon with REPORTING
    params = tmp_path / "module/page_reporting/parameters"
    params.mkdir(parents=True)
    (params / "page_reporting_order").write_text("9\n")
    before = _machine.free_page_reporting(tmp_path)
    assert before == {"order": 9, "reported_kib": None}
    (params / "reported_kib").write_text(f"{3 << 20}\n")
    after = _machine.free_page_reporting(tmp_path)
    assert after == {"order": 9, "reported_kib": 3 << 20}
    assert "order 9" in _machine.reporting_note(before, after)
    assert "given back" not in _machine.reporting_note(before, after)  # no first reading
    assert "3.0 GiB given back" in _machine.reporting_note({**after, "reported_kib": 0}, after)


def test_a_balloon_without_reporting_or_no_balloon_is_none(tmp_path):
    assert _machine.free_page_reporting(tmp_path) is None  # no virtio bus at all
    virtio(tmp_path, "virtio0", "0x0005", "0110000" + "0" * 57)  # balloon, bit 5 clear
    assert _machine.free_page_reporting(tmp_path) is None
    assert "reports no free memory" in _machine.reporting_note(None, None)
