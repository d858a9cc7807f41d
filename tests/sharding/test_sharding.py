"""Artifacts split over a device mesh: plans and their errors here; compile, load and run on 8
virtual CPU devices in subprocesses (the device count is fixed when jax starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from tpu_inductor.aot import artifact
from tpu_inductor.aot import compile as aot_compile
from tpu_inductor.aot import loader as aot_loader
from tpu_inductor.exc import ArtifactError, OptionError
from tpu_inductor.sharding.mesh import Plan, parse_mesh, parse_shard, partition_specs

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_mlp() -> nn.Module:
    """The factory the subprocesses name as `tests.sharding.test_sharding:make_mlp`."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()


def test_meshes_and_shards_parse_and_bad_ones_say_what_is_expected():
    mesh = parse_mesh("data=2,model=4")
    assert (mesh.axes, str(mesh)) == ((("data", 2), ("model", 4)), "data=2,model=4")
    assert parse_shard("x:data,-") == ("x", ("data", None))
    assert parse_shard("x:") == ("x", ())
    for bad in ("data", "data=0", "data=2,data=2", "1x=2", "data=²"):
        with pytest.raises(OptionError, match="--mesh"):
            parse_mesh(bad)
    with pytest.raises(OptionError, match="NAME:SPEC"):
        parse_shard("x")
    with pytest.raises(OptionError, match=r"more than once for \['x'\]"):
        Plan(mesh, (("x", ("data",)), ("x", (None,))))


def test_plans_split_the_first_dim_by_default_and_check_what_they_are_given():
    mesh = parse_mesh("data=4,model=2")
    shapes = {"x": (8, 6), "step": ()}
    assert partition_specs(mesh, shapes, {}) == {"x": ("data",), "step": ()}
    given = {"x": (None, "model")}
    assert partition_specs(mesh, shapes, given)["x"] == (None, "model")
    with pytest.raises(OptionError, match=r"dim 1 \(6\) does not divide over mesh axis data"):
        partition_specs(mesh, shapes, {"x": (None, "data")})
    with pytest.raises(OptionError, match="must use axes of the mesh"):
        partition_specs(mesh, shapes, {"x": ("batch",)})
    with pytest.raises(OptionError, match="must use axes of the mesh"):
        partition_specs(mesh, {"x": (8, 8)}, {"x": ("data", "data")})
    with pytest.raises(OptionError, match=r"names \['y'\], which are not inputs"):
        partition_specs(mesh, shapes, {"y": ("data",)})
    with pytest.raises(OptionError, match="gives 3 dims"):
        partition_specs(mesh, shapes, {"x": ("data", None, None)})


def test_shard_without_a_mesh_is_refused(tmp_path, capsys):
    from tpu_inductor import cli

    argv = ["compile", "tests.sharding.test_sharding:make_mlp", "--input", "x:float32[8,16]"]
    argv += ["--shard", "x:-", "--out", str(tmp_path / "a")]
    assert cli.main(argv) == 2
    assert "--shard needs a --mesh" in capsys.readouterr().err


def test_a_mesh_lowers_for_a_platform_absent_here(tmp_path):
    """For TPU from this machine: StableHLO with the partitioning, no executables."""
    plan = Plan(parse_mesh("data=4"))
    inputs = [artifact.parse_input("x:float32[8,16]")]
    aot_compile.compile_model(make_mlp(), inputs, tmp_path / "a", platform="tpu", plan=plan)
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["mesh"] == [["data", 4]] and manifest["entries"][0]["executable"] is None
    text = (tmp_path / "a" / "buckets" / "0" / "module.mlir").read_text()
    assert "mhlo.num_partitions = 4" in text and '[{"data"}, {}]' in text
    for damaged in ("data=4", [["data", 0]], [["data", 2]], None):
        manifest["mesh"] = damaged
        (tmp_path / "a" / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ArtifactError, match="manifest.json is malformed: .*mesh"):
            aot_loader.load(tmp_path / "a")


_ON_8_DEVICES = """
import sys, torch
from tpu_inductor.aot import artifact
from tpu_inductor.aot import compile as aot_compile
from tpu_inductor.aot import loader as aot_loader
from tpu_inductor.sharding.mesh import Plan, parse_mesh, parse_shard
from tests.sharding.test_sharding import make_mlp

out, mesh, shards = sys.argv[1], sys.argv[2], [parse_shard(s) for s in sys.argv[3:]]
plan = Plan(parse_mesh(mesh), tuple(shards))
inputs = [artifact.parse_input("x:float32[B,16]")]
aot_compile.compile_model(make_mlp(), inputs, out, buckets={"B": (8, 16)}, plan=plan)
loaded = aot_loader.load(out)
for batch in (8, 16):
    x = torch.randn(batch, 16)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), make_mlp()(x))
compiled = loaded._compiled[0]
print("HLO", compiled.executable.hlo_modules()[0].to_string())
"""


def _on_devices(count: int, code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={count}"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize(
    "mesh, shards, shard_shape",
    [("data=4", [], "f32[2,16]"), ("data=2,model=2", ["x:data,model"], "f32[4,8]")],
)
def test_an_artifact_split_over_a_mesh_runs_each_bucket_on_its_devices(
    tmp_path, mesh, shards, shard_shape
):
    """Each device gets its shard of x (the partitioned HLO's parameter), the results match
    eager, and another process needs as many devices to load it."""
    out = str(tmp_path / "a")
    proc = _on_devices(8, _ON_8_DEVICES, out, mesh, *shards)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hlo = proc.stdout.split("HLO", 1)[1]
    assert f"{shard_shape}" in hlo and "all-gather" in hlo, hlo[:2000]
    # Fresh processes run it and exit cleanly (zero-copy shards of torch memory aborted about
    # half of them at exit).
    run = "import sys, torch; from tpu_inductor import aot; print(aot.load(sys.argv[1])(torch.ones(8, 16)).shape)"
    for _ in range(4):
        again = _on_devices(8, run, out)
        assert again.returncode == 0 and "[8, 8]" in again.stdout, again.stderr[-2000:]
    load = "import sys; from tpu_inductor import aot; aot.load(sys.argv[1])"
    refused = _on_devices(2, load, out)
    assert refused.returncode != 0
    assert "needs 4 cpu devices; 2 here" in refused.stderr, refused.stderr[-2000:]
    assert "xla_force_host_platform_device_count=4" in refused.stderr


def test_a_mesh_takes_its_devices_in_the_topologys_order(monkeypatch, caplog):
    """mesh_placement.topology_order: jax's create_device_mesh decides (on a TPU slice, the
    order of its links); a shape it cannot map keeps jax.devices() order and says why."""
    import numpy as np
    from jax.experimental import mesh_utils

    from tpu_inductor.sharding import placement as mesh_placement

    devices = ["d0", "d1", "d2", "d3"]
    seen = []

    def by_links(shape, devices):
        seen.append(shape)
        return np.array(devices[::-1], dtype=object).reshape(shape)

    monkeypatch.setattr(mesh_utils, "create_device_mesh", by_links)
    assert mesh_placement.topology_order(devices, [2, 2]) == ("d3", "d2", "d1", "d0")
    assert seen == [(2, 2)]

    def refuses(shape, devices):
        raise ValueError("no such slice")

    monkeypatch.setattr(mesh_utils, "create_device_mesh", refuses)
    with caplog.at_level("INFO", logger="tpu_inductor.sharding.placement"):
        assert mesh_placement.topology_order(devices, [4]) == tuple(devices)
    assert "no such slice" in caplog.text
