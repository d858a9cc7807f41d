"""python -m tools.mutation [--files lowering/ops/losses.py,...] [--sample 20] [--seed 0]
[--rev HEAD] [--time-box 300] [--out bench/results/mutation.md] [--json F]: see tools/mutation/__init__.py.
Exits 1 when a named mutant is not killed or a file scores under --min-score."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from . import report, run
from .plan import TARGETS
from .workspace import workspace


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--files", default=",".join(TARGETS), help="comma-separated rule files")
    parser.add_argument("--sample", type=int, default=20, help="mutation sites per file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rev", default="HEAD", help="the commit whose rules and tests to use")
    parser.add_argument("--time-box", type=float, default=300, help="seconds per file")
    parser.add_argument("--min-score", type=float, default=0.85)
    parser.add_argument("--out", default="bench/results/mutation.md")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    repo = Path(__file__).resolve().parents[2]
    files = [f for f in args.files.split(",") if f]
    unknown = sorted(set(files) - set(TARGETS))
    if unknown:
        parser.error(f"no tests are mapped for {', '.join(unknown)} (tools/mutation/plan.py)")
    command = shlex.join(["python", "-m", "tools.mutation", *(argv or sys.argv[1:])])
    out = repo / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    with workspace(repo, args.rev) as ws:
        for path in files:
            print(f"mutating {path} ...", file=sys.stderr, flush=True)
            results.append(run.run_file(ws, path, args.sample, args.seed, args.time_box))
            print("\n".join(report.table(results[-1:])), file=sys.stderr, flush=True)
            out.write_text(report.markdown(results, command))  # after each file: a partial run
            if args.json:
                (repo / args.json).write_text(json.dumps(report.as_json(results), indent=1))
    print(f"wrote {out}", file=sys.stderr)
    named_alive = [m for r in results for m in r.named if m.outcome != "killed"]
    low = [r.path for r in results if (report.score(r) or 0) < args.min_score]
    for m in named_alive:
        print(f"named mutant not killed: {m.operator}: {m.outcome} {m.detail}", file=sys.stderr)
    for path in low:
        print(f"{path}: score under {args.min_score:.0%}", file=sys.stderr)
    return 1 if named_alive or low else 0


if __name__ == "__main__":
    sys.exit(main())
