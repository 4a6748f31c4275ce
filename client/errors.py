"""Errors of the Dilu client library: every one is a :class:`DiluError` whose ``str`` is one line
saying what happened, so a script can ``except DiluError as e: print(e)``.

The command line maps them onto exit codes (:data:`EXIT_CODES`): 1 the function (or a deploy)
failed, 2 bad input or a function that is not deployed, 3 no reply in time, 4 no capacity (a
deploy no GPU can take too),
5 NATS unreachable, 6 NATS refused what these credentials asked.
"""
from __future__ import annotations


class DiluError(Exception):
    """Base of the client's errors; the message is one line."""


class NotDeployed(DiluError):
    """``function`` is not deployed (no key in KV ``dilu-functions``); ``why``: more to say, e.g.
    that it was undeployed while a request waited in its queue."""

    def __init__(self, function: str, why: str = "") -> None:
        super().__init__(f"function {function!r} is not deployed" + (f" ({why})" if why else ""))
        self.function = function


class FunctionError(DiluError):
    """The function's code raised (or its instance failed the request); the message is the
    function's error as its instance reported it (e.g. ``ValueError: bad image``)."""


class InvocationTimeout(DiluError):
    """No final reply within the call's timeout (the request may still be served later)."""


class NoCapacity(DiluError):
    """The request was refused or dropped before any instance saw it (e.g. the invocation stream
    is full), or the function cannot be placed anywhere now and has no instance."""


class DeployError(DiluError):
    """A deploy (or undeploy) failed; the message is the reason the platform gave."""


class BadCode(DeployError):
    """The spec's code folder cannot be bundled (a file that is not a regular file, one that cannot
    be read, over the size limit); the message names it. Exit code 2, as for a bad spec."""


class NotAdmitted(DeployError):
    """The scheduler refused a deploy: no GPU of the cluster can take one instance of the
    function (memory, quota); the message is its reason. Exit code 4, as for no capacity."""


class BadRequest(DiluError):
    """The request was malformed or refused as such (by the client or an instance)."""


class Unreachable(DiluError):
    """NATS could not be reached (or the connection was lost for good)."""


class NotPermitted(DiluError):
    """NATS refused what these credentials asked (a permissions violation): credentials of
    another role, e.g. an integrator's where a caller's or the operator's are needed."""


EXIT_CODES: dict[type[DiluError], int] = {  # in order: the first class that matches decides
    NotAdmitted: 4,
    BadCode: 2,
    FunctionError: 1,
    DeployError: 1,
    BadRequest: 2,
    NotDeployed: 2,
    InvocationTimeout: 3,
    NoCapacity: 4,
    Unreachable: 5,
    NotPermitted: 6,
}


def exit_code(exc: DiluError) -> int:
    """The command-line exit code of ``exc`` (:data:`EXIT_CODES`; 1 for another DiluError)."""
    for kind, code in EXIT_CODES.items():
        if isinstance(exc, kind):
            return code
    return 1
