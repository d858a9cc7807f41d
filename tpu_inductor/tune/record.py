"""One recorded run of a program, in a process of its own, for `tpu-inductor tune`:

    python -m tpu_inductor.tune.record OUT SAVE_PLANS SCRIPT [ARGS]

runs SCRIPT under `tpu_inductor.profile(OUT)` (the options its compiles take come from the
environment the tuner gives it: TPU_INDUCTOR_SHAPES, TPU_INDUCTOR_CONFIG), then, when SAVE_PLANS
is 1, writes the `auto` bucket plans with the sizes seen (their files named by the options), and
`OUT/record.json`: the profile's figures, the run's wall time, the plan files written, the
platform it ran on, the survey of the model its last `shard(model, mesh, "auto")` placed
(sharding/named.py: each named plan's bytes per device) and, for another target than the
CPU, the collective bytes as a GPU's or TPU's pipeline would move them (an estimate).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tpu_inductor.config import Options
from tpu_inductor.debug import records
from tpu_inductor.runtime import buckets, devices
from tpu_inductor.sharding import collectives, named
from tpu_inductor.tune.profile import profile, run_script


def main(argv: list[str]) -> int:
    out, save_plans, script, *args = argv
    start = time.perf_counter()
    with profile(out) as found:
        run_script(script, args)
    wall = time.perf_counter() - start
    plans = buckets.save_plans() if save_plans == "1" else []
    platform = devices.select_device(Options.from_user().device).platform
    facts = {
        "graphs": found.graphs,
        "totals": found.totals,
        "wall_s": wall,
        "plans": plans,
        "platform": platform,
        "sharding": named.surveys[-1] if named.surveys else None,
        "accelerator_collective_bytes": _on_accelerators(found.graphs),
    }
    (Path(out) / "record.json").write_text(json.dumps(facts, indent=1) + "\n")
    return 0


def _on_accelerators(graphs: dict) -> float:
    """The collective bytes per device of `graphs` as a GPU's or TPU's pipeline would move
    them (collectives.moved_bytes): each graph's measured bytes scaled by its compile records'
    ratio of the two counts (one record per executable; a bucketed graph's, averaged)."""
    moved = 0.0
    for name, graph in graphs.items():
        reports = [r.communication for r in records.records if r.graph == name and r.communication]
        here = sum(collectives.moved_bytes(c, "cpu") for c in reports)
        there = sum(collectives.moved_bytes(c, "tpu") for c in reports)
        moved += graph["collective_bytes"] * (there / here if here else 1.0)
    return moved


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
