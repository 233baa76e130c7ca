"""The experiments' quick modes write only under pytest's tmp paths: reports and records under each test's
``tmp_path``, the policy snapshots that gradient_variance and proxy_fidelity read in :func:`snapshots_dir`."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def snapshots_dir(tmp_path_factory) -> Path:
    """``--snapshots-dir`` of the experiments' quick modes: built once a session, not cached in runs/snapshots."""
    return tmp_path_factory.mktemp("snapshots")
