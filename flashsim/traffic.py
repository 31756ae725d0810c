"""One value type for HBM data movement, shared by the simulator, `fs.count`, the
closed forms in `fs.theory` and (later) instrumented kernels, so that "do they agree?"
is a plain ``==``.

A `Traffic` holds, per tensor name, the bytes read from the memory behind a level
into it (HBM into SRAM in the two-level model), the bytes written back, and the bytes
of *reductions*: atomic adds the memory performs itself (a GPU's L2 does a kernel's
``atomicAdd``), one transfer where a read-modify-write by the SM would be two. The same
type serves every level of `flashsim.hierarchy` (SM↔L2, L2↔DRAM, compulsory). Integers
only: every count is exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

# Canonical tensor order for tables: inputs, intermediates, output, row statistics.
TENSOR_ORDER = ("Q", "K", "V", "Knew", "Vnew", "block_table", "S", "P", "Osplit", "Oring", "O",
                "m", "l", "Lsplit", "Lring", "L",
                "dO", "D", "dP", "dS", "dQacc", "dQring", "dQ", "dKring", "dK", "dVring", "dV")


def _order_key(name: str) -> tuple[int, str]:
    try:
        return (TENSOR_ORDER.index(name), name)
    except ValueError:
        return (len(TENSOR_ORDER), name)


def _clean(mapping: Mapping[str, int] | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, value in (mapping or {}).items():
        if not isinstance(name, str):
            raise TypeError(f"Traffic tensor names must be str, got {name!r}")
        iv = int(value)
        if iv != value or iv < 0:
            raise ValueError(f"Traffic bytes must be non-negative integers, got {name}={value!r}")
        if iv:
            out[name] = out.get(name, 0) + iv
    return dict(sorted(out.items(), key=lambda kv: _order_key(kv[0])))


class Traffic:
    """HBM bytes moved, per tensor and direction.

    >>> t = Traffic(reads={"Q": 128}, writes={"O": 128})
    >>> (t + t).total_bytes
    512
    """

    __slots__ = ("_reads", "_writes", "_reduces")

    def __init__(self, reads: Mapping[str, int] | None = None,
                 writes: Mapping[str, int] | None = None,
                 reduces: Mapping[str, int] | None = None):
        self._reads = _clean(reads)
        self._writes = _clean(writes)
        self._reduces = _clean(reduces)

    # -- views ---------------------------------------------------------------------
    @property
    def reads(self) -> Mapping[str, int]:
        """Bytes read HBM→SRAM per tensor (zero entries omitted)."""
        return MappingProxyType(self._reads)

    @property
    def writes(self) -> Mapping[str, int]:
        """Bytes written SRAM→HBM per tensor (zero entries omitted)."""
        return MappingProxyType(self._writes)

    @property
    def reduces(self) -> Mapping[str, int]:
        """Bytes of reductions (atomic adds performed by the memory) per tensor."""
        return MappingProxyType(self._reduces)

    @property
    def reduce_bytes(self) -> int:
        return sum(self._reduces.values())

    @property
    def read_bytes(self) -> int:
        return sum(self._reads.values())

    @property
    def write_bytes(self) -> int:
        return sum(self._writes.values())

    @property
    def total_bytes(self) -> int:
        return self.read_bytes + self.write_bytes + self.reduce_bytes

    @property
    def tensors(self) -> tuple[str, ...]:
        names = set(self._reads) | set(self._writes) | set(self._reduces)
        return tuple(sorted(names, key=_order_key))

    def of(self, name: str) -> int:
        """Bytes read plus written (plus reduced) for one tensor."""
        return self._reads.get(name, 0) + self._writes.get(name, 0) + self._reduces.get(name, 0)

    def reductions_as_reads_and_writes(self) -> "Traffic":
        """The same traffic with each reduction counted as a read plus a write of its
        bytes: what a read-modify-write by the SM would move (the two-level model's view
        of an atomic add)."""
        return Traffic(_merged(self._reads, self._reduces), _merged(self._writes, self._reduces))

    # -- arithmetic ----------------------------------------------------------------
    def __add__(self, other: "Traffic") -> "Traffic":
        if not isinstance(other, Traffic):
            return NotImplemented
        return Traffic(_merged(self._reads, other._reads), _merged(self._writes, other._writes),
                       _merged(self._reduces, other._reduces))

    def __radd__(self, other):
        # lets sum([...]) start from 0
        if other == 0:
            return self
        return NotImplemented

    def __mul__(self, k: int) -> "Traffic":
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            return NotImplemented
        return Traffic({n: v * k for n, v in self._reads.items()},
                       {n: v * k for n, v in self._writes.items()},
                       {n: v * k for n, v in self._reduces.items()})

    __rmul__ = __mul__

    def __eq__(self, other) -> bool:
        if not isinstance(other, Traffic):
            return NotImplemented
        return (self._reads == other._reads and self._writes == other._writes
                and self._reduces == other._reduces)

    def __hash__(self):
        return hash((tuple(self._reads.items()), tuple(self._writes.items()),
                     tuple(self._reduces.items())))

    def diff(self, other: "Traffic") -> dict[tuple[str, str], tuple[int, int]]:
        """{(direction, tensor): (self, other)} for every entry that differs."""
        out = {}
        for direction, a, b in (("read", self._reads, other._reads),
                                ("write", self._writes, other._writes),
                                ("reduce", self._reduces, other._reduces)):
            for name in sorted(set(a) | set(b), key=_order_key):
                if a.get(name, 0) != b.get(name, 0):
                    out[(direction, name)] = (a.get(name, 0), b.get(name, 0))
        return out

    # -- printing ------------------------------------------------------------------
    def table(self, unit: str = "auto") -> str:
        """A per-tensor table of reads, writes and totals."""
        return format_table({"": self}, unit=unit)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        extra = f", reduces={self._reduces!r}" if self._reduces else ""
        return f"Traffic(reads={self._reads!r}, writes={self._writes!r}{extra})"

    def to_dict(self) -> dict:
        out = {"reads": dict(self._reads), "writes": dict(self._writes),
               "read_bytes": self.read_bytes, "write_bytes": self.write_bytes,
               "total_bytes": self.total_bytes}
        if self._reduces:
            out["reduces"] = dict(self._reduces)
            out["reduce_bytes"] = self.reduce_bytes
        return out


def _merged(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _pick_unit(largest: int) -> str:
    for name in ("TiB", "GiB", "MiB", "KiB"):
        if largest >= 10 * _UNITS[name]:
            return name
    return "B"


def _fmt(value: int, unit: str) -> str:
    if value == 0:
        return "-"
    if unit == "B":
        return f"{value:,}"
    return f"{value / _UNITS[unit]:,.2f}"


def format_table(columns: Mapping[str, Traffic], unit: str = "auto") -> str:
    """Side-by-side table of several `Traffic` values (read and write columns per entry,
    and reduce where any entry has reductions)."""
    if not columns:
        raise ValueError("format_table needs at least one Traffic")
    if unit != "auto" and unit not in _UNITS:
        raise ValueError(f"unit must be 'auto' or one of {sorted(_UNITS)}, got {unit!r}")
    if unit == "auto":
        unit = _pick_unit(max(t.total_bytes for t in columns.values()))
    names = sorted({n for t in columns.values() for n in t.tensors}, key=_order_key)
    # a reduce column only where some level has reductions (tables of the two-level
    # model look as they always did)
    red = any(t.reduce_bytes for t in columns.values())
    header = ["tensor"]
    for label in columns:
        prefix = f"{label} " if label else ""
        header += [f"{prefix}read", f"{prefix}write"] + ([f"{prefix}reduce"] if red else [])
    rows = [header]
    for n in names:
        row = [n]
        for t in columns.values():
            row += [_fmt(t.reads.get(n, 0), unit), _fmt(t.writes.get(n, 0), unit)]
            row += [_fmt(t.reduces.get(n, 0), unit)] if red else []
        rows.append(row)
    total = ["total"]
    for t in columns.values():
        total += [_fmt(t.read_bytes, unit), _fmt(t.write_bytes, unit)]
        total += [_fmt(t.reduce_bytes, unit)] if red else []
    rows.append(total)
    grand = ["all" if red else "read+write"]
    for t in columns.values():
        grand += [_fmt(t.total_bytes, unit), ""] + ([""] if red else [])
    rows.append(grand)
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines = []
    for k, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [r[c].rjust(widths[c]) for c in range(1, len(r))]
        lines.append("  ".join(cells).rstrip())
        if k == 0 or k == len(rows) - 3:
            lines.append("  ".join("-" * w for w in widths))
    lines.append(f"(bytes in {unit})")
    return "\n".join(lines)
