"""Stages as tasks on a Dask cluster: `doit nightly ... cluster=ADDRESS` (or $DASK_SCHEDULER_ADDRESS).

    dask scheduler                                                      # once, anywhere the workers reach
    CUDA_VISIBLE_DEVICES=0 dask worker HOST:8786 --nthreads 1 --resources GPU=1   # one per GPU
    doit nightly models=tiny_lm,qwen_moe targets=cuda cluster=HOST:8786
    doit nightly models=tiny_lm targets=cpu cluster=local               # a cluster of this machine, for the run

The driver (the doit process) decides every stage as without a cluster (Runner.decide: cached,
restorable, run) and restores what the shared tier holds, importing no torch; only a stage that
must run becomes a task, sent once its upstream stages are done (doit's task_dep) and asking for
the Dask resources its pipeline row implies (`resources_for`: a stage on a device asks GPU=1; its
memory estimate, MEMORY=bytes, where workers offer MEMORY). A worker runs the stage's Runner.execute
with its own local cache and the same shared tier, which the outputs reach before the record; the
driver then restores the record, as it restores any. So the tier is required, and a stage is built
once however many builds or workers want it: the tier's build lease (executors.InProcess.claim), and one Dask
task per action key.

A worker that dies mid-stage publishes nothing (blobs first, the record last); the scheduler gives
the task to another worker (up to distributed.scheduler.allowed-failures times), which waits out
the dead worker's lease (CUDABUILD_REMOTE_LEASE_SECONDS) and builds it. Each attempt is logged to
the scheduler (ATTEMPT_TOPIC), so the driver knows which workers were lost on the way.

Owns: reaching the scheduler (or starting a local cluster, at the first stage that must run, so a
no-op starts none), a stage's resources, submitting one stage and waiting for it, what it learns
of placement and retries, and the worker side's frame around a stage (`on_worker`). Must not
touch: what a stage does or how a build is configured; the task the workers run is handed in
(cudabuild.cluster_worker.run_stage). distributed is imported here only, by builds that name a cluster.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from cudabuild.errors import ClusterError, InvalidOption, NoWorkerOffers, SchedulerUnreachable, one_line

ADDRESS_ENV = "DASK_SCHEDULER_ADDRESS"  # Dask's own variable: the scheduler a client connects to
LOCAL = "local"
ATTEMPT_TOPIC = "cudabuild-attempt"  # one event per stage attempt, logged by the worker that starts it
# A pipeline row's device -> the Dask resource a stage on it asks one of.
DEVICE_RESOURCES = {"cuda": "GPU"}
MEMORY = "MEMORY"  # bytes; a stage asks its memory estimate, where workers offer this resource


def address_from(cli_value: str, environ=os.environ) -> str:
    """The cluster a nightly is sent to: cluster=ADDRESS, else $DASK_SCHEDULER_ADDRESS, else "" (none)."""
    return (cli_value or environ.get(ADDRESS_ENV, "")).strip()


def parse_resources(text: str) -> dict[str, dict[str, float]]:
    """`resources=compile:GPU=1,verify:GPU=1` -> {"compile": {"GPU": 1.0}, "verify": {"GPU": 1.0}}:
    what stages of a kind ask for beside what their row implies (a worker set aside for some kind
    of stage; or, on a machine without a GPU, the cuda rule played by another stage kind)."""
    asked: dict[str, dict[str, float]] = {}
    problems = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        kind, _, pair = item.partition(":")
        name, _, amount = pair.partition("=")
        try:
            value = float(amount)
        except ValueError:
            value = -1.0
        if not kind or not name or value <= 0:
            problems.append(item)
            continue
        asked.setdefault(kind, {})[name] = value
    if problems:
        raise InvalidOption(f"resources={text}", f"cannot read {', '.join(problems)}",
                            expected="KIND:RESOURCE=AMOUNT items separated by commas, e.g. resources=compile:GPU=1")
    return asked


def resources_for(device: Optional[str], estimate: Optional[int]) -> dict[str, float]:
    """What a stage asks of the worker that runs it: one of its device (a row's `device`: cuda ->
    GPU=1) and its memory estimate in bytes (MEMORY), when known."""
    asked: dict[str, float] = {}
    if device:
        asked[DEVICE_RESOURCES.get(device, device.upper())] = 1.0
    if estimate:
        asked[MEMORY] = float(estimate)
    return asked


def start_local(workers: int, gpus: Sequence[str] = ()):
    """A cluster of this machine for one run: `workers` worker processes of one thread each, at
    least one per GPU in `gpus` (the first ones: CUDA_VISIBLE_DEVICES=<that GPU>, GPU=1).

    Dask's nanny sets OMP_NUM_THREADS=1 (and the like) in its workers by default; here they get the
    driver's environment instead, as doit's own workers do: a CPU compile writes torch's thread
    count into the code it generates, so a worker with another count builds other bytes."""
    import dask
    from distributed import Nanny, Scheduler, SpecCluster

    specs = {}
    for i in range(max(workers, len(gpus))):
        gpu = gpus[i] if i < len(gpus) else None
        specs[f"gpu{gpu}" if gpu is not None else f"host{i}"] = {"cls": Nanny, "options": {
            "nthreads": 1, "memory_limit": 0, "host": "127.0.0.1", "dashboard": False,
            "silence_logs": logging.WARNING, "resources": {"GPU": 1} if gpu is not None else {},
            "env": {"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {},
        }}
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard": False, "dashboard_address": None}}
    with dask.config.set({"distributed.nanny.pre-spawn-environ": {}}):
        return SpecCluster(workers=specs, scheduler=scheduler, silence_logs=logging.WARNING, name="cudabuild")


class Pool:
    """One run's connection to a Dask cluster: what the driver's runners hand stages that must run.

    `task(payload) -> outcome` is what a worker runs (a module-level function, so Dask pickles it by
    name); `tier` names the shared tier (its `where`), which a worker checks it has too. Safe to
    use from doit's threads: each waits on its own stage's future.
    """

    def __init__(self, address: str, task: Callable[[dict], dict], tier: str, *,
                 extra: Optional[dict[str, dict[str, float]]] = None, local_workers: int = 1,
                 local_gpus: Sequence[str] = ()):
        self.address, self.task, self.tier = address, task, tier
        self.extra = extra or {}
        self.local_workers, self.local_gpus = local_workers, list(local_gpus)
        self.submitted = 0  # tasks sent: a no-op nightly sends none
        self.retried: list[dict] = []  # per stage whose workers died under it: which ones
        self._client = None
        self._cluster = None
        self._lock = threading.Lock()
        self._ran: set[str] = set()  # task keys whose "ran" one build has taken (another build: "remote")
        self._workers: dict[str, dict] = {}  # address -> what the scheduler said of it

    def connect(self) -> "Pool":
        """Reach the scheduler now, so that an address nobody answers on stops the run before it
        builds anything (SchedulerUnreachable). A local cluster starts at the first stage that must run."""
        if self.address != LOCAL:
            self._ensure()
        return self

    def _ensure(self):
        with self._lock:
            if self._client is None:
                from distributed import Client

                if self.address == LOCAL:
                    self._cluster = start_local(self.local_workers, self.local_gpus)
                    self._client = Client(self._cluster, set_as_default=False)
                    self._client.wait_for_workers(len(self._cluster.worker_spec), timeout=120)
                else:
                    try:  # gives up after distributed.comm.timeouts.connect (Dask's own setting)
                        self._client = Client(self.address, set_as_default=False)
                    except (OSError, ValueError, TypeError) as e:
                        raise SchedulerUnreachable(self.address, one_line(e)) from None
            return self._client

    def hand_off(self, build: dict) -> Callable:
        """The hand-off of one build's stages to the cluster (executors.ClusterWorker): `build` is
        the caller's description of it (what a worker needs to configure the same build), sent
        with each of its stages."""
        return lambda label, work, asked: self.run(build, label, work, asked)

    def _offered(self) -> tuple[int, dict[str, float]]:
        """How many workers the cluster has, and the most of each resource one of them offers."""
        info = self._client.scheduler_info().get("workers", {})
        with self._lock:
            self._workers.update({address: {"name": str(w.get("name")), "host": w.get("host"),
                                            "resources": dict(w.get("resources") or {})} for address, w in info.items()})
        most: dict[str, float] = {}
        for worker in info.values():
            for name, amount in (worker.get("resources") or {}).items():
                most[name] = max(most.get(name, 0.0), float(amount))
        return len(info), most

    def _fit(self, label: str, kind: str, asked: dict[str, float]) -> dict[str, float]:
        """What the task asks of the cluster: the row's resources and the command line's extra ones.
        MEMORY only where some worker offers it, and no more than the most one offers (an estimate
        beyond every worker runs on the largest); any other resource no worker offers is an error,
        not a task that would wait for ever."""
        wanted = dict(asked, **self.extra.get(kind, {}))
        count, offered = self._offered()
        if not count:
            raise ClusterError(f"the cluster at {self.where} has no workers; start one with "
                               f"`dask worker {self.where} --nthreads 1`")
        if MEMORY in wanted:
            if MEMORY in offered:
                wanted[MEMORY] = min(wanted[MEMORY], offered[MEMORY])
            else:
                del wanted[MEMORY]
        for name, amount in wanted.items():
            if offered.get(name, 0.0) < amount:
                raise NoWorkerOffers(label, name, amount, self.where)
        return wanted

    @property
    def where(self) -> str:
        if self.address == LOCAL and self._cluster is not None:
            return self._cluster.scheduler_address
        return self.address

    def run(self, build: dict, label: str, work: dict, asked: dict[str, float]) -> dict:
        """Run one stage on the cluster and wait for it: the outcome its worker reports (status,
        seconds, reason, peak_rss, worker, events), with the workers lost on the way under
        worker["lost"]. Raises ClusterError when the cluster could not run it."""
        from distributed import KilledWorker

        client = self._ensure()
        resources = self._fit(label, work["stage"][0], asked)
        # One task per action key: builds of one run that want the same key share its future.
        key = f"cudabuild-{label.rpartition(':')[2]}-{work['key']}"
        with self._lock:
            self.submitted += 1
        future = client.submit(self.task, dict(work, build=build, tier=self.tier, task=key), key=key,
                               resources=resources or None, pure=False)
        try:
            outcome = future.result()
        except KilledWorker as e:
            raise ClusterError(f"stage {label}: every worker that ran it died ({one_line(e)}); see the workers' logs, "
                               "and distributed.scheduler.allowed-failures for how many may") from None
        except Exception as e:  # the scheduler went away, or a bug in the task (its traceback is the worker's)
            raise ClusterError(f"stage {label} failed on the cluster at {self.where}: {one_line(e)}") from None
        finally:
            future.release()
        outcome = dict(outcome)
        worker = outcome.get("worker") or {}
        lost = self._lost(key, work["run"], worker)
        with self._lock:
            if outcome.get("status") == "ran":
                # One task per key on the scheduler: another build of this run, or another driver
                # (the task's run), may have sent it first; it was built once, for that one.
                if key in self._ran or outcome.get("run") != work["run"]:
                    outcome["status"] = "remote"
                self._ran.add(key)
            if lost and not any(r["task"] == key for r in self.retried):
                self.retried.append({"stage": label, "task": key, "lost": lost, "ran_on": _short(worker)})
        if worker:
            outcome["worker"] = dict(worker, lost=lost) if lost else worker
        return outcome

    def _lost(self, key: str, run: str, final: dict) -> list[dict]:
        """The attempts at task `key` in this run that are not the one that finished: workers lost
        while they ran it."""
        try:
            events = self._client.get_events(ATTEMPT_TOPIC)
        except Exception:  # the scheduler went away just now: the stage is done, its history is not known
            return []
        done = (final.get("address"), final.get("pid"))
        return [_short(msg) for _, msg in events
                if isinstance(msg, dict) and msg.get("task") == key and msg.get("run") == run
                and (msg.get("address"), msg.get("pid")) != done]

    def summary(self) -> dict:
        """nightly.json's `cluster`: where, its workers, how many tasks were sent, what was retried."""
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._offered()
        return {"address": self.address if self.address == LOCAL and self._cluster is None else self.where,
                "workers": [dict(w, address=a) for a, w in sorted(self._workers.items())],
                "submitted": self.submitted, "retried": list(self.retried)}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self._client is not None:
                self._client.close()
        with contextlib.suppress(Exception):
            if self._cluster is not None:
                self._cluster.close()
        self._client = self._cluster = None


def _short(placement: dict) -> dict:
    return {k: placement.get(k) for k in ("address", "name", "host", "pid", "gpu")}


# -- on a worker -------------------------------------------------------------------------------

_ONE_STAGE = threading.Lock()


def placement(worker) -> dict:
    """Where this worker process is: its address and name, the host, the pid and the GPU it was given."""
    return {"address": worker.address, "name": str(worker.name), "host": socket.gethostname(), "pid": os.getpid(),
            "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"), "resources": dict(worker.state.total_resources)}


@contextlib.contextmanager
def on_worker(task: str, run: str) -> Iterator[tuple[dict, Path]]:
    """Around one stage on a Dask worker: the process runs one stage at a time, whatever its thread
    count (a stage sets process-wide state: inductor's config, fds 1 and 2 for its log); the attempt
    is logged to the scheduler (how the driver learns of retries); yields (this worker's placement,
    its workspace: a folder in the worker's local directory, for its cache and build folders)."""
    from distributed import get_worker

    worker = get_worker()
    with _ONE_STAGE:
        where = placement(worker)
        worker.log_event(ATTEMPT_TOPIC, dict(where, task=task, run=run))
        yield where, Path(worker.local_directory) / "cudabuild"
