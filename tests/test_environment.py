"""cudabuild/environment.py: every CUDABUILD_* variable the code reads is checked before anything runs,
one line each, with the settings' problems, exit status 2; a bad value read at import is no traceback;
an unknown name is a warning with the name it likely meant."""

from __future__ import annotations

import re

import pytest

from conftest import REPO
from cudabuild import environment

# (variable, a value its readers cannot take, one they can)
VALUES = [
    ("CUDABUILD_CACHE_MAX_SIZE", "lots", "20G"),
    ("CUDABUILD_DEVICE_MEMORY", "big", "24GiB"),
    ("CUDABUILD_JOBS", "0", "2"),
    ("CUDABUILD_VERBOSE", "loud", "1"),
    ("CUDABUILD_KEEP_INDUCTOR", "maybe", "yes"),
    ("CUDABUILD_WARM", "sometimes", "0"),
    ("CUDABUILD_PROGRESS_SECONDS", "-1", "2.5"),
    ("CUDABUILD_SPANS_MIN_REGION", "64k", "4096"),
    ("CUDABUILD_WARM_IDLE_SECONDS", "soon", "30"),
    ("CUDABUILD_WARM_SPARES", "0", "3"),
    ("CUDABUILD_WARM_MODE", "many", "spares"),
    ("CUDABUILD_REMOTE", "http://host/x", "redis://127.0.0.1:6379/0"),
    ("CUDABUILD_REMOTE_BLOBS", "s3://bucket/prefix", ""),  # set alone: the tier refuses it
    ("CUDABUILD_RUN_ID", "mine", "0123456789abcdef0123456789abcdef"),
]


@pytest.mark.parametrize("name, bad, good", VALUES)
def test_each_variable_has_a_check_that_names_it(name, bad, good):
    problems = environment.problems({name: bad})
    assert len(problems) == 1 and problems[0].startswith(name), problems
    assert environment.problems({name: good}) == []


def test_folders_must_be_folders(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    for name in ("CUDABUILD_CACHE_DIR", "CUDABUILD_INDUCTOR_DIR", "CUDABUILD_KERNEL_CACHE", "CUDABUILD_PROJECT"):
        assert environment.problems({name: str(a_file)}) == [f"{name}={a_file}: is a file; expected a folder"]
        assert environment.problems({name: str(tmp_path)}) == []
    # A cache or inductor folder is made when missing; a project must exist.
    assert environment.problems({"CUDABUILD_CACHE_DIR": str(tmp_path / "new")}) == []
    assert "no such folder" in environment.problems({"CUDABUILD_PROJECT": str(tmp_path / "new")})[0]


def test_every_variable_the_code_reads_is_in_the_table():
    read = set()
    for path in (REPO / "cudabuild").rglob("*.py"):
        if path.name == "environment.py":  # the table itself (and its examples of typos)
            continue
        read |= set(re.findall(r"CUDABUILD_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert read - set(environment.NAMES) == set(), "add each to cudabuild/environment.py's VARIABLES, with its check"


def test_every_problem_at_once_in_the_tables_order_and_the_unknown_names_are_warnings():
    environ = {"CUDABUILD_JOBS": "x", "CUDABUILD_CACHE_MAX_SIZE": "lots", "CUDABUILD_JOB": "3", "CUDABUILD_TEST_MARK": "1"}
    assert [p.split()[0].split("=")[0] for p in environment.problems(environ)] == ["CUDABUILD_CACHE_MAX_SIZE", "CUDABUILD_JOBS"]
    assert environment.unknown(environ) == ["CUDABUILD_JOB is not a variable cudabuild reads; ignored (did you mean CUDABUILD_JOBS?)"]


def test_a_flag_set_to_0_means_off_everywhere():
    environ = {"CUDABUILD_VERBOSE": "0", "CUDABUILD_KEEP_INDUCTOR": "off", "CUDABUILD_WARM": "0"}
    assert environment.check(environ) == []
    assert environ == {"CUDABUILD_WARM": "0"}  # the set-or-unset flags are unset; CUDABUILD_WARM reads its words


def test_a_bad_variable_stops_the_build_before_its_first_stage_with_the_settings_problems(project):
    """CUDABUILD_CACHE_MAX_SIZE=lots was met only after all 12 stages; a bad value read at import
    (CUDABUILD_PROGRESS_SECONDS) was a traceback."""
    done = project.export("model=tiny_lm", "target=cpu", "layers=0",
                          env=project.env(CUDABUILD_CACHE_MAX_SIZE="lots", CUDABUILD_PROGRESS_SECONDS="x"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        "cudabuild: error: CUDABUILD_CACHE_MAX_SIZE 'lots' is not a size; use bytes or a number with K, M, G, T "
        "(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 500M or 1.5GiB",
        "cudabuild: error: CUDABUILD_PROGRESS_SECONDS=x: expected a number of seconds > 0",
        "cudabuild: error: tiny_lm option layers=0: expected an integer >= 1 (default 2)",
    ]
    assert done.stdout == "" and not (project.root / "build").exists()


def test_a_cudabuild_command_checks_them_too(project):
    done = project.cudabuild("cache", "stats", check=False, CUDABUILD_WARM_IDLE_SECONDS="soon")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "cudabuild: error: CUDABUILD_WARM_IDLE_SECONDS=soon: expected a number of seconds >= 0\n"
