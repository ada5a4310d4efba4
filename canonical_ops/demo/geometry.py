"""Both groups' canonical mappings and the byte sizes of the rows and regions."""

from __future__ import annotations

from dataclasses import dataclass

from layouts import CanonicalPageMapping, derive_group_mappings

from .config import DemoConfig, UsageError


@dataclass(frozen=True)
class Geometry:
    """Canonical mappings of both groups and the rows they use (O(layers) to build)."""

    writer_groups: list[tuple[CanonicalPageMapping, ...]]
    reader_groups: list[tuple[CanonicalPageMapping, ...]]
    row_bytes: int  # every layer's canonical page: one block of the whole model
    canonical_page_bytes: int  # of one layer

    def groups(self, role: str) -> list[tuple[CanonicalPageMapping, ...]]:
        return self.writer_groups if role == "writer" else self.reader_groups

    def stage_row_bytes(self, first: int, end: int) -> int:
        return (end - first) * self.canonical_page_bytes

    @property
    def parallelism_agnostic(self) -> bool:
        return all(
            m.parallelism_agnostic for g in self.writer_groups + self.reader_groups for m in g
        )


def plan_geometry(cfg: DemoConfig) -> Geometry:
    """Both groups' verified mappings (identical layers derive once) and the row size."""
    groups = {}
    for tp in (cfg.writer_tp, cfg.reader_tp):
        mappings = derive_group_mappings(cfg.spec(tp), tp, cfg.total_kv_heads)
        groups[tp] = [mappings] * cfg.layers
    w, r = groups[cfg.writer_tp], groups[cfg.reader_tp]
    w_row = sum(g[0].canonical_page_size_bytes for g in w)
    r_row = sum(g[0].canonical_page_size_bytes for g in r)
    if w_row != r_row:  # cannot happen for certified topologies (build_config checks them)
        raise UsageError(
            f"writer (TP={cfg.writer_tp}) and reader (TP={cfg.reader_tp}) canonical pages "
            f"differ in size ({w_row} vs {r_row} B per row)"
        )
    return Geometry(w, r, w_row, w[0][0].canonical_page_size_bytes)


def region_bytes(cfg: DemoConfig, geometry: Geometry, role: str = "writer") -> int:
    """/dev/shm bytes of ``role``'s regions (one per pipeline stage)."""
    from canonical_ops.engine.region import HEADER_BYTES

    return cfg.pp(role) * HEADER_BYTES + cfg.prompt_blocks * geometry.row_bytes
