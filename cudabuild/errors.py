"""The errors cudabuild reports to users: each one is a single line that says what, where and what to do.

Every failure a user can cause (bad model name, bad spec, a recipe that does not export, a corrupt
cache entry) is a `CudabuildError`; the command line prints `str(error)` alone, and a traceback only
with CUDABUILD_VERBOSE=1. Anything else reaching the top is a bug in cudabuild.
"""


class CudabuildError(Exception):
    """A failure with a one-line, actionable message."""


class UnknownModel(CudabuildError):
    pass


class UnknownTarget(CudabuildError):
    pass


class InvalidSpec(CudabuildError):
    pass


class InvalidOption(CudabuildError):
    pass


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


class CorruptBlob(CudabuildError):
    """A stored blob no longer matches its sha256; it has been dropped and will be rebuilt."""


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
