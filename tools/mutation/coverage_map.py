"""Which tests execute each line of a rule file: one run of its tests under coverage.

Coverage records each line's contexts as the node ids of the tests that ran it (contexts.py); a
mutant then runs the tests that execute the body of the function it changes (also when the
change is in its decorators or default arguments), and a mutant outside every function runs all
the file's tests.
The run is also the baseline: tests that fail before any mutation would kill every mutant.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .workspace import Workspace


@dataclasses.dataclass(frozen=True)
class CoverageMap:
    """The node ids of the tests that execute each line, each test's duration, the run's."""

    lines: dict[int, frozenset[str]]
    durations: dict[str, float]
    seconds: float

    def tests_for(self, region: range) -> set[str]:
        return {test for line in region for test in self.lines.get(line, ())}

    def quickest_first(self, tests) -> list[str]:
        return sorted(tests, key=lambda t: (self.durations.get(t, float("inf")), t))


def build(ws: Workspace, repo_path: str, tests: tuple[str, ...]) -> CoverageMap:
    """Run `tests` under coverage in the workspace; raise if any of them fails unmutated."""
    import coverage

    target = ws.path_of(repo_path)
    data_file = ws.root / f".coverage-{target.stem}"
    rcfile = ws.root / f".coveragerc-{target.stem}"
    rcfile.write_text(f"[run]\nsource = {target.parent}\ndata_file = {data_file}\n")
    command = [sys.executable, "-m", "coverage", "run", f"--rcfile={rcfile}"]
    plugin = ws.root / "_mutation_contexts.py"
    shutil.copy2(Path(__file__).with_name("contexts.py"), plugin)
    command += ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    command += ["-p", plugin.stem, *tests]
    durations = ws.root / f".durations-{target.stem}.json"
    env = {**os.environ, "TPU_INDUCTOR_MUTATION_DURATIONS": str(durations)}
    start = time.monotonic()
    run = subprocess.run(command, cwd=ws.root, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if run.returncode != 0:
        raise RuntimeError(
            f"the tests of {repo_path} fail before any mutation:\n{run.stdout[-3000:]}"
        )
    data = coverage.CoverageData(basename=str(data_file))
    data.read()
    contexts = data.contexts_by_lineno(str(target))
    lines = {line: frozenset(c for c in names if c) for line, names in contexts.items()}
    return CoverageMap(lines, json.loads(durations.read_text()), seconds)


def function_region(source: str, line: int) -> range | None:
    """The body lines of the innermost function around `line` (which may be in its decorators
    or signature), or None for module-level code.

    Only the body: decorators, signature and default arguments run when the module is
    imported, which happens lazily, inside whichever test first looks a rule up.
    """
    best = None
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if start <= line <= node.end_lineno and (best is None or start >= best[0]):
                best = start, range(node.body[0].lineno, node.end_lineno + 1)
    return best[1] if best else None
