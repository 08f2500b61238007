"""The errors every stage raises, each with its exit code: the one rule of the command line.

    1   problems found (damaged data, failed records above the rate, a lossy decode)
    2   usage or input: a wrong path or option, data made for another target or config
    75  stopped early and cleanly (a signal, a full disk): the same command resumes

A stage raises `UsageError` where the user must change what they asked for, `ProblemError`
where it found something wrong in what it read or ran (a damaged file, an engine that would
not start) and `Stopped` when it ends early but cleanly (its message names the command that
resumes); the command line maps any exception to its code with `exit_code`. Nothing the user
can meet is a bare ValueError (a test walks the library's raises). Below every other module:
imports nothing.
"""

from __future__ import annotations

EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_STOPPED = 75  # EX_TEMPFAIL


class EyasError(Exception):
    """An error a stage says in one line; `code` is its exit code."""

    code = EXIT_PROBLEMS


class UsageError(EyasError, ValueError):
    """What was asked cannot be done as asked: a wrong option or path, or data, a run or a
    directory made with another target or config (exit 2). A ValueError, so that callers
    that catch those keep doing so."""

    code = EXIT_USAGE


class ProblemError(EyasError, ValueError):
    """Something found wrong in what a stage read or ran: a damaged or inconsistent file,
    an engine that would not start, a step that could not be taken (exit 1). A ValueError,
    so that callers that catch those keep doing so."""

    code = EXIT_PROBLEMS


class Stopped(EyasError):
    """The stage stopped early and cleanly, everything committed kept (exit 75); the message
    ends with the command that resumes."""

    code = EXIT_STOPPED


def exit_code(exc: BaseException, default: int = EXIT_PROBLEMS) -> int:
    """The exit code of an exception: its class's where it is an EyasError; a missing file
    is a wrong path (2); else `default`."""
    if isinstance(exc, EyasError):
        return exc.code
    return EXIT_USAGE if isinstance(exc, FileNotFoundError) else default
