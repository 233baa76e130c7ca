"""experiments/equal_rate.py and the code stamp of experiments/common/: the quick mode (records with their code,
resume, report), the refusals without a committed rule, the seeds, r from issue 28's records, the exact tests and
the verdict rule on synthetic records (each outcome), never the verdict itself."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import equal_rate

import common


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.fixture
def repo(tmp_path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q", "-b", "main")
    _git(root, "config", "user.email", "t@example.com")
    _git(root, "config", "user.name", "t")
    (root / "a.txt").write_text("a\n")
    _git(root, "add", "a.txt")
    _git(root, "commit", "-q", "-m", "first")
    return root


def test_code_state_marks_a_dirty_tree(repo, tmp_path):
    """Clean after a commit; an untracked file or a modified tracked one marks it dirty; outside git, unknown."""
    head = _git(repo, "rev-parse", "HEAD")
    assert common.read_code_state(repo) == {"commit": head, "clean": True}
    (repo / "new.txt").write_text("x\n")
    assert common.read_code_state(repo) == {"commit": head, "clean": False}
    (repo / "new.txt").unlink()
    (repo / "a.txt").write_text("changed\n")
    assert common.read_code_state(repo)["clean"] is False
    outside = tmp_path / "plain"
    outside.mkdir()
    state = common.read_code_state(outside)
    assert state["commit"] is None and state["clean"] is None and state["error"]
    assert "uncommitted changes" in common.code_text({"commit": head, "clean": False})


def test_records_carry_the_code_of_their_process(tmp_path):
    path = common.write_json_record(tmp_path / "r.json", {"x": 1})
    assert json.loads(path.read_text())["code"] == common.CODE_AT_START
    assert common.CODE_AT_START["commit"] == _git(ROOT, "rev-parse", "HEAD")
    path = common.write_records("some", {"y": 2}, tmp_path)
    assert json.loads(path.read_text())["code"] == common.CODE_AT_START


def test_equal_rate_quick_records_resumes_and_reports(tmp_path):
    out, runs = tmp_path / "out", tmp_path / "runs"
    report = equal_rate.main(["--quick", "--runs-dir", str(runs), "--out-dir", str(out)])
    records = out / "equal_rate"
    seeds = equal_rate.seeds_from("quick", 2)
    names = sorted(p.name for p in records.glob("*.json"))
    assert names == sorted(f"{arm}_n2_lr0.001_seed{s}.json" for arm in equal_rate.ARMS for s in seeds)
    matched = json.loads((records / f"rloo_matched_n2_lr0.001_seed{seeds[0]}.json").read_text())
    assert matched["arm_lr"] == 0.0015 and matched["flags"][matched["flags"].index("--lr") + 1] == "0.0015"
    assert matched["code"] == common.CODE_AT_START and [row[0] for row in matched["steps"]] == [1, 2]
    text = report.read_text()
    assert "Rule output: **" in text and "| rloo_matched | 0.0015 |" in text and "Code:" in text
    stamps = {p.name: p.stat().st_mtime_ns for p in records.iterdir()}
    equal_rate.main(["--quick", "--runs-dir", str(runs), "--out-dir", str(out)])
    assert {p.name: p.stat().st_mtime_ns for p in records.iterdir()} == stamps


def test_driver_refuses_without_a_committed_rule(repo, tmp_path):
    rule = repo / "RULE.md"
    with pytest.raises(equal_rate.RuleError, match="missing"):
        equal_rate.main(["--rule", str(rule), "--out-dir", str(tmp_path / "out"), "--runs-dir", str(tmp_path)])
    assert not (tmp_path / "out").exists()
    rule.write_text("rule\n")
    with pytest.raises(equal_rate.RuleError, match="not committed"):
        equal_rate.rule_commit(rule)
    _git(repo, "add", "RULE.md")
    _git(repo, "commit", "-q", "-m", "rule")
    commit = _git(repo, "rev-parse", "HEAD")
    (repo / "a.txt").write_text("later\n")
    _git(repo, "commit", "-q", "-am", "later")
    assert equal_rate.rule_commit(rule) == commit  # the commit that added it, not the latest
    rule.write_text("rule, changed\n")
    with pytest.raises(equal_rate.RuleError, match="changed since"):
        equal_rate.rule_commit(rule)
    _git(repo, "commit", "-q", "-am", "rule changed")
    with pytest.raises(equal_rate.RuleError, match="changed since"):
        equal_rate.rule_commit(rule)


def test_records_count_only_with_the_rule_clean_code_descending_from_it(repo):
    rule = _git(repo, "rev-parse", "HEAD")
    (repo / "a.txt").write_text("b\n")
    _git(repo, "commit", "-q", "-am", "after")
    after = _git(repo, "rev-parse", "HEAD")
    _git(repo, "checkout", "-q", "--orphan", "other")
    _git(repo, "commit", "-q", "-m", "unrelated")
    unrelated = _git(repo, "rev-parse", "HEAD")
    assert equal_rate.is_ancestor(repo, rule, after) and not equal_rate.is_ancestor(repo, rule, unrelated)

    def why(rule_commit, commit, clean=True):
        return equal_rate.admissible(
            {"rule_commit": rule_commit, "code": {"commit": commit, "clean": clean}}, rule, repo
        )

    assert why(rule, after) == "" and why(rule, rule) == ""
    assert "descend" in why(rule, unrelated)
    assert "uncommitted" in why(rule, after, clean=False)
    assert "rule commit" in why(after, after)


def test_seeds_from_the_commit_hash():
    a, b = equal_rate.seeds_from("a" * 40), equal_rate.seeds_from("b" * 40)
    assert len(set(a)) == 10 and a == equal_rate.seeds_from("a" * 40) and a != b
    assert all(10_000 <= s < 1_000_000 for s in a + b)
    import hashlib

    assert a[0] == 10_000 + int(hashlib.sha256(("a" * 40 + "/0").encode()).hexdigest()[:8], 16) % 990_000


def test_update_ratio_from_issue_28_records_is_the_rules():
    """r as RULE.md quotes it, recomputed from issue 28's committed records (and its report's rounded column)."""
    rule = (ROOT / "results" / "equal_rate" / "RULE.md").read_text()
    for (n, lr), quoted in {(4, 3e-4): 1.077, (16, 3e-4): 1.092, (4, 1e-3): 1.356, (16, 1e-3): 1.431}.items():
        assert equal_rate.update_ratio(equal_rate.ISSUE_28, n, lr) == quoted
        assert f"r = {quoted}" in rule
    report = (ROOT / "results" / "variance_lr.md").read_text()
    for row, rounded in (("\n| 4 | 0.0003 | 3 |", "| 1.08 |"), ("\n| 16 | 0.0003 | 3 |", "| 1.09 |")):
        assert report.split(row)[1].split("\n")[0].endswith(rounded)
    with pytest.raises(ValueError, match="records_dir"):
        equal_rate.update_ratio(equal_rate.ISSUE_28, 8, 3e-4)


def test_exact_tests():
    assert equal_rate.sign_flip_p([0.1] * 10) == 1 / 1024
    assert equal_rate.sign_flip_p([-0.1] * 10) == 1.0
    assert equal_rate.sign_flip_p([0.3, -0.1]) == 0.5  # (+,+) and (+,−) reach the observed mean 0.1
    assert equal_rate.sign_flip_p([0.1, 0.2, 0.3]) == 1 / 8
    assert equal_rate.holm({"a": 0.01, "b": 0.04}) == {"a": 0.02, "b": 0.04}
    assert equal_rate.holm({"a": 0.03, "b": 0.02}) == {"a": 0.04, "b": 0.04}
    assert equal_rate.mcnemar_p([True] * 5 + [False] * 5, [False] * 10) == 2 / 32
    assert equal_rate.mcnemar_p([True, False], [False, True]) == 1.0
    assert equal_rate.mcnemar_p([False] * 3, [False] * 3) == 1.0


def _record(arm, n, lr, seed, reward, step):
    rows = [{"step": i + 1, "tokens": 100 * (i + 1), "generated_tokens": 100, "reward_mean": reward,
             "update_norm": step} for i in range(10)]  # fmt: skip
    return {"arm": arm, "group_size": n, "lr": lr, "seed": seed, "rows": rows}


def _cells(otb: list[float], matched: list[float], seeds=range(10)):
    import variance_lr

    runs = []
    for n in (4, 16):
        runs += [_record("otb_loo", n, 3e-4, s, 0.5 + otb[i], 0.0108) for i, s in enumerate(seeds)]
        runs += [_record("rloo", n, 3e-4, s, 0.5, 0.01) for s in seeds]
        runs += [_record("rloo_matched", n, 3e-4, s, 0.5 + matched[i], 0.0106) for i, s in enumerate(seeds)]
    by_cell = variance_lr.cells(runs)
    return [equal_rate.cell(by_cell, n, 3e-4, list(range(10))) for n in (4, 16)]


def test_verdict_rule_comes_out_each_way():
    up = [0.02, 0.03, 0.01, 0.02, 0.04, 0.02, 0.03, 0.01, 0.02, 0.05]
    assert "**variance reduction helps at equal step size**" in equal_rate.verdict(_cells(up, [0.0] * 10))
    assert "**step-matched RLOO better**" in equal_rate.verdict(_cells([0.0] * 10, up))
    mixed = [0.02, -0.03, 0.01, -0.02, 0.04, -0.02, 0.03, -0.01, 0.02, -0.05]
    text = equal_rate.verdict(_cells(mixed, [0.0] * 10))
    assert "**not shown at equal step size**" in text and "step sizes not matched" not in text
    cells = _cells(up, [0.0] * 10)
    assert cells[0]["p_otb"] == 1 / 1024 and abs(cells[0]["step_ratio"] - 0.0108 / 0.0106) < 1e-12
    assert abs(cells[0]["step_ratio_unmatched"] - 1.08) < 1e-12
    one_short = _cells(up[:9], [0.0] * 9, seeds=range(9))
    assert "**not decided yet** (18 complete seed triples of 20)" in equal_rate.verdict(one_short)


def test_the_docs_quote_the_committed_verdict():
    """The rule's output and the numbers RESULTS.md, the README and results/equal_rate.md quote, recomputed from the
    committed records with the committed rule (its commit, seeds and admissibility checks)."""
    import re

    import variance_lr
    import variance_lr_pilot as pilot

    commit = equal_rate.rule_commit()
    seeds = equal_rate.seeds_from(commit)
    runs = pilot.load_runs(ROOT / "results" / "equal_rate")
    assert not [r["name"] for r in runs if equal_rate.admissible(r, commit)]
    by_cell = variance_lr.cells(runs)
    cells = [equal_rate.cell(by_cell, n, 3e-4, seeds) for n in equal_rate.GROUP_SIZES]
    assert all(c["complete"] for c in cells)
    line = equal_rate.verdict(cells)
    word = re.search(r"\*\*(.+?)\*\*", line).group(1)
    report = (ROOT / "results" / "equal_rate.md").read_text()
    results, readme = (" ".join((ROOT / name).read_text().split()) for name in ("docs/RESULTS.md", "README.md"))
    assert line in report and f'"{word}"' in results and f'"{word}"' in readme
    for c in cells:
        d = c["contrasts"]["otb_loo − rloo_matched"]
        text = f"{d['mean']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]"
        assert text in results and text in readme
        assert f"p = {c['p_otb']:.4f}" in results and f"{c['step_ratio']:.3f}" in results
        share = c["contrasts"]["rloo_matched − rloo"]["mean"] / c["contrasts"]["otb_loo − rloo"]["mean"]
        assert f"{share:.0%}" in results and f"{share:.0%}" in readme
        for key in ("otb_loo − rloo", "rloo_matched − rloo"):
            assert f"{c['contrasts'][key]['mean']:+.4f}" in results
        assert c["contrasts"]["otb_loo − rloo_matched"]["mean"] < variance_lr.DELTA  # "below δ" in both docs
    secondary = [equal_rate.cell(by_cell, n, 1e-3, seeds) for n in equal_rate.GROUP_SIZES]
    adjusted = equal_rate.holm({c["n"]: c["p_otb"] for c in secondary})
    assert all(c["complete"] for c in secondary) and all(f"Holm p = {p:.4f}" in results for p in adjusted.values())
    assert f"ratios {secondary[0]['step_ratio']:.3f}, {secondary[1]['step_ratio']:.3f}" in results
    fallen = {arm: [sum(c["per"]["collapsed"][arm].values()) for c in secondary] for arm in ("otb_loo", "rloo_matched")}
    assert f"otb_loo {fallen['otb_loo'][0]} and {fallen['otb_loo'][1]} of 10" in results
    assert f"rloo {fallen['rloo_matched'][0]} and {fallen['rloo_matched'][1]} of 10" in results
