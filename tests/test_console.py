"""The console shows cudabuild's progress and summary only; what libraries print while a stage runs
goes to that stage's log, and a failed stage points at its log (cudabuild.engine.console: terminal, progress)."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import REPO, tiny_build_output, broken_recipe_text

from cudabuild.engine.console import terminal as console
from cudabuild.engine.console.progress import LiveProgress, PlainProgress, live_terminal

THIRD_PARTY = re.compile(r"Warning:|Failed to load|^[WI]\d{4} \d\d:\d\d|AUTOTUNE")


def test_a_builds_console_holds_no_third_party_output_and_its_logs_do(built_tiny, tmp_path_factory):
    result = tiny_build_output(tmp_path_factory)
    shown = (result.stdout + result.stderr).splitlines()
    assert [line for line in shown if THIRD_PARTY.search(line)] == []
    assert any(line.startswith("> compile decode") for line in shown) and "tiny_lm / cpu" in shown
    logs = built_tiny.build_dir / "logs"
    stages = [s["stage"] + (f".{s['method']}" if s["method"] else "") for s in built_tiny.manifest()["stages"]]
    assert sorted(p.stem for p in logs.glob("*.log")) == sorted(stages)  # every stage ran: one log each
    logged = "\n".join(p.read_text() for p in logs.glob("*.log"))
    assert THIRD_PARTY.search(logged), "the warnings the console did not show are in the stage logs"


def test_a_failing_stage_shows_its_log_and_the_lines_that_matter(project):
    broken = project.root / "recipes" / "broken_lm.py"
    text = broken_recipe_text(project)
    text = text.replace("    torch.manual_seed(options.seed)\n",
                        "    torch.manual_seed(options.seed)\n    print('building broken_lm, seed', options.seed)\n"
                        "    import warnings; warnings.warn('a third-party warning', FutureWarning)\n")
    broken.write_text(text)
    result = project.export("model=broken_lm", "target=cpu")
    assert result.returncode != 0
    out = (result.stdout + result.stderr).splitlines()
    error = next(i for i, line in enumerate(out) if line.startswith("cudabuild: error: [trace.decode]"))
    assert out[error + 1] == "  log: build/broken_lm/cpu/logs/trace.decode.log"
    log = project.root / "build/broken_lm/cpu/logs/trace.decode.log"
    tail = [line[4:] for line in out[error + 2:] if line.startswith("  | ")]
    assert tail and tail == console.lines_that_matter(log)  # the end of the log, without the noise
    assert any("broken_lm.py" in line and "if tokens.sum() > 0" in line for line in tail)  # torch's own pointer
    assert not any("a third-party warning" in line for line in out)  # a warning is not what matters
    assert "a third-party warning" in log.read_text() and "building broken_lm, seed 0" in log.read_text()
    # The timeline of a failed build is written too, up to the failure.
    timeline = json.loads((project.root / "build/broken_lm/cpu/trace.json").read_text())["traceEvents"]
    build = next(e for e in timeline if e["name"] == "build")
    assert build["args"]["failed"] == "trace.decode" and any(e["name"] == "trace.decode" for e in timeline)


def test_capture_takes_fd_level_output_and_the_console_still_reaches_the_terminal(tmp_path):
    log = tmp_path / "stage.log"
    script = textwrap.dedent(f"""
        import os, sys, warnings, logging
        sys.path.insert(0, {str(REPO)!r})
        from cudabuild.engine.console import terminal as console
        with console.capture(__import__('pathlib').Path({str(log)!r})):
            print('python print')
            os.write(1, b'fd one\\n')
            os.write(2, b'fd two\\n')
            warnings.warn('careful', UserWarning)
            logging.getLogger('lib').warning('library says hi')
            console.note('progress line')
        print('after')
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "  progress line\nafter\n" and done.stderr == ""
    text = log.read_text()
    for piece in ("python print", "fd one", "fd two", "UserWarning: careful", "library says hi"):
        assert piece in text


def test_lines_that_matter_drop_warnings_their_source_lines_and_library_noise(tmp_path):
    log = tmp_path / "x.log"
    log.write_text(
        "Failed to load /x/torchao/_C_mxfp8.so: Could not load this library\n"
        "/usr/lib/python3.12/copyreg.py:99: FutureWarning: `isinstance(treespec, LeafSpec)` is deprecated\n"
        "  return cls.__new__(cls, *args)\n"
        "W1201 09:16:00.288000 3586 torch/utils/_pytree.py:630] <enum 'KernelPreference'> is an Enum\n"
        "step 1 of 2\n\n"
        "Runtime error during autotuning: out of resources\n"
    )
    assert console.lines_that_matter(log) == ["step 1 of 2", "Runtime error during autotuning: out of resources"]
    assert console.lines_that_matter(log, last=1) == ["Runtime error during autotuning: out of resources"]


@pytest.mark.parametrize("argv, environ, streams", [
    ([], {}, False), (["export", "-v", "2"], {}, True), (["--verbosity=2"], {}, True),
    (["-v", "1"], {}, False), ([], {"CUDABUILD_VERBOSE": "1"}, True),
])
def test_streaming_is_asked_for_by_verbose_or_doits_verbosity_2(argv, environ, streams):
    assert console.streaming(argv, environ) is streams


def shows(stream, text: str, seconds: float = 600) -> bool:
    """Whether `text` appears in what `stream` was written, waiting for it (a thread writes it)."""
    deadline = time.monotonic() + seconds
    while text not in stream.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    return text in stream.getvalue()


def test_plain_progress_keeps_one_ticker_per_running_stage():
    # Under `doit -n 4 nightly` several stages run at once: one finishing must not silence another.
    stream = io.StringIO()
    progress = PlainProgress(stream, tick=0.05)
    progress.start("export:compile.decode", 76.0)
    progress.start("export:compile.prefill", None)
    assert shows(stream, "  compile.decode still running")  # its ticker ticked
    progress.finish("export:compile.decode", ok=True)
    ticks = stream.getvalue().count("  compile.prefill still running")
    deadline = time.monotonic() + 600
    while stream.getvalue().count("  compile.prefill still running") <= ticks and time.monotonic() < deadline:
        time.sleep(0.01)  # the other's ticker ticks on
    progress.close()
    lines = stream.getvalue().splitlines()
    done_at = next(i for i, line in enumerate(lines) if line.startswith("  compile.decode done in"))
    assert any(line.startswith("  compile.prefill still running") for line in lines[done_at + 1:])
    assert any(line.endswith("(its last run took 76s)") for line in lines if line.startswith("  compile.decode still"))


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_gets_rich_live_lines_with_the_last_runs_time(monkeypatch):
    monkeypatch.setenv("TERM", "xterm-256color")  # the terminal a live display is for (not the test run's)
    stream = FakeTerminal()
    assert live_terminal(stream, {}) and not live_terminal(stream, {"CI": "true"}) and not live_terminal(io.StringIO(), {})
    assert not live_terminal(stream, {"TERM": "dumb"})  # no cursor to move: plain lines
    progress = LiveProgress(stream)
    progress.start("export:compile.decode", 76.0)
    assert shows(stream, "last run 76s")  # drawn by rich's refresh thread
    progress.finish("export:compile.decode", ok=True)
    progress.close()
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", stream.getvalue())
    assert "compile decode" in shown and "last run 76s" in shown and "done in" in shown


def test_the_summary_says_what_an_option_means_and_what_the_saved_time_counts(tmp_path):
    """layers=0 is every layer, said where the options are; the cache's saving is stage time added
    up (stages that ran side by side add up to more than their build's wall time), and says so."""
    from cudabuild.engine.console.progress import print_summary

    manifest = {"model": "qwen_moe", "target": "cpu", "options": {"size": "tiny", "layers": 0, "checkpoint": ""},
                "outputs": {"model.pte": "x"},
                "stages": [{"stage": "compile", "method": m, "status": "cached", "seconds": 0.0, "saved_seconds": 70.0}
                           for m in ("decode", "prefill")]}
    out = io.StringIO()
    print_summary(manifest, 0.4, tmp_path, out=out, shown={"layers": "0 (every layer)"})
    lines = out.getvalue().splitlines()
    assert "  options: size=tiny, layers=0 (every layer)" in lines
    assert ("  ran 0, restored 0, cached 2; 0.4s total; the cache saved 140.0s of stage time (the served stages' runs, "
            "added up)") in lines


def test_a_finished_stage_names_its_running_time_beside_its_wait():
    """The progress line's time runs from the stage's start here (a worker's import, its turn
    included); the summary counts the stage's own work. A line names both, so the two agree."""
    from cudabuild.engine.console import progress

    outcome = {"export:export.decode": ("ran", 0.01), "export:compile.decode": ("restored", 0.01)}.get
    assert progress.done_words(8.8, ("ran", 3.2)) == "done in 8.8s (3.2s running, 5.6s importing and waiting)"
    stream = io.StringIO()
    plain = PlainProgress(stream, tick=600, outcome=outcome)
    for name in ("export:export.decode", "export:compile.decode", "export:probe"):
        plain.start(name, None)
        time.sleep(0.2)  # its worker importing, say
        plain.finish(name, ok=True)
    lines = stream.getvalue().splitlines()
    assert lines[1].startswith("  export.decode done in ") and lines[1].endswith("importing and waiting)")
    assert lines[3].startswith("  compile.decode restored in ")
    assert lines[5].startswith("  probe done in ") and lines[5].endswith("s")  # nothing known of it: one figure


def test_a_full_disk_shows_its_log_but_not_the_librarys_traceback_of_it(tmp_path):
    """A stage that met a full disk says it in one line (cudabuild.engine.room); the traceback a
    library printed of the same OSError (inductor's, when the compile met it first) is not shown
    after it. Any other failure shows the log's last lines."""
    import errno

    from cudabuild.engine import room
    from cudabuild.engine.console.progress import failure_lines
    from cudabuild.errors import CompileFailed

    log = tmp_path / "compile.prefill.log"
    log.write_text("Traceback (most recent call last):\n  File \"shutil.py\", line 144, in _fastcopy_sendfile\n"
                   "torch._inductor.exc.InductorError: OSError: [Errno 28] No space left on device\n")
    cache = tmp_path / "cache"
    full = room.full_disk_error("compile.prefill", OSError(errno.ENOSPC, "No space left on device", str(cache)), cache)
    said = failure_lines(log, tmp_path, error=full)
    assert said == "\n  log: compile.prefill.log"
    other = failure_lines(log, tmp_path, error=CompileFailed("method prefill: AOTInductor failed"))
    assert "InductorError: OSError: [Errno 28]" in other and other.startswith("\n  log: compile.prefill.log\n  | ")
