"""The compile cache: keys, the disk level, faults (fuzzed), concurrency, safety, eviction, CLI."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tests.helpers import assert_same, compile_aten
from tpu_inductor import cli
from tpu_inductor.cache import lookup, stores
from tpu_inductor.cache.key import CacheKey, for_graph, sha256, xla_flags
from tpu_inductor.config import Options
from tpu_inductor.debug import records
from tpu_inductor.exc import CacheError


def _fn(x, y):
    return (x @ y).relu() + 1


_ARGS = (torch.randn(4, 4), torch.randn(4, 4))


def _compile_into(directory, fn=_fn, args=_ARGS):
    """Compile `fn` with the disk cache at `directory`, memory level emptied first; call it."""
    stores.memory_cache.clear()
    compiled = compile_aten(fn, args, {"cache_dir": str(directory)})
    result = compiled(*args)
    assert_same(result, fn(*args))
    return records.records[-1]


def _entry_dirs(directory):
    return sorted(p for p in directory.iterdir() if len(p.name) == 64)


# --- keys -------------------------------------------------------------------------------------


def test_key_entries_hash_separately_and_explain_names_the_difference():
    a = CacheKey.of([("graph", "g"), ("inputs", ((4,), "f32")), ("options", {"x": 1})])
    same = CacheKey.of([("graph", "g"), ("inputs", ((4,), "f32")), ("options", {"x": 1})])
    b = CacheKey.of([("graph", "g"), ("inputs", ((5,), "f32")), ("options", {"x": 1})])
    assert a.digest == same.digest and a.digest != b.digest
    assert a.explain(b) == ["inputs"]
    assert a.explain(same) == []


def test_unhashable_entry_bypasses_the_cache():
    assert for_graph("g", [object()]) is None  # an input with no stable text: no key
    bypass = stores.counters["bypass"]
    record = records.CompileRecord("g", ())
    assert lookup.find(None, Options(), None, record) is None
    assert stores.counters["bypass"] == bypass + 1 and record.cache["decision"] == "bypass"


def test_the_key_ignores_xla_dump_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x --xla_cpu_enable_fast_math=false")
    assert xla_flags() == ("--xla_cpu_enable_fast_math=false",)


def test_cache_knobs_are_not_in_the_key(monkeypatch, tmp_path):
    monkeypatch.setenv("TPU_INDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TPU_INDUCTOR_CACHE", "0")
    options = Options.from_user()
    assert options.cache_dir == str(tmp_path) and options.cache is False
    assert not {"cache", "cache_dir", "cache_max_mb"} & set(options.cache_key_entries())
    assert Options.from_user(
        {"cache_dir": "/elsewhere", "cache_max_mb": 1}
    ).cache_key_entries() == (options.cache_key_entries())


# --- the disk level ---------------------------------------------------------------------------


def test_disk_hit_skips_lowering_and_compiling(tmp_path):
    cold = _compile_into(tmp_path)
    assert cold.cache["decision"] == "miss" and "pjrt_compile" in cold.timings
    warm = _compile_into(tmp_path)
    assert warm.cache["decision"] == "disk_hit"
    assert "lower" not in warm.timings and "pjrt_compile" not in warm.timings
    assert warm.cache["key"] == cold.cache["key"] and len(_entry_dirs(tmp_path)) == 1


def test_input_returned_as_an_output_is_the_same_tensor_after_a_disk_hit(tmp_path):
    def fn(x, y):
        return x * 2, y  # y passes through: no copy through the module

    args = (torch.randn(3), torch.randn(4))
    for decision in ("miss", "disk_hit"):
        stores.memory_cache.clear()
        doubled, same = compile_aten(fn, args, {"cache_dir": str(tmp_path)})(*args)
        assert records.records[-1].cache["decision"] == decision
        assert same is args[1]
        assert_same(doubled, args[0] * 2)


def test_cache_false_writes_nothing(tmp_path):
    stores.memory_cache.clear()
    target = tmp_path / "never"
    compiled = compile_aten(_fn, _ARGS, {"cache": False, "cache_dir": str(target)})
    assert_same(compiled(*_ARGS), _fn(*_ARGS))
    assert not target.exists()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One compiled entry (its key, files and a decoder), mutated by the fault tests."""
    directory = tmp_path_factory.mktemp("pristine")
    record = _compile_into(directory)
    (entry,) = _entry_dirs(directory)
    key = directory / entry.name / stores.MANIFEST
    body = json.loads(key.read_text())["body"]
    return directory, entry.name, CacheKey(tuple(map(tuple, body["key"]))), record


def _mutations(files: dict[str, bytes]):
    """At least 100 damaged variants of an entry: (description, {file: new bytes or None})."""
    for name, data in sorted(files.items()):
        yield f"{name} empty", {name: b""}
        yield f"{name} removed", {name: None}
        for cut in (1, len(data) // 3, len(data) // 2, len(data) - 1):
            yield f"{name} truncated to {cut}", {name: data[:cut]}
        for i in range(20):
            at = (i * 7919) % len(data)
            flipped = bytearray(data)
            flipped[at] ^= 1 << (i % 8)
            yield f"{name} bit {i % 8} of byte {at} flipped", {name: bytes(flipped)}
        yield f"{name} grown", {name: data + b"\0"}
    manifest = json.loads(files[stores.MANIFEST])
    forged_fields = (
        ("format", stores.FORMAT + 1),
        ("digest", "0" * 64),
        ("key", []),
        ("key", None),
        ("key", [["name", "hash", "extra"]]),
    )
    for field, value in forged_fields:
        body = dict(manifest["body"], **{field: value})
        forged = {"checksum": sha256(stores._dump(body)), "body": body}  # a valid checksum
        yield f"manifest with {field}={value!r}", {stores.MANIFEST: json.dumps(forged).encode()}
    yield "manifest not an object", {stores.MANIFEST: b"[1, 2]"}


def test_damaged_entries_are_a_warning_and_a_recompile_never_a_crash(pristine, tmp_path, caplog):
    source, digest, key, _ = pristine
    original = {p.name: p.read_bytes() for p in (source / digest).iterdir()}
    disk = stores.open_disk_cache(tmp_path, 64)
    decode = _codec().decode
    variants = list(_mutations(original))
    assert len(variants) >= 100
    for description, changes in variants:
        shutil.copytree(source / digest, tmp_path / digest)
        for name, data in changes.items():
            if data is None:
                (tmp_path / digest / name).unlink()
            else:
                (tmp_path / digest / name).write_bytes(data)
        faults = stores.counters["disk_fault"]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tpu_inductor.cache.stores"):
            assert disk.load(key, decode) is None, description
        assert stores.counters["disk_fault"] == faults + 1, description
        assert "is unusable" in caplog.text, description
        assert not (tmp_path / digest).exists(), description  # removed, so a store can replace it
    shutil.copytree(source / digest, tmp_path / digest)  # the control: the intact entry loads
    assert disk.load(key, decode) is not None


def test_a_corrupted_entry_is_recompiled_and_replaced(pristine, tmp_path):
    source, digest, _, _ = pristine
    shutil.copytree(source / digest, tmp_path / digest)
    blob = tmp_path / digest / "executable.bin"
    blob.write_bytes(blob.read_bytes()[:100])
    record = _compile_into(tmp_path)
    assert record.cache["decision"] == "miss"
    assert _compile_into(tmp_path).cache["decision"] == "disk_hit"


def test_entry_of_another_key_is_foreign(pristine, tmp_path):
    source, digest, key, _ = pristine
    other = "f" * 64
    shutil.copytree(source / digest, tmp_path / other)
    foreign_key = CacheKey((*key.entries[:-1], ("xla_flags", "0" * 64)))
    assert foreign_key.digest != digest
    os.rename(tmp_path / other, tmp_path / foreign_key.digest)
    faults = stores.counters["disk_fault"]
    assert stores.open_disk_cache(tmp_path, 64).load(foreign_key, _codec().decode) is None
    assert stores.counters["disk_fault"] == faults + 1


def _forge_key(entry, value):
    """Give the manifest of `entry` another "key" behind a valid checksum."""
    manifest = json.loads((entry / stores.MANIFEST).read_text())
    manifest["body"]["key"] = value
    manifest["checksum"] = sha256(stores._dump(manifest["body"]))
    (entry / stores.MANIFEST).write_text(json.dumps(manifest))


def test_explain_of_an_entry_with_a_malformed_key_is_a_cache_error(pristine, tmp_path):
    source, digest, _, _ = pristine
    shutil.copytree(source / digest, tmp_path / digest)
    _forge_key(tmp_path / digest, None)
    with pytest.raises(CacheError, match=rf"{digest}.*unreadable: manifest key is None"):
        stores.open_disk_cache(tmp_path, 64).key_of(digest[:12])


def _codec():
    from tpu_inductor.cache import serialize
    from tpu_inductor.runtime import devices

    return serialize.disk_codec(devices.select_device("auto"))


# --- safety, eviction -------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
def test_directory_writable_by_others_is_refused_with_the_reason(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(CacheError, match="writable by group or others.*chmod 700"):
        stores.open_disk_cache(shared, 64)
    stores.memory_cache.clear()
    with pytest.raises(CacheError, match="run code as you"):
        compile_aten(_fn, _ARGS, {"cache_dir": str(shared)})


def test_new_directory_is_private(tmp_path):
    disk = stores.open_disk_cache(tmp_path / "a" / "b", 64)
    assert disk.directory.stat().st_mode & 0o777 == 0o700


def test_size_cap_evicts_least_recently_used(tmp_path):
    disk = stores.DiskCache(tmp_path, max_bytes=2**20)
    keys = [CacheKey.of([("n", i)]) for i in range(4)]
    for age, key in enumerate(keys[:3]):
        disk.store(key, lambda: ({"blob": b"x" * 1000}, {}), "")
        disk.max_bytes = int(3.5 * disk.entries()[0].size)  # room for three entries
        os.utime(tmp_path / key.digest / stores.MANIFEST, (1000 + age, 1000 + age))
    assert disk.load(keys[0], lambda files, meta: files["blob"]) == b"x" * 1000  # now most recent
    evicted = stores.counters["disk_evict"]
    disk.store(keys[3], lambda: ({"blob": b"y" * 1000}, {}), "")
    left = {p.name for p in _entry_dirs(tmp_path)}
    assert left == {keys[0].digest, keys[2].digest, keys[3].digest}
    assert stores.counters["disk_evict"] == evicted + 1


@pytest.mark.parametrize(
    "error",
    [ValueError("no JSON form"), RuntimeError("UNIMPLEMENTED: `LessThan` is not serializable.")],
    ids=["no_json_form", "executable_not_serializable"],
)
def test_value_without_a_disk_form_is_skipped(tmp_path, caplog, error):
    """A value with no disk form is not stored (the compiled value is used all the same):
    never a crash (PJRT cannot serialize XLA:CPU's sort of complex numbers: that one is a
    warning)."""
    disk = stores.DiskCache(tmp_path, max_bytes=2**20)

    def encode():
        raise error

    skipped = stores.counters["disk_skip"]
    disk.store(CacheKey.of([("n", 1)]), encode, "g")
    assert stores.counters["disk_skip"] == skipped + 1 and not _entry_dirs(tmp_path)
    assert ("LessThan" in caplog.text) == isinstance(error, RuntimeError)


def _leftover(directory, name: str, age_s: float):
    temp = directory / name
    temp.mkdir()
    (temp / "executable.bin").write_bytes(b"x" * 4096)
    os.utime(temp, (time.time() - age_s, time.time() - age_s))
    return temp


def test_stale_temporary_directories_are_counted_and_removed(tmp_path, capsys):
    disk = stores.DiskCache(tmp_path, max_bytes=2**20)
    stale = _leftover(tmp_path, ".tmp-0123456789abcdef-42-0badf00d", 3600)
    trash = _leftover(tmp_path, ".tmp-rm-0123456789ab", 3600)
    live = _leftover(tmp_path, ".tmp-fedcba9876543210-43-0badf00d", 0)  # a writer at work
    assert cli.main(["cache", "--dir", str(tmp_path), "stats"]) == 0
    assert "leftovers: 2 temporary directories" in capsys.readouterr().out
    disk.store(CacheKey.of([("n", 1)]), lambda: ({"blob": b"x"}, {}), "")
    assert not stale.exists() and not trash.exists() and live.exists()


def test_clear_removes_only_entries_and_its_own_leftovers(tmp_path, capsys):
    _compile_into(tmp_path)
    mine = tmp_path / ".tmp-build"
    mine.mkdir()
    notes = tmp_path / ("f" * 64)
    notes.mkdir()
    (notes / "notes.txt").write_text("precious")
    stale = _leftover(tmp_path, ".tmp-0123456789abcdef-42-0badf00d", 3600)
    assert cli.main(["cache", "--dir", str(tmp_path), "clear"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, notes.name])
    assert not stale.exists()


def test_cache_dir_may_be_a_path_object(tmp_path):
    assert Options.from_user({"cache_dir": tmp_path, "dump_dir": tmp_path}).cache_dir == str(
        tmp_path
    )


# --- processes --------------------------------------------------------------------------------

_WORKER = textwrap.dedent(
    """
    import sys, torch
    from tests.helpers import compile_aten
    from tpu_inductor.cache import key
    from tpu_inductor.debug import records
    from tpu_inductor.passes import pipeline
    key._source_digest = lambda: "pinned"  # a source edit mid-test must not split the key
    pipeline._module_digest = lambda fn: "pinned"
    torch.manual_seed(0)
    x, y = torch.randn(16, 16), torch.randn(16, 16)
    fn = lambda x, y: torch.tanh(x @ y) * 3 - y
    out = compile_aten(fn, (x, y), {"cache_dir": sys.argv[1]})(x, y)
    torch.testing.assert_close(out, fn(x, y))
    print(records.records[-1].cache["decision"])
    """
)


def _workers(directory, count: int) -> list[str]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(directory)],
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        outs.append(out.strip().splitlines()[-1])
    return outs


def test_four_processes_compiling_at_once_leave_one_valid_entry(tmp_path):
    decisions = _workers(tmp_path, 4)
    assert set(decisions) <= {"miss", "disk_hit"}
    (entry,) = _entry_dirs(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [entry.name]  # no temporary leftovers
    body = json.loads((entry / stores.MANIFEST).read_text())["body"]
    key = CacheKey(tuple(map(tuple, body["key"])))
    assert stores.open_disk_cache(tmp_path, 64).load(key, _codec().decode) is not None  # valid


# --- the command line ---------------------------------------------------------------------------


def test_cli_stats_ls_explain_clear(tmp_path, capsys):
    first = _compile_into(tmp_path).cache["key"]
    second = _compile_into(tmp_path, args=(torch.randn(2, 4), torch.randn(4, 4))).cache["key"]
    assert cli.main(["cache", "--dir", str(tmp_path), "stats"]) == 0
    assert "entries:   2" in capsys.readouterr().out
    assert cli.main(["cache", "--dir", str(tmp_path), "ls"]) == 0
    assert first[:16] in capsys.readouterr().out
    assert cli.main(["cache", "--dir", str(tmp_path), "explain", first[:12], second[:12]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["inputs"]
    assert cli.main(["cache", "--dir", str(tmp_path), "clear"]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert not _entry_dirs(tmp_path)


_LAPACK_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from tpu_inductor.cache import stores
    a = torch.randn(5, 5, generator=torch.Generator().manual_seed(0))
    spd = a @ a.mT + 5 * torch.eye(5)
    f = torch.compile(torch.linalg.cholesky, backend="tpu_inductor",
                      options={"cache_dir": sys.argv[1], "fallback": "error"})
    torch.testing.assert_close(f(spd), torch.linalg.cholesky(spd))
    print(json.dumps(dict(stores.counters)))
    """
)


def test_cached_executable_with_lapack_calls_runs_in_a_fresh_process(tmp_path):
    """A warm process skips lowering, which is where jax registers its LAPACK kernels: loading
    an executable that calls them must register them first (it used to crash the process)."""
    runs = [
        subprocess.run(
            [sys.executable, "-c", _LAPACK_CHILD, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        for _ in range(2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    cold, warm = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert cold.get("disk_store", 0) >= 1 and warm.get("disk_hit", 0) >= 1, (cold, warm)


def test_memory_level_keeps_the_most_recently_used_entries():
    memory, compiles = stores.MemoryCache(max_entries=2), []

    def get(name):
        graph = CacheKey.of([("graph", name)])
        if memory.get(graph) is None:
            compiles.append(name)
            memory.put(graph, name)
        return memory.get(graph)

    for name in ("a", "b", "a", "c", "a", "b"):  # "c" evicts "b" (a was used since)
        assert get(name) == name
    assert compiles == ["a", "b", "c", "b"]
