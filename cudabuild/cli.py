"""The `cudabuild` command: say what a build would do and why, and look after the cache.

    cudabuild explain model=tiny_lm target=cpu decode.max_autotune=ON
    cudabuild report model=tiny_lm --last 5 --svg times.svg
    cudabuild cache stats --last 10
    cudabuild cache verify
    cudabuild cache gc --max-size 2G --max-age 30 [--dry-run]
    cudabuild warm [stop] [--all]
    cudabuild start model=qwen_moe target=cuda size=35b-a3b      # a build that outlives this command
    cudabuild status model=qwen_moe target=cuda size=35b-a3b
    cudabuild wait model=qwen_moe target=cuda size=35b-a3b --timeout 540

Building stays `doit export ...` (dodo.py). The project is $CUDABUILD_PROJECT or the current
directory, the cache $CUDABUILD_CACHE_DIR (default ~/.cache/cudabuild). A user error is one line
on stderr, `cudabuild: error: ...`, exit status 2; CUDABUILD_VERBOSE=1 adds the traceback. This
module parses argv and prints; the work is in explain.py, report.py and cache_admin.py. No torch here.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import Optional

from cudabuild import environment
from cudabuild.errors import CudabuildError, InvalidConfig, error_lines, one_line

# (command, one line): what `cudabuild --help` lists.
COMMANDS = (
    ("explain", "for each stage of a build: up to date, restorable from cache, or why it will run; builds nothing"),
    ("report", "the last builds' seconds and status per stage, as a table (and an SVG chart with --svg)"),
    ("cache stats", "entries and bytes in the cache; hits, restores, misses and time saved over the last builds"),
    ("cache verify", "re-hash every blob; drop corrupt ones and the records that named them"),
    ("cache gc", "evict least-recently-used entries that build/ does not reference, down to --max-size"),
    ("warm", "this cache's warm processes (torch imported, ready for the next build; --all: every cache's); `warm stop` ends them"),
    ("start", "`doit export SETTINGS` in a session of its own, which outlives this command (and the terminal)"),
    ("status", "the detached build of these settings: running, done or failed; the stages it finished; its log's end"),
    ("wait", "wait for the detached build to end; its exit status, or 124 if --timeout passes first"),
)


ABOUT = dict(COMMANDS)


class UsageError(CudabuildError):
    """A command line that does not parse."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage and exits; cudabuild errors are one line
        raise UsageError(f"{message} (see {self.prog} --help)")


def _parser() -> _Parser:
    listing = "\n".join(f"  {name:<14}{line}" for name, line in COMMANDS)
    parser = _Parser(
        prog="cudabuild", usage="cudabuild COMMAND [ARGS]", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"commands:\n{listing}\n\nBuild with `doit export model=NAME ...`; `cudabuild COMMAND --help` for details.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", help=argparse.SUPPRESS)

    explain = commands.add_parser(
        "explain", prog="cudabuild explain", description=ABOUT["explain"] + ".",
        usage="cudabuild explain model=NAME [target=auto|cpu|cuda] [OPTION=V] [SPEC=V] [METHOD.SPEC=V]",
    )
    explain.add_argument("settings", nargs="*", metavar="NAME=VALUE", help="as for doit export")

    report = commands.add_parser(
        "report", prog="cudabuild report", description=ABOUT["report"] + ", from the cache's build log.",
        usage="cudabuild report model=NAME [target=cpu|cuda] [--last N] [--svg PATH]",
    )
    report.add_argument("settings", nargs="*", metavar="NAME=VALUE", help="model=NAME, and target=T to pick one target")
    report.add_argument("--last", type=_count, default=5, metavar="N", help="the last N builds (default 5)")
    report.add_argument("--svg", metavar="PATH", help="also write a chart of them to PATH")

    cache = commands.add_parser("cache", prog="cudabuild cache", usage="cudabuild cache {stats,verify,gc} ...",
                                description="cache stats | verify | gc")
    cache_commands = cache.add_subparsers(dest="cache_command", metavar="{stats,verify,gc}")
    stats = cache_commands.add_parser("stats", prog="cudabuild cache stats", description=ABOUT["cache stats"] + ".")
    stats.add_argument("--last", type=_count, metavar="N", help="only the last N builds (default: all logged)")
    cache_commands.add_parser("verify", prog="cudabuild cache verify",
                              description=ABOUT["cache verify"] + ". Exit status 1 when something was dropped.")
    gc = cache_commands.add_parser(
        "gc", prog="cudabuild cache gc", description=ABOUT["cache gc"] + " and/or --max-age. Blobs named by a stamp "
        "under build/*/*/.stamps/ and those stamps' records are never evicted. Also deletes files that killed "
        "cache writes left without an entry (untouched for an hour).",
    )
    gc.add_argument("--max-size", metavar="SIZE", help="500M, 2G (powers of 1000), 1.5GiB (of 1024), or bytes; "
                    "default $CUDABUILD_CACHE_MAX_SIZE")
    gc.add_argument("--max-age", type=_days, metavar="DAYS", help="also evict entries not used for DAYS days")
    gc.add_argument("--dry-run", action="store_true", help="say what would be evicted and deleted; change nothing")
    gc.add_argument("--remote", action="store_true", help="bound the shared tier's object store instead, to --max-size: "
                    "evict its least-recently-used blobs that no record younger than --keep-days names")
    gc.add_argument("--keep-days", type=_days, default=7.0, metavar="DAYS",
                    help="with --remote: blobs named by records younger than DAYS days are kept (default 7)")
    warm = commands.add_parser("warm", prog="cudabuild warm", usage="cudabuild warm [stop] [--all]",
                               description=ABOUT["warm"] + ". Each build leaves one, idle for up to "
                               "$CUDABUILD_WARM_IDLE_SECONDS (900) before it ends.")
    warm.add_argument("action", nargs="?", choices=("list", "stop"), default="list")
    warm.add_argument("--all", action="store_true", help="every warm process of this user, not only this cache's")
    for name in ("start", "status", "wait"):
        detached = commands.add_parser(name, prog=f"cudabuild {name}", description=ABOUT[name] + ".",
                                       usage=f"cudabuild {name} model=NAME [NAME=VALUE ...]" + (" [--timeout S]" if name == "wait" else ""))
        detached.add_argument("settings", nargs="*", metavar="NAME=VALUE", help="as for doit export")
        if name == "wait":
            detached.add_argument("--timeout", type=_seconds, metavar="S", help="give up after S seconds (exit status 124)")
    return parser


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number of builds, got '{text}'")
    return int(text)


def _days(text: str) -> float:
    try:
        days = float(text)
    except ValueError:
        days = -1.0
    if days < 0:
        raise argparse.ArgumentTypeError(f"expected a number of days, got '{text}'")
    return days


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got '{text}'")
    return seconds


def _settings(pairs: list[str], command: str = "explain") -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not name:
            raise UsageError(f"{command} takes NAME=VALUE settings as doit export does (model=tiny_lm target=cpu), got '{pair}'")
        out[name] = value
    return out


def _config(args, command: str):
    """The build the settings name, checked as `doit export` checks them: the environment's
    problems (found by main), a setting given two values and every problem of the settings, in
    one InvalidConfig."""
    from cudabuild.config import load_reporting
    from cudabuild.engine.store import Store
    from cudabuild.options import given_twice

    settings = _settings(args.settings, command)
    found = args.environment_problems + given_twice(pair.partition("=")[::2] for pair in args.settings)
    try:
        store = Store()
    except CudabuildError as e:
        raise InvalidConfig(found + [line for line in error_lines(e) if line not in found]) from None
    try:
        return load_reporting(found, _project(), settings, store)
    finally:
        store.close()


def _project() -> Path:
    return Path(os.environ.get("CUDABUILD_PROJECT") or os.getcwd()).resolve()


def cmd_explain(args) -> int:
    from cudabuild.config import model_note
    from cudabuild.engine.explain import forecast, not_cached_words, not_in_cache
    from cudabuild.engine.runner import Runner
    from cudabuild.engine.store import Store

    config = _config(args, "explain")
    for note in (model_note(_project(), _settings(args.settings)), config.target_note):
        if note:
            print(note, file=sys.stderr)
    store = Store()
    try:
        runner = Runner(config, store, run_id="explain")
        lines = forecast(runner)
        missing = not_in_cache(runner, lines)
    finally:
        store.close()
    width = max(len(f.stage) for f in lines)
    print(f"{config.model} / {config.target}")
    for f in lines:
        print("  " + f.line(width))
    if missing:
        where = os.path.relpath(config.build_dir) if config.build_dir.is_relative_to(Path.cwd()) else str(config.build_dir)
        print(not_cached_words(where, len(missing), sum(f.verdict == "up to date" for f in lines)))
    return 0


def cmd_report(args) -> int:
    from cudabuild.engine.console import report
    from cudabuild.engine.files import atomic_write_text
    from cudabuild.engine.store import Store

    settings = _settings(args.settings, "report")
    if set(settings) - {"model", "target"} or "model" not in settings:
        raise UsageError(f"report takes model=NAME and optionally target=T, got '{' '.join(args.settings)}'")
    store = Store()
    try:
        builds = report.history(store.actions.build_log(), settings["model"], settings.get("target"), args.last)
    finally:
        store.close()
    if not builds:
        where = settings["model"] + (f"/{settings['target']}" if "target" in settings else "")
        raise UsageError(f"no logged builds of {where} in the cache {store.root}")
    print("\n".join(report.table(builds)))
    if args.svg:
        atomic_write_text(Path(args.svg), report.svg(builds, f"cudabuild: {settings['model']}, last {len(builds)} builds"))
        print(f"chart written to {args.svg}")
    return 0


def cmd_cache(args) -> int:
    from cudabuild.engine import cache_admin
    from cudabuild.engine.cache_admin import MAX_SIZE_ENV
    from cudabuild.engine.store import Store

    if args.cache_command is None:
        raise UsageError("cache needs a command: stats, verify or gc (see cudabuild cache --help)")
    if args.cache_command == "gc" and args.remote:
        print("\n".join(cache_admin.gc_remote(args.max_size, args.keep_days, args.dry_run)))
        return 0
    if args.cache_command == "gc":
        raw = args.max_size or os.environ.get(MAX_SIZE_ENV, "").strip() or None
        max_bytes = cache_admin.parse_size(raw, "--max-size" if args.max_size else MAX_SIZE_ENV) if raw else None
        if max_bytes is None and args.max_age is None:
            raise UsageError(f"cache gc needs --max-size SIZE or --max-age DAYS (or {MAX_SIZE_ENV} set)")
    store = Store()
    try:
        if args.cache_command == "stats":
            lines = cache_admin.stats(store, args.last).lines(store.root)
            if store.remote is not None:  # the shared tier: where it is and what it holds
                lines += store.remote.describe()
            status = 0
        elif args.cache_command == "verify":
            report = cache_admin.verify(store, _project())
            lines, status = report.lines(), 0 if report.clean else 1
        else:
            lines, status = cache_admin.gc(store, _project(), max_bytes, args.max_age, dry_run=args.dry_run).lines(), 0
    finally:
        store.close()
    print("\n".join(lines))
    return status


# How long `cudabuild warm stop` waits for the processes to be gone before it says which still finish a call.
WARM_STOP_SECONDS = 15.0


def cmd_warm(args) -> int:
    from cudabuild.engine import warm
    from cudabuild.engine.store import default_root

    cache = str(Path(default_root()).resolve())
    processes = [p for p in warm.running() if args.all or p.get("cache") == cache]
    whose = "" if args.all else " of this cache"
    if args.action == "stop":
        for process in processes:
            warm.stop(process)
        left = warm.wait_gone(processes, WARM_STOP_SECONDS)
        gone = len(processes) - len(left)
        others = 0 if args.all else sum(1 for p in warm.running() if p.get("cache") != cache)
        print(f"stopped {_processes(gone)}{whose}" + (f"; {others} of other caches run on (--all stops them)" if others else ""))
        if left:
            pids = ", ".join(str(p["pid"]) for p in left)
            print(f"{_processes(len(left))} still finishing a build's stage (pid {pids}): each exits once its stage is done")
        return 0
    if not processes:
        print(f"no warm process{whose}" + ("" if args.all else f" ({cache}); --all lists every cache's"))
        return 0
    for process in processes:
        mb = warm.resident_bytes(int(process["pid"])) / 1e6
        state = "starting (importing)" if process.get("starting") else f"{mb:.0f} MB resident"
        print(f"pid {process['pid']}  {state}  cache {process['cache']}  {', '.join(process['modules'])}")
    idle = warm.idle_seconds() / 60
    print(f"{_processes(len(processes))}{whose}, each ending after {idle:g} min idle; `cudabuild warm stop` ends "
          + ("them" if args.all else "them now, --all lists every cache's"))
    return 0


def _processes(count: int) -> str:
    return f"{count} warm process{'es' if count != 1 else ''}"


def cmd_detached(args) -> int:
    """start / status / wait: the build directory is the one `doit export` would use for these
    settings, and the record there must be of this build (its options and specs), not another's."""
    from cudabuild import detached

    config = _config(args, args.command)  # bad settings: one line each, now
    build_dir = config.build_dir
    build = detached.build_of(config.model, config.target, config.options, config.specs)
    if args.command == "start":
        from cudabuild.backend.toolchain import require_device

        require_device(config.target)  # the build would stop at once: say so here, and start nothing
        record, started = detached.start(build_dir, _project(), args.settings, build)
        verb = "started" if started else "already running"
        print(f"{verb}: pid {record['pid']}, log {build_dir / detached.LOG}; `cudabuild status` or `cudabuild wait` with the same settings")
        return 0
    detached.find(build_dir, build, args.settings)  # none of this build: one line, what the folder holds instead
    if args.command == "status":
        print("\n".join(detached.describe(build_dir)))
        return 0
    record = detached.wait(build_dir, args.timeout, build)
    if record is None:
        print(f"still running after {args.timeout:g} s", file=sys.stderr)
        return 124
    if not detached.is_of(record, build):  # another build of the folder started meanwhile: this one ended
        record = detached.find(build_dir, build, args.settings)
    print("\n".join(detached.describe(build_dir, record=record)))
    return int(record.get("rc", 1))


def _reader_left() -> int:
    """The reader of stdout closed it (`cudabuild cache stats | head -1`): end quietly, as `git log |
    head` does, with the status a process ended by SIGPIPE has (128 + 13). What is still buffered
    goes to /dev/null, or Python's exit would report the closed pipe once more."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if not argv:
            names = ", ".join(name for name, _ in COMMANDS)
            raise UsageError(f"no command given; commands: {names} (see cudabuild --help)")
        args = _parser().parse_args(argv)
        # Every CUDABUILD_* variable, before anything runs; a command that takes a build's settings
        # reports these with the settings' problems, in one go.
        args.environment_problems = environment.check()
        if args.environment_problems and args.command not in ("explain", "start", "status", "wait"):
            raise InvalidConfig(args.environment_problems)
        commands = {"explain": cmd_explain, "report": cmd_report, "warm": cmd_warm,
                    "start": cmd_detached, "status": cmd_detached, "wait": cmd_detached}
        status = commands.get(args.command, cmd_cache)(args)
        sys.stdout.flush()  # a reader that left early (`| head`) is found here, not at exit
        return status
    except BrokenPipeError:
        return _reader_left()
    except SystemExit as e:  # --help, which argparse ends with exit(0)
        return e.code if isinstance(e.code, int) else 0
    except CudabuildError as e:
        for line in error_lines(e):
            print(f"cudabuild: error: {line}", file=sys.stderr)
        if os.environ.get("CUDABUILD_VERBOSE"):
            traceback.print_exc()
        return 2
    except KeyboardInterrupt:
        print("cudabuild: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug in cudabuild, not in the user's input
        print(f"cudabuild: internal error: {one_line(e)} (CUDABUILD_VERBOSE=1 shows the traceback)", file=sys.stderr)
        if os.environ.get("CUDABUILD_VERBOSE"):
            traceback.print_exc()
        return 1
