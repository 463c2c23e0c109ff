"""A build's disk at its peak, not only at rest (issue 52): what would have caught the 40-layer build
that filled its disk 757 s in with four or five copies of the weights.

- the reference's stored state holds no weight (only the buffers a method writes);
- the compile writes no weights blob of its own, not even in inductor's folder;
- sampled while a cold build runs, the disk it takes (the cache, build/, the work folders beside
  the cache, inductor's folders) never passes the weights twice over and a stated allowance for
  the code (.so, .pte, C++ objects) and the folders' small files;
- a build that cannot fit is refused before its first stage, in one line, with nothing written; so
  is one of new weights (another seed) after a build of the old, which stores them afresh;
- a disk that fills anyway is named the same way by whichever stage meets it (end to end in
  tests/test_hardening.py, on a real tmpfs).
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import assert_ok

MiB = 1 << 20


class _Module(torch.nn.Module):
    """A weight held as a buffer (as ExecuTorch's int4 experts are), and a state written in place."""

    def __init__(self):
        super().__init__()
        self.register_buffer("experts", torch.randn(4, 8))
        self.register_buffer("state", torch.zeros(1, 8))
        self.register_buffer("cache", torch.zeros(2, 8))

    def forward(self, x):
        self.state.copy_(self.state + x)
        self.cache[0].copy_(x[0])  # written through a view
        return x @ self.experts.t() + self.state.sum()


def test_the_reference_keeps_the_state_a_method_writes_and_no_weight():
    from cudabuild.backend import sampled_logits

    ep = torch.export.export(_Module(), (torch.randn(1, 8),))
    assert sampled_logits.program_buffers(ep) == ["cache", "state"]


def _du(*folders: Path) -> int:
    """What the files under `folders` take on the disk (a hole takes nothing), read while a build
    adds, moves and deletes them. Each file is counted once by its inode, as du does: a file moved
    from a work folder into the store while the walk is between the two would otherwise count twice
    (and did once, on a loaded machine); a copy is another inode, and counts again."""
    total, seen = 0, set()
    for folder in folders:
        for parent, _, names in os.walk(folder):  # a folder deleted while walked is skipped
            for name in names:
                try:
                    found = os.lstat(os.path.join(parent, name))
                except FileNotFoundError:
                    continue
                if not stat.S_ISLNK(found.st_mode) and (found.st_dev, found.st_ino) not in seen:
                    seen.add((found.st_dev, found.st_ino))
                    total += found.st_blocks * 512
    return total


def _fat_recipe(project) -> None:
    """tiny_lm with a vocabulary of 16k at width 256: 33 MB of weights, twice its code's files."""
    text = (project.root / "recipes" / "tiny_lm.py").read_text()
    fat = text.replace("TinyConfig(n_layers=options.layers)", "TinyConfig(n_layers=options.layers, dim=256, vocab_size=16384)")
    assert fat != text
    (project.root / "recipes" / "fat_lm.py").write_text(fat)


def test_a_cold_build_never_holds_its_weights_more_than_twice(project, tmp_path):
    """Every folder a cold build writes (the cache with its work folders, build/, inductor's) is
    sampled every 50 ms (a walk costs about 5 ms of a core; a copy of the weights lived seconds). At its peak they hold the weights at most twice (cached once, in the .ptd
    once), the code's files (.so, .pte, C++ objects, kept inductor folders: measured at rest, with
    the weights taken out) and half the weights more (a work folder's files on their way into the
    cache). Before issue 52 the compile's own blob, the blob stage's file and verify's copy each
    added a whole copy. And the compile leaves no weights blob of its own in inductor's folder."""
    _fat_recipe(project)
    inductor = tmp_path / "inductor"
    env = project.env(CUDABUILD_INDUCTOR_DIR=inductor, CUDABUILD_KEEP_INDUCTOR=1)
    folders = (project.cache, project.root / "build", inductor)
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.wait(0.05):
            peak[0] = max(peak[0], _du(*folders))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        # (The C++ wrappers at O0, their quickest compile: the files a build holds are the same.)
        assert_ok(project.export("model=fat_lm", "target=cpu", "layers=1", "compile_wrapper_opt_level=O0", env=env))
    finally:
        stop.set()
        sampler.join()
    assert not list(inductor.rglob("*_weights.blob")), "the compile wrote a weights blob of its own"
    weights = (project.root / "build" / "fat_lm" / "cpu" / "aoti_cpu_blob.ptd").stat().st_size
    at_rest = _du(*folders)
    code = at_rest - 2 * weights
    assert weights > 30 * MiB and 0 < code < weights, (weights, code)
    assert peak[0] <= 2.5 * weights + code, (peak[0], weights, code)


def test_a_build_that_cannot_fit_is_refused_before_its_first_stage(project):
    """qwen_moe's CPU form at 35b-a3b keeps its weights in bf16, about 70 GB at 40 layers: on a disk
    with less than 2.2 times that free, the build stops in one line before anything runs."""
    from cudabuild.models import qwen35_moe_plain
    from cudabuild.registry import load_recipe

    cpu = load_recipe(project.root, "qwen_moe").defaults("cpu")
    need = 2.2 * qwen35_moe_plain.weights_bytes(cpu.replace(size="35b-a3b", layers=0))
    if shutil.disk_usage(project.root.parent).free >= need:
        pytest.skip("this disk could hold a 35b-a3b CPU build")
    result = project.export("model=qwen_moe", "size=35b-a3b", "target=cpu")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cudabuild: error: qwen_moe/cpu (size=35b-a3b") and " needs about " in lines[0], lines
    assert "GB free" in lines[0] and "CUDABUILD_CACHE_DIR" in lines[0]
    assert not (project.root / "build").exists()


# A build's room, checked as `doit export` checks it before its first stage, for weights of 60% of
# the cache's free space (one copy fits, the build's two do not): "fits", or the refusal's line;
# and whether the check imported torch.
ROOM = """
import dataclasses, shutil, sys
from pathlib import Path
from cudabuild.config import load_config
from cudabuild.doit_tasks import check_room
from cudabuild.engine.room import NoRoom
from cudabuild.engine.runner import Runner
from cudabuild.engine.store import Store
store = Store()
config = load_config(Path.cwd(), dict(a.split("=", 1) for a in sys.argv[1:]), store)
runner = Runner(dataclasses.replace(config, weights_bytes=int(shutil.disk_usage(store.root).free * 0.6)), store, "t")
try:
    check_room(runner)
    print("ROOM fits")
except NoRoom as e:
    print("ROOM", e)
print("TORCH", "torch" in sys.modules)
"""


@pytest.mark.slow
def test_a_new_seed_after_a_build_is_checked_for_room_and_the_same_build_is_not(tiny_copy):
    """A built package no longer exempts a build: new weights (another seed) are stored in the cache
    and written into a new .ptd, and are checked; the same weights again are not (a no-op build
    decides no more than its stages' stamps, and imports no torch)."""
    def room(*settings):
        out = tiny_copy.run("-c", ROOM, "model=tiny_lm", "target=cpu", *settings).stdout.splitlines()
        return out[-2], out[-1]

    assert room() == ("ROOM fits", "TORCH False")
    refused, torch_loaded = room("seed=7")
    assert refused.startswith("ROOM tiny_lm/cpu (seed=7) needs about ") and " GB free" in refused, refused
    assert torch_loaded == "TORCH False"


def test_the_projection_counts_only_build_s_ptd_when_the_weights_are_cached(tmp_path):
    from cudabuild.engine import room

    free = shutil.disk_usage(tmp_path).free
    weights = int(free * 0.6)
    with pytest.raises(room.NoRoom, match=r"needs about .* GB of disk at .*and it has .* GB free; free space there"):
        room.check(weights, tmp_path / "cache", tmp_path / "build", "m/cuda")
    room.check(weights, tmp_path / "cache", tmp_path / "build", "m/cuda", weights_cached=True)  # a restore
    room.check(None, tmp_path / "cache", tmp_path / "build", "m/cuda")  # a recipe that says nothing


def test_a_full_disk_met_inside_a_library_is_named_as_the_caches_writer_names_it(tmp_path):
    """Inductor wraps the OSError of its write (InductorError: OSError: [Errno 28] ...) and the
    compile stage wraps that in its own line: the build says what the cache's writer says of a full
    disk instead. (tests/test_hardening.py fills a real tmpfs under a build, end to end.)"""
    from cudabuild.engine import room
    from cudabuild.errors import CompileFailed

    try:
        try:
            raise RuntimeError("InductorError: OSError: [Errno 28] No space left on device: '/x/model.wrapper.o'")
        except RuntimeError as inner:
            raise CompileFailed("method decode: AOTInductor compile failed: InductorError: OSError: [Errno 28]") from inner
    except CompileFailed as e:
        full = room.disk_full(e, tmp_path)
    assert full is not None
    line = str(room.full_disk_error("compile.decode", full, tmp_path / "cache"))
    assert line.startswith(f"cannot write to the cache at {tmp_path / 'cache'} while running stage compile.decode: "
                           "its disk is full"), line
    assert "CUDABUILD_CACHE_DIR" in line
    # Not every error is a full disk: one with room to spare and no errno 28 behind it is itself.
    assert room.disk_full(RuntimeError("unexpected pos 768 vs 662"), tmp_path) is None
