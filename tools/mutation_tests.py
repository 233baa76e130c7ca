"""The test command cosmic-ray runs for each mutant (issue 29): only the tests that execute the mutated statement.

Three subcommands, all run by `tools/mutation_score.py`:

* `coverage OUT.json -- PYTEST_ARGS`: one pytest run of the unmutated tree under coverage with one context per
  test (pytest-cov's `--cov-context=test`); writes, per source file, which tests execute each line, and each test's
  duration.
* `serve SOCKET MAP.json`: a fork server in a mutation worktree. It imports torch, numpy, pytest and hypothesis once
  (never otb_ref, so each mutant is imported fresh) and, per request, forks a child that runs pytest in process on
  the selected tests with `-x`, fastest first, and answers pytest's exit status.
* `run SOCKET`: the client cosmic-ray calls as its test command; the server finds the one module that differs from
  HEAD and answers a verdict (below) with pytest's exit status.

Verdicts (issue 42): only a test's failure counts as a kill: an exception raised in a selected test (a failed
assertion, `pytest.fail`, or an error such as a TypeError), in the collection of its file, or by the mutated module's
import; and the test that failed must pass on the unmutated code (checked once per test and lane, with the package
imported from a pristine copy of HEAD). Apart from kills: "timeout" (the run passed its limit), "crash" (the child
died of a signal: a segfault, an OOM kill) and "driver error" (pytest's internal or usage error without a test's
exception, a broken lane, a killing test that fails unmutated too). The answer names the failing test, its
exception's type and first line, and whether the traceback passes through the mutated module and the mutated lines.

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
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
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
    pristine = {m: subprocess.check_output(["git", "show", f"HEAD:{m}"], text=True) for m in test_map["files"]}
    lane = Lane(pytest, test_map, pristine, _pristine_copy(sock_path + ".pristine"))
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
            try:
                answer = lane.one_mutant(request)
            except Exception as error:  # the lane's own failure: a driver error, never a kill
                answer = {"status": -1, "verdict": DRIVER, "note": f"{type(error).__name__}: {error}"}
            conn.sendall((json.dumps(answer) + "\n").encode())


def _pristine_copy(where: str, package: str = "otb_ref") -> tuple[str, str]:
    """HEAD's ``package`` exported to ``where``: what a check that a killing test passes unmutated imports.
    Returns ``(package, where)``."""
    import shutil
    import tarfile

    shutil.rmtree(where, ignore_errors=True)
    os.makedirs(where)
    archive = subprocess.run(["git", "archive", "--format=tar", "HEAD", package], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(where, filter="data")
    return package, where


KILLED, SURVIVED, TIMEOUT, CRASH, DRIVER = "killed", "survived", "timeout", "crash", "driver error"
BASE_LIMIT = 60.0  # seconds a stage may run beyond 5 times its tests' durations in the coverage run


class Lane:
    """The server's state: the map, HEAD's sources, and which killing tests were seen to pass unmutated."""

    def __init__(self, pytest, test_map: dict, pristine: dict, unmutated: tuple[str, str] | None):
        """``unmutated``: (package, directory holding a pristine copy of it), None to trust every kill."""
        self.pytest, self.test_map, self.pristine, self.unmutated = pytest, test_map, pristine, unmutated
        self.duration = dict(zip(test_map["tests"], test_map["durations"]))  # node id -> seconds in the map's run
        self.passes_unmutated: dict[str, bool] = {}

    def one_mutant(self, request: dict) -> dict:
        changed = [m for m in self.pristine if Path(m).read_text() != self.pristine[m]]
        lines = None
        if "baseline" in request:  # the fastest tests on the unmutated tree: must pass, or the lane is broken
            if changed:
                return {"status": -1, "verdict": DRIVER, "note": f"not pristine: {changed}"}
            tests = sorted(self.test_map["tests"], key=self.duration.__getitem__)[: request["baseline"]]
        elif len(changed) != 1:
            return {"status": -1, "verdict": DRIVER, "note": f"expected one mutated module, found {changed}"}
        else:
            source = Path(changed[0]).read_text()
            lines = changed_lines(self.pristine[changed[0]], source)
            tests = select(self.test_map, changed[0], self.pristine[changed[0]], source)
            if not tests:
                return {"status": 0, "verdict": SURVIVED, "tests": 0, "note": "no test executes it"}
        start = time.monotonic()
        # Two stages: the fastest few tests first (few test files to import), then the rest.
        for stage in (tests[:STAGE_ONE], tests[STAGE_ONE:]):
            if stage:
                limit = BASE_LIMIT + 5.0 * sum(self.duration.get(t, 0.0) for t in stage)
                run = run_in_child(self.pytest, stage, limit, changed[0] if changed else None, lines)
                if run["verdict"] != SURVIVED:
                    break
        answer = {**run, "tests": len(tests), "seconds": round(time.monotonic() - start, 2)}
        # A test that failed must pass unmutated (a file that failed to collect or import did: the map's run on HEAD).
        if answer["verdict"] == KILLED and answer["phase"] not in ("collect", "import"):
            if not self._passes_unmutated(answer["by"]):
                answer.update(verdict=DRIVER, note="the killing test fails on the unmutated code too")
        return answer

    def _passes_unmutated(self, test: str) -> bool:
        if self.unmutated is None:
            return True
        if test not in self.passes_unmutated:
            limit = BASE_LIMIT + 5.0 * self.duration.get(test, 0.0)
            run = run_in_child(self.pytest, [test], limit, None, None, self.unmutated)
            self.passes_unmutated[test] = run["verdict"] == SURVIVED
        return self.passes_unmutated[test]


class _OneThread:
    """One torch thread per lane (tests/conftest.py sets two; the lanes share the cores)."""

    def pytest_configure(self, config):
        import torch

        torch.set_num_threads(1)


def describe(error: BaseException, test: str, phase: str, mutated: str | None, lines) -> dict:
    """A failure as the answer reports it: the test, the phase, the exception's type and first line, and whether
    its traceback passes through the mutated module (``through_mutant``) with its innermost frame there on the
    mutated lines (``at_mutation``)."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f.lineno for f in frames if mutated and os.path.abspath(f.filename) == os.path.abspath(mutated)]
    text = str(error).strip().splitlines()
    return {
        "by": test,
        "phase": phase,
        "exception": type(error).__name__,
        "message": text[0][:200] if text else "",
        "through_mutant": bool(ours),
        "at_mutation": bool(ours) and lines is not None and lines[0] <= ours[-1] <= lines[1],
    }


class _FirstFailure:
    """pytest plugin: the first exception raised by a test (setup, call, teardown) or by a test file's collection."""

    def __init__(self, mutated: str | None, lines):
        self.mutated, self.lines, self.first = mutated, lines, None

    def pytest_exception_interact(self, node, call, report):
        if self.first is None and call.excinfo is not None:
            self.first = describe(call.excinfo.value, node.nodeid, call.when, self.mutated, self.lines)


class _Pristine:
    """Meta path finder: the package ``name`` from ``root`` (a pristine copy), whatever sys.path says."""

    def __init__(self, name: str, root: str):
        self.name, self.root = name, root

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        from importlib.machinery import PathFinder

        return PathFinder.find_spec(name, [self.root])


def _module_name(path: str) -> str:
    parts = list(Path(path).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _child(pytest, tests: list[str], out: str, mutated: str | None, lines, unmutated) -> int:
    """In the forked child: pytest -x on the tests; the first failure to ``out``; pytest's exit status."""
    import importlib

    sys.dont_write_bytecode = True
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    if unmutated is not None:
        sys.meta_path.insert(0, _Pristine(*unmutated))
    recorder = _FirstFailure(mutated, lines)
    args = ["-x", "-q", "--tb=no", "-p", "no:cacheprovider", "-p", "no:cov", *tests]
    rc = int(pytest.main(args, plugins=[_OneThread(), recorder]))
    failure = recorder.first
    if failure is None and rc not in (0, 1) and mutated:  # e.g. a conftest's import of the mutated module failed
        try:
            importlib.import_module(_module_name(mutated))
        except BaseException as error:
            failure = describe(error, f"import {_module_name(mutated)}", "import", mutated, lines)
    Path(out).write_text(json.dumps(failure))
    return rc


def run_in_child(pytest, tests: list[str], limit: float, mutated=None, lines=None, unmutated=None) -> dict:
    """pytest -x on the tests in a forked child (which imports the package afresh), judged: {"status", "verdict",
    and the failure's fields}; "status" is pytest's exit status, 124 past the limit, minus the signal's number for a
    child a signal ended."""
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    with warnings.catch_warnings():  # Python 3.12 warns of fork in a process with threads (torch's): known here
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        rc = 3
        try:
            rc = _child(pytest, tests, out, mutated, lines, unmutated)
        finally:
            os._exit(rc)
    start = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - start > limit:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.unlink(out)
            return {"status": 124, "verdict": TIMEOUT, "note": f"timeout after {limit:.0f} s"}
        time.sleep(0.02)
    text = Path(out).read_text()
    os.unlink(out)
    failure = json.loads(text) if text else None
    rc = os.waitstatus_to_exitcode(status)
    if rc < 0:
        return {"status": rc, "verdict": CRASH, "note": f"the child died of {signal.Signals(-rc).name}"}
    if rc == 0:
        return {"status": 0, "verdict": SURVIVED}
    if failure is not None and (rc in (1, 2) or failure["phase"] in ("collect", "import")):
        return {"status": rc, "verdict": KILLED, **failure}
    return {"status": rc, "verdict": DRIVER, "note": f"pytest exit status {rc} without a test's exception"}


def ask(sock_path: str, request: dict) -> dict:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(sock_path)
    client.sendall((json.dumps(request) + "\n").encode())
    return json.loads(client.makefile().readline())


def run(sock_path: str) -> int:
    """cosmic-ray's test command: 0 if the mutant survived, 1 if a test killed it; 3 for a timeout, a crash or a
    driver error (cosmic-ray counts any non-zero status as a kill: tools/mutation_score.py reads the verdict)."""
    answer = ask(sock_path, {})
    print(json.dumps(answer))
    return {SURVIVED: 0, KILLED: 1}.get(answer.get("verdict"), 3)


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
