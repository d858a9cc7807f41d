"""options={"config": "tuned.json"} (or TPU_INDUCTOR_CONFIG): options read from a JSON file,
between the environment and the dict's own keys; a bad file is a typed error naming it."""

from __future__ import annotations

import json

import pytest
import torch

import tpu_inductor
from tests.helpers import compile_tpu
from tpu_inductor.config import Options
from tpu_inductor.exc import OptionError


@pytest.fixture
def config(tmp_path):
    def write(values, name="tuned.json") -> str:
        path = tmp_path / name
        path.write_text(values if isinstance(values, str) else json.dumps(values))
        return str(path)

    return write


def test_the_file_sits_between_the_environment_and_the_dict(config, monkeypatch):
    path = config({"shapes": {"policy": "exact"}, "host_sync": "explicit"})
    monkeypatch.setenv("TPU_INDUCTOR_SHAPES", '{"policy": "multiple"}')
    monkeypatch.setenv("TPU_INDUCTOR_X64", "narrow")
    options = Options.from_user({"config": path, "host_sync": "each_call"})
    assert options.shapes.policy == "exact"  # the file over the environment
    assert options.host_sync == "each_call"  # the dict over the file
    assert options.x64 == "narrow"  # the environment where the file says nothing


def test_the_environment_names_a_file_too(config, monkeypatch):
    monkeypatch.setenv("TPU_INDUCTOR_CONFIG", config({"shapes": {"policy": "exact"}}))
    assert Options.from_user().shapes.policy == "exact"
    assert Options.from_user({"config": config({}, "empty.json")}).shapes.policy == "pow2"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "cannot read"),
        ("[1, 2]", "must hold a JSON object"),
        ({"config": "other.json"}, "no 'config' of its own"),
        ({"shapes": {"policy": "fast"}}, r"option 'shapes.policy' from config file .*tuned.json"),
        ({"speed": 3}, r"unknown option 'speed' from config file"),
    ],
)
def test_a_bad_file_is_an_error_naming_it(config, content, message):
    with pytest.raises(OptionError, match=message):
        Options.from_user({"config": config(content)})


def test_a_missing_file_or_no_path_is_an_error(tmp_path):
    with pytest.raises(OptionError, match=r"option 'config': cannot read .*absent.json"):
        Options.from_user({"config": str(tmp_path / "absent.json")})
    with pytest.raises(OptionError, match="must be the path of a JSON file"):
        Options.from_user({"config": 3})


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compile_follows_the_file(config):
    """Three sizes of one dynamic graph: one pow2 bucket by default, three compiles under the
    file's exact policy."""

    def compiles(options) -> tuple[int, list]:
        torch._dynamo.reset()
        f, before = compile_tpu(lambda x: x.cos() * 2, **options), tpu_inductor.compiles()
        outs = []
        for n in (5, 6, 7):
            x = torch.randn(n)
            torch._dynamo.mark_dynamic(x, 0)
            outs.append((f(x), x.cos() * 2))
        return tpu_inductor.compiles() - before, outs

    default, outs = compiles({})
    exact, exact_outs = compiles({"config": config({"shapes": {"policy": "exact"}})})
    assert (default, exact) == (1, 3)
    for got, want in outs + exact_outs:
        torch.testing.assert_close(got, want)
