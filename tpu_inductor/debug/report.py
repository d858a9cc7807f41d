"""Reading a dump folder back: `tpu-inductor explain | report`.

`explain DUMP_DIR` prints a summary of a run (compiles, their causes, time per stage, cache hit
rate, fallback ops); `report DUMP_DIR` writes one static HTML page (no server, no CDN, no
script) with a section per compile: its stage files, a timing bar per stage, the cache decision
and the recompile reason; `repro DIR` recompiles a failed compile's reproducer.
"""

from __future__ import annotations

import collections
import errno
import html
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Stage files embedded in the report are cut past this many characters (the link has it all).
_EMBED_LIMIT = 200_000
_HIT_DECISIONS = ("memory_hit", "disk_hit")


# What this module reads of each compile.json (debug.compile_summary writes these and more).
_KEYS = frozenset(
    {"id", "graph", "compile_id", "status", "error", "inputs", "timings", "cache"}
    | {"recompile_reason", "options", "fallback_ops", "files"}
)


def load_run(dump_dir: str | Path) -> list[dict[str, Any]]:
    """Every compile.json under `dump_dir`, oldest first, each with its "folder" added.

    A missing `dump_dir` is an error; a damaged compile.json (e.g. of a process killed while
    writing it) is skipped with a warning that names it.
    """
    root = Path(dump_dir)
    if not root.is_dir():
        error = NotADirectoryError if root.exists() else FileNotFoundError
        raise error(
            errno.ENOTDIR if root.exists() else errno.ENOENT,
            "No such dump folder (a run with TPU_INDUCTOR_DUMP_DIR=DIR or options "
            "{'dump_dir': DIR} writes one)",
            str(root),
        )
    compiles = []
    for path in sorted(root.glob("*/compile.json")):
        try:
            summary = json.loads(path.read_text())
            if not isinstance(summary, dict):
                raise ValueError("not a JSON object")
            missing = _KEYS - summary.keys()
            if missing:
                raise ValueError(f"missing key(s) {', '.join(sorted(missing))}")
        except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError included
            log.warning("tpu-inductor: skipping %s, which is damaged: %s", path, e)
            continue
        summary["folder"] = path.parent.name
        compiles.append(summary)
    return sorted(compiles, key=lambda c: (c["id"], c["folder"]))


def _stage_totals(compiles: list[dict]) -> dict[str, float]:
    totals: dict[str, float] = collections.Counter()
    for c in compiles:
        for stage, seconds in c["timings"].items():
            totals[stage] += seconds
    return dict(totals)


def _decision(summary: dict) -> str:
    return summary["cache"].get("decision", "unknown")


def explain(dump_dir: str | Path, compiles: list[dict[str, Any]] | None = None) -> str:
    """A plain-text summary of the run dumped in `dump_dir` (its `load_run`, unless given)."""
    compiles = load_run(dump_dir) if compiles is None else compiles
    if not compiles:
        return f"no compiles found in {dump_dir} (no readable */compile.json)"
    graphs = {c["graph"] for c in compiles}
    decisions = collections.Counter(_decision(c) for c in compiles)
    hits = sum(decisions[d] for d in _HIT_DECISIONS)
    lines = [
        f"{len(compiles)} compile(s) of {len(graphs)} graph(s) in {dump_dir}",
        f"cache: {hits} hit(s) of {len(compiles)} ({100 * hits / len(compiles):.0f}%): "
        + ", ".join(f"{d} {n}" for d, n in sorted(decisions.items())),
        "time per stage (all compiles): "
        + ", ".join(f"{s} {t:.3f}s" for s, t in _stage_totals(compiles).items()),
        "compiles:",
    ]
    for c in compiles:
        timings = " ".join(f"{s} {t:.3f}s" for s, t in c["timings"].items())
        lines.append(
            f"  {c['folder']}  [{c['status']}] {_decision(c)}  inputs {', '.join(c['inputs'])}"
            + (f"  ({timings})" if timings else "")
        )
        if c["recompile_reason"]:
            lines.append(f"    recompiled: {c['recompile_reason']}")
        bucketing = c.get("bucketing")
        if bucketing and "refused" in bucketing:
            lines.append(f"    not bucketed: {bucketing['refused']}")
        elif bucketing:
            share = bucketing.get("padded_share")
            padded = "" if share is None else f", {100 * share:.0f}% of the input padding"
            lines.append(
                f"    bucket {bucketing['bucket']} ({bucketing['policy']}) for true sizes "
                f"{bucketing['true_sizes']}{padded}"
            )
        if c.get("transfers"):
            lines.append(f"    transfers: {transfer_line(c['transfers'])}")
        if c.get("memory"):  # records written before it have none
            lines.append(f"    memory per device: {memory_line(c['memory'])}")
        if c.get("communication"):
            lines.append(f"    communication: {communication_line(c['communication'])}")
        if c["error"]:
            lines.append(f"    error: {c['error']}")
    fallback: dict[str, int] = collections.Counter()
    for c in _one_per_graph(compiles):
        for op, facts in c["fallback_ops"].items():
            fallback[op] += facts["count"]
    if fallback:
        lines.append(
            "ops run in eager torch: " + ", ".join(f"{op} x{n}" for op, n in fallback.items())
        )
    return "\n".join(lines)


def _one_per_graph(compiles: list[dict]) -> list[dict]:
    """One compile per top-level graph (regions and specializations share its fallback ops)."""
    seen: dict[str, dict] = {}
    for c in compiles:
        seen.setdefault(c["graph"].split(".")[0], c)
    return list(seen.values())


_STYLE = """
body { font: 14px/1.4 sans-serif; margin: 1.5em; color: #222; }
section { border: 1px solid #ccc; border-radius: 6px; padding: 0.5em 1em; margin: 1em 0; }
table.facts td { padding: 1px 8px 1px 0; vertical-align: top; }
.bar-row { display: flex; align-items: center; margin: 2px 0; }
.bar-name { width: 11em; }
.bar { background: #1f6feb; height: 14px; min-width: 2px; }
.bar-time { margin-left: 6px; color: #555; }
.recompile { color: #9a3412; }
.error { color: #b91c1c; font-weight: bold; }
pre { background: #f6f8fa; padding: 6px; overflow-x: auto; font-size: 12px; }
pre.summary { white-space: pre-wrap; }
"""


def render_html(dump_dir: str | Path) -> str:
    """The report page of `dump_dir` as one self-contained HTML string."""
    root = Path(dump_dir)
    compiles = load_run(root)
    longest = max((t for c in compiles for t in c["timings"].values()), default=0.0) or 1.0
    summary = html.escape(explain(root, compiles))
    body = ["<h1>tpu_inductor compile report</h1>", f"<pre class='summary'>{summary}</pre>"]
    body += [_section(root, c, longest) for c in compiles]
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>tpu_inductor report: {html.escape(str(root))}</title>"
        f"<style>{_STYLE}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def _section(root: Path, c: dict, longest: float) -> str:
    esc = html.escape
    facts = [
        ("graph", c["graph"]),
        ("Dynamo compile id", c["compile_id"] or "-"),
        ("status", c["status"]),
        ("inputs", ", ".join(c["inputs"])),
        ("cache", ", ".join(f"{k}: {v}" for k, v in c["cache"].items()) or "-"),
        ("options", ", ".join(f"{k}={v}" for k, v in c["options"].items())),
    ]
    parts = [f"<section id='{esc(c['folder'])}'><h2>{esc(c['folder'])}</h2><table class='facts'>"]
    parts += [f"<tr><td>{esc(k)}</td><td>{esc(str(v))}</td></tr>" for k, v in facts]
    parts.append("</table>")
    if c["recompile_reason"]:
        parts.append(f"<p class='recompile'>Recompiled: {esc(c['recompile_reason'])}</p>")
    if c["error"]:
        parts.append(f"<p class='error'>Failed: {esc(c['error'])}</p>")
    for op, facts in c["fallback_ops"].items():
        sites = "; ".join(facts["sites"])
        parts.append(f"<p>Eager fallback: {esc(op)} x{facts['count']} ({esc(facts['why'])}): ")
        parts.append(f"{esc(sites)}</p>")
    parts.append("<h3>Time per stage</h3>")
    for stage, seconds in c["timings"].items():
        width = 100 * seconds / longest
        parts.append(
            f"<div class='bar-row'><span class='bar-name'>{esc(stage)}</span>"
            f"<div class='bar' style='width:{width:.1f}%'></div>"
            f"<span class='bar-time'>{seconds:.3f}s</span></div>"
        )
    parts.append("<h3>Stages</h3>")
    for name in c["files"]:
        text = (root / c["folder"] / name).read_text(errors="replace")
        cut = f"\n... cut at {_EMBED_LIMIT} characters" if len(text) > _EMBED_LIMIT else ""
        href = esc(f"{c['folder']}/{name}")
        parts.append(
            f"<details><summary><a href='{href}'>{esc(name)}</a></summary>"
            f"<pre>{esc(text[:_EMBED_LIMIT])}{cut}</pre></details>"
        )
    parts.append("</section>")
    return "\n".join(parts)


def write_report(dump_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report page (default: DUMP_DIR/report.html); returns its path."""
    path = Path(out) if out is not None else Path(dump_dir) / "report.html"
    path.write_text(render_html(dump_dir))
    return path


def _run_explain(args) -> int:
    print(explain(args.dump_dir))
    return 0


def _run_report(args) -> int:
    print(write_report(args.dump_dir, args.output))
    return 0


def add_subcommands(commands) -> None:
    """`tpu-inductor explain | report`."""
    explain_cmd = commands.add_parser("explain", help="summarize the compiles in a dump folder")
    explain_cmd.add_argument("dump_dir")
    explain_cmd.set_defaults(run=_run_explain)
    report_cmd = commands.add_parser("report", help="write an HTML report of a dump folder")
    report_cmd.add_argument("dump_dir")
    report_cmd.add_argument("-o", "--output", help="the HTML file (default DUMP_DIR/report.html)")
    report_cmd.set_defaults(run=_run_report)


def transfer_line(transfers: dict) -> str:
    """A compile record's transfer summary as one line: bytes per steady-state call by
    direction and kind (nonzero ones), what the first call sends besides, what stays."""
    parts = []
    for direction, label in (("host_to_device", "to device"), ("device_to_host", "to host")):
        kinds = {k: n for k, n in transfers["per_call"][direction].items() if n}
        text = ", ".join(f"{k} {_size(n)}" for k, n in kinds.items()) or "nothing"
        parts.append(f"per call {label}: {text}")
    parts.append(f"parameters sent once {_size(transfers['resident_bytes'])}")
    parts.append(f"{transfers['kept_on_device']} saved activation(s) kept on the device")
    if transfers.get("donated_bytes"):  # records written before it have none
        parts.append(f"written buffers updated in place {_size(transfers['donated_bytes'])}")
    return "; ".join(parts)


def _size(n: int) -> str:
    for unit, scale in (("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def memory_line(memory: dict) -> str:
    """A compile record's memory analysis (XLA's, per device) as one line."""
    parts = [
        f"{label} {_size(memory[key])}"
        for key, label in (
            ("arguments", "arguments"),
            ("temporaries", "temporaries"),
            ("outputs", "outputs"),
            ("alias", "aliased"),
            ("generated_code", "code"),
        )
        if key in memory
    ]
    if "need" in memory:
        parts.append(f"a call needs {_size(memory['need'])} beyond the resident state")
    return ", ".join(parts)


def communication_line(communication: dict) -> str:
    """A graph's collectives report (sharding/collectives.py) as one line."""
    ops = communication["collectives"]
    found = ", ".join(f"{kind} x{e['count']} ({e['bytes']} B)" for kind, e in ops.items())
    sliced = communication.get("sliced_all_reduces")
    if sliced:
        found += (
            f" (all-reduced and sliced x{sliced['count']}, {sliced['bytes']} B: reduce-scatters "
            "on GPU/TPU)"
        )
    memory = communication["per_device_bytes"]
    return (
        f"mesh {communication['mesh']}: {found or 'no collectives'}; per device: arguments "
        f"{memory['arguments']} B, temporaries {memory['temporaries']} B"
    )
