"""Test configuration: hypothesis profiles and import path.

Profiles: ``ci`` (default under CI=true: few examples, derandomised so CI is
reproducible), ``dev`` (default locally), ``thorough`` (HYPOTHESIS_PROFILE=thorough).
"""

import os
import sys
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/strategies.py, tests/reference.py

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

_common = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
settings.register_profile("ci", max_examples=25, derandomize=True, print_blob=True, **_common)
settings.register_profile("dev", max_examples=60, **_common)
settings.register_profile("thorough", max_examples=1000, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


import pytest  # noqa: E402

import otb_ref.advantages  # noqa: E402


@pytest.fixture(params=["one_block", "row_blocks"])
def row_blocking(request):
    """Run a test with all rows in one block and with one row per block (the CPU blocking path)."""
    saved = otb_ref.advantages._CPU_BLOCK_ELEMENTS
    otb_ref.advantages._CPU_BLOCK_ELEMENTS = saved if request.param == "one_block" else 1
    yield request.param
    otb_ref.advantages._CPU_BLOCK_ELEMENTS = saved
