"""`cudabuild report model=NAME`: the last builds' seconds and status per stage, and an SVG chart."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from _fixtures_cli import scripted_builds


def test_report_shows_each_logged_build_as_a_column_and_draws_them(tmp_path_factory, tmp_path):
    project = scripted_builds(tmp_path_factory)  # the first build, then no-op, a decode spec change, a restore
    chart = tmp_path / "times.svg"
    lines = project.cudabuild("report", "model=tiny_lm", "--last", "4", "--svg", str(chart)).stdout.splitlines()
    assert lines.pop() == f"chart written to {chart}"
    legend = lines.pop()  # every word a cell uses, said once
    assert all(f"{status}: " in legend for status in ("ran", "restored", "remote", "cached", "total"))
    header, rows = lines[0], {line.split()[0]: line.split()[1:] for line in lines[1:-1]}
    assert header.split()[0] == "stage" and header.count(" cpu") == 4
    assert [cell for cell in rows["compile.decode"] if not cell.endswith("s")] == ["ran", "cached", "ran", "restored"]
    assert [cell for cell in rows["compile.prefill"] if not cell.endswith("s")] == ["ran", "cached", "cached", "restored"]
    # A restore's seconds are shown beside it, and the total adds up what the column shows.
    restored = [cell for cell in rows["compile.prefill"] if cell.endswith("s")][-1]
    assert float(restored.rstrip("s")) < 30
    assert lines[-1].startswith("total") and lines[-2].startswith("verify.prefill")
    svg = ET.parse(chart).getroot()
    builds = [g for g in svg.iter("{http://www.w3.org/2000/svg}g") if g.get("class") == "build"]
    assert len(builds) == 4
    assert len(list(builds[0].iter("{http://www.w3.org/2000/svg}rect"))) >= 8  # the first build ran every stage


def test_report_of_a_model_never_built_is_one_line(project):
    done = project.cudabuild("report", "model=tiny_lm", check=False)
    assert done.returncode == 2 and done.stderr.startswith("cudabuild: error: no logged builds of tiny_lm")
