"""The CPU ISA answer (cudabuild.backend.vec_isa): recorded from torch's own check, used by later
compiles to skip it, and the same bytes either way."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from conftest import Project, assert_ok, new_project

torch = pytest.importorskip("torch")

from torch._inductor import config as inductor_config  # noqa: E402
from torch._inductor import cpu_vec_isa  # noqa: E402

from cudabuild.backend import vec_isa  # noqa: E402

x86_only = pytest.mark.skipif(vec_isa.answer_key() is None, reason="torch checks ISAs by building only on x86-64")


def _base_probes(project: Project) -> list[dict]:
    """The `python -c` children that load a probe library: one per ISA check torch made."""
    events = json.loads((project.build_dir / "trace.json").read_text())["traceEvents"]
    return [e for e in events if e.get("cat") == "tool" and "from ctypes import cdll" in e["args"].get("command", "")]


@x86_only
def test_an_answer_is_recorded_from_torchs_check_and_then_skips_it(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_VEC_ISA_OK", raising=False)
    with vec_isa.answered(tmp_path) as skipped:
        assert skipped is False and inductor_config.cpp.vec_isa_ok is None
        checked = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]  # what a compile asks
    saved, = (tmp_path / vec_isa.FOLDER).glob("*.json")
    answer = json.loads(saved.read_text())
    assert answer["valid"] == checked and answer["all_valid"] == (checked == answer["listed_by_cpu"])
    with vec_isa.answered(tmp_path) as skipped:
        assert skipped is answer["all_valid"]
        assert inductor_config.cpp.vec_isa_ok is (True if answer["all_valid"] else None)
    assert inductor_config.cpp.vec_isa_ok is None  # put back
    # An answer in which an ISA failed its check is not taken: compiles go on checking.
    saved.write_text(json.dumps(dict(answer, valid=answer["valid"][1:], all_valid=False)))
    with vec_isa.answered(tmp_path) as skipped:
        assert skipped is False and inductor_config.cpp.vec_isa_ok is None
    # Nor where the user says it: $TORCHINDUCTOR_VEC_ISA_OK wins.
    saved.write_text(json.dumps(answer))
    with inductor_config.patch({"cpp.vec_isa_ok": False}), vec_isa.answered(tmp_path) as skipped:
        assert skipped is None and inductor_config.cpp.vec_isa_ok is False


@x86_only
@pytest.mark.slow
def test_a_cold_build_that_knows_the_answer_skips_the_check_and_builds_the_same_bytes(built_tiny, tmp_path):
    answers = list((built_tiny.cache / vec_isa.FOLDER).glob("*.json"))
    assert answers, "the shared build's compiles recorded no answer"
    if not json.loads(answers[0].read_text())["all_valid"]:
        pytest.skip("an ISA this CPU lists fails torch's check here: compiles keep checking")
    probed = _base_probes(built_tiny)
    assert probed  # the shared build (an empty cache) made torch's check, child by child
    fresh = new_project(tmp_path)
    shutil.copytree(built_tiny.cache / vec_isa.FOLDER, fresh.cache / vec_isa.FOLDER)
    assert_ok(fresh.export("model=tiny_lm", "target=cpu"))
    assert set(fresh.statuses().values()) == {"ran"}
    assert len(_base_probes(fresh)) < len(probed)  # the ISAs' base checks were skipped
    for name in ("model.pte", "aoti_cpu_blob.ptd"):
        digest = lambda p: hashlib.sha256((p.build_dir / name).read_bytes()).hexdigest()
        assert digest(fresh) == digest(built_tiny), name
