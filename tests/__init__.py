"""vmready's trial test suite.

Hypothesis runs here without its timing checks: a per-example deadline and
the "too slow" health check assert speed, which on a shared machine fails
tests that behave correctly. Speed is measured in ``benchmarks/``, not here.
"""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "vmready",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("vmready")
