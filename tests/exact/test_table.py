"""`python -m otb_ref.exact` runs and prints both tables (small horizons; nothing timed)."""

import subprocess
import sys


def test_exact_table_command():
    """The command prints a population row per (policy, horizon) and group rows for each N."""
    out = subprocess.run(
        [sys.executable, "-m", "otb_ref.exact", "--horizons", "2", "3", "--group-horizons", "2", "--group-sizes", "2", "3", "--skip-transformer"],
        check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    population = [line for line in out.splitlines() if line.startswith("| tree |") or line.startswith("| shared |")]
    assert len([line for line in population if line.count("|") == 14]) == 4  # 2 policies x 2 horizons
    group_rows = [line for line in population if line.count("|") == 9]
    assert len(group_rows) == 2 * 2 * 8  # 2 policies x N in {2, 3} x 8 estimators
    optimal_column = [line.split("|")[-2].strip() for line in population if line.count("|") == 14]
    assert optimal_column == ["1.0000"] * 4  # B** relative to itself
    leave_one_out_bias = [float(line.split("|")[7]) for line in group_rows if "grpo" not in line]
    assert max(leave_one_out_bias) < 1e-9  # F7: leave-one-out is unbiased (std scaling excepted)


def test_exact_table_rejects_bad_flags():
    result = subprocess.run([sys.executable, "-m", "otb_ref.exact", "--vocab", "1"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "--vocab" in result.stderr and "Traceback" not in result.stderr
