"""Real tiny_lm builds for the explain / cache / cli tests, made once per test run and copied.

`tiny_lm_build()` is the run's one `doit export model=tiny_lm target=cpu` (conftest.tiny_build);
`scripted_builds()` copies it and adds three logged builds: a no-op, a one-method spec change, and a
rebuild after `rm -rf build`. Tests that change a project or its cache work on a `copy()`.
"""

from __future__ import annotations

import shutil

from conftest import Project, assert_ok, shared_build, tiny_build

BUILD = ("model=tiny_lm", "target=cpu")
SPEC_CHANGE = "decode.emulate_precision_casts=OFF"  # compile-only, and a quick compile (max_autotune takes ~30 s)



def tiny_lm_build(tmp_path_factory) -> Project:
    """The run's one real build (read-only: copy it to change it)."""
    return tiny_build(tmp_path_factory)


def scripted_builds(tmp_path_factory) -> Project:
    """A copy of the build with three more logged builds: no-op, SPEC_CHANGE, rm -rf build + rebuild
    (made once per test run, like the build: conftest.shared_build)."""
    def script(folder):
        scripted = tiny_lm_build(tmp_path_factory).copy(folder)
        assert_ok(scripted.export(*BUILD))
        assert_ok(scripted.export(*BUILD, SPEC_CHANGE))
        shutil.rmtree(scripted.root / "build")
        assert_ok(scripted.export(*BUILD))
        return scripted

    return shared_build("scripted", tmp_path_factory, script)
