"""The benchmark command runs and prints the documented JSON records (tiny shapes; no timing asserted)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_benchmark_command_quick():
    """`python benchmarks/run.py --quick` prints one JSON line per measurement, with the ratio fields."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick"],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    otb = [r for r in records if r["bench"] == "otb"]
    proxy = [r for r in records if r["bench"] == "proxy"]
    assert len(otb) == 2 and len(proxy) == 2
    for record in otb:
        assert record["vectorised_over_floor"] > 0 and record["loop_over_vectorised"] > 0
    assert {r["mode"] for r in proxy} == {"forward", "forward_backward"}
    for record in proxy:
        assert record["chunked_seconds"] > 0 and record["naive_seconds"] > 0


def test_gpu_flag_without_cuda_is_one_clear_line():
    """`run.py --gpu` on a machine without CUDA exits non-zero with one line saying so (CPU CI)."""
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available: `run.py --gpu --quick` is exercised on the GPU machine")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--gpu", "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and out.stdout == ""
    assert out.stderr.strip().startswith("--gpu: CUDA is not available") and len(out.stderr.strip().splitlines()) == 1


def test_advantages_vs_commit_quick_times_both_trees(tmp_path):
    """`benchmarks/advantages_vs_commit.py --quick` (any load) times this tree and the base commit's otb_ref in
    separate processes, one record per round naming the otb_ref each imported, and one summary per shape. The base
    here is HEAD (a shallow clone may lack 78958c0, the default)."""
    import pytest

    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("no git history: the benchmark extracts the base commit's otb_ref with git archive")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "advantages_vs_commit.py"),
            "--quick",
            "--allow-load",
            "--rounds=1",
            "--repeats=1",
            "--estimator=otb",
            "--base=HEAD",
            "--worker-env=OTB_BENCH_PROBE=a=b",
            f"--out={tmp_path / 'records.jsonl'}",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert records == [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert records[0]["worker_env"] == {"OTB_BENCH_PROBE": "a=b"}  # the header says what the workers were given
    rounds = [r for r in records if "round" in r]
    assert len(rounds) == 2 and len([r for r in records if r.get("summary")]) == 2
    for record in rounds:
        assert Path(record["head_otb_ref"]).is_relative_to(ROOT)
        assert not Path(record["base_otb_ref"]).is_relative_to(ROOT)
        assert record["head_seconds"] > 0 and record["base_seconds"] > 0 and "base_load_1min" in record
    assert records[0]["base"] == "HEAD" and records[0]["threads"] == 2


def test_advantages_vs_commit_refuses_a_worker_env_without_a_value():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "advantages_vs_commit.py"), "--quick", "--worker-env=NO_VALUE"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--worker-env: expected NAME=VALUE" in out.stderr
