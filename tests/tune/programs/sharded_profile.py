"""A linear layer split over 8 virtual CPU devices (its weight by input features: each call
all-reduces its output), profiled into DIR; prints the profile's graphs and, per graph, the
bytes per call its compile records' collectives report says. Arguments: DIR."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

import tpu_inductor  # noqa: E402
from tpu_inductor.debug import records  # noqa: E402

model = torch.nn.Linear(64, 32, bias=False)
weight = model.weight.detach().clone()
tpu_inductor.shard(model, tpu_inductor.Mesh({"model": 8}), {"weight": (None, "model")})
f = torch.compile(model, backend="tpu_inductor")
x = torch.randn(4, 64)
with torch.no_grad(), tpu_inductor.profile(sys.argv[1]) as found:
    for _ in range(3):
        out = f(x)
torch.testing.assert_close(out, x @ weight.T)
reported = {
    r.graph: sum(c["bytes"] for c in r.communication["collectives"].values())
    for r in records.records
    if r.communication
}
print(json.dumps({"graphs": found.graphs, "reported": reported}))
