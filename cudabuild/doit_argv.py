"""What a doit command line holds, read as doit reads it, before doit has: its settings (NAME=VALUE)
and its words (a command, then task names).

Owns reading argv the way doit does; decides nothing about models or stages. No torch here.

    doit exprot model=tiny_lm             -> 'exprot' is not a task or a doit command; did you mean export?
    doit export model=tiny_lm layers=1 layers=3   -> layers=1 layers=3: layers is given 2 values; give layers once

dodo.py is loaded while doit runs, after doit took each NAME=VALUE word into a dict (the last value
of a name wins, silently) and before it looks the other words up as tasks (a word that names none
ends in doit's own four lines and exit status 3). doit has no hook for either, so cudabuild's task
creators ask here and say it in one line, with everything else that is wrong, before anything runs.
The words are found with doit's own option tables and parser (cmdparse), so an option's value
(`-n 2`, `--db-file x`) is never taken for a word.

`CommandLine.read(argv)` is the one reading: the command, its task words, doit's own options given
(`-n`, `-P`, `--db-file`, `--backend`, by doit's names for them), and the settings. cudabuild's
doit tasks (cudabuild.doit_tasks) ask it what they need before doit hands it over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

from cudabuild import options as option_table
from cudabuild.errors import compose

# doit's commands whose words are task names (`help` takes a topic, `dumpdb` and `tabcompletion` none).
TAKE_TASKS = ("run", "list", "info", "clean", "forget", "ignore", "strace", "reset-dep")


def settings(argv: list[str]) -> list[tuple[str, str]]:
    """Every NAME=VALUE word, in order, repeats kept: doit's rule (DoitMain.process_args)."""
    return [tuple(arg.split("=", 1)) for arg in argv if arg[:1] != "-" and "=" in arg]


@dataclass(frozen=True)
class CommandLine:
    """One doit command line, as doit reads it: what cudabuild's tasks need of it before doit hands
    it over (the worker count DOIT_CONFIG says, the database doit is about to open, the tasks asked
    for, a build's settings)."""

    argv: tuple[str, ...]
    command: str  # doit's command: `run` where none is named
    words: tuple[str, ...]  # the task names given
    settings: Mapping[str, str] = field(default_factory=dict)  # NAME=VALUE: the last value of a name wins
    options: Mapping[str, Any] = field(default_factory=dict)  # doit's own options given, by doit's names

    @classmethod
    def read(cls, argv: Iterable[str]) -> "CommandLine":
        argv = tuple(argv)
        command, found, given = _parsed(list(argv))
        return cls(argv, command, tuple(found), dict(settings(list(argv))), given)

    def requested(self, task: str) -> bool:
        """Whether the command line names `task` or one of its sub-tasks (`nightly:report`)."""
        return any(word == task or word.startswith(task + ":") for word in self.words)

    @property
    def builds(self) -> bool:
        """Whether doit runs tasks (`doit export ...` is `run`), rather than lists or cleans them."""
        return self.command == "run"

    def workers(self, default: int) -> int:
        """The worker count doit runs with: `-n N` (`--process N`), else `default`; doit's 0 (no
        worker processes) is one stage at a time, as 1 is."""
        given = self.options.get("num_process")
        return max(1, given) if isinstance(given, int) and given >= 0 else default


def words(argv: list[str]) -> tuple[str, list[str]]:
    """(the doit command, its words): the command `run` where none is named, as doit decides
    (DoitMain.run); the words after doit's options, up to the first option given after them
    (which doit refuses itself). No words where doit's own parser fails: doit says why."""
    command, found, _ = _parsed(argv)
    return command, found


def _parsed(argv: list[str]) -> tuple[str, list[str], dict[str, Any]]:
    """(the command, its words, doit's options given: {name: value}), by doit's own option tables
    and parser; no words and no options where the parser fails (doit then says why itself)."""
    from doit.cmd_base import DodoTaskLoader, DoitCmdBase
    from doit.cmdparse import CmdOption, CmdParse, CmdParseError
    from doit.doit_cmd import DoitMain

    commands = {cmd.get_name(): cmd for cmd in DoitMain.DOIT_CMDS}
    loader_options = list(DodoTaskLoader.cmd_options)
    try:  # loader options may come before the command's name
        _, args = CmdParse([CmdOption(o) for o in loader_options]).parse_only(argv)
    except CmdParseError:
        args = list(argv)
    args = [a for a in args if not (a[:1] != "-" and "=" in a)]
    name = args.pop(0) if args and args[0] in commands else "run"
    command = commands[name]
    declared = list(command.cmd_options)
    if issubclass(command, DoitCmdBase):
        declared = list(DoitCmdBase.base_options) + loader_options + declared
    try:  # no defaults: what is not None was given
        params, positional = CmdParse([CmdOption(dict(o, default=None)) for o in declared]).parse(args)
    except CmdParseError:
        return name, [], {}
    found = []
    for word in positional:
        if word.startswith("-"):
            break
        found.append(word)
    return name, found, {key: value for key, value in params.items() if value is not None}


def given_twice(argv: list[str]) -> list[str]:
    """A line per setting given two values (`layers=1 layers=3`), which doit would take the last of."""
    return option_table.given_twice(settings(argv))


def stray_words(argv: list[str], tasks: Iterable[str], settings_named: Mapping[str, str]) -> list[str]:
    """A line per word that is no task of `tasks` (nor a sub-task, `export:probe`), with the setting
    it likely meant (`settings_named`: a bare word that is a setting's value, e.g. {"tiny_lm":
    "model", "cpu": "target"}) or the task or command it is closest to (`exprot`: export)."""
    found: list[str] = []
    command, given = words(argv)
    if command not in TAKE_TASKS:
        return found
    tasks = list(tasks)
    for word in given:
        if word in tasks or word.partition(":")[0] in tasks and ":" in word:
            continue
        if word in settings_named:
            found.append(compose(f"'{word}' is not a task", fix=f"settings are NAME=VALUE: {settings_named[word]}={word}"))
            continue
        found.append(_not_a_task(word, command, tasks))
    return found


def _not_a_task(word: str, command: str, tasks: list[str]) -> str:
    from doit.doit_cmd import DoitMain

    commands = [cmd.get_name() for cmd in DoitMain.DOIT_CMDS]
    # The first word may be a mistyped command as well as a task; later ones only tasks.
    meant: Optional[str] = option_table.closest(word, tasks + (commands if command == "run" else []))
    what = "a task or a doit command" if command == "run" else f"a task (doit {command} TASK)"
    return compose(f"'{word}' is not {what}" + (f"; did you mean {meant}?" if meant else ""),
                   fix=f"tasks: {', '.join(tasks)} (`doit list` says what each does)")
