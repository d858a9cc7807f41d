"""Options: structured knobs (records), their checks, the JSON environment form, the cache key."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tpu_inductor.config import Options, ShapeOptions
from tpu_inductor.exc import OptionError

# --- records given as dicts or as instances ----------------------------------------------------


def test_shapes_defaults():
    shapes = Options.from_user().shapes
    assert shapes == ShapeOptions() and (shapes.policy, shapes.max_compiles) == ("pow2", 64)


def test_a_partial_dict_keeps_the_other_fields_defaults():
    assert Options.from_user({"shapes": {"max_compiles": 8}}).shapes == ShapeOptions(max_compiles=8)
    assert Options.from_user({"shapes": {"policy": "exact"}}).shapes.max_compiles == 64
    assert Options.from_user({"shapes": {}}).shapes == ShapeOptions()


def test_a_record_instance_is_taken_and_checked():
    options = Options.from_user({"shapes": ShapeOptions(max_compiles=3)})
    assert isinstance(options.shapes, ShapeOptions) and options.shapes.max_compiles == 3
    with pytest.raises(OptionError, match=r"option 'shapes.max_compiles' must be an integer >= 1"):
        Options.from_user({"shapes": ShapeOptions(max_compiles=0)})


def test_options_with_records_stay_frozen_and_hashable():
    a = Options.from_user({"shapes": {"max_compiles": 8}})
    b = Options.from_user({"shapes": ShapeOptions(max_compiles=8)})
    assert a == b and hash(a) == hash(b) and len({a, b, Options.from_user()}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.shapes.max_compiles = 9  # type: ignore[misc]


@pytest.mark.parametrize(
    "shapes, message",
    [
        (
            {"max_compiles": 0},
            r"option 'shapes.max_compiles' must be an integer >= 1, got 0\.",
        ),
        (
            {"max_compiles": True},
            r"option 'shapes.max_compiles' must be an integer >= 1, got True\.",
        ),
        (
            {"max_compiles": "32"},
            r"option 'shapes.max_compiles' must be an integer >= 1, got '32'\.",
        ),
        (
            {"policy": "pow3"},
            r"option 'shapes.policy' has value 'pow3'; allowed values: 'exact', 'pow2', "
            r"'multiple', 'sizes', 'auto'\.",
        ),
        (
            {"max_compile": 3},
            r"unknown option 'shapes.max_compile' \(value 3\)\. "
            r"Allowed keys of 'shapes': max_compiles, min_bucket, multiple, pad_with, plan, policy, sizes\.",
        ),
        (
            32,
            r"option 'shapes' must be a dict with keys among max_compiles, min_bucket, multiple, pad_with, plan, policy, sizes .* "
            r"or a ShapeOptions, got 32\.",
        ),
    ],
)
def test_bad_record_values_name_the_key_path_the_value_and_what_is_allowed(shapes, message):
    with pytest.raises(OptionError, match=message):
        Options.from_user({"shapes": shapes})


def test_top_level_checks_are_unchanged():
    with pytest.raises(OptionError, match=r"unknown option 'devise'.*Allowed options: .*shapes"):
        Options.from_user({"devise": "cpu"})
    with pytest.raises(OptionError, match=r"option 'cache_max_mb' must be a non-negative integer"):
        Options.from_user({"cache_max_mb": -1})
    with pytest.raises(OptionError, match=r"option 'disable_passes' must be a list of names"):
        Options.from_user({"disable_passes": 3})


# --- the environment: JSON and the plain forms -------------------------------------------------


def test_env_json_record_and_list(monkeypatch):
    monkeypatch.setenv("TPU_INDUCTOR_SHAPES", '{"max_compiles": 32}')
    monkeypatch.setenv("TPU_INDUCTOR_DISABLE_PASSES", '["cleanup", "fuse_patterns"]')
    options = Options.from_user()
    assert options.shapes == ShapeOptions(max_compiles=32)
    assert options.disable_passes == ("cleanup", "fuse_patterns")


@pytest.mark.parametrize(
    "name, raw, expected",
    [
        ("DEVICE", '"cpu"', "cpu"),
        ("DEVICE", "cpu", "cpu"),
        ("CACHE_MAX_MB", "16", 16),
        ("CACHE", "false", False),
        ("CACHE", "0", False),
        ("DISABLE_PASSES", "cleanup, fuse_patterns", ("cleanup", "fuse_patterns")),
        ("DUMP_DIR", '"some dir"', "some dir"),
    ],
)
def test_env_plain_and_json_scalars(monkeypatch, name, raw, expected):
    monkeypatch.setenv(f"TPU_INDUCTOR_{name}", raw)
    assert getattr(Options.from_user(), name.lower()) == expected


@pytest.mark.parametrize(
    "name, raw, message",
    [
        (
            "SHAPES",
            "{max_compiles: 32}",
            r"environment variable TPU_INDUCTOR_SHAPES='\{max_compiles: 32\}' is not valid JSON "
            r"\(.*\); give a JSON object with keys among max_compiles, min_bucket, multiple, pad_with, plan, policy, sizes, "
            r"e\.g\. TPU_INDUCTOR_SHAPES='\{\"max_compiles\": 64, .*\}'",
        ),
        ("SHAPES", "32", r"TPU_INDUCTOR_SHAPES='32' is not a JSON object; give a JSON object"),
        ("SHAPES", "[32]", r"TPU_INDUCTOR_SHAPES='\[32\]' is not a JSON object"),
        (
            "DISABLE_PASSES",
            '["cleanup"',
            r"TPU_INDUCTOR_DISABLE_PASSES='\[\"cleanup\"' is not valid JSON .*JSON list of names",
        ),
        ("DEVICE", '"cpu', r"TPU_INDUCTOR_DEVICE='\"cpu' is not valid JSON"),
    ],
)
def test_bad_env_json_names_the_variable_the_text_and_the_form(monkeypatch, name, raw, message):
    monkeypatch.setenv(f"TPU_INDUCTOR_{name}", raw)
    with pytest.raises(OptionError, match=message):
        Options.from_user()


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            '{"max_compiles": 0}',
            r"option 'shapes.max_compiles' from environment variable TPU_INDUCTOR_SHAPES "
            r"must be an integer >= 1, got 0\.",
        ),
        (
            '{"max_compile": 3}',
            r"unknown option 'shapes.max_compile' from environment variable "
            r"TPU_INDUCTOR_SHAPES \(value 3\)\. Allowed keys of 'shapes': max_compiles, min_bucket, multiple, pad_with, plan, policy, sizes\.",
        ),
        (
            '{"policy": "buckets"}',
            r"option 'shapes.policy' from environment variable TPU_INDUCTOR_SHAPES has value "
            r"'buckets'; allowed values: 'exact', 'pow2', 'multiple', 'sizes', 'auto'\.",
        ),
    ],
)
def test_bad_env_record_fields_name_the_variable_and_key_path(monkeypatch, raw, message):
    monkeypatch.setenv("TPU_INDUCTOR_SHAPES", raw)
    with pytest.raises(OptionError, match=message):
        Options.from_user()


def test_bad_env_json_list_items_are_checked(monkeypatch):
    monkeypatch.setenv("TPU_INDUCTOR_DISABLE_PASSES", '["cleanup", 1]')
    with pytest.raises(
        OptionError, match=r"environment variable TPU_INDUCTOR_DISABLE_PASSES must be a list"
    ):
        Options.from_user()


def test_the_users_dict_beats_the_environment(monkeypatch):
    monkeypatch.setenv("TPU_INDUCTOR_SHAPES", '{"max_compiles": 32}')
    assert Options.from_user().shapes.max_compiles == 32
    # the user's key replaces the variable whole: unset fields take the record's defaults
    assert Options.from_user({"shapes": {"policy": "exact"}}).shapes.max_compiles == 64
    assert Options.from_user({"shapes": {"max_compiles": 4}}).shapes.max_compiles == 4
    monkeypatch.setenv("TPU_INDUCTOR_SHAPES", "not json")  # overridden, so never read
    assert Options.from_user({"shapes": ShapeOptions()}).shapes == ShapeOptions()


# --- the cache key -----------------------------------------------------------------------------


def test_cache_key_holds_records_as_plain_sorted_dicts():
    entries = Options.from_user().cache_key_entries()
    assert entries["shapes"] == {"min_bucket": 1, "multiple": 128, "policy": "pow2", "sizes": ()}
    assert list(entries) == sorted(entries)

    def listed(value):  # what JSON makes of tuples, at any depth
        if isinstance(value, dict):
            return {k: listed(v) for k, v in value.items()}
        return [listed(v) for v in value] if isinstance(value, tuple) else value

    assert json.loads(json.dumps(entries)) == listed(entries)


def test_max_compiles_leaves_the_key_and_policy_is_in_it(monkeypatch):
    base = Options.from_user().cache_key_entries()
    assert Options.from_user({"shapes": {"max_compiles": 2}}).cache_key_entries() == base
    monkeypatch.setenv("TPU_INDUCTOR_SHAPES", '{"max_compiles": 5}')
    assert Options.from_user().cache_key_entries() == base
    # the policy reaches the key; what fills the padding and the plan's file do not
    other = Options.from_user({"shapes": {"policy": "exact", "pad_with": "nan", "plan": "p"}})
    assert other.cache_key_entries()["shapes"]["policy"] == "exact"
    assert "pad_with" not in other.cache_key_entries()["shapes"]
    assert other.cache_key_entries() != base
    padded = Options.from_user({"shapes": {"pad_with": "nan", "plan": "p"}})
    assert padded.cache_key_entries() == base
