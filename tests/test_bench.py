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


def test_interleaved_gives_each_rep_the_host_times_its_window_ran_between():
    """``spans``: per entry and rep, the host times between which the window ran, with as
    much of the settling before it as makes 200 ms (here all 5 ms of it: 3 + 5 ms)."""
    cp = FakeCuPy()
    fns = {k: (lambda k=k: cp.log.append(k), None) for k in ("a", "b")}
    spans = {}
    interleaved(cp, fns, reps=2, warmup=1, settle_ms=5.0, window_ms=3.0, spans=spans)
    assert set(spans) == {"a", "b"} and all(len(v) == 2 for v in spans.values())
    for t0, t1 in spans["a"] + spans["b"]:
        assert t1 - t0 == pytest.approx(0.008, abs=1e-6)   # (time.time()'s float)
    assert spans["a"][0][1] <= spans["b"][0][1] <= spans["a"][1][1] <= spans["b"][1][1]


FAKE_SMI = '''
import datetime, sys, time
# nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader,nounits -lms P -i ID
assert sys.argv[1] == "--query-gpu=timestamp,clocks.sm,power.draw", sys.argv
assert sys.argv[2:5] == ["--format=csv,noheader,nounits", "-lms", "10"], sys.argv
assert sys.argv[5:] == ["-i", "0000:01:00.0"], sys.argv
n = 0
while True:
    now = datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    watts = "[N/A]" if n % 3 == 2 else str(600 + 100 * (n % 3))
    print(f"{now}, {1500 + 100 * (n % 3)}, {watts}", flush=True)
    n += 1
    time.sleep(0.01)
'''


def test_power_sampler_averages_nvidia_smis_samples_over_the_spans(tmp_path):
    """The samples are nvidia-smi's lines placed by their own timestamps; lines it could
    not read ("[N/A]") are left out; a span with no sample gives None."""
    import sys
    import time

    from flashsim.bench import PowerSampler
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!{sys.executable}\n{FAKE_SMI}")
    fake.chmod(0o755)
    t0 = time.time()
    ps = PowerSampler(gpu="0000:01:00.0", period_ms=10, exe=str(fake))
    while len(ps.samples) < 5 and time.time() < t0 + 30:   # (a slow start on a busy host)
        time.sleep(0.05)
    t1 = time.time()
    ps.stop()
    inside = [x for x in ps.samples if x[0] <= t1]
    assert len(inside) >= 5 and min(x[0] for x in ps.samples) >= t0 - 0.002
    # the [N/A] lines (every third, at 1700 MHz) are not samples
    assert {mhz for _, mhz, _ in ps.samples} == {1500.0, 1600.0}
    assert {w for _, mhz, w in ps.samples} == {600.0, 700.0}
    mhz, watts, n = ps.mean([(t0 - 0.002, t1)])
    assert n == len(inside)
    assert mhz == pytest.approx(sum(x[1] for x in inside) / n)
    assert watts == pytest.approx(mhz - 900.0)
    assert ps.mean([(t1 + 10, t1 + 20)]) is None and ps.mean([]) is None
    assert PowerSampler.parse("2026/11/29 10:16:02.123, 1600, [N/A]") is None
    assert PowerSampler.parse("2026/11/29 10:16:02.123, 1600, 650.5")[1:] == (1600.0, 650.5)


def test_power_without_nvidia_smi_is_refused_before_any_gpu_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        main(["--power"])
    assert e.value.code == 2 and "nvidia-smi" in capsys.readouterr().err


def test_the_table_is_the_committed_runs_and_gains_power_columns_where_measured():
    """bench.md from a run's bench.json reads as that run's bench.md did; rows with
    --power's fields get their clock and power columns."""
    import json
    from pathlib import Path

    from flashsim.bench import table
    out = Path(__file__).resolve().parent.parent / "analysis" / "out" / "bench"
    run = json.loads((out / "ws_v89_h200_bf16.json").read_text())
    assert table(run["rows"], run["meta"]) == (out / "ws_v89_h200_bf16.md").read_text().splitlines()
    rows = [dict(r) for r in run["rows"][:3]]
    rows[0].update(fwd_mhz=1581.04, fwd_w=690.2, bwd_mhz=1700.0, bwd_w=691.0)
    md = table(rows, run["meta"])
    assert md[4].endswith("| fwd MHz | fwd W | bwd MHz | bwd W |") and md[5].count("---") == 17
    assert md[6].endswith("| 1581 | 690 | 1700 | 691 |") and md[7].endswith("|  |  |  |  |")
