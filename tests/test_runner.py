"""Runner.decide: the one up-to-date ladder (cached -> restorable -> run) that a build, doit's
up-to-date check and `cudabuild explain` all ask. Driven in-process against a real tiny_lm build."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from cudabuild.config import load_config
from cudabuild.engine.graph import Stage
from cudabuild.engine.runner import Runner
from cudabuild.engine.stamp import Stamp
from cudabuild.engine.store import Store

pytestmark = pytest.mark.slow  # shares the session's one real tiny_lm build


@pytest.fixture
def runner_for(tiny_copy, monkeypatch):
    """A Runner over a private copy of the built project, as `doit export model=tiny_lm target=cpu SETTINGS`."""
    monkeypatch.setenv("CUDABUILD_CACHE_DIR", str(tiny_copy.cache))
    for name in [n for n in os.environ if n.startswith("CUDABUILD_REMOTE")]:
        monkeypatch.delenv(name)
    stores = []

    def make(**settings) -> Runner:
        store = Store(tiny_copy.cache)
        stores.append(store)
        config = load_config(tiny_copy.root, {"model": "tiny_lm", "target": "cpu", **settings}, store)
        return Runner(config, store, run_id="test")

    yield make, tiny_copy
    for store in stores:
        store.close()


def test_a_built_project_is_cached_everywhere(runner_for):
    make, _ = runner_for
    runner = make()
    decisions = [runner.decide(s, find=runner.store.actions.lookup) for s in runner.pipeline.plan(runner.config)]
    assert {d.verdict for d in decisions} == {"cached"}
    assert all(d.key == d.old.key for d in decisions)
    assert runner.is_up_to_date(Stage("package"))


def test_a_missing_output_is_restorable_and_only_a_lookup_finds_that(runner_for):
    make, project = runner_for
    runner = make()
    (project.build_dir / "model.pte").unlink()
    stage = Stage("package")
    assert runner.decide(stage).verdict == "run"  # doit's check: not up to date; execute will restore
    found = runner.decide(stage, find=runner.store.actions.lookup)
    assert found.verdict == "restorable" and found.tier == "local"
    assert found.record["outputs"]["model.pte"] == found.old.outputs["model.pte"]
    assert runner.execute(stage) == "restored" and (project.build_dir / "model.pte").exists()


def test_a_build_that_only_restores_writes_each_stage_s_log_saying_so(runner_for):
    """Issue 59: after `rm -rf build`, a build that restores every stage wrote no logs/, though
    the README lists logs/<stage>.log. Each restored stage's log now says it ran nothing here,
    and where its outputs came from."""
    make, project = runner_for
    shutil.rmtree(project.root / "build")
    runner = make()
    stages = runner.pipeline.plan(runner.config)
    assert {runner.execute(stage) for stage in stages} == {"restored"}
    for stage in stages:
        log = (project.build_dir / "logs" / f"{stage.id}.log").read_text()
        assert log.startswith(f"{stage.id}: restored from the cache at {project.cache} (key {runner.read_stamp(stage).key[:12]}), "
                              "not run in this build, so nothing was printed"), log
        assert log.count("\n") == 1


def test_a_spec_change_runs_that_methods_compile_and_waits_on_predicted_results(runner_for):
    make, _ = runner_for
    runner = make(**{"decode.emulate_precision_casts": "OFF"})
    compile_decode = runner.decide(Stage("compile", "decode"), find=runner.store.actions.lookup)
    assert compile_decode.verdict == "run" and compile_decode.key != compile_decode.old.key
    assert runner.decide(Stage("compile", "prefill")).verdict == "cached"
    # With explain's reader, the blob depends on a result that compile has not produced yet, and
    # package on the blob's.
    from cudabuild.engine.graph import Pending, Result

    predicted = lambda s: Result(Pending(s.id)) if s.id in ("compile.decode", "blob.decode") else runner.stamps.result(s)
    waiting = runner.decide(Stage("blob", "decode"), read=predicted, find=runner.store.actions.lookup)
    assert waiting.verdict == "wait" and waiting.waits == {"compile.decode"} and waiting.key is None
    waiting = runner.decide(Stage("package"), read=predicted, find=runner.store.actions.lookup)
    assert waiting.verdict == "wait" and waiting.waits == {"blob.decode"} and waiting.key is None


def test_a_damaged_stamp_reads_as_absent_and_the_stage_is_restored(runner_for):
    make, project = runner_for
    runner = make()
    path = runner.stamps.path(Stage("edge", "decode"))
    path.write_text(json.dumps({"key": "k", "inputs": {}}))  # no digest, no outputs: not a stamp
    assert Stamp.load(path) is None
    decision = runner.decide(Stage("edge", "decode"), find=runner.store.actions.lookup)
    assert decision.old is None and decision.verdict == "restorable"
    assert runner.execute(Stage("edge", "decode")) == "restored"
    assert Stamp.load(path).key == decision.key


def test_stamps_round_trip_through_the_one_reader_and_writer(tmp_path):
    stamp = Stamp(key="k", inputs={"stage": "package"}, digest="d", outputs={"model.pte": "a" * 64},
                  finals=["model.pte"], value=None, status="restored", seconds=0.0, run="r", saved_seconds=2.5)
    stamp.save(tmp_path / "s.json")
    assert Stamp.load(tmp_path / "s.json") == stamp and stamp.cost_seconds == 2.5
    assert stamp.replace(saved_seconds=None, seconds=1.0).cost_seconds == 1.0
    shutil.copy(tmp_path / "s.json", tmp_path / "t.json")
    (tmp_path / "t.json").write_text((tmp_path / "t.json").read_text().replace('"finals"', '"finales"'))
    assert Stamp.load(tmp_path / "t.json").finals == []  # an unknown field is ignored, a default used


def test_a_corrupt_upstream_blob_is_rebuilt_through_the_builds_executor(runner_for):
    """A producer whose output turns out bad is run again by the build's executor (its lock, its
    admission, its process), not beside it; then the consumer reads the new output. Export hands on
    the trace's outputs: it reads them first, and its own producer, the trace, is run again too."""
    from cudabuild.engine import executors

    make, _ = runner_for
    runner = make()
    verify, export = Stage("verify", "decode"), Stage("export", "decode")
    runner.store.actions.drop_record(runner.read_stamp(verify).key)
    runner.stamps.path(verify).unlink()
    damaged = runner.store.objects.blob_path(runner.read_stamp(export).outputs["inputs.pt"])
    damaged.write_bytes(b"\0" * damaged.stat().st_size)
    jobs = []

    class Noted:
        """The build's executor: the stages it is handed, run here."""

        logs_here = True

        def run(self, job):
            jobs.append((job.stage.id, job.key))
            return executors.InProcess().run(job)

    runner.executor = Noted()
    assert runner.execute(verify) == "ran"
    assert [stage for stage, _ in jobs] == ["verify.decode", "export.decode", "trace.decode"]
    rebuilt = runner.read_stamp(export)
    assert (rebuilt.status, rebuilt.key, runner.statuses["export.decode"]) == ("ran", jobs[1][1], "ran")
    assert runner.store.objects.verify_blob(rebuilt.outputs["inputs.pt"])  # stored again, whole
    assert runner.read_stamp(verify).status == "ran"


def test_a_handed_on_output_found_bad_is_made_again_by_its_producer(runner_for, tmp_path):
    """Issue 59: a corrupt compiled model.so was not repaired. The cuda blob stage hands the
    compile's .so on without reading it (StageResult.stored), so once a reader had found it corrupt
    and dropped it, the blob stage's rebuild failed on it ("handed on model.so, which is no longer
    in the cache"), and so did every build after (the compile's stamp was intact). The .so is now
    made again by its producer, through the build's executor, and handed on."""
    from cudabuild.engine.context import StageResult
    from cudabuild.errors import CorruptBlob

    make, _ = runner_for
    runner = make()
    blob, compiled = Stage("blob", "decode"), Stage("compile", "decode")
    so = runner.read_stamp(compiled).outputs["model.so"]
    path = runner.store.objects.blob_path(so)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptBlob):  # what package's read of it did: dropped
        runner.store.objects.read_bytes(so)
    assert not runner.store.objects.has_blob(so)

    (tmp_path / "weights.blob").write_bytes(b"the weights")
    key = runner.read_stamp(blob).key
    runner.store_result(blob, key, runner.read_stamp(blob).inputs,
                        StageResult({"weights.blob": tmp_path / "weights.blob"}, stored={"model.so": so}),
                        started=0.0, why=None, peak_rss=None)
    assert runner.statuses["compile.decode"] == "ran" and runner.read_stamp(compiled).outputs["model.so"] == so
    assert runner.store.objects.verify_blob(so)  # made again, whole: a CPU compile gives the same bytes
    assert runner.store.actions.local_record(key)["outputs"]["model.so"] == so


def test_a_stage_that_lost_an_input_where_it_ran_has_its_producer_rewound_and_runs_again(runner_for):
    """A stage handed to another process (the warm process, a cluster's worker: cudabuild.engine.far_end)
    that found an upstream blob bad there gives LostInput back, since it cannot run the producer
    itself: the runner rewinds the producer through its executor, then decides and runs the stage
    again. A second loss of the same producer is the stage's error."""
    from cudabuild.engine import executors
    from cudabuild.engine.stage_io import LostInput

    make, _ = runner_for
    verify, export = Stage("verify", "decode"), Stage("export", "decode")
    for losses in (1, 2):
        runner = make()
        runner.store.actions.drop_record(runner.read_stamp(verify).key)
        runner.stamps.path(verify).unlink()
        jobs = []

        class Elsewhere:
            """The build's executor, losing verify's input from export `losses` times."""

            logs_here = True
            left = losses

            def run(self, job):
                jobs.append(job.stage.id)
                if job.stage == verify and self.left:
                    self.left -= 1
                    raise LostInput("export", "decode", "cached blob 0123456789ab failed its sha256 check")
                return executors.InProcess().run(job)

        runner.executor = Elsewhere()
        if losses == 1:
            assert runner.execute(verify) == "ran"
            assert jobs == ["verify.decode", "export.decode", "verify.decode"]
            assert runner.read_stamp(export).status == "ran" and runner.statuses["export.decode"] == "ran"
            assert runner.read_stamp(verify).status == "ran"
        else:
            with pytest.raises(LostInput, match="^cached blob 0123456789ab failed its sha256 check$"):
                runner.execute(verify)
            assert jobs == ["verify.decode", "export.decode", "verify.decode"]
