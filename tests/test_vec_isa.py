"""Inductor's CPU ISA probes (cudabuild.backend.vec_isa): the answer torch's own check gave is
remembered per source and build command, a later compile on the machine builds and loads no probe,
and the bytes are the same."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
import warnings

import pytest

from conftest import Project, assert_ok, new_project

torch = pytest.importorskip("torch")

from torch._inductor import config as inductor_config  # noqa: E402
from torch._inductor import cpu_vec_isa  # noqa: E402

from cudabuild.backend import vec_isa  # noqa: E402

pytestmark = pytest.mark.fresh_machine  # its caches start with no probe answers or C++ objects (conftest)

x86_only = pytest.mark.skipif(vec_isa.machine_key() is None, reason="torch probes ISAs by building only on x86-64")


def _probe_children(project: Project) -> list[dict]:
    """The `python -c` children that load a probe library: one per probe torch ran."""
    events = json.loads((project.build_dir / "trace.json").read_text())["traceEvents"]
    return [e for e in events if e.get("cat") == "tool" and "from ctypes import cdll" in e["args"].get("command", "")]


def _probe_one(isa) -> bool:
    """One probe as a compile makes it, past the process's own memo of the answer."""
    return isa.check_build(cpu_vec_isa.VecISA._avx_code)


def _listed_isas() -> list:
    flags = cpu_vec_isa.x86_isa_checker()
    return [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(flag in flags for flag in str(isa).split())]


@x86_only
def test_a_probe_is_remembered_with_its_answer_and_asked_once_per_source_and_build_command(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_VEC_ISA_OK", raising=False)
    if not _listed_isas():
        pytest.skip("this CPU lists no vector ISA torch probes")
    isa = _listed_isas()[-1]  # the narrowest the CPU lists: the likeliest to pass
    machine = vec_isa.machine_key()
    with vec_isa.answered(tmp_path) as count:
        passed = _probe_one(isa)
    assert (count.remembered, count.checked) == (0, 1)
    remembered = vec_isa.probe_path(tmp_path, machine, isa, cpu_vec_isa.VecISA._avx_code)
    if not passed:
        pytest.skip(f"{isa} fails torch's probe here")
    assert json.loads(remembered.read_text())["passed"] is True
    with vec_isa.answered(tmp_path) as count:
        assert _probe_one(isa) is True
    assert (count.remembered, count.checked) == (1, 0)
    assert "cudabuild" not in cpu_vec_isa.VecISA.check_build.__module__  # torch's own check, put back

    # A probe that cannot build fails; once torch's check has failed it in FAILURES_TO_KEEP
    # compiles, that is its answer, without a compiler run.
    broken = cpu_vec_isa.VecISA._avx_code + "\nthis is not C++;\n"
    for _ in range(vec_isa.FAILURES_TO_KEEP):
        with vec_isa.answered(tmp_path) as count:
            assert isa.check_build(broken) is False
        assert (count.remembered, count.checked) == (0, 1)
    with vec_isa.answered(tmp_path) as count:
        assert isa.check_build(broken) is False
    assert (count.remembered, count.checked) == (1, 0)

    # The build command is part of the question: ExecuTorch's CUDA lowering links no libtorch.
    with inductor_config.patch({"aot_inductor.link_libtorch": False}):
        assert vec_isa.probe_path(tmp_path, machine, isa, cpu_vec_isa.VecISA._avx_code) != remembered
        with vec_isa.answered(tmp_path) as count:
            _probe_one(isa)
        assert (count.remembered, count.checked) == (0, 1)

    # $TORCHINDUCTOR_VEC_ISA_OK, inductor's own switch, wins: nothing is remembered or answered.
    with inductor_config.patch({"cpp.vec_isa_ok": False}), vec_isa.answered(tmp_path) as count:
        assert count is None


@x86_only
@pytest.mark.skipif(not hasattr(cpu_vec_isa.VecISA, "_probe_load"), reason="this torch's probe has no load timeout")
def test_a_probe_whose_load_timed_out_is_asked_again(tmp_path, monkeypatch):
    """torch 2.13 gives up on a probe child after 60 s, warns that it hung and says False: that
    False says nothing about the machine, so it is not kept."""
    if not _listed_isas():
        pytest.skip("this CPU lists no vector ISA torch probes")
    isa = _listed_isas()[-1]

    def hung(self, output_path):  # what torch's _probe_load does once its child outlives the timeout
        warnings.warn(f"VecISA dlopen probe for {self} hung after 60s", stacklevel=2)
        return False

    monkeypatch.setattr(cpu_vec_isa.VecISA, "_probe_load", hung)
    for _ in range(vec_isa.FAILURES_TO_KEEP + 1):
        with pytest.warns(UserWarning, match="hung"), vec_isa.answered(tmp_path) as count:
            assert _probe_one(isa) is False
        assert (count.remembered, count.checked) == (0, 1)
    assert not list(tmp_path.rglob("*.json"))  # no answer, no failure counted


def _forget_asked_isas() -> None:
    """Make this process ask torch's probes again (it keeps their answers per process)."""
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    for isa in cpu_vec_isa.supported_vec_isa_list:
        for cls in type(isa).__mro__:
            for name in ("__bool__", "_VecISA__bool__impl"):
                memo = vars(cls).get(name)
                if hasattr(memo, "cache_clear"):
                    memo.cache_clear()


@x86_only
def test_probes_start_side_by_side_when_lowering_starts_and_torch_takes_their_answers(tmp_path, monkeypatch):
    """A compile on a fresh cache: the first probe of every listed ISA runs in a thread of its own,
    all at once, from the moment inductor lowers; the compile's own asks wait for those answers
    instead of probing again, and the answers are remembered."""
    listed = _listed_isas()
    if not listed:
        pytest.skip("this CPU lists no vector ISA torch probes")
    monkeypatch.delenv("TORCHINDUCTOR_VEC_ISA_OK", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    runs = []
    torch_check = cpu_vec_isa.VecISA.check_build

    def recorded(isa, code):  # torch's check, as answered() finds it: who ran it, and when
        started = time.monotonic()
        passed = torch_check(isa, code)
        runs.append((str(isa), code == cpu_vec_isa.VecISA._avx_code, threading.current_thread().name,
                     started, time.monotonic()))
        return passed

    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", recorded)
    _forget_asked_isas()
    # (Before the compile: a passed feature probe adds its flags to the ISA's build after it.)
    remembered = [vec_isa.probe_path(tmp_path / "store", vec_isa.machine_key(), isa, cpu_vec_isa.VecISA._avx_code)
                  for isa in listed]
    torch._dynamo.reset()

    def add_one(x):
        return x * 2.0 + 1.0

    with inductor_config.patch(fx_graph_cache=False), vec_isa.answered(tmp_path / "store") as count:
        out = torch.compile(add_one, backend="inductor")(torch.arange(64, dtype=torch.float32))
    assert torch.equal(out, torch.arange(64, dtype=torch.float32) * 2.0 + 1.0)

    first = [r for r in runs if r[1]]  # each ISA's first probe (the source every ISA is first asked)
    assert sorted(r[0] for r in first) == sorted(str(isa) for isa in listed)  # each once: none asked twice
    assert all(name.startswith("isa-probe") for _, _, name, _, _ in first)
    if len(first) > 1:  # side by side: every one had started before the first had ended
        assert max(r[3] for r in first) < min(r[4] for r in first)
    assert count.checked == len(runs)
    # Each answer kept: a pass as the answer, a failure as one of the FAILURES_TO_KEEP it takes.
    assert all(path.is_file() or list(path.parent.glob(f"{path.stem}.failed-*.json")) for path in remembered)
    assert cpu_vec_isa.VecISA.check_build is recorded  # what it found, put back
    from torch._inductor.graph import GraphLowering
    assert "cudabuild" not in GraphLowering.run.__module__  # inductor's own, put back


def _probe_counts(project: Project) -> dict[str, dict]:
    """Per compile stage, the probes answered from the cache and those torch ran."""
    stamps = project.build_dir / ".stamps"
    return {p.stem: json.loads(p.read_text())["value"]["isa_probes"] for p in stamps.glob("compile.*.json")}


@x86_only
@pytest.mark.slow
def test_a_cold_build_on_a_machine_that_probed_before_runs_no_probe_and_builds_the_same_bytes(built_tiny, tmp_path):
    before = _probe_counts(built_tiny)
    assert _probe_children(built_tiny) and sum(c["checked"] for c in before.values()) > 0  # an empty cache: torch probed
    assert list((built_tiny.cache / vec_isa.FOLDER).rglob("*.json")), "the shared build remembered no probe"
    fresh = new_project(tmp_path)
    shutil.copytree(built_tiny.cache / vec_isa.FOLDER, fresh.cache / vec_isa.FOLDER)
    assert_ok(fresh.export("model=tiny_lm", "target=cpu"))
    assert set(fresh.statuses().values()) == {"ran"}
    after = _probe_counts(fresh)
    # (A compile in a worker that compiled before asks nothing: torch keeps answers per process.)
    assert after.keys() == before.keys() and sum(c["remembered"] for c in after.values()) > 0
    # Every probe has its answer from the cache: torch builds and loads none.
    assert sum(c["checked"] for c in after.values()) == 0 and _probe_children(fresh) == []
    for name in ("model.pte", "aoti_cpu_blob.ptd"):
        digest = lambda p: hashlib.sha256((p.build_dir / name).read_bytes()).hexdigest()
        assert digest(fresh) == digest(built_tiny), name
