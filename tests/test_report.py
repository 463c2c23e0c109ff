"""`cudabuild report model=NAME`: the last builds' seconds and status per stage, and an SVG chart."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from _fixtures_cli import scripted_builds
from cudabuild.engine.console import report


def _columns(lines: list[str]) -> tuple[set[int], set[int]]:
    """(where the statuses start, where the seconds end) over the table's rows."""
    starts = {m.start() for line in lines for m in re.finditer(r"\b(ran|restored|remote|cached)\b", line)}
    ends = {m.end() for line in lines for m in re.finditer(r"\d+\.\ds", line)}
    return starts, ends


def test_report_shows_each_logged_build_as_a_column_and_draws_them(tmp_path_factory, tmp_path):
    project = scripted_builds(tmp_path_factory)  # the first build, then no-op, a decode spec change, a restore
    chart = tmp_path / "times.svg"
    lines = project.cudabuild("report", "model=tiny_lm", "--last", "4", "--svg", str(chart)).stdout.splitlines()
    assert lines.pop() == f"chart written to {chart}"
    legend = lines.pop()  # every word a cell uses, said once
    assert all(f"{status}: " in legend for status in ("ran", "restored", "remote", "cached", "total"))
    # A line per build: its settings, the spec the third one changed among them.
    assert lines[0].split() == ["build", "when", "target", "settings"]
    builds = {line.split()[0]: line for line in lines[1:5]}
    assert list(builds) == ["#1", "#2", "#3", "#4"] and lines[5] == ""
    assert all(" cpu " in line and "layers=2 seed=0" in line for line in builds.values())
    assert builds["#3"].endswith("decode.emulate_precision_casts=OFF") and builds["#1"].endswith("decode.emulate_precision_casts=ON")
    table = lines[6:]
    header, rows = table[0], {line.split()[0]: line.split()[1:] for line in table[1:-1]}
    assert header.split() == ["stage", "#1", "#2", "#3", "#4"]
    assert [cell for cell in rows["compile.decode"] if not cell.endswith("s")] == ["ran", "cached", "ran", "restored"]
    assert [cell for cell in rows["compile.prefill"] if not cell.endswith("s")] == ["ran", "cached", "cached", "restored"]
    # A restore's seconds are shown beside it, and the total adds up what the column shows.
    restored = [cell for cell in rows["compile.prefill"] if cell.endswith("s")][-1]
    assert float(restored.rstrip("s")) < 30
    assert table[-1].startswith("total") and table[-2].startswith("verify.prefill")
    # Each build's statuses start in one column, and its seconds end in one.
    assert [len(found) for found in _columns(table[1:])] == [4, 4]
    svg = ET.parse(chart).getroot()
    builds = [g for g in svg.iter("{http://www.w3.org/2000/svg}g") if g.get("class") == "build"]
    assert len(builds) == 4
    assert len(list(builds[0].iter("{http://www.w3.org/2000/svg}rect"))) >= 8  # the first build ran every stage


def _logged(seconds: dict, options: dict, specs: dict) -> dict:
    """A build log's entry as ActionCache.record_build writes it."""
    return {"model": "m", "target": "cpu", "time": 1e9, "options": options, "specs": specs,
            "stages": [{"stage": s.split(".")[0], "method": s.partition(".")[2] or None, "status": status, "seconds": t}
                       for s, (t, status) in seconds.items()]}


def test_the_table_lines_up_and_tells_builds_of_other_settings_apart():
    spec = {"decode": {"max_autotune": "OFF"}, "prefill": {"max_autotune": "OFF"}}
    builds = [
        _logged({"probe": (0.0, "restored"), "export.decode": (1.4, "ran"), "compile.decode": (123.4, "ran")},
                {"layers": 2, "checkpoint": ""}, spec),
        _logged({"probe": (0.0, "cached"), "export.decode": (0.0, "cached"), "compile.decode": (9.9, "ran")},
                {"layers": 3, "checkpoint": ""}, dict(spec, decode={"max_autotune": "ON"})),
        {"model": "m", "target": "cpu", "time": 1e9, "stages": [{"stage": "probe", "method": None, "status": "ran", "seconds": 1.0}]},
    ]
    lines = report.table(builds)
    assert lines[1].endswith("checkpoint='' layers=2 decode.max_autotune=OFF")  # prefill's spec is every build's: not shown
    assert lines[2].endswith("checkpoint='' layers=3 decode.max_autotune=ON")
    assert lines[3].endswith("(settings not logged)")  # an entry logged before the log kept them
    table = lines[5:-1]
    assert [len(found) for found in _columns(table[1:])] == [3, 3], "\n".join(table)
    assert table[0].split() == ["stage", "#1", "#2", "#3"] and table[-1].split() == ["total", "124.8s", "9.9s", "1.0s"]


def test_report_of_a_model_never_built_is_one_line(project):
    done = project.cudabuild("report", "model=tiny_lm", check=False)
    assert done.returncode == 2 and done.stderr.startswith("cudabuild: error: no logged builds of tiny_lm")
