"""The errors cudabuild reports to users: each one is a single line that says what, where and what to do.

Every failure a user can cause (bad model name, bad spec, a recipe that does not export, a corrupt
cache entry) is a `CudabuildError`; the command line prints `str(error)` alone, and a traceback only
with CUDABUILD_VERBOSE=1. Anything else reaching the top is a bug in cudabuild.

The classes compose their one line from its parts, as DVC's stage errors do: what (the setting, file
or stage, as the user wrote it), the problem, what was expected, and the fix (`compose`). A raise
site gives the parts, not the sentence: `InvalidOption("CUDABUILD_JOBS=x", expected="a whole number
of stages, 1 or more")` says `CUDABUILD_JOBS=x: expected a whole number of stages, 1 or more`. The
collected problems of a build's settings (options.check, a recipe's resolve) are lines composed the
same way.
"""

from __future__ import annotations

from typing import Optional


def compose(what: str, problem: str = "", expected: str = "", fix: str = "") -> str:
    """One line from its parts: `what: problem; expected EXPECTED; fix` (the parts given)."""
    text = what
    if problem:
        text += f": {problem}"
    if expected:
        text += f"{'; ' if problem else ': '}expected {expected}"
    if fix:
        text += f"; {fix}"
    return text


class CudabuildError(Exception):
    """A failure with a one-line, actionable message, composed from its parts (`compose`); a class
    that knows its own sentence (CorruptBlob, the cluster's) composes it from its own arguments."""

    def __init__(self, what: str = "", problem: str = "", *, expected: str = "", fix: str = ""):
        self.what, self.problem, self.expected, self.fix = what, problem, expected, fix
        super().__init__(compose(what, problem, expected, fix))


class UnknownModel(CudabuildError):
    pass


class UnknownTarget(CudabuildError):
    pass


class InvalidSpec(CudabuildError):
    pass


class InvalidOption(CudabuildError):
    pass


class InvalidConfig(InvalidOption):
    """Every problem of one build's settings (options, specs, a checkpoint's config.json and
    tensors). `problems` holds one line each; str() joins them on one line, so a printer that
    shows one line still shows them all."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))

    def __reduce__(self):  # pickled with its problems (a warm process hands it back)
        return type(self), (self.problems,)


class RecipeError(CudabuildError):
    """The recipe file itself is broken: a syntax error, an import error, no RECIPE."""


class ExportFailed(CudabuildError):
    pass


class CompileFailed(CudabuildError):
    pass


class VerifyFailed(CudabuildError):
    pass


class NoGpu(CudabuildError):
    pass


class DeviceTooSmall(CudabuildError):
    """A stage needs more of a device than the device has: said before the stage starts."""

    def __init__(self, stage: str, device: str, need: int, room: int, basis: str):
        self.stage, self.device, self.need, self.room, self.basis = stage, device, need, room, basis
        super().__init__(f"stage {stage} needs ~{need / 2**30:.1f} GiB of {device} memory ({basis}) and the device has "
                         f"{room / 2**30:.1f} GiB for one stage", fix="build on a larger device, or with fewer layers")

    def __reduce__(self):
        return type(self), (self.stage, self.device, self.need, self.room, self.basis)


class CorruptBlob(CudabuildError):
    """A stored blob no longer matches its sha256; it has been dropped and will be rebuilt.

    `name` is the file the blob was being copied to, when there was one.
    """

    def __init__(self, sha: str, name: Optional[str] = None):
        self.sha, self.name = sha, name
        blob = f"cached blob {sha[:12]}" + (f" for {name}" if name else "")
        super().__init__(f"{blob} failed its sha256 check; dropped, it will be rebuilt")

    def __reduce__(self):  # pickled with its arguments, not its message (doit's parallel workers)
        return type(self), (self.sha, self.name)


class MissingBlob(CudabuildError):
    pass


class CacheUnwritable(CudabuildError):
    """The cache could not be opened or written (a full disk, a read-only mount)."""


class InvalidRemote(CudabuildError):
    """$CUDABUILD_REMOTE or one of its companion variables does not parse."""


def one_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message, prefixed by its type when it is not ours."""
    text = str(exc).strip()
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if isinstance(exc, CudabuildError):
        return first
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def error_lines(exc: BaseException) -> list[str]:
    """What to print for an error: one line per problem it carries (a config with several wrong
    settings says each), else its one line."""
    problems = getattr(exc, "problems", None)
    return [str(p) for p in problems] if problems else [one_line(exc)]


class ClusterError(CudabuildError):
    """A build sent to a Dask cluster (`doit nightly cluster=...`) cannot go on; the message says why and what to do."""


class ClusterNeedsTier(ClusterError):
    def __init__(self, address: str, why: str = "none is set"):
        self.address, self.why = address, why
        super().__init__(f"cluster={address}: the workers hand their artifacts to the driver through the shared tier, "
                         f"and {why}; set CUDABUILD_REMOTE=redis://HOST:PORT/DB (or s3://BUCKET/PREFIX) here and "
                         "on every worker")

    def __reduce__(self):
        return type(self), (self.address, self.why)


class SchedulerUnreachable(ClusterError):
    def __init__(self, address: str, reason: str):
        self.address, self.reason = address, reason
        super().__init__(f"cannot reach the Dask scheduler at {address} ({reason}); start one (`dask scheduler`) "
                         "or fix cluster= / DASK_SCHEDULER_ADDRESS")

    def __reduce__(self):
        return type(self), (self.address, self.reason)


class NoWorkerOffers(ClusterError):
    def __init__(self, stage: str, resource: str, amount: float, address: str):
        self.stage, self.resource, self.amount, self.address = stage, resource, amount, address
        super().__init__(f"stage {stage} asks for {resource}={amount:g} and no worker of the cluster at {address} "
                         f"offers it; start one with `dask worker {address} --nthreads 1 --resources {resource}=1`")

    def __reduce__(self):
        return type(self), (self.stage, self.resource, self.amount, self.address)


class WorkerMismatch(ClusterError):
    """A worker would key a stage differently from its driver: another toolchain, project or checkpoint."""

    def __init__(self, stage: str, difference: str, same: str):
        self.stage, self.difference, self.same = stage, difference, same
        super().__init__(f"stage {stage}: {difference}; run the workers with the driver's {same}")

    def __reduce__(self):
        return type(self), (self.stage, self.difference, self.same)
