"""`doit nightly cluster=ADDRESS` (cudabuild.engine.cluster, cudabuild.cluster_worker): stages sent
to a real Dask cluster, their artifacts moved through a real Redis tier on loopback.

The cluster is a real `dask scheduler` and two real `dask worker` processes (one thread each, no
nanny, so a killed worker stays dead), one of them offering GPU=1 without a GPU. The cuda rule of
the pipeline table (compile and verify on cuda ask GPU=1) cannot run on a CPU, so the end-to-end
test plays it with the documented `resources=compile:GPU=1` (what stages of a kind ask beside
their row's), and the table's own rule is checked on a cuda configuration without building it.
To stay cheap, most end-to-end tests seed the tier from the run's one tiny build and remove the
records of the few stages they want run: everything else is restored from the tier. Two build
cold (Redis, S3) on two workers, each stage kind pinned by resources to the worker that did not
make its inputs, and compare the outputs byte for byte with the run's local cold build; one kills
the worker that made a stage's input before the stage runs elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from conftest import REPO, Project, assert_ok, new_project
from cudabuild.config import load_config
from cudabuild.engine import cluster
from cudabuild.engine.graph import Stage
from cudabuild.engine import admission
from cudabuild.engine.runner import Runner
from cudabuild.engine.store import Store
from cudabuild.errors import InvalidOption
from test_remote import STAGES, _free_port, seed, server  # noqa: F401  (server: the Redis fixture)

NIGHTLY = ("nightly", "models=tiny_lm", "targets=cpu")
# The driver's own process, run in-process so that what it imported and its peak RSS can be read
# (VmHWM: its peak since exec; getrusage's ru_maxrss keeps that of the process it was forked from).
DRIVER = (
    "import sys; from doit.doit_cmd import DoitMain; sys.argv = ['doit'] + sys.argv[1:];\n"
    "rc = DoitMain().run(sys.argv[1:]);\n"
    "hwm = next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM:'));\n"
    "print('DRIVER', 'torch' in sys.modules, hwm, rc)"
)


@dataclasses.dataclass
class DaskCluster:
    address: str
    workers: dict[str, subprocess.Popen]  # name -> its process (the worker itself: no nanny)
    add_worker: Callable[..., subprocess.Popen]  # (name, *dask worker options): started, and joined

    def kill(self, name: str) -> int:
        """SIGKILL a worker and wait until it is gone; its pid."""
        process = self.workers[name]
        process.kill()
        process.wait(timeout=30)
        return process.pid


def _dask(*args: str, env: dict, cwd: Path, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "dask", *args], env=env, cwd=cwd, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture
def dask_on(tmp_path):
    """`start(project, env, {name: [dask worker options]})`: a scheduler and workers on loopback, one
    thread each, no nanny (a killed worker stays dead), each in a local directory of its own. A
    worker imports cudabuild from the project a test builds ($CUDABUILD_PROJECT, PYTHONPATH)."""
    started: list[subprocess.Popen] = []

    def start(project: Project, env: dict, workers: dict[str, list[str]]) -> DaskCluster:
        env = dict(env, PYTHONPATH=str(project.root))
        port = _free_port()
        address = f"tcp://127.0.0.1:{port}"
        started.append(_dask("scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard",
                             env=env, cwd=project.root, log=tmp_path / "scheduler.log"))
        cluster_ = DaskCluster(address, {}, None)

        def add_worker(name: str, *options: str) -> subprocess.Popen:
            process = _dask("worker", address, "--name", name, "--nthreads", "1", "--no-nanny", "--no-dashboard",
                            "--local-directory", str(tmp_path / f"worker-{name}"), *options,
                            env=env, cwd=project.root, log=tmp_path / f"worker-{name}.log")
            started.append(process)
            cluster_.workers[name] = process
            from distributed import Client

            with Client(address, timeout=600) as client:
                deadline = time.monotonic() + 600
                while name not in {str(w.get("name")) for w in client.scheduler_info()["workers"].values()}:
                    assert time.monotonic() < deadline and process.poll() is None, f"worker {name} did not join"
                    time.sleep(0.2)
            return process

        cluster_.add_worker = add_worker
        for name, options in workers.items():
            add_worker(name, *options)
        return cluster_

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture
def dask_cluster(dask_on, server):
    """A scheduler and two workers on loopback: `gpu` (GPU=1) and `cpu`, sharing the tier `server`."""
    return lambda project: dask_on(project, project.env(CUDABUILD_REMOTE=server.url, CUDABUILD_REMOTE_LEASE_SECONDS=2),
                                   {"gpu": ["--resources", "GPU=1"], "cpu": []})


def seeded_without(built: Project, server, stages: list[str]) -> dict[str, str]:
    """Seed the tier from the run's tiny build, less the records of `stages` ({stage: its key})."""
    seed(built, server)
    keys = {s: json.loads((built.build_dir / ".stamps" / f"{s}.json").read_text())["key"] for s in stages}
    assert server.client().delete(*(f"cudabuild:rec:{k}" for k in keys.values())) == len(keys)
    return keys


def nightly_json(project: Project) -> dict:
    return json.loads((project.root / "build" / "nightly.json").read_text())


# -- without a cluster: resources, and what stops a run before it builds ---------------------------------


def test_resources_come_from_the_pipeline_table_and_the_command_line(built_tiny, tmp_path):
    proj = built_tiny.copy(tmp_path)
    store = Store(proj.cache)
    cpu = load_config(proj.root, {"model": "tiny_lm", "target": "cpu"}, store)
    # The table's rule on cuda (compile, reference and verify, and the probe, ask the device), without a GPU:
    cuda = dataclasses.replace(cpu, target="cuda")
    on_cuda, on_cpu = Runner(cuda, store, "r"), Runner(cpu, store, "r")
    asked = {s.id: admission.resources(on_cuda, s, {"stage": s.kind}) for s in cpu.pipeline.plan(cuda)}
    assert {s for s, r in asked.items() if r.get("GPU") == 1} == {"probe", "compile.decode", "compile.prefill",
                                                                   "blob.decode", "blob.prefill",
                                                                   "reference.decode", "reference.prefill",
                                                                   "verify.decode", "verify.prefill"}
    # On cpu nothing asks a GPU; memory is the admission's estimate (here: the last run's peak).
    compile_decode = Stage("compile", "decode")
    asked = admission.resources(on_cpu, compile_decode, on_cpu.inputs(compile_decode))
    assert "GPU" not in asked and asked["MEMORY"] == admission.memory_estimate(on_cpu, compile_decode, on_cpu.inputs(compile_decode)) > 0
    store.close()
    assert cluster.parse_resources("compile:GPU=1, verify:GPU=1,export:BIG=2") == {
        "compile": {"GPU": 1.0}, "verify": {"GPU": 1.0}, "export": {"BIG": 2.0}}
    with pytest.raises(InvalidOption, match="cannot read compile, verify:GPU=0"):
        cluster.parse_resources("compile,verify:GPU=0")


def test_a_cluster_needs_a_reachable_scheduler_and_a_shared_tier(server, tmp_path):
    proj = new_project(tmp_path)
    unreachable = f"tcp://127.0.0.1:{_free_port()}"
    runs = {
        "no tier": proj.doit(*NIGHTLY, "cluster=local"),
        "no scheduler": proj.doit(*NIGHTLY, env=proj.env(CUDABUILD_REMOTE=server.url, DASK_SCHEDULER_ADDRESS=unreachable,
                                                        DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT="2s")),
        "resources alone": proj.doit(*NIGHTLY, "resources=compile:GPU=1"),
    }
    for case, result in runs.items():
        errors = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
        assert result.returncode == 2 and len(errors) == 1 and errors[0].startswith("cudabuild: error: "), (case, errors)
    assert "shared tier, and none is set; set CUDABUILD_REMOTE=redis://" in runs["no tier"].stderr
    assert f"cannot reach the Dask scheduler at {unreachable}" in runs["no scheduler"].stderr
    assert "give cluster=ADDRESS too" in runs["resources alone"].stderr
    store = Store(proj.cache)
    assert not (proj.root / "build").exists() and not list(store.actions.records())  # nothing built, nothing cached
    store.close()


def test_a_worker_refuses_a_stage_it_would_key_differently(built_tiny, server, tmp_path, monkeypatch):
    """cluster_worker: the driver's fingerprint keys the probe, so only what decides a build must agree
    (not a compiler's inode, nor which GPU a worker sees); and the stage's key must be the driver's."""
    from cudabuild.backend.toolchain import cheap_fingerprint, fingerprint_difference
    from cudabuild.cluster_worker import _prepared
    from cudabuild.engine.hashing import digest
    from cudabuild.errors import WorkerMismatch

    here = cheap_fingerprint("cpu")
    elsewhere = json.loads(json.dumps(here))
    elsewhere["compiler"]["stat"] = [1, 2, 3]
    assert fingerprint_difference(here, elsewhere) is None
    elsewhere["packages"]["torch"] = "2.11.0"
    assert fingerprint_difference(here, elsewhere) == f"packages.torch: '2.11.0' there, {here['packages']['torch']!r} here"

    proj = built_tiny.copy(tmp_path)
    seed(proj, server)
    monkeypatch.setenv("CUDABUILD_REMOTE", server.url)
    store = Store(proj.cache)
    config = load_config(proj.root, {"model": "tiny_lm", "target": "cpu"}, store)
    driver = Runner(config, store, "r")
    stage = Stage("compile", "decode")
    inputs = json.loads(json.dumps(driver.inputs(stage)))
    inputs["specs"]["low_memory_mode"] = "ON"  # the driver was given a setting the worker was not
    payload = {"build": {"project": str(proj.root), "settings": {"model": "tiny_lm", "target": "cpu"}},
               "stage": ["compile", "decode"], "key": digest(inputs), "inputs": inputs, "run": "r",
               "upstream": {d.id: dataclasses.asdict(driver.read_stamp(d)) for d in config.pipeline.dependencies(stage, config)},
               "fingerprint": here, "tier": store.remote.where}
    with pytest.raises(WorkerMismatch, match=r"this worker keys it \w+, its driver \w+ \(spec low_memory_mode: ON -> OFF\)"):
        _prepared(payload, tmp_path / "worker")
    with pytest.raises(WorkerMismatch, match="toolchain is not its driver's .packages.torch"):
        _prepared(dict(payload, fingerprint=elsewhere), tmp_path / "worker")
    store.close()


# -- on a cluster ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_worker_killed_mid_stage_is_retried_elsewhere_and_nothing_is_half_published(built_tiny, server,
                                                                                      dask_cluster, tmp_path):
    key = seeded_without(built_tiny, server, ["package"])["package"]
    proj = new_project(tmp_path / "driver")
    dask = dask_cluster(proj)
    driver = subprocess.Popen([sys.executable, "-m", "doit", *NIGHTLY, f"cluster={dask.address}"], cwd=proj.root,
                              env=proj.env(CUDABUILD_REMOTE=server.url), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    redis = server.client()
    try:
        # The worker that takes the package holds its build lease while it imports and runs it:
        # kill it then, before anything is published.
        deadline = time.monotonic() + 600
        while (token := redis.get(f"cudabuild:lease:{key}")) is None:
            assert time.monotonic() < deadline and driver.poll() is None, "no worker took the package"
            time.sleep(0.05)
        killed = int(token.decode().split(":")[1])
        name = next(n for n, p in dask.workers.items() if p.pid == killed)
        assert redis.get(f"cudabuild:rec:{key}") is None
        os.kill(killed, signal.SIGKILL)
        output, _ = driver.communicate(timeout=600)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, output[-3000:]
    build, = nightly_json(proj)["builds"]
    other = next(n for n in dask.workers if n != name)
    assert build["status"] == "ok" and build["placement"]["package"]["name"] == other
    lost, = build["retried"]["package"]
    assert (lost["name"], lost["pid"]) == (name, killed)
    assert nightly_json(proj)["cluster"]["retried"][0]["stage"] == "tiny_lm/cpu:package"
    # Published whole, once: the record the retry wrote names blobs the tier holds, and the outputs
    # are the ones the tiny build made.
    assert proj.statuses() == {s: ("ran" if s == "package" else "remote") for s in STAGES}
    record = json.loads(redis.get(f"cudabuild:rec:{key}"))["record"]
    assert all(redis.exists(f"cudabuild:blob:{sha}") for sha in record["outputs"].values())
    assert proj.manifest()["outputs"] == built_tiny.manifest()["outputs"]
    assert "1 retried after a worker died" in output


@pytest.mark.slow
def test_a_local_cluster_runs_what_must_run_and_a_stage_failing_there_fails_its_build_only(built_tiny, server, tmp_path):
    from test_nightly import BROKEN_RECIPE

    seeded_without(built_tiny, server, ["package"])
    proj = new_project(tmp_path)
    (proj.root / "recipes" / "broken.py").write_text(BROKEN_RECIPE)
    result = proj.doit("nightly", "models=tiny_lm,broken", "targets=cpu", "cluster=local",
                       env=proj.env(CUDABUILD_REMOTE=server.url, CUDABUILD_JOBS=1))
    assert result.returncode == 1, result.stdout + result.stderr
    report = nightly_json(proj)
    builds = {b["model"]: b for b in report["builds"]}
    assert builds["tiny_lm"]["status"] == "ok" and builds["tiny_lm"]["stages"]["ran"] == 1
    assert builds["tiny_lm"]["placement"]["package"]["name"] == "host0"  # cluster=local, CUDABUILD_JOBS=1: one worker
    assert proj.manifest()["outputs"] == built_tiny.manifest()["outputs"]
    broken = builds["broken"]
    assert broken["status"] == "failed" and broken["failed_step"] == "trace.forward"
    assert broken["error"].startswith("on worker host0 (") and "broken on purpose" in broken["error"]
    assert [w["name"] for w in report["cluster"]["workers"]] == ["host0"] and report["cluster"]["submitted"] == 2


# -- cold, on two workers: every stage's inputs made by another worker ------------------------------------

# Where each kind of stage runs: compile on the worker offering GPU=1 (the cuda rule, played), blob on
# the other (the .so compile made there), package on the GPU worker (the blobs the other made), verify
# on the other (the package the GPU worker made); probe, export and edge wherever the scheduler puts
# them. The command line asks for the resources the workers offer.
PINNED = {"gpu": ["--resources", "GPU=1"], "cpu": ["--resources", "B=1"]}
CROSSED = "resources=compile:GPU=1,blob:B=1,package:GPU=1,verify:B=1"


def assert_every_kind_read_another_workers_output(placement: dict) -> None:
    on = {stage: worker["name"] for stage, worker in placement.items()}
    for method in ("decode", "prefill"):
        assert on[f"blob.{method}"] != on[f"compile.{method}"], on
        assert on[f"verify.{method}"] != on["package"], on
    assert on["package"] not in {on["blob.decode"], on["blob.prefill"]}, on


def assert_built_as_a_local_cold_build(project: Project, local: Project) -> None:
    outputs = project.manifest()["outputs"]
    assert outputs == local.manifest()["outputs"]
    for name in outputs:
        assert (project.build_dir / name).read_bytes() == (local.build_dir / name).read_bytes(), name


def cold_nightly_on_two_workers(project: Project, env: dict, dask_on) -> tuple[dict, DaskCluster]:
    dask = dask_on(project, env, PINNED)
    assert_ok(project.doit(*NIGHTLY, f"cluster={dask.address}", CROSSED, env=env))
    assert set(project.statuses().values()) == {"ran"}
    build, = nightly_json(project)["builds"]
    assert build["status"] == "ok" and build["retried"] == {}
    return build, dask


@pytest.mark.slow
def test_a_cold_build_on_two_workers_through_redis_is_byte_identical_to_a_local_one(built_tiny, server, dask_on,
                                                                                   tmp_path):
    """Every stage ran once, on the cluster, on the worker its kind asks for; the bytes are a local
    build's; the trace has a row per worker; a no-op sends nothing and imports no torch."""
    proj = new_project(tmp_path / "driver")  # a fresh machine: an empty cache, nothing built
    build, dask = cold_nightly_on_two_workers(proj, proj.env(CUDABUILD_REMOTE=server.url), dask_on)
    placed = build["placement"]
    assert set(placed) == set(STAGES)
    assert_every_kind_read_another_workers_output(placed)
    assert {placed["compile.decode"]["name"], placed["compile.prefill"]["name"]} == {"gpu"}  # GPU=1: that worker only
    for worker in placed.values():
        assert worker["pid"] == dask.workers[worker["name"]].pid and worker["host"] == socket.gethostname()
    assert_built_as_a_local_cold_build(proj, built_tiny)
    report = nightly_json(proj)["cluster"]
    assert report["submitted"] == len(STAGES) and report["retried"] == []  # each key built once
    assert {w["name"]: w["resources"] for w in report["workers"]} == {"gpu": {"GPU": 1.0}, "cpu": {"B": 1.0}}
    # trace.json: one process row per worker, holding the runs of the stages it ran.
    events = json.loads((proj.build_dir / "trace.json").read_text())["traceEvents"]
    rows_named = {e["args"]["name"].split()[1]: e["pid"] for e in events if e.get("ph") == "M"}
    assert set(rows_named) == {"gpu", "cpu"}
    for stage in placed:  # its span on the driver waits for the task; the worker's runs it
        run_on = {e["pid"] for e in events if e["name"] == stage and e.get("args", {}).get("status") == "ran"}
        assert rows_named[placed[stage]["name"]] in run_on, stage

    # A no-op through the cluster sends no task and imports no torch in the driver; nor does a
    # fresh machine, which restores everything from the tier.
    for project in (proj, new_project(tmp_path / "fresh")):
        driver = subprocess.run([sys.executable, "-c", DRIVER, *NIGHTLY, f"cluster={dask.address}", CROSSED],
                                cwd=project.root, env=project.env(CUDABUILD_REMOTE=server.url),
                                capture_output=True, text=True, timeout=600)
        assert_ok(driver)
        torch_imported, peak_rss, rc = driver.stdout.split("DRIVER ")[1].split()[:3]
        assert (torch_imported, rc) == ("False", "0") and int(peak_rss) < 300 * 2**20
        assert nightly_json(project)["cluster"]["submitted"] == 0
        assert set(project.statuses().values()) == ({"cached"} if project is proj else {"remote"})


@pytest.mark.slow
def test_a_cold_build_on_two_workers_through_s3_is_byte_identical_to_a_local_one(built_tiny, s3_server, dask_on,
                                                                                tmp_path):
    proj = new_project(tmp_path / "driver")
    url = s3_server.url("cluster")
    build, _ = cold_nightly_on_two_workers(proj, proj.env(CUDABUILD_REMOTE=url, **s3_server.env()), dask_on)
    assert_every_kind_read_another_workers_output(build["placement"])
    assert_built_as_a_local_cold_build(proj, built_tiny)
    # What the workers published is in the object store: every stage's record, each blob once.
    assert sum(key.startswith("rec/") for key in s3_server.keys(url)) >= len(STAGES)


@pytest.mark.slow
def test_a_stage_whose_producers_worker_is_gone_reads_what_it_made_from_the_tier(built_tiny, server, dask_on, tmp_path):
    keys = seeded_without(built_tiny, server, ["compile.decode", "blob.decode", "package", "verify.decode"])
    proj = new_project(tmp_path / "driver")
    env = proj.env(CUDABUILD_REMOTE=server.url)
    dask = dask_on(proj, env, {"producer": []})
    # The producer: compile.decode alone (and the upstream stages it needs, restored from the tier).
    assert_ok(proj.doit("nightly:tiny_lm/cpu:compile.decode", "models=tiny_lm", "targets=cpu",
                        f"cluster={dask.address}", env=env))
    compiled = proj.stamp("compile.decode")
    assert compiled["status"] == "ran" and compiled["worker"]["name"] == "producer"
    redis = server.client()
    assert redis.exists(f"cudabuild:rec:{keys['compile.decode']}") and not redis.exists(f"cudabuild:rec:{keys['blob.decode']}")
    killed = dask.kill("producer")
    # The consumers, on a worker whose cache is empty, after the producer and its cache are gone.
    dask.add_worker("consumer")
    result = proj.doit(*NIGHTLY, f"cluster={dask.address}", env=env)
    assert_ok(result)
    statuses = proj.statuses()
    assert {s for s, status in statuses.items() if status == "ran"} == {"blob.decode", "package", "verify.decode"}
    assert statuses["compile.decode"] == "cached"
    build, = nightly_json(proj)["builds"]
    assert {worker["name"] for worker in build["placement"].values()} == {"consumer"}
    assert proj.stamp("compile.decode")["worker"]["pid"] == killed  # made by the worker that is gone
    assert_built_as_a_local_cold_build(proj, built_tiny)
