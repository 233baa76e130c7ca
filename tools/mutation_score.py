"""Mutation score of the formula modules from a standard tool, cosmic-ray (issue 29; not part of CI).

    python tools/mutation_score.py [--modules advantages proxy ...] [--lanes 2] [--commit]
    python tools/mutation_score.py --table      # docs/mutations.md's table from the committed results

cosmic-ray (`pip install -e ".[mutation]"`) chooses the mutants: its operators on every operator, comparison,
number, boolean, loop, decorator and exception handler of each module. Left out, with the reason:

* a replacement *to* a bitwise or shift operator (`a + b` → `a | b`, `a << b`) that is applied to a float: it is run,
  and left out when its first failure is the TypeError (Python) or NotImplementedError (torch) that such an operator
  raises on a float or a float tensor, raised on the mutated line; on masks, integers and indices it is judged like
  any other mutant (issue 42);
* mutations inside type annotations (never evaluated: `from __future__ import annotations`);
* mutants that are not valid Python: cosmic-ray's operators see the bare `*` of keyword-only parameters and the
  `**` of a dict display as arithmetic (`def f(a, %, b)`, `{**d}` → `{-d}`), and put `not` where only a unary
  operator may stand (`a & ~b` → `a & not b`); such a file cannot be imported, so every test "fails" and the
  mutant would count as killed.

Each mutant runs only the tests that execute the mutated statement (tools/mutation_tests.py: a coverage map of the
unmutated tree, one context per test; import-time code runs every test of the module), `-x`, fastest first, with
CI's derandomised hypothesis examples without shrinking (profile `mutations`). Only a selected test's exception
counts as a kill; timeouts, crashes (signals) and driver errors are counted apart (tools/mutation_tests.py). Mutants
run in `--lanes` git worktrees of HEAD under runs/mutation/, each with a fork server that has torch imported once.
Resumable: cosmic-ray's session files (runs/mutation/sessions/) keep every result, and the results file seeds a new
session: kills kept while the module is unchanged (each record names the tests tree that judged it), survivors
(listed equivalents among them) only while the library and the tests tree are unchanged, so a listed equivalent is
run again whenever the tests change, and one that is then killed leaves the list (logged in
results/mutation_score/equivalent_changes.jsonl). Each module's per-mutant results go to
results/mutation_score/<module>.jsonl, whose header records the module's code, the library's and the tests tree's
hashes; mutants shown equivalent are listed, with their kind and reason, in results/mutation_score/equivalent.json;
`--table` builds docs/mutations.md's table from both and refuses results whose module code or tests tree is not
HEAD's (tests/tools/test_mutation_score.py checks that the docs show it).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import mutation_tests

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "runs" / "mutation"
RESULTS = ROOT / "results" / "mutation_score"
EQUIVALENT = RESULTS / "equivalent.json"
CHANGES = RESULTS / "equivalent_changes.jsonl"  # listed equivalents that a run killed, one line each
DOCS = ROOT / "docs" / "mutations.md"
CR = str(Path(sys.executable).parent / "cosmic-ray")
# module name -> (path cosmic-ray mutates, files it leaves out)
MODULES = {
    "advantages": ("otb_ref/advantages.py", ()),
    "readable": ("otb_ref/readable.py", ()),
    "estimators": ("otb_ref/estimators.py", ()),
    "proxy": ("otb_ref/proxy.py", ()),
    "_checks": ("otb_ref/_checks.py", ()),
    "_validation": ("otb_ref/_validation.py", ()),
    "diagnostics": ("otb_ref/diagnostics.py", ()),
    "grad_norms": ("otb_ref/grad_norms.py", ()),
    "exact": ("otb_ref/exact", ()),  # the table printer is experiments/exact_table.py, outside the library
}
# The library's files that are not scored, each with why (tests/tools/test_mutation_results.py: every otb_ref/ file
# is under MODULES or here).
NOT_SCORED = {
    "otb_ref/__init__.py": "re-exports the public names (imports, __all__, __version__): no operator to mutate",
    "otb_ref/integrations": (
        "the verl and TRL adapters: their tests run only where verl or TRL is installed (CI's two extra "
        "environments), never in the environment the mutants run in, where they skip; every mutant would survive"
    ),
}
# The tests whose coverage decides what each mutant runs (multi-process FSDP tests and the benchmark commands
# start subprocesses, which coverage does not follow; tools/mutations.py leaves them out for the same reason).
TEST_POOL = ["tests/test_otb_ref", "tests/test_conformance.py", "-k", "not fsdp and not benchmark_command"]
TO_BITWISE = re.compile(r"core/ReplaceBinaryOperator_\w+_(BitOr|BitAnd|BitXor|LShift|RShift)$")
# What a bitwise or shift operator raises on a float or a float tensor (Python, torch, numpy).
ON_FLOAT = re.compile(
    r"not implemented for '(Float|Double|Half|BFloat16|Complex\w*)'"
    r"|unsupported operand type\(s\) for (\||&|\^|<<|>>|\|=|&=|\^=|<<=|>>=): .*'(float|complex)'"
    r"|ufunc '(bitwise_\w+|left_shift|right_shift)' not supported"
)
APART = ("timeout", "crash", "driver error")  # outcomes that are neither kills nor survivors (issue 42)
KINDS = ("equivalent", "equivalent within tolerance", "out of scope")  # equivalent.json's "kind" of an entry


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.check_output(["git", *args], cwd=cwd, text=True).strip()


def coverage_map(key: str, head: str) -> Path:
    """The map of which tests run each line, from one pytest run in a clean worktree of HEAD."""
    path = RUNS / f"coverage-{key}.json"
    if not path.exists():
        print(f"coverage map of {key} (one pytest run under coverage) ...", flush=True)
        tree = worktree(0, head)
        env = {**os.environ, "PYTHONPATH": str(tree), "CI": "true", "OMP_NUM_THREADS": "1"}
        command = [
            sys.executable,
            "tools/mutation_tests.py",
            "coverage",
            str(path),
            "--",
            "-q",
            "-p",
            "no:cacheprovider",
        ]
        subprocess.run([*command, *TEST_POOL], cwd=tree, env=env, check=True)
    return path


def annotation_spans(path: Path) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) positions, lines 1-based, of every type annotation in a file."""
    spans = []
    for node in ast.walk(ast.parse(path.read_text())):
        found = []
        if isinstance(node, ast.arg) and node.annotation is not None:
            found.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            found.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            found.append(node.annotation)
        spans += [((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset)) for a in found]
    return spans


# Operators that can break the syntax: from `*`/`**`, which may be star syntax (a bare `*` in a signature, `**x`
# unpacking), and unary replacements (`a & ~b` → `a & not b`). Every mutant of the formula modules that did not parse
# came from these (a parse of all of them, 2026-11-25); parsing only these keeps a session's start-up short.
MAY_NOT_PARSE = ("ReplaceBinaryOperator_Mul_", "ReplaceBinaryOperator_Pow_", "ReplaceUnaryOperator_")


def is_valid_python(source: str, mutation) -> bool:
    """Whether the module ``source`` still parses with ``mutation`` applied (see the module docstring)."""
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator

    if not any(kind in mutation.operator_name for kind in MAY_NOT_PARSE):
        return True

    operator = get_operator(mutation.operator_name)(**(mutation.operator_args or {}))
    mutated = mutate_code(source, operator, mutation.occurrence)
    try:
        ast.parse(mutated if mutated is not None else "")
    except SyntaxError:
        return False
    return True


def init_session(name: str, session: Path, module: str, key: str, resume: bool = True) -> None:
    """cosmic-ray init, then mark the mutants left out (see the module docstring) as skipped, with the reason."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    path, excluded = MODULES[name]
    config = session.with_suffix(".toml")
    config.write_text(_config(path, excluded, "true"))
    subprocess.run([CR, "init", str(config), str(session)], cwd=ROOT, check=True)
    spans, sources = {}, {}
    with use_db(str(session), WorkDB.Mode.open) as db:
        for item in list(db.pending_work_items):
            (mutation,) = item.mutations
            file = str(mutation.module_path)
            if file not in sources:
                sources[file] = (ROOT / file).read_text()
                spans[file] = annotation_spans(ROOT / file)
            reason = None
            if any(a <= tuple(mutation.start_pos) and tuple(mutation.end_pos) <= b for a, b in spans[file]):
                reason = "left out: in a type annotation"
            elif not is_valid_python(sources[file], mutation):
                reason = "left out: not valid Python"
            if reason:
                db.set_result(item.job_id, WorkResult(output=reason, worker_outcome=WorkerOutcome.SKIPPED))
        if resume:
            _resume_from_results(db, name, module, key)


def _resume_from_results(db, name: str, module: str, key: str) -> None:
    """Results already in the results file are not run again (see :func:`kept`). (`--fresh` runs every mutant.)"""
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    done = load_results().get(name)
    if done is None:
        return
    known = {(r["file"], r["operator"], r["occurrence"]): r for r in kept(*done, module, key)}
    for item in list(db.pending_work_items):
        (m,) = item.mutations
        record = known.get((str(m.module_path), m.operator_name, m.occurrence))
        if record is not None:
            outcome = TestOutcome.SURVIVED if record["outcome"] == "survived" else TestOutcome.KILLED
            result = WorkResult(
                worker_outcome=WorkerOutcome.NORMAL,
                test_outcome=outcome,
                output=record["note"],
                diff=f"-{record['original']}\n+{record['mutated']}",
            )
            db.set_result(item.job_id, result)


def kept(header: dict, records: list[dict], module: str, key: str) -> list[dict]:
    """The records a new session keeps: none if the module's code changed; else every kill (tests only grow, so a
    mutant once killed stays killed; its note keeps the tests tree that judged it) and every bitwise operator left
    out for raising on a float (a kill too), and the survivors, listed equivalents among them, only while the library
    and the tests tree are unchanged (issue 42: an equivalent is judged again against new tests). Timeouts, crashes,
    driver errors and results without the test command's answer are run again."""
    if header.get("module_code") != module:
        return []
    out = []
    for r in records:
        answer = _answer(r["note"])
        if answer is None:
            continue
        if "judged" not in answer:  # a record from before issue 42: judged by the run its header describes
            tests = header.get("tests", f"before issue 42 ({header.get('code')})")
            answer["judged"] = {"tests": tests, "date": header.get("date"), "machine": header.get("machine")}
            r = {**r, "note": json.dumps(answer)}
        if r["outcome"] == "killed" or (r["outcome"] == "left out" and "verdict" in answer):
            out.append(r)
        elif r["outcome"] == "survived" and header.get("code") == key:
            out.append(r)
    return out


def judge(operator: str, note: str) -> str:
    """A mutant's outcome from the test command's answer: "killed", "survived", one of :data:`APART`, or "left out"
    for a bitwise or shift operator whose kill is the error such an operator raises on a float, on the mutated line.
    An answer from before issue 42 has pytest's exit status only (1: a test failed, 0: none did)."""
    answer = _answer(note)
    if answer is None:  # cosmic-ray's own timeout, or the client failed: no answer
        return "timeout" if note == "timeout" else "driver error"
    verdict = answer.get("verdict") or {0: "survived", 1: "killed", 124: "timeout"}.get(answer.get("status"))
    if verdict == "killed" and TO_BITWISE.match(operator) and answer.get("at_mutation"):
        if ON_FLOAT.search(answer.get("message", "")):
            return "left out"
    return verdict if verdict in ("killed", "survived", *APART) else "driver error"


def _answer(note: str) -> dict | None:
    """The test command's answer in a record's note (a JSON object), None if the note is something else."""
    try:
        answer = json.loads(note)
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


def _config(path: str, excluded: tuple[str, ...], test_command: str) -> str:
    return (
        "[cosmic-ray]\n"
        f'module-path = "{path}"\n'
        f"excluded-modules = {json.dumps(list(excluded))}\n"
        "timeout = 3600.0\n"
        f'test-command = "{test_command}"\n'
        '[cosmic-ray.distributor]\nname = "local"\n'
    )


def shard_session(session: Path, shard: int, shards: int) -> Path:
    """A copy of the session in which only every shards-th pending mutant (by job id) is left to run."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    path = session.with_name(f"{session.stem}.{shard}of{shards}.sqlite")
    if not path.exists():
        shutil.copy(session, path)
        with use_db(str(path), WorkDB.Mode.open) as db:
            for item in list(db.pending_work_items):
                if int(item.job_id, 16) % shards != shard:
                    db.set_result(item.job_id, WorkResult(output="other shard", worker_outcome=WorkerOutcome.SKIPPED))
    return path


def worktree(index: int, head: str) -> Path:
    """runs/mutation/lane<index>, a clean git worktree at ``head``."""
    tree = RUNS / f"lane{index}"
    if not tree.exists():
        git("worktree", "add", "--detach", str(tree), head)
    git("checkout", "--force", "--detach", head, cwd=tree)
    git("clean", "-fdq", cwd=tree)
    for cache in tree.rglob("__pycache__"):
        shutil.rmtree(cache)
    return tree


def lane(index: int, head: str, test_map: Path) -> tuple[Path, Path, subprocess.Popen]:
    """A worktree of HEAD with a fork server; returns (worktree, socket, server)."""
    tree = worktree(index, head)
    # CI's derandomised hypothesis examples without shrinking (tests/conftest.py's "mutations" profile).
    env = {**os.environ, "PYTHONPATH": str(tree), "HYPOTHESIS_PROFILE": "mutations", "PYTHONDONTWRITEBYTECODE": "1"}
    where = subprocess.check_output(
        [sys.executable, "-c", "import otb_ref; print(otb_ref.__file__)"], cwd=tree, env=env
    )
    if not where.decode().startswith(str(tree)):
        raise SystemExit(f"lane {index} imports otb_ref from {where.decode().strip()}, not from {tree}")
    sock = Path(f"/tmp/otb-mutation-lane{index}.sock")
    sock.unlink(missing_ok=True)
    log = open(RUNS / f"lane{index}.log", "a")
    server = subprocess.Popen(
        [sys.executable, "tools/mutation_tests.py", "serve", str(sock), str(test_map)],
        cwd=tree,
        env=env,
        stdout=log,
        stderr=log,
    )
    for _ in range(600):
        if sock.exists():
            break
        time.sleep(0.1)
    answer = mutation_tests.ask(str(sock), {"baseline": 40})
    if answer["status"] != 0:
        server.kill()
        raise SystemExit(f"lane {index}: the 40 fastest tests fail on the unmutated tree: {answer}")
    return tree, sock, server


def run_unit(name: str, session: Path, tree: Path, sock: Path) -> None:
    path, excluded = MODULES[name]
    config = session.with_suffix(".toml")
    config.write_text(_config(path, excluded, f"{sys.executable} tools/mutation_tests.py run {sock}"))
    subprocess.run([CR, "exec", str(config), str(session)], cwd=tree, check=True)


def _lines(diff: str, sign: str) -> str:
    body = [line[1:].strip() for line in diff.splitlines() if line.startswith(sign) and not line.startswith(sign * 3)]
    return " / ".join(body)


def collect(name: str, key: str, head: str) -> tuple[list[dict], int]:  # key: the session's
    """Per-mutant records of a module from its sessions (shards merged) and the number still pending."""
    from cosmic_ray.work_db import WorkDB, use_db

    judged = {"tests": key.rsplit("-", 1)[-1], "date": time.strftime("%Y-%m-%d"), "machine": _machine()}
    owner: dict[str, dict] = {}
    pending = 0
    for session in sorted((RUNS / "sessions").glob(f"{name}-{key}.*of*.sqlite")):
        with use_db(str(session), WorkDB.Mode.open) as db:
            results = dict(db.results)
            for item in db.work_items:
                result = results.get(item.job_id)
                if result is None:
                    pending += 1
                elif result.output != "other shard":
                    owner[item.job_id] = _record(item.mutations[0], result, head, judged)
    records = sorted(owner.values(), key=lambda r: (r["file"], r["line"], r["col"], r["operator"], r["occurrence"]))
    return records, pending


def _record(mutation, result, head: str, judged: dict) -> dict:
    """A mutant's record. ``judged``: the tests tree, date and machine of a run made now; a result kept from an
    earlier run (:func:`kept`) carries its own in the note."""
    file = str(mutation.module_path)
    source = _source(head, file)  # HEAD's text: a session of older code may name lines HEAD no longer has
    index = mutation.start_pos[0] - 1
    line = _lines(result.diff or "", "-") or (source[index].strip() if 0 <= index < len(source) else "")
    if result.worker_outcome == "skipped":
        outcome, note = "left out", result.output
    else:
        output = (result.output or "").strip().splitlines()
        note = output[-1] if output else ""  # the test command's answer
        outcome = judge(mutation.operator_name, note)
        if (answer := _answer(note)) is not None and "judged" not in answer:
            note = json.dumps({**answer, "judged": judged})
    return {
        "file": file,
        "line": mutation.start_pos[0],
        "col": mutation.start_pos[1],
        "operator": mutation.operator_name,
        "occurrence": mutation.occurrence,
        "definition": mutation.definition_name,
        "original": line,
        "mutated": _lines(result.diff or "", "+"),
        "outcome": outcome,
        "note": note,
    }


def _source(head: str, file: str, cache: dict = {}) -> list[str]:  # noqa: B006 (a cache on purpose)
    if (head, file) not in cache:  # [] for a file HEAD does not have (removed since the session ran)
        shown = subprocess.run(["git", "show", f"{head}:{file}"], cwd=ROOT, capture_output=True, text=True)
        cache[head, file] = shown.stdout.splitlines() if shown.returncode == 0 else []
    return cache[head, file]


def write_results(name: str, module: str, key: str, head: str) -> int:
    records, pending = collect(name, f"{module}-{key}", head)
    RESULTS.mkdir(parents=True, exist_ok=True)
    header = {
        "module": name,
        "tool": f"cosmic-ray {_version('cosmic-ray')}",
        "module_code": module,
        "library": key.split("-")[0],
        "tests": key.split("-")[1],
        "code": key,
        "date": time.strftime("%Y-%m-%d"),
        "machine": _machine(),
        "pending": pending,
        "command": "python tools/mutation_score.py",
    }
    lines = [json.dumps(header)] + [json.dumps(r, ensure_ascii=False) for r in records]
    (RESULTS / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return pending


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def _machine() -> str:
    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    return f"{model}, {os.cpu_count()} cores"


def load_results(results: Path | None = None) -> dict[str, tuple[dict, list[dict]]]:
    out = {}
    for name in MODULES:
        path = (results or RESULTS) / f"{name}.jsonl"
        if path.exists():
            header, *records = [json.loads(line) for line in path.read_text().splitlines()]
            out[name] = (header, records)
    return out


def equivalent_key(record: dict) -> tuple[str, str, str, str]:
    """A mutation by its text. cosmic-ray writes a removed decorator's line with a varying run of "/" and blanks
    before the "@" (" / @staticmethod", "/ @staticmethod"): that prefix is dropped."""
    original = re.sub(r"^[\s/]+(?=@)", "", record["original"].strip())
    return record["file"], record["operator"], original, record["mutated"]


def load_equivalent(path: Path | None = None) -> dict[tuple, str]:
    """The listed equivalents' keys (the mutation's text, and its line where an entry gives one: the same text
    elsewhere in the file may not be equivalent), each with its kind (:data:`KINDS`)."""
    path = path or EQUIVALENT
    entries = json.loads(path.read_text()) if path.exists() else []
    return {(*equivalent_key(e), e.get("line")): e.get("kind", "equivalent") for e in entries}


def is_equivalent(record: dict, listed) -> bool:
    key = equivalent_key(record)
    return (*key, None) in listed or (*key, record["line"]) in listed


def equivalent_kind(record: dict, listed: dict[tuple, str]) -> str | None:
    """The kind of the entry that lists this survivor, None if none does."""
    key = equivalent_key(record)
    return listed.get((*key, record["line"])) or listed.get((*key, None))


COLUMNS = ("mutants", "killed", *KINDS, "survived", "apart")


def counts(records: list[dict], listed: dict[tuple, str]) -> dict[str, int]:
    """A module's mutants (left out ones aside) by outcome; a listed survivor counts under its entry's kind; "apart"
    sums the timeouts, crashes and driver errors, which are also counted each under its own name."""
    out = dict.fromkeys((*COLUMNS, *APART), 0)
    for r in records:
        if r["outcome"] == "left out":
            continue
        out["mutants"] += 1
        if r["outcome"] == "survived":
            out[equivalent_kind(r, listed) or "survived"] += 1
        elif r["outcome"] in APART:
            out["apart"] += 1
            out[r["outcome"]] += 1
        else:
            out["killed"] += 1
    return out


def _percent(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}" if whole > 0 else "—"


def table(results: Path | None = None) -> str:
    """docs/mutations.md's table. score = killed / (mutants − equivalent − within tolerance − out of scope − apart);
    strict = killed / (mutants − equivalent): what is within tolerance, out of scope or apart counts as not killed."""
    results = results or RESULTS
    listed = load_equivalent(results / "equivalent.json")
    names = [c.replace("equivalent within tolerance", "within tolerance") for c in COLUMNS]
    rows = ["| module | " + " | ".join(names) + " | score % | strict % |", "|---" * (len(COLUMNS) + 3) + "|"]
    notes, dates, machines, tools = [], set(), set(), set()
    for name, (header, records) in load_results(results).items():
        c = counts(records, listed)
        excluded = sum(c[k] for k in KINDS) + c["apart"]
        score = _percent(c["killed"], c["mutants"] - excluded)
        strict = _percent(c["killed"], c["mutants"] - c["equivalent"])
        rows.append(f"| `{MODULES[name][0]}` | " + " | ".join(str(c[k]) for k in COLUMNS) + f" | {score} | {strict} |")
        notes += _notes(name, header, records, c)
        tools.add(header["tool"])
        for judged in [_judged(r, header) for r in records if r["outcome"] != "left out"] or [header]:
            dates.add(judged["date"])
            machines.add(judged["machine"])
    made = (
        f"Tool: {', '.join(sorted(tools))}; runs of {', '.join(sorted(dates))} on {', '.join(sorted(machines))}; "
        "command `python tools/mutation_score.py`."
    )
    return "\n".join([made, "", *rows] + (["", *notes] if notes else []))


def _notes(name: str, header: dict, records: list[dict], c: dict[str, int]) -> list[str]:
    """The table's footnotes for one module: mutants pending, apart, and kills judged with an older tests tree."""
    notes = []
    if header["pending"]:
        notes.append(f"* `{name}`: {header['pending']} mutants not run yet.")
    if c["apart"]:
        notes.append(f"* `{name}` apart: " + ", ".join(f"{c[k]} {k}" for k in APART if c[k]) + ".")
    older = sum(r["outcome"] == "killed" and _judged(r, header)["tests"] != header.get("tests") for r in records)
    if older:
        notes.append(f"* `{name}`: {older} kills kept from a run with an earlier tests tree (the module is unchanged).")
    return notes


def _judged(record: dict, header: dict) -> dict:
    """The tests tree, date and machine that judged a record: its note's, else its results file's header's."""
    judged = (_answer(record.get("note", "")) or {}).get("judged") or {}
    return {"tests": header.get("tests"), "date": header["date"], "machine": header["machine"], **judged}


def write_docs(docs: Path | None = None) -> None:
    """Put :func:`table` between the markers of docs/mutations.md."""
    docs = docs or DOCS
    text = docs.read_text()
    start, end = "<!-- mutation-table -->\n", "<!-- /mutation-table -->"
    head, rest = text.split(start)
    docs.write_text(head + start + table() + "\n" + end + rest.split(end, 1)[1])


def prune_equivalents(name: str) -> list[dict]:
    """Listed equivalents of the module that a run killed leave the list (issue 42), each logged with the kill's
    answer in :data:`CHANGES`; returns them. Only once no mutant of the module is pending: an entry without a line
    covers every line with its text, and a kill on one of them says nothing while another is still to run."""
    done = load_results().get(name)
    if done is None or done[0].get("pending", 0) or not EQUIVALENT.exists():
        return []
    records = done[1]
    files = {r["file"] for r in records}
    survivors = [r for r in records if r["outcome"] == "survived"]
    entries, kept_entries, gone = json.loads(EQUIVALENT.read_text()), [], []
    for entry in entries:
        listed = {(*equivalent_key(entry), entry.get("line"))}
        killers = [r for r in records if r["outcome"] == "killed" and is_equivalent(r, listed)]
        if entry["file"] in files and killers and not any(is_equivalent(r, listed) for r in survivors):
            gone.append({"entry": entry, "killed": [{"line": r["line"], **_answer(r["note"])} for r in killers]})
        else:
            kept_entries.append(entry)
    if gone:
        EQUIVALENT.write_text(json.dumps(kept_entries, indent=1, ensure_ascii=False) + "\n")
        with CHANGES.open("a") as log:
            for change in gone:
                log.write(json.dumps({"date": time.strftime("%Y-%m-%d"), "change": "removed: killed", **change}) + "\n")
    return gone


def newest_sharded_session(stems: set[str], sessions: Path | None = None) -> tuple[str, str] | None:
    """``(module key, code key)`` of the newest of ``stems`` (session names ``<module name>-<module key>-<code
    key>``) that has shard files, by the newest file of each; None when none has."""
    sessions = sessions or RUNS / "sessions"
    sharded = [stem for stem in stems if list(sessions.glob(f"{stem}.*of*.sqlite"))]
    if not sharded:
        return None
    newest = max(sharded, key=lambda stem: max(p.stat().st_mtime for p in sessions.glob(f"{stem}.*")))
    _, module, code = newest.split("-", 2)
    return module, code


def _merge_older_sessions(name: str, stem: str, head: str) -> None:
    """Results of the newest session of this module under other code go to the results file, whence the new
    session takes what stays valid; then the older sessions are removed."""
    sessions = RUNS / "sessions"
    older = {p.name.split(".")[0] for p in sessions.glob(f"{name}-*.sqlite")} - {stem}
    if newest := newest_sharded_session(older):
        write_results(name, *newest, head)
    for old in older:
        for path in sessions.glob(f"{old}.*"):
            path.unlink()


def module_key(name: str) -> str:
    """The mutated files' contents at HEAD."""
    import hashlib

    return hashlib.sha1(git("ls-tree", "-r", "HEAD", MODULES[name][0]).encode()).hexdigest()[:10]


def tests_key(rev: str = "HEAD") -> str:
    """The tests tree the mutants run against: tests/ (less tests/tools, which tests this driver) and conformance/
    (tests/test_conformance.py's cases), at ``rev``."""
    import hashlib

    listing = git("ls-tree", "-r", rev, "tests", "conformance").splitlines()
    return hashlib.sha1("\n".join(ln for ln in listing if "\ttests/tools/" not in ln).encode()).hexdigest()[:10]


def code_key() -> str:
    """``<library>-<tests>``: the trees of otb_ref/ and of the tests (:func:`tests_key`) at HEAD."""
    return git("rev-parse", "HEAD:otb_ref")[:10] + "-" + tests_key()


def stale(results: Path | None = None) -> list[str]:
    """Why the results are not HEAD's, one line per module whose module code or tests tree differs (issue 42)."""
    problems = []
    tests = tests_key()
    for name, (header, _) in load_results(results or RESULTS).items():
        if header.get("module_code") != module_key(name):
            problems.append(f"{name}: its code {header.get('module_code')} is not HEAD's {module_key(name)}")
        if header.get("tests") != tests:
            problems.append(f"{name}: its tests tree {header.get('tests', '(not recorded)')} is not HEAD's {tests}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", nargs="+", choices=sorted(MODULES), default=list(MODULES))
    parser.add_argument("--lanes", type=int, default=2, help="worktrees mutated in parallel (one core each)")
    parser.add_argument("--commit", action="store_true", help="git commit each module's results as they change")
    parser.add_argument("--collect", action="store_true", help="no runs: the sessions' results into results/")
    parser.add_argument("--fresh", action="store_true", help="run every mutant again (no results kept)")
    parser.add_argument("--table", action="store_true", help="only the table: from the results into docs/mutations.md")
    args = parser.parse_args(argv)
    if args.table:
        if problems := stale():
            raise SystemExit(
                "refusing to print a score from stale results (run tools/mutation_score.py):\n" + "\n".join(problems)
            )
        write_docs()
        print(table())
        return 0
    if args.collect:  # the sessions' results so far into the results files (after a run was stopped)
        head = git("rev-parse", "HEAD")
        for name in args.modules:
            stems = {p.name.split(".")[0] for p in (RUNS / "sessions").glob(f"{name}-{module_key(name)}-*.sqlite")}
            if newest := newest_sharded_session(stems):
                print(name, write_results(name, *newest, head), "pending")
        return 0
    if git("status", "--porcelain", "otb_ref", "tests", "conformance", "tools/mutation_tests.py"):
        raise SystemExit(
            "commit otb_ref/, tests/, conformance/ and tools/mutation_tests.py first: lanes check out HEAD"
        )
    head, key = git("rev-parse", "HEAD"), code_key()
    (RUNS / "sessions").mkdir(parents=True, exist_ok=True)
    test_map = coverage_map(key, head)
    units = []
    keys = {name: module_key(name) for name in args.modules}
    for name in args.modules:
        stem = f"{name}-{keys[name]}-{key}"
        session = RUNS / "sessions" / f"{stem}.sqlite"
        _merge_older_sessions(name, stem, head)
        old_shards = list((RUNS / "sessions").glob(f"{stem}.*of*.sqlite"))
        if old_shards and not args.fresh:  # results so far to the results file, then shard afresh from there
            write_results(name, keys[name], key, head)
        if old_shards or args.fresh:
            for path in old_shards:
                path.unlink()
            session.unlink(missing_ok=True)
        if not session.exists():
            init_session(name, session, keys[name], key, resume=not args.fresh)
        units += [(name, shard_session(session, shard, args.lanes)) for shard in range(args.lanes)]
    lock = threading.Lock()

    def work(index: int) -> None:
        tree, sock, server = lane(index, head, test_map)
        try:
            while True:
                with lock:
                    if not units:
                        return
                    name, session = units.pop(0)
                run_unit(name, session, tree, sock)
                with lock:
                    pending = write_results(name, keys[name], key, head)
                    print(f"{name}: {session.name} done, {pending} pending", flush=True)
                    _written(name, pending, args.commit)
        finally:
            server.kill()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(args.lanes)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):  # every 10 minutes, the results so far (a session may end any time)
        for t in threads:
            t.join(timeout=600)
        with lock:
            for name in args.modules:
                if list((RUNS / "sessions").glob(f"{name}-{keys[name]}-{key}.*of*.sqlite")):
                    _written(name, write_results(name, keys[name], key, head), args.commit)
    print(table())
    return 0


def _written(name: str, pending: int, commit: bool) -> None:
    """After a module's results were written: listed equivalents now killed leave the list; commit if asked."""
    gone = prune_equivalents(name)
    for change in gone:
        entry = change["entry"]
        print(f"{name}: no longer equivalent (killed): {entry['file']}: {entry['original']} -> {entry['mutated']}")
    if commit:
        _commit(name, pending, len(gone))


def _commit(name: str, pending: int, pruned: int = 0) -> None:
    paths = [str(p) for p in (RESULTS / f"{name}.jsonl", EQUIVALENT, CHANGES) if p.exists()]
    if subprocess.run(["git", "diff", "--quiet", "HEAD", "--", *paths], cwd=ROOT).returncode == 0:
        if not subprocess.run(["git", "ls-files", "--others", "--", *paths], cwd=ROOT, capture_output=True).stdout:
            return  # nothing new
    subprocess.run(["git", "add", *paths], cwd=ROOT, check=True)
    dropped = f", {pruned} listed equivalents killed" if pruned else ""
    message = f"results/mutation_score: {name} ({pending} pending{dropped}), python tools/mutation_score.py"
    subprocess.run(["git", "commit", "-q", "-m", message, "--", *paths], cwd=ROOT, check=False)


if __name__ == "__main__":
    sys.exit(main())
