"""The two-level memory: HBM holds whole tensors, SRAM holds named tiles under a byte
budget, and every HBM↔SRAM move is counted in bytes per tensor.

Arrays are vectorised over all (batch, head) problems at once, but bytes and SRAM
occupancy are per problem (one thread block handles one problem's tile): a move of a
rows × cols tile costs rows · cols · elem_bytes · problems bytes of HBM traffic and
occupies rows · cols · elem_bytes bytes of SRAM.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from .problem import STAT_BYTES
from .traffic import Traffic


class SRAM:
    """Live tiles by name; tracks the peak of their total size."""

    def __init__(self, capacity: int | None):
        self.capacity = capacity
        self.live: dict[str, int] = {}
        self.used = 0
        self.peak = 0

    def alloc(self, slot: str, nbytes: int) -> None:
        if slot in self.live:
            raise RuntimeError(f"SRAM slot {slot!r} allocated twice (schedule bug)")
        self.live[slot] = nbytes
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        if self.capacity is not None and self.used > self.capacity:
            raise RuntimeError(
                f"SRAM overflow: {self.used} bytes live > {self.capacity} "
                f"({sorted(self.live.items())}); the block sizes do not fit (schedule bug)")

    def free(self, *slots: str) -> None:
        for s in slots:
            self.used -= self.live.pop(s)


class Machine:
    """HBM + SRAM + counters for one simulated run."""

    def __init__(self, problems: int, itemsize: int, sram_bytes: int | None = None):
        self.problems = problems
        self.itemsize = itemsize
        self.sram = SRAM(sram_bytes)
        self._reads: dict[str, int] = defaultdict(int)
        self._writes: dict[str, int] = defaultdict(int)

    def _elem(self, stat: bool, elem: int | None = None) -> int:
        if elem is not None:
            return elem
        return STAT_BYTES if stat else self.itemsize

    @staticmethod
    def _extent(src: np.ndarray, r0: int, r1: int, stat: bool) -> int:
        return (r1 - r0) * (1 if stat else src.shape[-1])

    # HBM → SRAM
    def load(self, tensor: str, src: np.ndarray, r0: int, r1: int, *,
             slot: str | None = None, stat: bool = False, elem: int | None = None) -> np.ndarray:
        """Copy rows r0:r1 of ``src`` into SRAM slot ``slot`` (default: the tensor name).
        ``stat`` marks a row statistic (one fp32 per row); ``elem`` overrides the bytes
        per element (e.g. 4 for an fp32 accumulator of an fp16 run)."""
        n = self._extent(src, r0, r1, stat) * self._elem(stat, elem)
        self._reads[tensor] += n * self.problems
        self.sram.alloc(slot or tensor, n)
        return np.array(src[..., r0:r1] if stat else src[..., r0:r1, :])

    # SRAM → HBM
    def store(self, tensor: str, dst: np.ndarray, r0: int, r1: int, tile, *,
              stat: bool = False, elem: int | None = None) -> None:
        """Write ``tile`` (already in SRAM) to rows r0:r1 of ``dst``."""
        n = self._extent(dst, r0, r1, stat) * self._elem(stat, elem)
        self._writes[tensor] += n * self.problems
        if stat:
            dst[..., r0:r1] = tile
        else:
            dst[..., r0:r1, :] = tile

    def store_block(self, tensor: str, dst: np.ndarray, r0: int, r1: int, c0: int, c1: int,
                    tile) -> None:
        """Write ``tile`` to rows r0:r1, columns c0:c1 of ``dst`` (a tile of a matrix
        that spans more columns than one tile, as standard attention's S)."""
        self._writes[tensor] += (r1 - r0) * (c1 - c0) * self.itemsize * self.problems
        dst[..., r0:r1, c0:c1] = tile

    # on-chip scratch (no HBM traffic)
    def scratch(self, slot: str, rows: int, cols: int = 1, *, stat: bool = False,
                elem: int | None = None) -> None:
        self.sram.alloc(slot, rows * cols * self._elem(stat, elem))

    def free(self, *slots: str) -> None:
        self.sram.free(*slots)

    @property
    def traffic(self) -> Traffic:
        return Traffic(self._reads, self._writes)

    # Whole-tensor moves of unfused kernels (standard attention): counted, but the
    # on-chip working set of a matmul library call is outside this model.
    def read_whole(self, tensor: str, src: np.ndarray, *, stat: bool = False) -> np.ndarray:
        self._reads[tensor] += self._whole(src, stat)
        return src

    def write_whole(self, tensor: str, value: np.ndarray, *, stat: bool = False) -> np.ndarray:
        self._writes[tensor] += self._whole(value, stat)
        return value

    def _whole(self, a: np.ndarray, stat: bool) -> int:
        per_problem = a.shape[-1] if stat else a.shape[-1] * a.shape[-2]
        return per_problem * self._elem(stat) * self.problems
