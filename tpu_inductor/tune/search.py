"""`tpu-inductor tune --mesh data=2,model=4 [--memory-per-device 2GiB]`: the sharding-plan search.

The defaults' run surveys the model its `shard(model, mesh, "auto")` placed (sharding/named.py):
per named plan, the bytes of parameters per device from the shapes and the plan's specs, or why
the plan does not apply. For each plan that applies, before anything is compiled for it:

- its estimate per device: parameters, and for a program that trains (a backward graph ran)
  gradients split like them and the optimizer's state (parameter-sized tensors per parameter,
  by its kind: Adam's 2). The optimizer step reads them all at once, so their total is a lower
  bound of the peak: a plan refused by it cannot fit. Beside it, where known, the largest need
  of a call beyond the resident state (`call_need`: XLA's memory analysis of the modules, with
  their temporaries), measured for the defaults' plan only: another plan's modules are not
  compiled before it is checked;
- over the stated memory: refused (PlanDoesNotFitError's figures in the report), nothing
  compiled or run for it. (The defaults' plan ran already, as the baseline the report compares
  against; refused, it is not proposed.)

Each plan left runs once, scored by its compiled modules' per-device peak (the memory ledger's
estimate: resident bytes and the largest need of XLA's memory analysis) and the bytes its
collectives moved per device (sharding/collectives.py). The program checks its own results: a
run that fails (results not eager's, a compile refused) is its plan's row, "failed" with the
end of its log, and the plan is not chosen.
The choice: among the plans that fit the memory once compiled (every plan, without a stated
memory), the one whose collectives move the fewest bytes, then the smallest peak: the least
communication that fits (data parallelism when the weights fit, FSDP or tensor parallelism
when they do not).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from tpu_inductor.exc import OptionError, PlanDoesNotFitError, TpuInductorError
from tpu_inductor.sharding import named

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(?P<number>[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>[a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """`2GiB`, `512MiB`, `1.5GB`, `4096` → bytes."""
    match = _SIZE.match(text)
    if match is None or match["unit"].lower() not in _UNITS:
        raise OptionError(
            f"tpu-inductor tune: --memory-per-device {text!r}: give bytes with a unit among "
            "B, KiB, MiB, GiB, TiB, KB, MB, GB, TB, e.g. 2GiB."
        )
    return int(float(match["number"]) * _UNITS[match["unit"].lower()])


def estimate(survey: dict, name: str, record: dict) -> dict:
    """Plan `name`'s bytes per device by kind (None: not known) and `total`, the bytes the
    optimizer step's arguments hold at once (parameters, gradients, state): a lower bound of
    the peak; `call_need` (not in it), measured for the defaults' plan only."""
    shares = survey["plans"][name]
    trains = any(graph.startswith("backward") for graph in record["graphs"])
    states = (survey.get("optimizer") or {}).get("states")
    figures = {
        "parameters": shares["parameters"] + shares["buffers"],
        "gradients": shares["trainable"] if trains else 0,
        "optimizer_state": None if states is None else states * shares["trainable"],
    }
    figures["total"] = sum(v for v in figures.values() if v is not None)
    needs = [g["need_bytes"] for g in record["graphs"].values()]
    figures["call_need"] = max(needs, default=0) if name == survey["plan"] else None
    return figures


def check_fits(name: str, figures: dict, memory: int | None) -> None:
    """A PlanDoesNotFitError with `figures` where their known total exceeds `memory`."""
    if memory is None or figures["total"] <= memory:
        return
    parts = ", ".join(
        f"{kind} {'not known' if v is None else f'{v:,}'}"
        for kind, v in figures.items()
        if kind not in ("total", "call_need")
    )
    need = figures["call_need"]
    parts += (
        "; its calls' needs not known before compiling"
        if need is None
        else f"; its largest call's need beyond the resident state, measured: {need:,}"
    )
    raise PlanDoesNotFitError(
        f"plan {name!r} needs at least {figures['total']:,} bytes per device ({parts}); the "
        f"target has {memory:,}: refused before compiling",
        figures,
    )


def search(
    before: dict, figures_of: Callable[[dict], dict], run_plan: Callable[[str], dict], memory
) -> tuple[str, list[dict]]:
    """(the chosen plan, a row per named plan: its status, estimate and measured figures).
    `before`: the defaults' record; `figures_of`: a record's figures; `run_plan(name)`: a
    recorded run under plan `name`. A PlanDoesNotFitError when no plan fits."""
    survey = before["sharding"]
    if survey is None:
        raise OptionError(
            "tpu-inductor tune --mesh: the program placed no model with "
            'tpu_inductor.shard(model, mesh, "auto") (mesh = tpu_inductor.auto_mesh(...)): '
            "there is no plan to search (docs/performance.md, 'Sharding plans')."
        )
    rows = []
    for name, shares in survey["plans"].items():
        row = {"plan": name, "what": named.NAMED[name][0]}
        rows.append(row)
        if "error" in shares:
            row.update(status="does not apply", reason=shares["error"])
            continue
        row["estimate"] = estimate(survey, name, before)
        try:
            check_fits(name, row["estimate"], memory)
        except PlanDoesNotFitError as refused:
            row.update(status="refused", reason=str(refused))
            if name == survey["plan"]:  # the baseline ran: its figures, for the comparison
                row["figures"] = figures_of(before)
            continue
        try:
            record = before if name == survey["plan"] else run_plan(name)
        except TpuInductorError as failed:  # its results differ from eager's, it cannot compile
            row.update(status="failed", reason=str(failed))
            continue
        row["figures"] = figures_of(record)
        fits = memory is None or row["figures"]["peak_bytes"] <= memory
        row["status"] = "ran" if fits else "did not fit once compiled"
    fitting = [r for r in rows if r.get("status") == "ran"]
    if not fitting:
        reasons = "; ".join(f"{r['plan']}: {r.get('reason', r['status'])}" for r in rows)
        if memory is None:  # none fails for memory: each failed or does not apply
            raise TpuInductorError(
                f"tpu-inductor tune: no sharding plan ran on mesh {survey['mesh']}: {reasons}"
            )
        raise PlanDoesNotFitError(
            f"tpu-inductor tune: no sharding plan fits {memory:,} bytes per device on mesh "
            f"{survey['mesh']}: {reasons}",
            {r["plan"]: r.get("estimate") for r in rows},
        )
    best = min(
        fitting, key=lambda r: (r["figures"]["collective_bytes"], r["figures"]["peak_bytes"])
    )
    best["status"] = "chosen"
    return best["plan"], rows
