"""Hypothesis strategies for attention problems, shared by the test suite and by users
who want to fuzz their own kernels against the simulator.

    from hypothesis import given
    from flashsim.strategies import attention_problems

    @given(attention_problems())
    def test_my_kernel(p):
        out, lse = my_kernel(p.q, p.k, p.v, causal=p.causal)
        ref_out, ref_lse = flashsim.attention_reference(p.q, p.k, p.v, causal=p.causal)
        ...

Sizes lean on the shapes that break tiled kernels: 1, primes, one past a power of two,
Nq ≠ Nk, d ≠ dv, block sizes that do not divide N. Inputs carry outliers (up to ±30)
because with only unit-normal data a missing max-subtraction or a wrong rescale
factor rarely shows: large logits are what make the online softmax earn its keep.
Requires hypothesis (a test dependency, not a run-time one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

# Sizes that break tiled code: 1, small primes, odd numbers around powers of two.
AWKWARD_SIZES = (1, 2, 3, 5, 7, 11, 13, 17, 31, 33, 63, 65, 97, 113, 127, 129, 203)
AWKWARD_HEAD_DIMS = (1, 3, 8, 16, 32, 40, 59, 64, 96, 111, 128, 160, 256)
OUTLIER = 30.0


def seq_lens(max_size: int = 203, allow_zero: bool = False) -> st.SearchStrategy[int]:
    """A sequence length: an awkward size or any size in range (optionally 0)."""
    lo = 0 if allow_zero else 1
    awkward = [n for n in AWKWARD_SIZES if n <= max_size]
    return st.one_of(st.sampled_from(awkward), st.integers(lo, max_size))


def head_dims(max_dim: int = 64) -> st.SearchStrategy[int]:
    awkward = [n for n in AWKWARD_HEAD_DIMS if n <= max_dim]
    return st.one_of(st.sampled_from(awkward), st.integers(1, max_dim))


def block_sizes(max_block: int = 64) -> st.SearchStrategy[tuple[int, int]]:
    """(Br, Bc), mostly not dividing the sequence lengths drawn above."""
    b = st.one_of(st.sampled_from([1, 2, 3, 7, 16, 32, 64]), st.integers(1, max_block))
    return st.tuples(b.filter(lambda x: x <= max_block), b.filter(lambda x: x <= max_block))


@st.composite
def batch_shapes(draw, max_batch: int = 2, max_heads: int = 4):
    """(q_batch, kv_batch): leading axes of q and k/v, with GQA/MQA head groups and
    size-1 axes that broadcast."""
    ndim = draw(st.integers(0, 2))
    if ndim == 0:
        return (), ()
    hk = draw(st.integers(1, max_heads))
    g = draw(st.sampled_from([1, 1, 2, 3]))     # query heads per K/V head
    hq = hk * g
    if ndim == 1:
        return (hq,), (hk,)
    B = draw(st.integers(1, max_batch))
    kvB = draw(st.sampled_from([B, 1]))         # K/V may broadcast over batch
    return (B, hq), (kvB, hk)


def random_tensor(rng: np.random.Generator, shape, outliers: bool = True) -> np.ndarray:
    """Unit normal entries with a few set to ±30 (never all zero)."""
    x = rng.standard_normal(shape)
    if outliers and x.size:
        n = max(1, x.size // 50)
        idx = rng.integers(0, x.size, n)
        x.flat[idx] = rng.choice([-OUTLIER, OUTLIER], n) * rng.uniform(0.5, 1.0, n)
    return x


@dataclass(frozen=True)
class AttentionProblem:
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    causal: bool
    block_sizes: tuple[int, int]

    @property
    def Nq(self) -> int:
        return self.q.shape[-2]

    @property
    def Nk(self) -> int:
        return self.k.shape[-2]

    @property
    def d(self) -> int:
        return self.q.shape[-1]

    @property
    def dv(self) -> int:
        return self.v.shape[-1]


@st.composite
def attention_problems(draw, *, max_seq: int = 203, max_dim: int = 64, max_block: int = 64,
                       max_heads: int = 4, dtypes=(np.float64,), causal=None,
                       allow_empty: bool = False, outliers: bool = True):
    """q, k, v arrays plus a causal flag and block sizes.

    Values come from a seeded NumPy generator (drawing each element through Hypothesis
    would be slow); the seed is part of the example, so failures replay exactly.
    """
    Nq = draw(seq_lens(max_seq, allow_empty))
    Nk = draw(seq_lens(max_seq, allow_empty))
    d = draw(head_dims(max_dim))
    dv = draw(st.one_of(st.just(d), head_dims(max_dim)))
    qb, kb = draw(batch_shapes(max_heads=max_heads))
    is_causal = draw(st.booleans()) if causal is None else bool(causal)
    blocks = draw(block_sizes(max_block))
    dtype = draw(st.sampled_from(list(dtypes)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scale_q = draw(st.sampled_from([0.5, 1.0, 3.0]))  # sharper or flatter softmax
    q = (scale_q * random_tensor(rng, qb + (Nq, d), outliers)).astype(dtype)
    k = random_tensor(rng, kb + (Nk, d), outliers).astype(dtype)
    v = random_tensor(rng, kb + (Nk, dv), outliers).astype(dtype)
    return AttentionProblem(q, k, v, is_causal, blocks)


@st.composite
def problem_sizes(draw, *, max_seq: int = 4096, max_dim: int = 256, max_heads: int = 8):
    """Keyword arguments for `flashsim.count` (no arrays): sizes only."""
    qb, kb = draw(batch_shapes(max_heads=max_heads))
    return dict(Nq=draw(seq_lens(max_seq, allow_zero=True)),
                Nk=draw(seq_lens(max_seq, allow_zero=True)),
                d=(d := draw(head_dims(max_dim))),
                dv=draw(st.one_of(st.just(d), head_dims(max_dim))),
                batch_shape=qb, kv_batch_shape=kb)
