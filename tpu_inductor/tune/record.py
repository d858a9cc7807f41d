"""One recorded run of a program, in a process of its own, for `tpu-inductor tune`:

    python -m tpu_inductor.tune.record OUT SAVE_PLANS SCRIPT [ARGS]

runs SCRIPT under `tpu_inductor.profile(OUT)` (the options its compiles take come from the
environment the tuner gives it: TPU_INDUCTOR_SHAPES, TPU_INDUCTOR_CONFIG), then, when SAVE_PLANS
is 1, writes the `auto` bucket plans with the sizes seen (their files named by the options), and
`OUT/record.json`: the profile's figures, the run's wall time, the plan files written, the
platform it ran on and the survey of the model its last `shard(model, mesh, "auto")` placed
(sharding/named.py: each named plan's bytes per device).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tpu_inductor.config import Options
from tpu_inductor.runtime import buckets, devices
from tpu_inductor.sharding import named
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
    }
    (Path(out) / "record.json").write_text(json.dumps(facts, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
