"""Hypothesis profiles: `ci` (default; thorough but inside the suite's time budget)
and `dev` (quick local loop: `python3 -m pytest --hypothesis-profile=dev`).
`gpu` sizes the GPU fuzzing to finish within a few minutes on one GPU
(`python3 -m pytest -m gpu --hypothesis-profile=gpu`)."""

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
