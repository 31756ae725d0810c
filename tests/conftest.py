"""Hypothesis profiles: `ci` (default; thorough but inside the suite's time budget)
and `dev` (quick local loop: `python3 -m pytest --hypothesis-profile=dev`).
A `gpu` profile sized for one GPU arrives with the GPU tests."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=150, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "dev", max_examples=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("ci")
