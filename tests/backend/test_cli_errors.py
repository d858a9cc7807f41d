"""User errors reach the user as one actionable line: CLI exit codes, env values, permissions."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from tpu_inductor import cli
from tpu_inductor.aot import artifact as aot
from tpu_inductor.aot import compile as aot_compile
from tpu_inductor.config import Options
from tpu_inductor.exc import OptionError

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("artifact")
    aot_compile.compile_model(torch.nn.Linear(4, 4), [aot.parse_input("x:float32[2,4]")], out)
    return out


# --- the command line -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["inspect", "{tmp}"], "is not an artifact directory: it has no manifest.json"),
        (["cache", "--dir", "{tmp}", "explain", "abc", "def"], "0 cache entries .* start with"),
        (["compile", "m:f", "--input", "x:floaty[2]", "--out", "{tmp}/a"], "bad --input"),
        (["run", "{artifact}", "--input", "{tmp}/absent.npz"], "No such file or directory"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(artifact, tmp_path, capsys, argv, message):
    argv = [a.format(tmp=tmp_path, artifact=artifact) for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err


@pytest.mark.parametrize("action", [["stats"], ["ls"], ["explain", "a", "b"], ["clear"]])
def test_cache_commands_never_create_the_directory(tmp_path, capsys, action):
    typo = tmp_path / "typo" / "compile"
    assert cli.main(["cache", "--dir", str(typo), *action]) == 2
    assert "the directory does not exist" in capsys.readouterr().err
    assert not (tmp_path / "typo").exists()


def test_an_empty_cache_directory_is_an_error_not_the_default(monkeypatch, capsys):
    assert cli.main(["cache", "--dir", "", "stats"]) == 2
    assert "empty path" in capsys.readouterr().err
    monkeypatch.setenv("TPU_INDUCTOR_CACHE_DIR", "")
    with pytest.raises(
        OptionError, match="environment variable TPU_INDUCTOR_CACHE_DIR is an empty"
    ):
        Options.from_user()


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("CACHE_MAX_MB", "-5", "TPU_INDUCTOR_CACHE_MAX_MB must be a non-negative integer, got -5"),
        ("DEVICE", "tpuu", "TPU_INDUCTOR_DEVICE has value 'tpuu'; allowed values: 'auto'"),
    ],
)
def test_bad_environment_values_name_the_variable(monkeypatch, name, value, message):
    monkeypatch.setenv(f"TPU_INDUCTOR_{name}", value)
    with pytest.raises(OptionError, match=f"environment variable {message}"):
        Options.from_user()


def test_an_option_overrides_a_bad_environment_value(monkeypatch):
    monkeypatch.setenv("TPU_INDUCTOR_CACHE", "maybe")
    monkeypatch.setenv("TPU_INDUCTOR_CACHE_MAX_MB", "lots")
    assert Options.from_user({"cache": False, "cache_max_mb": 8}).cache_max_mb == 8


def test_disabled_passes_from_the_environment_lose_their_spaces(monkeypatch):
    monkeypatch.setenv("TPU_INDUCTOR_DISABLE_PASSES", " cleanup , fuse_patterns,, ")
    assert Options.from_user().disable_passes == ("cleanup", "fuse_patterns")


def test_bool_options_take_1_and_0_as_the_table_shows():
    assert Options.from_user({"resident_params": 0, "cache": 1}).resident_params is False
    assert Options.from_user({"cache": 1}).cache is True
    for bad in (2, -1, 1.0, "0"):
        with pytest.raises(OptionError, match=r"'cache' must be True or False \(or 1 or 0\)"):
            Options.from_user({"cache": bad})


# --- permissions (root ignores mode bits: the child drops the capabilities that let it) --------


def _run_unprivileged(code: str, *args) -> subprocess.CompletedProcess:
    prefix = []
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("root without setpriv: mode bits do not apply")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]
    run = [*prefix, sys.executable, "-c", textwrap.dedent(code), *map(str, args)]
    proc = subprocess.run(run, cwd=_ROOT, capture_output=True, text=True, timeout=300)
    if "SKIP" in proc.stdout:
        pytest.skip("mode bits do not apply to this process")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


_COMPILE_IN_EACH = """
    import os, sys, torch
    from tests.helpers import compile_aten
    from tpu_inductor.cache import stores
    if os.access(sys.argv[1], os.R_OK):
        sys.exit(print("SKIP"))
    fn = lambda x, y: (x @ y).relu() + 1
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    for directory in sys.argv[1:]:
        stores.memory_cache.clear()
        compiled = compile_aten(fn, (x, y), {"cache_dir": directory})
        torch.testing.assert_close(compiled(x, y), fn(x, y))
"""


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
def test_unreadable_cache_directory_is_a_warning_and_a_compile(tmp_path):
    modes = (0o000, 0o300, 0o600, 0o500)
    directories = [tmp_path / f"mode{mode:o}" for mode in modes]
    for directory, mode in zip(directories, modes):
        directory.mkdir(mode=0o700)
        directory.chmod(mode)
    try:
        proc = _run_unprivileged(_COMPILE_IN_EACH, *directories)
    finally:
        for directory in directories:
            directory.chmod(0o700)
    for directory in directories:
        assert f"compile cache directory {directory}" in proc.stderr, proc.stderr[-3000:]
    assert "Make it readable and writable by you" in proc.stderr


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
def test_unreadable_artifact_file_is_an_artifact_error(artifact, tmp_path):
    directory = tmp_path / "a"
    shutil.copytree(artifact, directory)
    (directory / "weights.safetensors").chmod(0)
    proc = _run_unprivileged(
        """
        import os, sys
        from tpu_inductor.aot import artifact as aot
        from tpu_inductor.aot import compile as aot_compile
        from tpu_inductor.aot import loader as aot_loader
        from tpu_inductor.exc import ArtifactError
        if os.access(sys.argv[1] + "/weights.safetensors", os.R_OK):
            sys.exit(print("SKIP"))
        try:
            aot_loader.load(sys.argv[1])
        except ArtifactError as e:
            print(e)
        """,
        directory,
    )
    assert "cannot read" in proc.stdout and "weights.safetensors: Permission denied" in proc.stdout


@pytest.mark.parametrize("argv", [["ops", "--list"], ["devices"]])
def test_a_reader_that_leaves_stops_the_command_quietly(argv):
    """`tpu-inductor ops --list | head -1`: no BrokenPipeError traceback, big output or small."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tpu_inductor.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=_ROOT,
    )
    child.stdout.close()  # the reader is gone before the first line
    _, err = child.communicate(timeout=120)
    assert child.returncode == 1 and err == b""


def test_a_path_that_exists_already_is_a_user_error(monkeypatch, capsys):
    from tpu_inductor.debug import report

    def run(_args):
        raise FileExistsError(17, "File exists", "/some/where")

    monkeypatch.setattr(report, "_run_explain", run)
    assert cli.main(["explain", "dump"]) == 2
    assert capsys.readouterr().err == "tpu-inductor: [Errno 17] File exists: '/some/where'\n"


def test_x64_narrow_with_torch_mlir_lowering_is_refused_naming_both(monkeypatch):
    both = {"x64": "narrow", "lowering": "torch-mlir"}
    with pytest.raises(OptionError, match=r"option 'x64' is 'narrow' and option 'lowering' is"):
        Options.from_user(both)
    monkeypatch.setenv("TPU_INDUCTOR_LOWERING", "torch-mlir")
    with pytest.raises(OptionError, match=r"environment variable TPU_INDUCTOR_LOWERING is"):
        Options.from_user({"x64": "narrow"})
    assert Options.from_user({"x64": "narrow", "lowering": "own"}).x64 == "narrow"
    # fallback="torch-mlir" still narrows what our rules lower.
    assert Options.from_user({"x64": "narrow", "lowering": "own", "fallback": "torch-mlir"})
