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


def test_advantages_op_count_counts_both_trees():
    """`benchmarks/advantages_op_count.py` counts one call's torch operations in each tree (here both HEAD: equal)."""
    import pytest

    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("no git history: the script extracts the base commit's otb_ref with git archive")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "advantages_op_count.py"), "--base=HEAD", "--shape=512,512,8"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    base, head = (json.loads(line) for line in out.stdout.splitlines())
    assert (base["tree"], head["tree"]) == ("base", "head")
    assert base["operations"] == head["operations"] > 0 and base["blocks"] == head["blocks"] >= 2
    assert 0 < head["block_passes"] < head["operations"]


def test_train_cpu_quick_records_each_kind_of_case(tmp_path):
    """`benchmarks/train_cpu.py --quick` runs train.py for each kind of case and records what TRAINING.md quotes
    (learning summary, the random-init start, phase medians), with the machine and the commit; --out appends."""
    out = tmp_path / "records.jsonl"
    cases = ["default", "long_horizon_start", "estimator_cost"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "train_cpu.py"), "--quick", "--cases", *cases, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["case"] for r in records] == cases
    assert [json.loads(line) for line in out.read_text().splitlines()] == records
    default, start, cost = records
    assert default["steps"] == 2 and 0 <= default["reward_first10"] <= 1 and default["wall_s"] > 0
    assert default["median_throughput/generation_tokens_per_s"] > 0
    assert 1 <= start["response_length_mean"] <= start["response_length_max"] <= 512
    assert cost["flags"][:2] == ["--estimator", "eob"] and 0 < cost["median_time/advantages"] < cost["median_time/step"]
    assert all(r["machine"].startswith("cpu") and "load_before" in r and "commit" in r for r in records)
    assert all(r["cpu_per_wall"] > 0 and "cpu_model" in r for r in records)
