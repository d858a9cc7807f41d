"""`tpu-inductor explain` and `report` (debug/report.py) of a dump folder."""

from __future__ import annotations

import html.parser
import json
import logging
import shutil
import subprocess

import pytest

from tpu_inductor import cli
from tpu_inductor.debug import report

# ---------------------------------------------------------------------------------------------
# explain and report.


def test_explain_summarizes_the_run(run_dump, capsys):
    dump, compiles, _ = run_dump
    assert cli.main(["explain", str(dump)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"6 compile(s) of 4 graph(s) in {dump}")
    assert "cache: 0 hit(s) of 6 (0%): miss 6" in out
    assert "time per stage (all compiles): lower " in out and "pjrt_compile " in out
    assert out.count("recompiled: ") == 4  # forward and backward at sizes 5 and 7
    for c in compiles:
        assert c["folder"] in out


def test_explain_and_report_skip_a_damaged_compile_json_and_name_it(
    run_dump, tmp_path, capsys, caplog
):
    dump, compiles, _ = run_dump
    good = compiles[0]["folder"]
    shutil.copytree(dump / good, tmp_path / good)
    text = (dump / good / "compile.json").read_text()
    damaged = {"900_cut": text[:40], "901_keyless": json.dumps({"id": 1, "graph": "g"})}
    for folder, content in damaged.items():
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "compile.json").write_text(content)
    for command in ("explain", "report"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tpu_inductor.debug.report"):
            assert cli.main([command, str(tmp_path)]) == 0
        for folder in damaged:
            assert f"skipping {tmp_path / folder / 'compile.json'}, which is damaged" in caplog.text
        assert "missing key(s) cache, compile_id" in caplog.text
    assert f"1 compile(s) of 1 graph(s) in {tmp_path}" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["explain", "report"])
def test_explain_and_report_of_a_missing_folder_are_an_error_naming_it(tmp_path, capsys, command):
    missing = tmp_path / "no_such_dump"
    assert cli.main([command, str(missing)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "No such dump folder" in err and str(missing) in err
    assert not missing.exists()


class _Page(html.parser.HTMLParser):
    """The parts of the report page the tests check."""

    def __init__(self):
        super().__init__()
        self.sections, self.links, self.bars, self.text = [], [], [], []
        self.external = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self.sections.append(attrs["id"])
        if tag == "a":
            self.links.append(attrs["href"])
        if attrs.get("class") == "bar":
            self.bars.append(float(attrs["style"].removeprefix("width:").removesuffix("%")))
        for name in ("src", "href"):
            if "//" in attrs.get(name, ""):
                self.external.append(attrs[name])
        if tag in ("script", "link", "iframe", "img"):
            self.external.append(tag)

    def handle_data(self, data):
        self.text.append(data)


def test_report_html_content(run_dump):
    dump, compiles, _ = run_dump
    path = report.write_report(dump)
    page = _Page()
    page.feed(path.read_text())
    text = "".join(page.text)
    assert page.sections == [c["folder"] for c in compiles]
    assert page.links == [f"{c['folder']}/{name}" for c in compiles for name in c["files"]]
    assert all((dump / link).is_file() for link in page.links)
    assert len(page.bars) == sum(len(c["timings"]) for c in compiles)
    assert max(page.bars) == 100.0 and min(page.bars) > 0
    assert page.external == []  # one self-contained file: no script, CDN or image
    assert text.count("Recompiled: ") == 4 and "decision: miss" in text
    assert "stablehlo.dot_general" in text  # stage files are embedded


def test_report_renders_in_headless_chromium(run_dump, tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip(
            "chromium is not installed (apt-get install chromium); the HTML content "
            "test (test_report_html_content) still ran"
        )
    from PIL import Image

    dump, compiles, _ = run_dump
    url = report.write_report(dump).as_uri()
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    dom = subprocess.run(
        [*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "tpu_inductor compile report" in dom and compiles[0]["folder"] in dom
    shot = tmp_path / "report.png"
    subprocess.run(
        [*flags, f"--screenshot={shot}", "--window-size=1000,1400", url],
        capture_output=True,
        timeout=120,
        check=True,
    )
    image = Image.open(shot).convert("RGB")
    assert image.size == (1000, 1400)
    bar_pixels = sum(1 for p in image.getdata() if p == (0x1F, 0x6F, 0xEB))
    assert bar_pixels > 500  # the timing bars were laid out and painted
