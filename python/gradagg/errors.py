"""gradagg's exceptions: the C++ library's error types as Python classes.

Every one derives from :class:`Error`; :class:`InvalidArgument` is also a
:class:`ValueError`. Errors about one worker carry its ``rank`` and the
``phase`` it was in (e.g. ``"shard function"``, ``"backward"``); errors about
a file carry its ``path``.
"""


class Error(Exception):
    """Base of every gradagg error."""


class InvalidArgument(Error, ValueError):
    """Bad input: names the option, parameter or value, what was expected and what was got."""


class NotUsable(Error):
    """step() after close(), or after an error that stopped the workers."""


class InternalError(Error):
    """A broken invariant inside gradagg: a bug, please report it."""


class WorkerError(Error):
    """Anything that concerns one worker."""

    def __init__(self, message, rank=-1, phase=""):
        super().__init__(message)
        self.rank = rank    #: the worker's rank on this node
        self.phase = phase  #: where it was, e.g. "shard function"


class WorkerFailed(WorkerError):
    """The shard function raised or returned something unusable.

    The step is not applied; the workers live on and the aggregator stays usable.
    ``worker_message`` is what the worker reported: for a Python exception its
    traceback text (``traceback`` holds the same, else None).
    """

    def __init__(self, message, rank=-1, phase="", worker_message=""):
        super().__init__(message, rank, phase)
        self.worker_message = worker_message
        self.traceback = (worker_message
                          if "Traceback (most recent call last)" in worker_message else None)


class NonFiniteGradient(WorkerFailed):
    """A NaN or infinite gradient (or loss); ``parameter`` names it ("" for the loss)."""

    def __init__(self, message, rank=-1, phase="", worker_message="", parameter=""):
        super().__init__(message, rank, phase, worker_message)
        self.parameter = parameter


class WorkerDied(WorkerError):
    """A worker process exited or was killed; the others were stopped."""

    def __init__(self, message, rank=-1, phase="", exit_status=-1, signal=0):
        super().__init__(message, rank, phase)
        self.exit_status = exit_status  #: -1 when killed by a signal
        self.signal = signal            #: 0 when it exited


class StepTimeout(WorkerError):
    """A worker missed the step deadline; the workers were stopped."""


class NodeFailed(Error):
    """Across nodes: a peer node failed, stalled or diverged; ``node`` is this node's rank."""

    def __init__(self, message, node=0):
        super().__init__(message)
        self.node = node


class FileError(Error):
    """A file gradagg reads or writes failed; ``path`` names it, the reason is in the message."""

    def __init__(self, message, path=""):
        super().__init__(message)
        self.path = path  #: the file


class CheckpointError(FileError):
    """A checkpoint that cannot be written or read, or does not fit the model, optimizer or
    settings it is loaded into; ``path`` names the file. A failed save leaves the file as it
    was; a refused load leaves the model, optimizer and scheduler as they were."""
