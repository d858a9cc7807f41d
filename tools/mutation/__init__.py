"""Mutation testing of the lowering rules: `make mutation` (`python -m tools.mutation`).

Cosmic Ray's operators make the mutants (one source change each); every mutant runs only the
tests that execute the function it changes (a coverage map per rule file, made once per run),
in a private copy of the package, so the working tree is never touched. A sampled run fits in
minutes: `--sample` sites per file, each with one of its mutations, and a time box per file.

    plan.py        which tests cover each rule file; the named mutants (bugs seen before)
    equivalent.py  survivors judged equivalent, each with its reason
    workspace.py   the private copy and how a test run is started in it
    coverage_map.py  which tests execute each line
    run.py         sampling, running, classifying; __main__.py the command line
    report.py      the markdown report
"""
