"""Tiles: block sizes from an SRAM budget, each algorithm's SRAM footprint, and which
(Q tile i, K/V tile j) pairs a mask leaves to visit.

Notation: Q tile i holds rows [i·Br, min((i+1)·Br, Nq)), K/V tile j holds keys
[j·Bc, min((j+1)·Bc, Nk)); Tr = ⌈Nq/Br⌉, Tc = ⌈Nk/Bc⌉.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import SRAMOverflowError
from .problem import STAT_BYTES, check_size


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- masks -------------------------------------------------------------------------

@dataclass(frozen=True)
class Band:
    """Query row r sees key c iff r + off − left ≤ c ≤ r + off + right, off = Nk − Nq.

    ``left``/``right`` of None are unbounded. Causal is Band(None, 0): aligned to the
    bottom-right corner, as FlashAttention does when Nq ≠ Nk.
    """
    left: int | None = None
    right: int | None = None

    @property
    def unbounded(self) -> bool:
        return self.left is None and self.right is None

    def allowed(self, rows: np.ndarray, cols: np.ndarray, off: int) -> np.ndarray:
        """Boolean (len(rows), len(cols)) mask of visible entries."""
        delta = cols[None, :] - rows[:, None] - off
        ok = np.ones(delta.shape, dtype=bool)
        if self.left is not None:
            ok &= delta >= -self.left
        if self.right is not None:
            ok &= delta <= self.right
        return ok


FULL = Band()
CAUSAL = Band(None, 0)


def band_for(causal: bool) -> Band:
    return CAUSAL if causal else FULL


@dataclass(frozen=True)
class Tiles:
    """Tile boundaries of one (Nq, Nk) problem and the pairs a band leaves to visit.

    ``jlo[i]..jhi[i]`` (inclusive) are the K/V tiles visited by Q tile i, and
    ``ilo[j]..ihi[j]`` the Q tiles visited by K/V tile j; an empty range has hi < lo.
    A pair is visited iff at least one of its entries is visible: the set of
    c − r over the rectangle, [j0 − (i1 − 1), (j1 − 1) − i0], meets the band's
    [off − left, off + right].
    """
    Nq: int
    Nk: int
    Br: int
    Bc: int
    band: Band

    @property
    def Tr(self) -> int:
        return cdiv(self.Nq, self.Br)

    @property
    def Tc(self) -> int:
        return cdiv(self.Nk, self.Bc)

    @property
    def off(self) -> int:
        return self.Nk - self.Nq

    def q_bounds(self):
        i0 = np.arange(self.Tr, dtype=np.int64) * self.Br
        return i0, np.minimum(i0 + self.Br, self.Nq)

    def k_bounds(self):
        j0 = np.arange(self.Tc, dtype=np.int64) * self.Bc
        return j0, np.minimum(j0 + self.Bc, self.Nk)

    def positions(self, i0, i1):
        """Query positions [p0, p1) that rows [i0, i1) hold: the rows themselves here
        (a subclass may pack several heads per position)."""
        return i0, i1

    def kv_ranges(self):
        """(jlo, jhi) per Q tile: visible keys of rows i0..i1-1 form one interval."""
        p0, p1 = self.positions(*self.q_bounds())
        c_lo = np.zeros_like(p0)
        c_hi = np.full_like(p0, self.Nk - 1)
        if self.band.left is not None:
            c_lo = np.maximum(c_lo, p0 + self.off - self.band.left)
        if self.band.right is not None:
            c_hi = np.minimum(c_hi, p1 - 1 + self.off + self.band.right)
        return _to_tiles(c_lo, c_hi, self.Bc)

    def q_ranges(self):
        """(ilo, ihi) per K/V tile: by symmetry, key c is seen by rows
        c − off − right ≤ r ≤ c − off + left."""
        j0, j1 = self.k_bounds()
        r_lo = np.zeros_like(j0)
        r_hi = np.full_like(j0, self.Nq - 1)
        if self.band.right is not None:
            r_lo = np.maximum(r_lo, j0 - self.off - self.band.right)
        if self.band.left is not None:
            r_hi = np.minimum(r_hi, j1 - 1 - self.off + self.band.left)
        return _to_tiles(r_lo, r_hi, self.Br)

    def partial(self, i: int, j: int) -> bool:
        """True if visited pair (i, j) has masked entries (needs the elementwise mask)."""
        if self.band.unbounded:
            return False
        i0, i1 = i * self.Br, min((i + 1) * self.Br, self.Nq)
        j0, j1 = j * self.Bc, min((j + 1) * self.Bc, self.Nk)
        lo, hi = j0 - (i1 - 1) - self.off, (j1 - 1) - i0 - self.off
        inside_left = self.band.left is None or lo >= -self.band.left
        inside_right = self.band.right is None or hi <= self.band.right
        return not (inside_left and inside_right)

    def mask(self, i: int, j: int) -> np.ndarray:
        rows = np.arange(i * self.Br, min((i + 1) * self.Br, self.Nq))
        cols = np.arange(j * self.Bc, min((j + 1) * self.Bc, self.Nk))
        return self.band.allowed(rows, cols, self.off)


def _to_tiles(lo: np.ndarray, hi: np.ndarray, B: int):
    empty = lo > hi
    tlo = np.where(empty, 0, lo // B)
    thi = np.where(empty, -1, np.where(empty, 0, hi) // B)
    return tlo, thi


# -- SRAM footprints and block sizes ----------------------------------------------------

def sram_footprint(algorithm: str, Br: int, Bc: int, d: int, dv: int, itemsize: int) -> int:
    """Bytes live in SRAM at the busiest moment of one (Q tile, K/V tile) step.

    Matrix tiles cost ``itemsize`` per element (P overwrites S in place, dS overwrites
    dP), row statistics 4 bytes:
      flash1:  K_j, V_j, Q_i, O_i, S_ij/P_ij, and m_i, ℓ_i, m̃_ij, ℓ̃_ij, m_new, ℓ_new
               = (Bc·d + Bc·dv + Br·d + Br·dv + Br·Bc)·b + 6·Br·4
      flash2:  Q_i, O_i, K_j, V_j, S_ij/P_ij, and m_i, ℓ_i, m_new
               = (Br·d + Br·dv + Bc·d + Bc·dv + Br·Bc)·b + 3·Br·4
      splitkv: as flash2 (each split runs flash2's inner loop)
      flash1-backward: K_j, V_j, dK_j, dV_j, Q_i, O_i, dO_i, dQ_i, S/P, dP/dS, ℓ_i, m_i, D_i
               = (2·Bc·d + 2·Bc·dv + 2·Br·d + 2·Br·dv + 2·Br·Bc)·b + 3·Br·4
      flash2-backward: K_j, V_j, dK_j, dV_j, Q_i, dO_i, S/P, dP/dS, dQacc_i (fp32), L_i, D_i
               = (2·Bc·d + 2·Bc·dv + Br·d + Br·dv + 2·Br·Bc)·b + Br·d·4 + 2·Br·4
    """
    try:
        rule = BLOCK_RULES[algorithm]
    except KeyError:
        raise ValueError(f"no SRAM footprint for algorithm {algorithm!r}") from None
    return rule.footprint(Br, Bc, d, dv, itemsize)


@dataclass(frozen=True)
class BlockRule:
    """How an algorithm turns the resident tile size B into (Br, Bc), and its footprint.
    ``start(M, d)`` is the largest B tried (default: the paper's ⌈M/4d⌉)."""
    tiles: object           # (B, d) -> (Br, Bc)
    footprint: object       # (Br, Bc, d, dv, itemsize) -> bytes
    start: object = None    # (M, d) -> B


# The paper's rule sizes the tile that stays resident across the inner loop at ⌈M/4d⌉
# and caps the streamed tile at d. FlashAttention-1 (and every KV-outer backward) keeps
# K_j, V_j resident: Bc = ⌈M/4d⌉, Br = min(Bc, d). FlashAttention-2 swaps the loops and
# keeps Q_i resident, so the same rule gives Br = ⌈M/4d⌉, Bc = min(Br, d).
def _kv_resident(B, d):
    return min(B, d), B


def _q_resident(B, d):
    return B, min(B, d)


def _fp_flash1(Br, Bc, d, dv, b):
    return (Bc * d + Bc * dv + Br * d + Br * dv + Br * Bc) * b + 6 * Br * STAT_BYTES


def _fp_flash2(Br, Bc, d, dv, b):
    return (Br * d + Br * dv + Bc * d + Bc * dv + Br * Bc) * b + 3 * Br * STAT_BYTES


def _fp_splitkv(Br, Bc, d, dv, b):
    # each split runs flash2's loop; the combine streams one fp32 partial row at a time
    # (accumulator, partial, running max and sum: 4·dv + 4·dv... at least 4·dv + 16 bytes)
    return max(_fp_flash2(Br, Bc, d, dv, b), 4 * dv + 16)


def _fp_flash1_bwd(Br, Bc, d, dv, b):
    return (2 * Bc * d + 2 * Bc * dv + 2 * Br * d + 2 * Br * dv + 2 * Br * Bc) * b \
        + 3 * Br * STAT_BYTES


def _fp_flash2_bwd(Br, Bc, d, dv, b):
    return (2 * Bc * d + 2 * Bc * dv + Br * d + Br * dv + 2 * Br * Bc) * b \
        + Br * d * STAT_BYTES + 2 * Br * STAT_BYTES


BLOCK_RULES: dict[str, BlockRule] = {
    "flash1": BlockRule(_kv_resident, _fp_flash1),
    "flash2": BlockRule(_q_resident, _fp_flash2),
    "splitkv": BlockRule(_q_resident, _fp_splitkv),
    "flash1-backward": BlockRule(_kv_resident, _fp_flash1_bwd),
    "flash2-backward": BlockRule(_kv_resident, _fp_flash2_bwd),
}


def derive_block_sizes(algorithm: str, sram_bytes: int, d: int, dv: int,
                       itemsize: int) -> tuple[int, int]:
    """(Br, Bc) from an SRAM size by the paper's rule, shrunk until the footprint fits.

    M = sram_bytes / itemsize elements; the resident tile starts at ⌈M/4d⌉ and is
    reduced (the streamed tile following its cap) to the largest size that fits.
    """
    rule = BLOCK_RULES[algorithm]
    M = sram_bytes // itemsize
    B0 = max(1, rule.start(M, d) if rule.start is not None else cdiv(M, 4 * d))

    def fits(B):
        return rule.footprint(*rule.tiles(B, d), d, dv, itemsize) <= sram_bytes

    if not fits(1):
        need = rule.footprint(1, 1, d, dv, itemsize)
        raise SRAMOverflowError(
            f"{algorithm} needs at least {need} bytes of SRAM for 1×1 tiles at d={d}, "
            f"dv={dv}, {itemsize}-byte elements; got sram_bytes={sram_bytes}. "
            f"Give sram_bytes >= {need}.", minimum_bytes=need)
    lo, hi = 1, B0  # fits(lo) holds; find the largest B <= B0 that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return rule.tiles(lo, d)


def parse_size(text) -> int:
    """Bytes from an int or a string such as "192KiB", "1.5MiB", "100KB", "4096"."""
    if isinstance(text, (int, np.integer)) and not isinstance(text, bool):
        return int(text)
    if not isinstance(text, str):
        raise TypeError(f"size must be an int or a string like '192KiB', got {text!r}")
    s = text.strip().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6,
             "gb": 10**9, "k": 2**10, "m": 2**20, "g": 2**30, "b": 1, "": 1}
    num = s.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = s[len(num):].lower()
    if unit not in units or not num:
        raise ValueError(f"cannot read size {text!r}; write e.g. 192KiB, 1MiB, 100KB or 4096")
    value = float(num) * units[unit]
    if value != int(value):
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def resolve_block_sizes(algorithm: str, *, sram_bytes, block_sizes, d: int, dv: int,
                        itemsize: int) -> tuple[int, int] | None:
    """Validate the sram_bytes / block_sizes pair and return (Br, Bc), or None for
    standard attention (whose counts do not depend on tiling)."""
    if sram_bytes is not None:
        sram_bytes = parse_size(sram_bytes)
        check_size("sram_bytes", sram_bytes, 1)
    if block_sizes is not None:
        try:
            Br, Bc = block_sizes
        except (TypeError, ValueError):
            raise TypeError(f"block_sizes must be a pair (Br, Bc), got {block_sizes!r}") from None
        Br = check_size("Br (block_sizes[0])", Br, 1)
        Bc = check_size("Bc (block_sizes[1])", Bc, 1)
    if algorithm not in BLOCK_RULES:   # standard attention: counts do not depend on tiling
        return (Br, Bc) if block_sizes is not None else None
    if (sram_bytes is None) == (block_sizes is None):
        raise ValueError(
            f"{algorithm} needs exactly one of sram_bytes (block sizes derived by the paper's "
            "rule) or block_sizes=(Br, Bc); got "
            + ("neither" if sram_bytes is None else "both"))
    if block_sizes is not None:
        return Br, Bc
    return derive_block_sizes(algorithm, sram_bytes, d, dv, itemsize)
