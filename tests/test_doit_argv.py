"""cudabuild/doit_argv.py: the doit command line read as doit reads it, so that a setting given two
values and a word that names no task stop `doit ...` in one cudabuild line, exit status 2, not in
doit's four lines and exit status 3 (or, for the setting, the last value taken without a word)."""

from __future__ import annotations

import pytest

from cudabuild import doit_argv

NAMED = {"tiny_lm": "model", "cpu": "target"}


def test_words_skip_doits_options_and_their_values_as_doit_does():
    assert doit_argv.words(["export", "model=tiny_lm"]) == ("run", ["export"])
    assert doit_argv.words(["-n", "2", "export", "model=tiny_lm"]) == ("run", ["export"])
    assert doit_argv.words(["--db-file", "x.db", "-P", "thread", "exprot"]) == ("run", ["exprot"])
    assert doit_argv.words(["-f", "dodo.py", "list", "--all", "model=tiny_lm"]) == ("list", [])
    assert doit_argv.words(["info", "export:probe"]) == ("info", ["export:probe"])
    assert doit_argv.words([]) == ("run", [])


@pytest.mark.parametrize("argv, expected", [
    (["-n", "4", "nightly", "models=tiny_lm"], True),
    (["nightly:report"], True),
    (["run", "--continue", "nightly"], True),
    (["export", "model=nightly"], False),
    ([], False),
    (["list", "--all"], False),
])
def test_requested_reads_task_names_only(argv, expected):
    assert doit_argv.CommandLine.read(argv).requested("nightly") is expected


def test_a_word_that_names_no_task_is_one_line_with_what_it_likely_meant():
    assert doit_argv.stray_words(["exprot", "model=tiny_lm"], ("export", "nightly"), NAMED) == [
        "'exprot' is not a task or a doit command; did you mean export?; tasks: export, nightly (`doit list` says what each does)"]
    assert doit_argv.stray_words(["lsit"], ("export", "nightly"), NAMED)[0].startswith(
        "'lsit' is not a task or a doit command; did you mean list?")
    assert doit_argv.stray_words(["tiny_lm", "target=cpu"], ("export", "nightly"), NAMED) == [
        "'tiny_lm' is not a task; settings are NAME=VALUE: model=tiny_lm"]
    for fine in (["export"], ["-n", "2", "export:compile.decode"], ["nightly", "models=tiny_lm"], ["list", "--all"],
                 ["help", "anything"], ["model=tiny_lm"]):
        assert doit_argv.stray_words(fine, ("export", "nightly"), NAMED) == [], fine


def test_a_setting_given_two_values_is_a_problem_and_the_same_value_twice_is_not():
    assert doit_argv.given_twice(["export", "layers=1", "target=cpu", "layers=3", "--db-file=a=b"]) == [
        "layers=1 layers=3: layers is given 2 values; give layers once"]
    assert doit_argv.given_twice(["export", "layers=3", "layers=3"]) == []


def test_a_mistyped_task_stops_doit_in_one_line_before_anything_runs(project):
    done = project.doit("exprot", "model=tiny_lm", "target=cpu")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == ("cudabuild: error: 'exprot' is not a task or a doit command; did you mean export?; "
                           "tasks: export, nightly (`doit list` says what each does)\n")
    assert done.stdout == "" and not (project.root / "build").exists()


def test_two_values_of_a_setting_stop_the_build_with_the_other_problems(project):
    done = project.export("model=tiny_lm", "target=cpu", "target=cuda", "layers=1", "layers=3", "seed=x")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        "cudabuild: error: target=cpu target=cuda: target is given 2 values; give target once",
        "cudabuild: error: layers=1 layers=3: layers is given 2 values; give layers once",
        "cudabuild: error: tiny_lm option seed=x: expected an integer >= 0 (default 0)",
    ]
    assert not (project.root / "build").exists()
