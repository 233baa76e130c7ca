"""The test command cosmic-ray runs for each mutant (issue 29): only the tests that execute the mutated statement.

Three subcommands, all run by `tools/mutation_score.py`:

* `coverage OUT.json -- PYTEST_ARGS`: one pytest run of the unmutated tree under coverage with one context per
  test (pytest-cov's `--cov-context=test`); writes, per source file, which tests execute each line, and each test's
  duration.
* `serve SOCKET MAP.json`: a fork server in a mutation worktree. It imports torch, numpy, pytest and hypothesis once
  (never otb_ref, so each mutant is imported fresh) and, per request, forks a child that runs pytest in process on
  the selected tests with `-x`, fastest first, and answers pytest's exit status.
* `run SOCKET`: the client cosmic-ray calls as its test command; the server finds the one module that differs from
  HEAD and answers pytest's exit status (0: every selected test passed, the mutant survived).

Selection (sound for the mutant at hand): the statement holding the mutation is found in the unmutated source; a
statement inside a function body runs only when a test executes it, so the tests whose coverage context executed
any line of that statement are run. A mutation in module- or class-level code, a decorator, a default value or a
function header, or in a statement that ran while pytest collected (a function called at import), runs at import:
every test in the map that executes any line of the module is run. A statement no
test executes gives exit status 0 with "no test executes it" (it survives: no test could see it).
"""

from __future__ import annotations

import ast
import difflib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_PHASES = ("|setup", "|run", "|teardown")
IMPORT = -1  # in the map: the line ran while pytest collected (at import), outside any test
STAGE_ONE = 8  # tests in the first stage of a mutant's run


def build_map(out_path: str, pytest_args: list[str]) -> int:
    """Run pytest once under coverage with per-test contexts; write {file: {line: [test indices]}} and durations."""
    import coverage
    import pytest

    durations: dict[str, float] = {}

    class _Durations:
        def pytest_runtest_logreport(self, report):
            durations[report.nodeid] = durations.get(report.nodeid, 0.0) + report.duration

    data_file = Path(tempfile.mkdtemp()) / ".coverage"  # outside the checkout: the tests fail on new files there
    os.environ["COVERAGE_FILE"] = str(data_file)
    rc = pytest.main(
        [*pytest_args, "--cov=otb_ref", "--cov-context=test", "--cov-report=", f"--cov-config={os.devnull}"],
        plugins=[_Durations()],
    )
    if rc != 0:
        return int(rc)
    data = coverage.CoverageData(basename=str(data_file))
    data.read()
    tests = sorted(durations)
    index = {t: i for i, t in enumerate(tests)}
    files = {}
    for filename in data.measured_files():
        rel = os.path.relpath(filename)  # relative to the worktree the map was made in
        lines: dict[str, list[int]] = {}
        for line, contexts in data.contexts_by_lineno(filename).items():
            ids = {_nodeid(c) for c in contexts if c}
            at_import = [IMPORT] if "" in contexts else []  # ran outside any test: while collecting
            lines[str(line)] = at_import + sorted(index[t] for t in ids if t in index)
        files[rel] = lines
    Path(out_path).write_text(json.dumps({"tests": tests, "durations": [durations[t] for t in tests], "files": files}))
    data_file.unlink()
    return 0


def _nodeid(context: str) -> str:
    for phase in _PHASES:
        if context.endswith(phase):
            return context[: -len(phase)]
    return context


def changed_lines(pristine: str, mutated: str) -> tuple[int, int]:
    """First and last line (1-based, of the pristine source) that the mutation replaced."""
    old, new = pristine.splitlines(), mutated.splitlines()
    blocks = [op for op in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes() if op[0] != "equal"]
    if not blocks:
        raise ValueError("the module is unchanged: no mutation applied")
    return blocks[0][1] + 1, max(blocks[-1][2], blocks[-1][1] + 1)


def statement_span(tree: ast.Module, first: int, last: int) -> tuple[int, int] | None:
    """Lines of the innermost statement in a function body that holds lines first..last; None if it runs at import."""
    holders = [n for n in ast.walk(tree) if isinstance(n, ast.stmt) and n.lineno <= first and last <= n.end_lineno]
    functions = [
        n for n in holders if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and first >= n.body[0].lineno
    ]
    if not functions:
        return None  # module or class level, a decorator, a default value, a signature
    body_start = max(f.body[0].lineno for f in functions)
    inner = [n for n in holders if n.lineno >= body_start]
    statement = min(inner, key=lambda n: (-n.lineno, n.end_lineno))
    return statement.lineno, statement.end_lineno


def select(test_map: dict, module: str, pristine: str, mutated: str) -> list[str]:
    """The tests to run for this mutant, fastest first (see the module docstring)."""
    lines = test_map["files"].get(module, {})
    first, last = changed_lines(pristine, mutated)
    span = statement_span(ast.parse(pristine), first, last)
    if span is not None:
        chosen = {i for line in range(span[0], span[1] + 1) for i in lines.get(str(line), ())}
    if span is None or IMPORT in chosen:  # runs at import: every test that runs the module
        chosen = {i for ids in lines.values() for i in ids}
    chosen.discard(IMPORT)
    order = sorted(chosen, key=lambda i: test_map["durations"][i])
    return [test_map["tests"][i] for i in order]


def serve(sock_path: str, map_path: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import hypothesis  # noqa: F401  (imported once, before any fork)
    import numpy  # noqa: F401
    import pytest
    import torch

    torch.set_num_threads(1)
    test_map = json.loads(Path(map_path).read_text())
    duration = dict(zip(test_map["tests"], test_map["durations"]))  # node id -> seconds in the coverage run
    pristine = {m: subprocess.check_output(["git", "show", f"HEAD:{m}"], text=True) for m in test_map["files"]}
    if os.path.exists(sock_path):
        os.unlink(sock_path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock_path + ".starting")
    server.listen(1)
    os.rename(sock_path + ".starting", sock_path)  # the socket appears once it accepts
    while True:
        conn, _ = server.accept()
        with conn:
            request = json.loads(conn.makefile().readline())
            answer = _one_mutant(pytest, test_map, duration, pristine, request)
            conn.sendall((json.dumps(answer) + "\n").encode())


def _one_mutant(pytest, test_map: dict, duration: dict, pristine: dict, request: dict) -> dict:
    changed = [m for m in pristine if Path(m).read_text() != pristine[m]]
    if "baseline" in request:  # the fastest tests on the unmutated tree: must pass, or the lane is broken
        if changed:
            return {"status": -1, "note": f"not pristine: {changed}"}
        tests = sorted(test_map["tests"], key=duration.__getitem__)[: request["baseline"]]
    elif len(changed) != 1:
        return {"status": -1, "note": f"expected one mutated module, found {changed}"}
    else:
        tests = select(test_map, changed[0], pristine[changed[0]], Path(changed[0]).read_text())
        if not tests:
            return {"status": 0, "tests": 0, "note": "no test executes it"}
    start = time.monotonic()
    # Two stages: the fastest few tests first (few test files to import), then the rest.
    for stage in (tests[:STAGE_ONE], tests[STAGE_ONE:]):
        if not stage:
            continue
        rc = _pytest_in_child(pytest, stage, limit=60.0 + 5.0 * sum(map(duration.__getitem__, stage)))
        if rc != 0:
            break
    answer = {"status": rc, "tests": len(tests), "seconds": round(time.monotonic() - start, 2)}
    return answer if rc != 124 else {**answer, "note": "timeout"}


class _OneThread:
    """One torch thread per lane (tests/conftest.py sets two; the lanes share the cores)."""

    def pytest_configure(self, config):
        import torch

        torch.set_num_threads(1)


def _pytest_in_child(pytest, tests: list[str], limit: float) -> int:
    """pytest -x on the tests in a forked child (which imports otb_ref afresh); 124 if it runs past the limit."""
    pid = os.fork()
    if pid == 0:
        sys.dont_write_bytecode = True
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        args = ["-x", "-q", "--tb=no", "-p", "no:cacheprovider", "-p", "no:cov", *tests]
        os._exit(int(pytest.main(args, plugins=[_OneThread()])))
    start = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() - start > limit:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return 124
        time.sleep(0.02)


def ask(sock_path: str, request: dict) -> dict:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(sock_path)
    client.sendall((json.dumps(request) + "\n").encode())
    return json.loads(client.makefile().readline())


def run(sock_path: str) -> int:
    """cosmic-ray's test command: 0 if every selected test passed (survived), 1 if one failed or timed out (killed).

    Anything else (a broken lane, pytest's usage or internal error) exits 3 and is audited in the results' notes."""
    answer = ask(sock_path, {})
    print(json.dumps(answer))
    status = answer["status"]
    return 0 if status == 0 else 1 if status in (1, 2, 124) else 3


def main(argv: list[str]) -> int:
    command = argv[0]
    if command == "coverage":
        return build_map(argv[1], argv[3:] if argv[2:3] == ["--"] else argv[2:])
    if command == "serve":
        serve(argv[1], argv[2])
        return 0
    if command == "run":
        return run(argv[1])
    raise SystemExit(f"unknown command {command!r}: coverage, serve or run")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
