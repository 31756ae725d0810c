"""`count`: the simulator's exact accounting with no arrays and no math.

Instead of replaying every (i, j) pair, it sums tile sizes over the contiguous range of
tiles each outer tile visits (a band mask always leaves one interval), so a problem of
Nq = Nk = 2²⁰ costs O(Tr + Tc) NumPy work.
"""

from __future__ import annotations

import numpy as np

from .problem import STAT_BYTES, check_algorithm, check_options, itemsize_of, make_shape
from .tiling import Tiles, cdiv, resolve_block_sizes
from .traffic import Traffic
from .variants import make_band


def _span(lo: np.ndarray, hi: np.ndarray, B: int, N: int) -> np.ndarray:
    """Rows (or keys) covered by tiles lo..hi inclusive; 0 where the range is empty."""
    return np.where(hi >= lo, np.minimum((hi + 1) * B, N) - lo * B, 0)


def count(algorithm: str, *, Nq: int, Nk: int, d: int, dv: int | None = None,
          batch_shape=(), kv_batch_shape=None, sram_bytes=None, block_sizes=None,
          causal: bool = False, io_dtype="float16", window=None,
          num_splits=None, cluster: bool = False, hardware=None, launch: str = "auto"):
    """HBM traffic of ``algorithm`` for a problem of the given sizes; equal to
    ``simulate(...).traffic`` for the same problem, tiling, mask and options.
    (softcap and ALiBi change no count, so they are not parameters here.)

    With ``hardware`` (a `flashsim.hardware` preset name or `GPU`), returns a
    `flashsim.hierarchy.Prediction` instead: the three-level traffic (SM↔L2, L2↔DRAM,
    compulsory) and time of the project's kernel for these inputs on that GPU
    (``launch``: "auto" as `fs.gpu.attention` picks, or "wg", "tc", "ref"), whose
    ``.traffic`` is this function's count for the kernel's tiles."""
    algorithm = check_algorithm(algorithm)
    if algorithm == "ring":
        raise ValueError("ring attention's traffic comes from running its ranks: use "
                         "fs.simulate(q, k, v, 'ring', world_size=...) (and "
                         "flashsim.ring.ring_interconnect for the links)")
    shape = make_shape(Nq=Nq, Nk=Nk, d=d, dv=dv, batch_shape=batch_shape,
                       kv_batch_shape=kv_batch_shape)
    b = itemsize_of(io_dtype)
    band = make_band(causal, window)
    opts = check_options(algorithm, num_splits=num_splits, cluster=cluster)
    if hardware is not None:
        from . import hierarchy
        blocks = hierarchy.hardware_tiles(algorithm, shape, io_dtype, hardware,
                                          sram_bytes=sram_bytes, block_sizes=block_sizes,
                                          launch=launch, backward=False)
        traffic = _count_flash2(shape, Tiles(shape.Nq, shape.Nk, *blocks, band), b)
        return hierarchy.predict(shape, io_dtype, band, hardware, launch=launch,
                                 block_sizes=block_sizes, traffic=traffic)
    blocks = resolve_block_sizes(algorithm, sram_bytes=sram_bytes, block_sizes=block_sizes,
                                 d=shape.d, dv=shape.dv, itemsize=b)
    if algorithm == "standard":
        return _count_standard(shape, b, blocks)
    return COUNTS[algorithm](shape, Tiles(shape.Nq, shape.Nk, *blocks, band), b, **opts)


def _count_standard(shape, b, blocks=None) -> Traffic:
    Nq, Nk, d, dv, n = shape.Nq, shape.Nk, shape.d, shape.dv, shape.problems
    # K, V read once per Q tile; whole matrices are one tile (none if empty)
    Br = blocks[0] if blocks is not None else max(Nq, 1)
    Tr = cdiv(Nq, Br)
    return n * Traffic(
        reads={"Q": Nq * d * b, "K": Tr * Nk * d * b, "V": Tr * Nk * dv * b,
               "S": Nq * Nk * b, "P": Nq * Nk * b},
        writes={"S": Nq * Nk * b, "P": Nq * Nk * b, "O": Nq * dv * b, "L": Nq * STAT_BYTES})


def _count_flash2(shape, tiles: Tiles, b) -> Traffic:
    Nq, Nk, d, dv, n = shape.Nq, shape.Nk, shape.d, shape.dv, shape.problems
    jlo, jhi = tiles.kv_ranges()
    i0, i1 = tiles.q_bounds()
    q_rows = int(np.where(jhi >= jlo, i1 - i0, 0).sum())
    keys = int(_span(jlo, jhi, tiles.Bc, Nk).sum())
    return n * Traffic(
        reads={"Q": q_rows * d * b, "K": keys * d * b, "V": keys * dv * b},
        writes={"O": Nq * dv * b, "L": Nq * STAT_BYTES})


def _count_flash1(shape, tiles: Tiles, b) -> Traffic:
    Nq, Nk, d, dv, n = shape.Nq, shape.Nk, shape.d, shape.dv, shape.problems
    Br = tiles.Br
    ilo, ihi = tiles.q_ranges()
    j0, j1 = tiles.k_bounds()
    keys = int(np.where(ihi >= ilo, j1 - j0, 0).sum())
    rows = int(_span(ilo, ihi, Br, Nq).sum())
    return n * Traffic(
        reads={"K": keys * d * b, "V": keys * dv * b, "Q": rows * d * b,
               "O": rows * dv * b, "l": rows * STAT_BYTES, "m": rows * STAT_BYTES},
        writes={"O": (Nq + rows) * dv * b, "l": (Nq + rows) * STAT_BYTES,
                "m": (Nq + rows) * STAT_BYTES})


from .splitkv import count_splitkv  # noqa: E402
from .square import count_square  # noqa: E402

COUNTS = {"flash1": _count_flash1, "flash2": _count_flash2, "splitkv": count_splitkv,
          "square": count_square}
