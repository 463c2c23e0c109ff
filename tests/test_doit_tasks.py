"""cudabuild/doit_tasks.py: a build's stages as doit tasks, made when doit asks for them. Importing
the module does nothing; one DoitRun per run of doit holds what its tasks share."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import REPO

IMPORT_ONLY = textwrap.dedent("""
    import os, sys
    sys.argv = ["doit", "-P", "process", "nightly", "cluster=local"]  # a run that stops with exit 2 once made
    os.environ["CUDABUILD_RUN_ID"] = "kept"
    import cudabuild.doit_tasks
    from doit import control
    print(os.environ.get("CUDABUILD_RUN_ID"), getattr(control.TaskControl.task_dispatcher, "cudabuild_ordered", False),
          "torch" in sys.modules)
""")


def test_importing_the_tasks_reads_no_command_line_takes_no_run_id_and_patches_nothing():
    done = subprocess.run([sys.executable, "-c", IMPORT_ONLY], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["kept", "False", "False"]


def test_a_run_reads_its_command_line_once_and_takes_its_id_out_of_the_environment():
    from cudabuild.doit_tasks import DoitRun
    from cudabuild.engine.console.progress import CudabuildReporter

    environ = {"CUDABUILD_RUN_ID": " from-the-keeper "}
    run = DoitRun(["-n", "3", "export", "model=tiny_lm", "target=cpu"], environ)
    assert run.run_id == "from-the-keeper" and environ == {}
    assert (run.workers, run.cluster, dict(run.line.settings)) == (3, "", {"model": "tiny_lm", "target": "cpu"})
    config = run.doit_config()
    assert config["par_type"] == "process" and config["default_tasks"] == ["export"]
    assert issubclass(config["reporter"], CudabuildReporter) and config["reporter"].expected("export:probe") is None
    assert DoitRun([], {}).run_id != DoitRun([], {}).run_id  # a fresh id where no keeper gave one
