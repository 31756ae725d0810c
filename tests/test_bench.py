"""flashsim.bench.interleaved's timing protocol, on a stand-in for CuPy's events (no GPU)."""

from types import SimpleNamespace

import pytest

from flashsim.bench import interleaved, main


class FakeCuPy:
    """Records the order of calls, synchronizes and event records; every call takes
    1 ms, so a span between two events lasts as many ms as calls were made in it."""

    def __init__(self):
        self.log = []
        cp = self

        class Event:
            def record(self):
                cp.log.append("record")
                self.at = len(cp.log)

            def synchronize(self):
                cp.log.append("event-sync")

        class Device:
            def synchronize(self):
                cp.log.append("device-sync")
        def elapsed(a, b):
            return float(sum(x in ("a", "b") for x in cp.log[a.at:b.at]))
        self.cuda = SimpleNamespace(Event=Event, Device=Device, get_elapsed_time=elapsed)


@pytest.mark.parametrize("queued", [True, False])
def test_each_window_is_queued_behind_its_settling_calls_or_starts_on_an_idle_stream(queued):
    """Queued (the default): the settling calls, then the start event, the window's calls
    and the stop event, no synchronize between, so the events time the GPU's work;
    otherwise a synchronize before the start event. Each entry settles for settle_ms of
    its own calls (here 5 calls of 1 ms) and times window_ms of them (3 calls) per rep,
    reported per call; the entries take turns rep by rep, and ``host`` gets one host time
    per rep and entry."""
    cp = FakeCuPy()
    fns = {k: (lambda k=k: cp.log.append(k), None) for k in ("a", "b")}
    host = {}
    times = interleaved(cp, fns, reps=2, warmup=1, settle_ms=5.0, queued=queued, host=host,
                        window_ms=3.0)
    assert times == {"a": [1.0, 1.0], "b": [1.0, 1.0]}
    assert set(host) == {"a", "b"} and all(len(v) == 2 and min(v) >= 0 for v in host.values())
    # the reps: a's five settling calls and its timed three, then b's, twice
    one = (["a"] * 5 + ([] if queued else ["device-sync"]) + ["record"] + ["a"] * 3
           + ["record", "event-sync"])
    assert cp.log[-4 * len(one):] == (one + [x.replace("a", "b") for x in one]) * 2


def test_a_window_of_zero_times_one_call_and_settling_takes_at_least_one():
    """window_ms=0 and settle_ms=0: one untimed call, then one timed call, per rep."""
    cp = FakeCuPy()
    fns = {"a": (lambda: cp.log.append("a"), None)}
    times = interleaved(cp, fns, reps=3, warmup=1, settle_ms=0.0, window_ms=0.0)
    assert times == {"a": [1.0, 1.0, 1.0]}
    assert cp.log[-3 * 5:] == ["a", "record", "a", "record", "event-sync"] * 3


@pytest.mark.parametrize("argv, says", [(["--reps", "0"], "at least 1"),
                                        (["--settle-ms", "-5"], "0 or more"),
                                        (["--window-ms", "nan"], "0 or more")])
def test_bad_timing_options_are_refused_before_any_gpu_work(argv, says, capsys):
    """argparse's error (exit 2) names the option's rule; nothing is timed."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err
