"""Ahead-of-time artifacts: compile → load in a fresh process → eager numbers; faults; tpu."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import example, given
from hypothesis import strategies as st
from torch.utils._pytree import tree_flatten
from tpu_inductor.passes import pipeline

from tests.helpers import assert_same
from tests.strategies import PROPERTY, seeds
from tpu_inductor import cli
from tpu_inductor.aot import artifact as aot
from tpu_inductor.aot import compile as aot_compile
from tpu_inductor.aot import loader as aot_loader
from tpu_inductor.exc import ArtifactError, InputMismatchError, OptionError
from tpu_inductor.runtime import devices

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Model(nn.Module):
    """Embedding + a buffer + a dict output: weights, buffers and pytree outputs round trip."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.lin = nn.Linear(16, 8)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids, x):
        h = self.emb(ids).mean(1) * self.scale + x
        return {"y": self.lin(h).softmax(-1), "h": h}


def make_model() -> nn.Module:
    """The factory the CLI test names as `tests.aot.test_aot:make_model`."""
    torch.manual_seed(0)
    return _Model().eval()


_INPUTS = [aot.parse_input("ids:int64[2,S]"), aot.parse_input("x:float32[2,16]")]


def _example(seq: int):
    return {"ids": torch.randint(0, 50, (2, seq)), "x": torch.randn(2, 16)}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("artifact")
    aot_compile.compile_model(make_model(), _INPUTS, out, buckets={"S": (3, 5)})
    return out


def _copy(artifact, tmp_path):
    shutil.copytree(artifact, tmp_path / "a")
    return tmp_path / "a"


def test_parse_specs():
    spec = aot.parse_input("ids:int64[8, S]")
    assert (spec.name, spec.dtype, spec.shape) == ("ids", torch.int64, (8, "S"))
    assert aot.parse_bucket("S=16,32") == ("S", (16, 32))
    for bad in ("ids:int64", "ids:notatype[2]", "ids:int64[2,-1]"):
        with pytest.raises(OptionError, match="bad --input"):
            aot.parse_input(bad)
    with pytest.raises(OptionError, match="bad --bucket"):
        aot.parse_bucket("S=")


def test_named_dim_without_bucket_is_an_error(tmp_path):
    with pytest.raises(OptionError, match=r"dims \['S'\] have no --bucket"):
        aot_compile.compile_model(make_model(), _INPUTS, tmp_path)


def test_round_trip_in_a_fresh_process_matches_eager(artifact, tmp_path):
    model = make_model()
    for seq in (5,):  # the other bucket is checked in-process below
        inputs = _example(seq)
        np.savez(tmp_path / "in.npz", **{k: v.numpy() for k, v in inputs.items()})
        run = [sys.executable, "-m", "tpu_inductor.cli", "run", str(artifact)]
        run += ["--input", str(tmp_path / "in.npz"), "--out", str(tmp_path / "out.npz")]
        proc = subprocess.run(run, cwd=_ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        with np.load(tmp_path / "out.npz") as data:
            got = [torch.from_numpy(data[f"arr_{i}"]) for i in range(len(data.files))]
        with torch.no_grad():
            expected, _ = tree_flatten(model(**inputs))
        assert_same(got, expected)


def test_loaded_artifact_returns_the_model_structure(artifact):
    loaded = aot_loader.load(artifact)
    inputs = _example(3)
    with torch.no_grad():
        expected = make_model()(**inputs)
    assert_same(loaded(inputs["ids"], x=inputs["x"]), expected)


def test_mismatched_inputs_name_the_input_and_both_specs(artifact):
    loaded = aot_loader.load(artifact)
    ids, x = _example(5).values()
    with pytest.raises(InputMismatchError, match=r"'x' expected float32\[2, 16\].*got .*\[3, 16\]"):
        loaded(ids[:, :4], x[[0, 1, 0]])  # S=4 is served (padded), the batch of x is not
    with pytest.raises(
        InputMismatchError, match=r"'x' expected float32\[2, 16\].*got float64\[2, 16\]"
    ):
        loaded(ids, x.double())
    with pytest.raises(InputMismatchError, match=r"missing inputs \['x'\]"):
        loaded(ids)
    with pytest.raises(InputMismatchError, match="takes inputs"):
        loaded(ids, x, x)


@pytest.mark.parametrize(
    "damage, file",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-7]), "weights.safetensors"),
        (lambda p: p.write_bytes(b"\0" + p.read_bytes()[1:]), "buckets/0/executable.bin"),
        (lambda p: p.unlink(), "buckets/1/module.stablehlo"),
        (lambda p: p.write_text("{not json"), "manifest.json"),
    ],
)
def test_damaged_artifact_names_the_file(artifact, tmp_path, damage, file):
    directory = _copy(artifact, tmp_path)
    damage(directory / file)
    with pytest.raises(ArtifactError, match=rf"{file}.*(?:[Rr]ebuild)"):
        aot_loader.load(directory)(**_example(3))


def test_damage_behind_a_valid_checksum_is_still_an_artifact_error(artifact, tmp_path):
    directory = _copy(artifact, tmp_path)
    (directory / "buckets/0/module.stablehlo").write_bytes(b"junk that is not StableHLO")
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["files"]["buckets/0/module.stablehlo"] = aot._file_sha256(
        directory / "buckets/0/module.stablehlo"
    )
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="module.stablehlo.*rebuild"):
        aot_loader.load(directory)(**_example(3))


def test_newer_format_is_a_version_error(artifact, tmp_path):
    directory = _copy(artifact, tmp_path)
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["format"] = aot.FORMAT + 1
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="artifact format .*reads format"):
        aot_loader.load(directory)


def test_executable_for_another_jaxlib_is_recompiled_from_portable_stablehlo(artifact, tmp_path):
    directory = _copy(artifact, tmp_path)
    manifest = json.loads((directory / "manifest.json").read_text())
    for entry in manifest["entries"]:
        entry["executable"]["jaxlib"] = "0.0.1"
    (directory / "manifest.json").write_text(json.dumps(manifest))
    for name in ("buckets/0/executable.bin", "buckets/1/executable.bin"):
        (directory / name).write_bytes(b"never read")  # would fail if it were deserialized
        manifest["files"][name] = aot._file_sha256(directory / name)
    (directory / "manifest.json").write_text(json.dumps(manifest))
    inputs = _example(5)
    with torch.no_grad():
        assert_same(aot_loader.load(directory)(**inputs), make_model()(**inputs))


@pytest.mark.filterwarnings("error::FutureWarning")  # torch's own deprecation noise stays out
def test_cli_compile_and_inspect(tmp_path, capsys):
    out = tmp_path / "cli"
    args = ["compile", "tests.aot.test_aot:make_model", "--input", "ids:int64[2,4]"]
    assert cli.main([*args, "--input", "x:float32[2,16]", "--out", str(out)]) == 0
    assert cli.main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "bucket 0:  static" in text and "(executable)" in text
    inputs = _example(4)
    with torch.no_grad():
        assert_same(aot_loader.load(out)(**inputs), make_model()(**inputs))


def test_lowering_for_tpu_is_produced_on_this_machine(tmp_path):
    aot_compile.compile_model(make_model(), _INPUTS, tmp_path, buckets={"S": (4,)}, platform="tpu")
    manifest = aot_loader.read_manifest(tmp_path)
    assert manifest["platform"] == "tpu" and manifest["entries"][0]["executable"] is None
    assert not (tmp_path / "buckets/0/executable.bin").exists()
    text = (tmp_path / "buckets/0/module.mlir").read_text()
    assert "func.func public @main" in text and "tensor<2x4xi64>" in text
    assert aot_loader._from_portable(tmp_path / "buckets/0")  # the portable bytes deserialize
    with pytest.raises(ArtifactError, match="built for 'tpu'.*--platform cpu"):
        aot_loader.load(tmp_path)


def test_inputs_given_twice_are_refused_at_compile_and_at_call(artifact, tmp_path):
    spec = aot.parse_input("ids:int64[2,4]")
    with pytest.raises(OptionError, match=r"--input 'ids' is given 2 times"):
        aot_compile.compile_model(make_model(), [spec, spec], tmp_path / "dup")
    assert not (tmp_path / "dup").exists()
    ids, x = _example(3).values()
    with pytest.raises(InputMismatchError, match=r"input 'ids' .* given twice"):
        aot_loader.load(artifact)(ids, x, ids=ids)


def test_input_count_is_checked_against_forward(tmp_path):
    with pytest.raises(
        OptionError, match=r"forward\(ids, x\) takes 2 inputs; got 1 --input \(ids\)"
    ):
        aot_compile.compile_model(make_model(), _INPUTS[:1], tmp_path, buckets={"S": (3,)})
    swapped = list(reversed(_INPUTS))  # named for forward's parameters, given in another order
    with pytest.raises(OptionError, match=r"--input 'x' is given at position 1, where .*'ids'"):
        aot_compile.compile_model(make_model(), swapped, tmp_path, buckets={"S": (3,)})


class _Cast(nn.Module):
    """`.float()` and `.to(dtype)`: torch.export leaves an _assert_tensor_metadata per cast."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, ids):
        return self.lin(ids.float()).to(torch.float16)


def test_dtype_casts_compile_ahead_of_time(tmp_path):
    torch.manual_seed(0)
    model = _Cast().eval()
    removed = pipeline.counters["cleanup.assert_removed"]
    aot_compile.compile_model(model, [aot.parse_input("ids:int64[2,4]")], tmp_path)
    assert pipeline.counters["cleanup.assert_removed"] >= removed + 2  # one per cast
    ids = torch.arange(8).reshape(2, 4)
    with torch.no_grad():
        assert_same(aot_loader.load(tmp_path)(ids), model(ids))


def test_saved_exported_program_compiles(tmp_path, capsys):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU()).eval()
    x = torch.randn(2, 16)
    torch.export.save(torch.export.export(model, (x,)), tmp_path / "m.pt2")
    out = tmp_path / "art"
    args = ["compile", str(tmp_path / "m.pt2"), "--input", "x:float32[2,16]", "--out", str(out)]
    assert cli.main(args) == 0
    with torch.no_grad():
        assert_same(aot_loader.load(out)(x), model(x))
    with pytest.raises(OptionError, match=r"nope.pt2 does not exist"):
        aot_compile.load_target(str(tmp_path / "nope.pt2"))


class _Pair(nn.Module):
    def forward(self, a, b):
        return a * 2 + b


def test_inputs_from_different_buckets_name_the_dim(tmp_path):
    specs = [aot.parse_input("a:float32[B,4]"), aot.parse_input("b:float32[B,4]")]
    aot_compile.compile_model(_Pair(), specs, tmp_path, buckets={"B": (2, 4)})
    loaded = aot_loader.load(tmp_path)
    with pytest.raises(InputMismatchError, match=r"disagree on dim 'B': 'a' has B=4, 'b' has B=2"):
        loaded(torch.ones(4, 4), torch.ones(2, 4))
    assert_same(loaded(torch.ones(4, 4), torch.ones(4, 4)), torch.full((4, 4), 3.0))


class _Broken(nn.Module):
    def forward(self, x):
        raise RuntimeError("this model fails to trace")


def test_out_directory_is_new_empty_or_a_previous_artifact(tmp_path):
    spec = [aot.parse_input("a:float32[B,4]"), aot.parse_input("b:float32[B,4]")]
    notes = tmp_path / "notes"
    (notes / "sub").mkdir(parents=True)
    (notes / "sub" / "todo.txt").write_text("mine")
    with pytest.raises(OptionError, match=r"notes is a directory that holds other files"):
        aot_compile.compile_model(_Pair(), spec, notes, buckets={"B": (2,)})
    assert [p.name for p in notes.iterdir()] == ["sub"]
    out = tmp_path / "art"
    aot_compile.compile_model(_Pair(), spec, out, buckets={"B": (2, 4)})
    aot_compile.compile_model(_Pair(), spec, out, buckets={"B": (4,)})  # replaces the first
    files = aot_loader.read_manifest(out)["files"]
    assert not (out / "buckets/1").exists() and not any(f.startswith("buckets/1") for f in files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "notes"]  # no staging left
    with pytest.raises(RuntimeError, match="fails to trace"):
        aot_compile.compile_model(_Broken(), spec[:1], tmp_path / "failed", buckets={"B": (2,)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "notes"]


def _rewrite_manifest(directory, change):
    manifest = json.loads((directory / "manifest.json").read_text())
    change(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda m: m.pop("platform"), "field 'platform' is missing"),
        (lambda m: m.__setitem__("files", []), "field 'files' is .*expected a dict"),
        (lambda m: m.pop("entries"), "field 'entries' is missing"),
        (lambda m: m["entries"][0].pop("executable"), r"entries\[0\].executable"),
        (lambda m: m["entries"][0].pop("graph_inputs"), r"entries\[0\].graph_inputs"),
        (lambda m: m["entries"][1].pop("sizes"), r"entries\[1\].sizes"),
        (lambda m: m["inputs"][0].pop("shape"), r"inputs\[0\]"),
        (lambda m: m["entries"][0]["lowered"].pop("output_specs"), r"entries\[0\].lowered"),
    ],
)
def test_manifest_with_missing_or_ill_typed_fields_is_an_artifact_error(
    artifact, tmp_path, change, problem
):
    directory = _copy(artifact, tmp_path)
    _rewrite_manifest(directory, change)
    with pytest.raises(ArtifactError, match=rf"manifest.json is malformed: {problem}.*rebuild"):
        aot_loader.load(directory)(**_example(3))
    assert cli.main(["inspect", str(directory)]) == 2


def test_manifest_naming_an_absent_weight_is_an_artifact_error(artifact, tmp_path):
    directory = _copy(artifact, tmp_path)
    _rewrite_manifest(directory, lambda m: m["entries"][0]["graph_inputs"][0].update(weight="w9"))
    with pytest.raises(ArtifactError, match=r"weights.safetensors lacks the weights \['w9'\]"):
        aot_loader.load(directory)


def test_a_directory_that_is_not_an_artifact_says_so(tmp_path):
    with pytest.raises(ArtifactError, match="not an artifact directory: it has no manifest.json"):
        aot_loader.load(tmp_path)
    with pytest.raises(ArtifactError, match="not an artifact directory: it does not exist"):
        aot_loader.load(tmp_path / "typo")


def test_cli_run_names_the_file_it_wrote(artifact, tmp_path, capsys):
    np.savez(tmp_path / "in.npz", **{k: v.numpy() for k, v in _example(3).items()})
    args = ["run", str(artifact), "--input", str(tmp_path / "in.npz")]
    assert cli.main([*args, "--out", str(tmp_path / "out")]) == 0
    assert f"wrote {tmp_path / 'out.npz'}" in capsys.readouterr().out
    assert (tmp_path / "out.npz").is_file()


# --- padded buckets (aot_buckets.py): every size up to the largest bucket, exact -------------


@PROPERTY
@given(seq=st.integers(2, 5), pad_with=st.sampled_from(["zeros", "nan"]), seed=seeds())
@example(seq=4, pad_with="nan", seed=0)  # between the buckets 3 and 5
def test_a_size_between_buckets_is_padded_to_the_next_and_exact(artifact, seq, pad_with, seed):
    torch.manual_seed(seed)
    loaded, before = aot_loader.load(artifact, pad_with=pad_with), devices.stats["pjrt_compiles"]
    inputs = _example(seq)
    with torch.no_grad():
        expected = make_model()(**inputs)
    assert_same(loaded(**inputs), expected, atol=1e-5, rtol=1e-4)
    assert devices.stats["pjrt_compiles"] == before  # served by a compiled bucket
    manifest = aot_loader.read_manifest(artifact)
    assert [e["padded"] for e in manifest["entries"]] == [True, True]
    assert manifest["padding"]["dims"] == {manifest["padding"]["layout"]["symbols"][0]: "S"}


def test_a_size_above_the_largest_bucket_names_the_dim_the_size_and_the_largest(artifact):
    ids, x = _example(6).values()
    with pytest.raises(InputMismatchError, match=r"dim 'S' is 6, above its largest bucket S=5"):
        aot_loader.load(artifact)(ids, x)
    with pytest.raises(
        InputMismatchError, match=r"dim 'S' is 1; padded buckets serve sizes from 2"
    ):
        aot_loader.load(artifact)(ids[:, :1], x)


class _Grid(nn.Module):
    """Reads across both named dims: a softmax over S, a mean over B, a matmul over S."""

    def forward(self, x, w):
        return x.softmax(1).mean(0), x @ w, x.amax(0)


def test_two_padded_dims_and_a_bucket_of_one_beside_them(tmp_path):
    specs = [aot.parse_input("x:float32[B,S]"), aot.parse_input("w:float32[S,3]")]
    aot_compile.compile_model(_Grid(), specs, tmp_path, buckets={"B": (1, 2, 4), "S": (3, 6)})
    manifest = aot_loader.read_manifest(tmp_path)
    padded = {tuple(e["sizes"].values()): e["padded"] for e in manifest["entries"]}
    assert padded == {(1, 3): False, (1, 6): False, (2, 3): True, (2, 6): True, (4, 3): True,
                      (4, 6): True}  # fmt: skip
    loaded = aot_loader.load(tmp_path, pad_with="nan")
    for b, s in ((3, 5), (2, 2), (4, 6), (1, 3)):  # (1, 3): the exact entry
        x, w = torch.randn(b, s), torch.randn(s, 3)
        assert_same(loaded(x, w), _Grid()(x, w), atol=1e-5, rtol=1e-4)
    with pytest.raises(InputMismatchError, match=r"dim 'B' is 1; padded buckets .*B=1,"):
        loaded(torch.randn(1, 4), torch.randn(4, 3))  # B=1 is compiled at S=3 and 6 only


class _Branchy(nn.Module):
    def forward(self, x):
        return x * 2 if x.shape[1] > 4 else x  # export keeps no symbolic S


def test_a_model_that_export_cannot_keep_symbolic_gets_exact_buckets_and_says_why(tmp_path, capsys):
    spec = [aot.parse_input("x:float32[2,S]")]
    aot_compile.compile_model(_Branchy(), spec, tmp_path / "a", buckets={"S": (3, 5)})
    manifest = aot_loader.read_manifest(tmp_path / "a")
    assert "torch.export cannot keep ['S'] symbolic" in manifest["padding"]["refused"]
    assert not any(e.get("padded") for e in manifest["entries"])
    loaded = aot_loader.load(tmp_path / "a")
    assert_same(loaded(torch.ones(2, 5)), torch.full((2, 5), 2.0))
    with pytest.raises(InputMismatchError, match=r"exact sizes only: torch.export cannot keep"):
        loaded(torch.ones(2, 4))
    assert cli.main(["inspect", str(tmp_path / "a")]) == 0
    assert "padding:   none, every bucket serves its exact sizes" in capsys.readouterr().out


class _Sorted(nn.Module):
    def forward(self, x):
        return torch.sort(x, dim=1).values  # sort has no padding rule


def test_a_graph_the_pass_cannot_prove_exact_gets_exact_buckets_with_the_pass_reason(tmp_path):
    aot_compile.compile_model(
        _Sorted(), [aot.parse_input("x:float32[2,S]")], tmp_path, buckets={"S": (3,)}
    )
    manifest = aot_loader.read_manifest(tmp_path)
    assert "sort" in manifest["padding"]["refused"] and not manifest["entries"][0].get("padded")
    x = torch.randn(2, 3)
    assert_same(aot_loader.load(tmp_path)(x), _Sorted()(x))


def test_an_executable_pjrt_cannot_serialize_is_left_out_and_loading_compiles_it(
    tmp_path, monkeypatch, caplog
):
    def refuse(executable, device):  # as XLA:CPU does for some sorts
        raise RuntimeError("UNIMPLEMENTED: `LessThan` is not serializable.")

    monkeypatch.setattr(devices, "serialize_executable", refuse)
    with caplog.at_level(logging.WARNING, logger="tpu_inductor.aot.compile"):
        aot_compile.compile_model(_Sorted(), [aot.parse_input("x:float32[2,3]")], tmp_path)
    assert "the executable is not stored" in caplog.text and "LessThan" in caplog.text
    assert not list(tmp_path.rglob("executable.bin"))
    assert aot_loader.read_manifest(tmp_path)["entries"][0]["executable"] is None
    x = torch.randn(2, 3)
    assert_same(aot_loader.load(tmp_path)(x), _Sorted()(x))


def test_inspect_shows_the_sizes_each_padded_bucket_serves(artifact, capsys):
    assert cli.main(["inspect", str(artifact)]) == 0
    text = capsys.readouterr().out
    assert "{'S': 3}  serves S=2..3" in text and "{'S': 5}  serves S=4..5" in text


def test_a_padded_entry_without_a_layout_is_an_artifact_error(artifact, tmp_path):
    directory = _copy(artifact, tmp_path)
    _rewrite_manifest(directory, lambda m: m.update(padding=None))
    with pytest.raises(ArtifactError, match="entries are padded but field 'padding' has no layout"):
        aot_loader.load(directory)
    _rewrite_manifest(directory, lambda m: m.update(padding={"layout": {}, "dims": {}}))
    with pytest.raises(ArtifactError, match="field 'padding' is malformed"):
        aot_loader.load(directory)
