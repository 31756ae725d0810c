"""flashsim.bench.interleaved's timing protocol, on a stand-in for CuPy's events (no GPU)."""

from types import SimpleNamespace

import pytest

from flashsim.bench import interleaved


class FakeCuPy:
    """Records the order of calls, synchronizes and event records; every timed span is
    1 ms."""

    def __init__(self):
        self.log = []
        cp = self

        class Event:
            def record(self):
                cp.log.append("record")

            def synchronize(self):
                cp.log.append("event-sync")

        class Device:
            def synchronize(self):
                cp.log.append("device-sync")
        self.cuda = SimpleNamespace(Event=Event, Device=Device,
                                    get_elapsed_time=lambda a, b: 1.0)


@pytest.mark.parametrize("queued", [True, False])
def test_the_timed_call_is_queued_behind_its_settling_calls_or_starts_on_an_idle_stream(queued):
    """Queued (the default): the settling calls, then the start event, the call and the
    stop event, no synchronize between, so the events time the GPU's work; otherwise a
    synchronize before the start event. Each entry settles for settle_ms of its own calls
    (here 5 calls of 1 ms), the entries take turns rep by rep, and ``host`` gets one host
    time per rep and entry."""
    cp = FakeCuPy()
    fns = {k: (lambda k=k: cp.log.append(k), None) for k in ("a", "b")}
    host = {}
    times = interleaved(cp, fns, reps=2, warmup=1, settle_ms=5.0, queued=queued, host=host)
    assert times == {"a": [1.0, 1.0], "b": [1.0, 1.0]}
    assert set(host) == {"a", "b"} and all(len(v) == 2 and min(v) >= 0 for v in host.values())
    # the reps: a's five settling calls and its timed one, then b's, twice
    tail = cp.log[-4 * 9:] if queued else cp.log[-4 * 10:]
    one = ["a"] * 5 + ([] if queued else ["device-sync"]) + ["record", "a", "record", "event-sync"]
    assert tail == (one + [x.replace("a", "b") for x in one]) * 2
