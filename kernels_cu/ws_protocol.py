"""A model of flash2_fwd_ws's synchronisation (flash2_ws.cu), to check a change of its
protocol for deadlocks before it runs on a GPU: the producer and each consumer warpgroup
as agents, the mbarriers with their phases and arrival counts (a warp's arrival counted 4
to a warpgroup), the consumers' named-barrier ping-pong, the per-warpgroup bound (the
producer arriving for the warpgroups that skip a step), tiles with no visible key, one or
two Q slots' parities, 1–3 K/V stages, with and without the tile counter; the tensor
cores and the copy engine finish at once. Random interleavings of random tile sequences;
`python3 kernels_cu/ws_protocol.py [runs]`. It mirrors the kernel's code by hand: a
change of the kernel's waits, arrivals or turns needs the same change here (NOTES v50:
a version that fused each tile's last P V with the next tile's first S deadlocked here
before it ran on a GPU)."""
import random
import sys

PROGRESS = [0]    # arrivals so far: an interleaving that makes none while every agent waits is stuck


class Mbar:
    """An mbarrier: ``count`` arrivals complete a phase."""

    def __init__(self, count):
        self.count, self.got, self.phase = count, 0, 0

    def arrive(self, n=1):
        PROGRESS[0] += 1
        self.got += n
        assert self.got <= self.count, "over-arrival"
        if self.got == self.count:
            self.got, self.phase = 0, self.phase + 1

    def done(self, ph):
        """Whether mbar_wait(bar, ph) returns."""
        return (self.phase & 1) != ph


class Named:
    """A named barrier of two warpgroups (bar.sync's count: the waiter and the passer)."""

    def __init__(self):
        self.got, self.gen = 0, 0

    def arrive(self):
        PROGRESS[0] += 1
        self.got += 1
        assert self.got <= 2, "named barrier over-arrival"
        if self.got == 2:
            self.got, self.gen = 0, self.gen + 1


def run(tiles, C, STAGES, counter, seed, frees_skipped=True, free_late=True, frees_late=True):
    """One interleaving of a CTA's C consumer warpgroups and producer over ``tiles``
    ((jlo, jhi, [each warpgroup's last key tile]) per tile, in the CTA's order) with
    STAGES K/V slots: ('ok', each warpgroup's turns), 'deadlock', or 'arrival left' (a
    barrier not at rest at the end). ``counter``: the consumers read each tile's index
    from its Q slot (the tile counter's walk; with FLASHSIM_WS_TILE_SMEM, the kernel's
    default, every walk reads its tile's problem and row there, which waits the same).
    free_late (FLASHSIM_WS_O_FREE_LATE, the default): a warpgroup's first warp frees the
    slot its O_i left from only after the next tile's first S is issued (or at that tile's
    top where it has no step there, or at the end), the other three warps at the epilogue.
    frees_skipped=False: a producer that does not arrive for the warpgroups that skip a
    step; frees_late=False: a first warp that never makes its late arrival (seeded bugs)."""
    rng = random.Random(seed)
    fullQ, emptyQ = [Mbar(1), Mbar(1)], [Mbar(4 * C), Mbar(4 * C)]
    fullK, emptyK = [Mbar(1) for _ in range(STAGES)], [Mbar(4 * C) for _ in range(STAGES)]
    fullV, emptyV = [Mbar(1) for _ in range(STAGES)], [Mbar(4 * C) for _ in range(STAGES)]
    named = [Named() for _ in range(C + 1)]
    nt = len(tiles)

    def W(bar, ph):            # a wait: yield until done
        while not bar.done(ph):
            yield

    def producer():
        n = 0
        for kq in range(nt + 1):
            q = kq & 1
            yield from W(emptyQ[q], ((kq >> 1) & 1) ^ 1)
            if kq == nt:                                 # the tile counter's end mark
                fullQ[q].arrive()
                return
            jlo, jhi, wl = tiles[kq]
            fullQ[q].arrive()        # Q_i (its bytes land at once)
            if jhi < jlo:
                continue
            for j in range(jlo, jhi + 1):
                s, ph = n % STAGES, (n // STAGES) & 1
                skip = 4 * sum(j > w for w in wl) if frees_skipped else 0
                yield from W(emptyK[s], ph ^ 1)
                fullK[s].arrive()
                if skip:                                 # for the warpgroups past their bound
                    emptyK[s].arrive(skip)
                yield from W(emptyV[s], ph ^ 1)
                fullV[s].arrive()
                if skip:
                    emptyV[s].arrive(skip)
                n += 1
    turns = [0] * C

    def consumer(cw):
        nxt = 0 if cw + 1 == C else cw + 1

        def turn_wait():
            g = named[1 + cw].gen
            named[1 + cw].arrive()
            while named[1 + cw].gen == g:
                yield
            turns[cw] += 1

        def turn_pass():
            named[1 + nxt].arrive()

        def turn():                  # issue in turn: wait for it, then pass it on
            yield from turn_wait()
            turn_pass()

        if nxt == 0:                 # the last warpgroup lets the first take the first turn
            named[1].arrive()
        nb = 0
        pending = [None]             # free_late: the slot whose first warp's arrival waits

        def free_o_slot():
            if pending[0] is not None and frees_late:
                emptyQ[pending[0]].arrive(1)
            pending[0] = None

        for kq in range(nt + 1):
            q = kq & 1
            if counter:              # the tile's index, read from its Q slot
                yield from W(fullQ[q], (kq >> 1) & 1)
            if kq == nt:
                free_o_slot()
                break
            jlo, jhi, wls = tiles[kq]
            yield from W(fullQ[q], (kq >> 1) & 1)
            if jhi < jlo:            # no visible key: no turns
                free_o_slot()
                emptyQ[q].arrive(4)
                continue
            slot = lambda j: (nb + j - jlo) % STAGES
            par = lambda j: ((nb + j - jlo) // STAGES) & 1
            wl = wls[cw]
            if wl >= jlo:
                yield from W(fullK[slot(jlo)], par(jlo))
                yield from turn()      # S_jlo
                free_o_slot()          # (free_late: the last tile's O slot, while S_jlo runs)
                emptyK[slot(jlo)].arrive(4)
                for j in range(jlo + 1, wl + 1):         # S_j with P_{j-1} V_{j-1}
                    yield from W(fullK[slot(j)], par(j))
                    yield from W(fullV[slot(j - 1)], par(j - 1))
                    yield from turn()
                    emptyK[slot(j)].arrive(4)
                    emptyV[slot(j - 1)].arrive(4)
                yield from W(fullV[slot(wl)], par(wl))
                yield from turn()      # the last P V
                emptyV[slot(wl)].arrive(4)
            free_o_slot()              # (pending where this warpgroup ran no step)
            if free_late:              # the epilogue: three warps now, the first one later
                emptyQ[q].arrive(3)
                pending[0] = q
            else:
                emptyQ[q].arrive(4)                      # the epilogue frees Q's slot
            # the turns of the steps skipped (v48): jhi − jlo + 2 per tile for every warpgroup
            for t in range(jlo - 2 if wl < jlo else wl, jhi):
                yield from turn()
            nb += jhi - jlo + 1
        if cw == 0:
            yield from turn_wait()

    live = {"P": producer()} | {f"C{c}": consumer(c) for c in range(C)}
    stuck, seen = 0, PROGRESS[0]
    while live:
        k = rng.choice(list(live))
        try:
            next(live[k])
        except StopIteration:
            del live[k]
            stuck = 0
            continue
        if PROGRESS[0] != seen:
            stuck, seen = 0, PROGRESS[0]
        else:
            stuck += 1
        if stuck > 200 * len(live):      # every agent tried many times, no arrival: a deadlock
            return "deadlock", sorted(live)
    # every barrier back at rest
    if any(nm.got for nm in named) or any(b.got for b in fullQ + emptyQ + fullK + emptyK + fullV + emptyV):
        return "arrival left", turns
    return "ok", turns


def random_tiles(rng, C, n):
    """n tiles for run(): some with no visible key, the rest with per-warpgroup bounds."""
    out = []
    for _ in range(n):
        if rng.random() < 0.15:
            out.append((0, -1, [0] * C))
            continue
        jlo = rng.randrange(0, 4)
        jhi = jlo + rng.randrange(0, 5)
        # warpgroups' bounds (the kernel's grow with c, as rows further down see later
        # keys; any order here): one with rows sees jhi; some past N (jlo − 1)
        k = rng.randrange(1, C + 1)                  # warpgroups with rows
        wl = sorted(rng.randrange(jlo - 1, jhi + 1) for _ in range(k))
        wl[-1] = jhi
        wl += [jlo - 1] * (C - k)
        out.append((jlo, jhi, wl))
    return out


if __name__ == "__main__":
    rng = random.Random(50)
    bad = 0
    N = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    for it in range(N):
        C, STAGES = rng.choice((2, 3)), rng.choice((1, 2, 3))
        tiles = random_tiles(rng, C, rng.randrange(1, 6))
        for counter in (0, 1):
            r, info = run(tiles, C, STAGES, counter, it, free_late=bool(it & 1))
            if r != "ok":
                bad += 1
                if bad < 6:
                    print("BAD", r, dict(C=C, STAGES=STAGES, counter=counter, tiles=tiles), info)
    print("bad", bad, "of", N * 2)
