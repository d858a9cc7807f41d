"""The mutation report: per rule file, mutants killed, survived and equivalent, and the score
(killed / (killed + survived)); then the named mutants, each survivor with the key to judge
it by (equivalent.py), each equivalent mutant with its reason."""

from __future__ import annotations

import collections
import dataclasses

from .run import FileResult


def counts(result: FileResult) -> collections.Counter:
    return collections.Counter(m.outcome for m in result.sampled)


def score(result: FileResult) -> float | None:
    c = counts(result)
    judged = c["killed"] + c["survived"]
    return c["killed"] / judged if judged else None


def table(results: list[FileResult]) -> list[str]:
    """The per-file counts as markdown table rows."""
    lines = [
        "| rule file | sites | mutants | sampled | killed | survived | equivalent | no tests "
        "| not run | error | score | baseline |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        c, s = counts(r), score(r)
        cells = [c[k] for k in ("killed", "survived", "equivalent", "no tests", "not run", "error")]
        lines.append(
            f"| {r.path} | {r.sites} | {r.mutants} | {len(r.sampled)} | "
            + " | ".join(map(str, cells))
            + f" | {'-' if s is None else f'{s:.0%}'} | {r.baseline_s:.0f} s |"
        )
    return lines


def markdown(results: list[FileResult], command: str) -> str:
    lines = ["# Mutation testing of the lowering rules", "", f"`{command}`", "", *table(results)]
    lines += ["", "Score: killed / (killed + survived); equivalent mutants are left out.", ""]
    lines += ["## Named mutants", ""]
    for r in results:
        for m in r.named:
            lines.append(f"- {m.operator} ({m.path}:{m.line}): **{m.outcome}** {m.detail}")
    for title, outcome in (("Survivors", "survived"), ("Equivalent", "equivalent")):
        lines += ["", f"## {title}", ""]
        for r in results:
            for m in r.sampled:
                if m.outcome == outcome:
                    lines.append(f"- {m.path}:{m.line} {m.detail} `{m.key!r}`")
    lines += ["", "## No test executes them", ""]
    for r in results:
        lines += [f"- {m.path}:{m.line} `{m.before}`" for m in r.sampled if m.outcome == "no tests"]
    return "\n".join(lines) + "\n"


def as_json(results: list[FileResult]) -> list[dict]:
    return [dataclasses.asdict(r) | {"score": score(r)} for r in results]
