"""Hypothesis profiles: `ci` (default; thorough but inside the suite's time budget)
and `dev` (quick local loop: `python3 -m pytest --hypothesis-profile=dev`).
`gpu` sizes the GPU fuzzing to finish within a few minutes on one GPU
(`python3 -m pytest -m gpu --hypothesis-profile=gpu`)."""

import os
import shutil
import signal
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, settings

# the GPU tests' `poisoned` fixture is function-scoped on purpose: it patches every
# allocation alike, so Hypothesis's examples may share it (on a GPU machine the default
# profile runs them too)
settings.register_profile(
    "ci", max_examples=150, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.function_scoped_fixture])
settings.register_profile(
    "dev", max_examples=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.function_scoped_fixture])
settings.register_profile(
    "gpu", max_examples=100, deadline=None, derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.function_scoped_fixture])
settings.load_profile("ci")


# tests/test_kernels.py checks ptxas's report of every kernel instance, per arch: a cold
# build is most of the suite's time (nvcc on every core, ~6 min for sm_90 on two). Once
# collection shows those tests will run, `flashsim kernels build` runs in a separate
# process, filling kernels.build's cache beside the suite's single-threaded CPU tests (a
# process, so that the tests' monkeypatches of flashsim and the environment cannot reach
# it). The tests then wait for it and build through the cache; whatever it failed to
# build, they compile again themselves and report.
_BUILD_TESTS = ("test_every_kernel_compiles_without_spills",
                "test_the_launch_tables_registers_give_each_builds_occupancy")
_PREBUILD: list[subprocess.Popen] = []


def pytest_collection_modifyitems(session, config, items):
    # the tests that wait for the background build run last, so that the rest of the suite
    # runs beside the build (two CPU-bound jobs on a two-core machine) rather than after it
    waits = [it for it in items if getattr(it, "originalname", None) in _BUILD_TESTS]
    if waits:
        items[:] = [it for it in items if it not in waits] + waits


def pytest_collection_finish(session):
    if shutil.which("nvcc") is None or session.config.option.collectonly:
        return
    archs = sorted({item.callspec.params["arch"] for item in session.items
                    if getattr(item, "originalname", None) in _BUILD_TESTS
                    and "arch" in getattr(getattr(item, "callspec", None), "params", {})},
                   reverse=True)                  # sm_90, the larger, first
    if not archs:
        return
    root = str(session.config.rootpath)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "flashsim", "kernels", "build"]
    for arch in archs:
        cmd += ["--arch", arch]
    # a session of its own, so that an interrupted run can stop its nvcc processes too
    _PREBUILD.append(subprocess.Popen(cmd, cwd=root, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True))


def pytest_sessionfinish(session):
    for proc in _PREBUILD:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="session")
def kernel_build():
    """``kernel_build(arch)``: ptxas's report of every instance for ``arch`` (a tuple of
    kernels.BuildRow), once the background build has finished; one per arch a session."""
    from flashsim import kernels
    done: dict[str, tuple] = {}

    def get(arch):
        for proc in _PREBUILD:
            proc.wait()
        if arch not in done:
            done[arch] = tuple(kernels.build(arch))
        return done[arch]
    return get
