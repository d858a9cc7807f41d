"""`tpu-inductor tune`'s report: the runs with the defaults and with the tuned config, side by
side, as markdown and as one self-contained HTML page (inline SVG bars: no script, no link to
anything outside the page)."""

from __future__ import annotations

import html
import json

# (key, what it is, how it prints): every figure is the less the better.
FIGURES = (
    ("compiles", "PJRT compiles", "{:,.0f}"),
    ("padded_share", "padded share of the bucketed inputs", "{:.1%}"),
    ("graph_ms", "compiled graphs' time, ms (device + host, every call)", "{:,.1f}"),
    ("compile_s", "compile time, s", "{:,.2f}"),
    ("wall_s", "the run's wall time, s", "{:,.2f}"),
    ("crossed_bytes", "bytes crossed host <-> device", "{:,.0f}"),
    ("collective_bytes", "bytes collectives moved per device (over a mesh)", "{:,.0f}"),
    ("peak_bytes", "peak bytes per device (estimate)", "{:,.0f}"),
)


def _figures(facts: dict):
    """FIGURES with their labels for this report: the collective bytes, scored for a target
    platform other than the one the runs ran on (tune.figures), say they are an estimate."""
    estimated = facts["platform"] != facts["ran_on"] and bool(facts.get("plans"))
    for key, what, form in FIGURES:
        if estimated and key == "collective_bytes":
            what = f"{what} (estimate for {facts['platform']})"
        yield key, what, form


def _change(before: float, after: float) -> str:
    if before == after:
        return "same"
    if not before:
        return "new"
    return f"{(after - before) / before:+.0%}"


def _plan_rows(facts: dict) -> list[tuple[str, ...]]:
    """The sharding search's rows (tune/search.py) as text cells: plan, status, estimated
    bytes per device before compiling, measured peak and collective bytes per device."""
    rows = []
    for r in facts.get("plans", []):
        estimate, measured = r.get("estimate"), r.get("figures")
        rows.append(
            (
                r["plan"],
                r["status"],
                f"{estimate['total']:,}" if estimate else "-",
                f"{measured['peak_bytes']:,.0f}" if measured else "-",
                f"{measured['collective_bytes']:,.0f}" if measured else "-",
            )
        )
    return rows


_PLAN_HEAD = (
    "plan",
    "status",
    "estimate bytes/device (before compiling, at least)",
    "peak bytes/device",
    "collective bytes/device",
)


def markdown(facts: dict) -> str:
    """The figures before and after, the config and what it rests on."""
    before, after = facts["before"], facts["after"]
    lines = [
        f"# tpu-inductor tune: {facts['script']}",
        "",
        f"target platform {facts['platform']}, ran on {facts['ran_on']}; config: "
        f'{facts["config_file"]} (`options={{"config": ...}}` or TPU_INDUCTOR_CONFIG)',
        "",
        "| figure | defaults | tuned | change |",
        "|---|---:|---:|---:|",
    ]
    for key, what, form in _figures(facts):
        lines.append(
            f"| {what} | {form.format(before[key])} | {form.format(after[key])} "
            f"| {_change(before[key], after[key])} |"
        )
    if facts.get("plans"):
        lines += ["", f"| {' | '.join(_PLAN_HEAD)} |", "|---|---|---:|---:|---:|"]
        lines += [f"| {' | '.join(row)} |" for row in _plan_rows(facts)]
    lines += ["", "```json", json.dumps(facts["config"], indent=1), "```", ""]
    lines += [
        f"- {note}" if not note.startswith("  ") else f"  - {note.strip()}"
        for note in facts["notes"]
    ]
    if facts["estimates"]:
        lines += ["", "Estimates (not measured here):"]
        lines += [f"- {e}" for e in facts["estimates"]]
    return "\n".join(lines) + "\n"


def _bars(key: str, before: float, after: float, form: str) -> str:
    """Two horizontal bars, defaults and tuned, scaled to the larger."""
    width, top = 360, max(before, after) or 1
    rows = []
    for y, (label, value, colour) in enumerate(
        (("defaults", before, "#9e9e9e"), ("tuned", after, "#1e88e5"))
    ):
        length = max(1, round(width * value / top)) if value else 0
        rows.append(
            f'<text x="0" y="{18 + 26 * y}" font-size="12">{label}</text>'
            f'<rect class="bar {label}" data-figure="{key}" x="70" y="{6 + 26 * y}" '
            f'width="{length}" height="18" fill="{colour}"/>'
            f'<text x="{76 + length}" y="{19 + 26 * y}" font-size="12">'
            f"{html.escape(form.format(value))}</text>"
        )
    return f'<svg width="560" height="58" role="img">{"".join(rows)}</svg>'


def html_page(facts: dict) -> str:
    """The report as one page."""
    before, after = facts["before"], facts["after"]
    sections = "".join(
        f"<section><h3>{html.escape(what)} ({_change(before[key], after[key])})</h3>"
        f"{_bars(key, before[key], after[key], form)}</section>"
        for key, what, form in _figures(facts)
    )
    notes = "".join(f"<li>{html.escape(n.strip())}</li>" for n in facts["notes"])
    estimates = "".join(f"<li>{html.escape(e)}</li>" for e in facts["estimates"])
    plans = "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>"
        for row in _plan_rows(facts)
    )
    if plans:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in _PLAN_HEAD)
        plans = f'<h2>Sharding plans</h2><table class="plans"><tr>{head}</tr>{plans}</table>'
    title = html.escape(f"tpu-inductor tune: {facts['script']}")
    return (
        '<!DOCTYPE html><html><head><meta charset="utf-8">'
        f"<title>{title}</title><style>body{{font-family:sans-serif;margin:2em}}"
        "section{margin-bottom:1em}h3{font-size:14px;margin:0.2em 0}</style></head><body>"
        f"<h1>{title}</h1><p>target platform {html.escape(facts['platform'])}, ran on "
        f"{html.escape(facts['ran_on'])}; config {html.escape(facts['config_file'])}</p>"
        f"{sections}{plans}<h2>The config</h2><pre>{html.escape(json.dumps(facts['config'], indent=1))}"
        f"</pre><ul>{notes}</ul>"
        + (f"<h2>Estimates (not measured here)</h2><ul>{estimates}</ul>" if estimates else "")
        + "</body></html>\n"
    )
