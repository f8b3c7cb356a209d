"""gradagg.StopSignals: SIGINT, SIGTERM and SIGHUP ask the run to stop at the end of its
current step, write its stop checkpoint and return, instead of killing it::

    with gradagg.StopSignals() as stop:
        for epoch in range(state.position.epoch, epochs):
            for position in data.steps(epoch, state.position):
                if stop.requested:
                    break
                agg.step(position)
                opt.step()
            if stop.requested:
                break
            scheduler.step()
        if stop.requested:
            with stop.hold():              # a second signal waits for the file
                ckpt.save(model, opt, step=agg.steps_done, position=agg.position,
                          scheduler=scheduler)
                ckpt.wait()
            sys.exit(128 + stop.signal)

The handlers are the C++ ``gradagg::StopSignals``' (include/gradagg/stop_signals.h): the
first signal sets ``requested`` and ends a wait on other nodes ``patience`` seconds later
(gradagg.NodeFailed) while a step whose peers answer in time ends as usual; Python's own
SIGINT handler does not run meanwhile, so no KeyboardInterrupt lands in the middle of a
step or of a save. A second signal within a second is the same request delivered twice
(timeout(1), Ctrl-C reaching the whole job) and is ignored; a later one kills the process
(the signal's default action), except while a ``hold()`` lives: then it takes effect when
the hold ends. A signal ignored at start (SIGINT in a background job of a shell script,
SIGHUP under nohup) stays ignored, and SIGXFSZ is ignored while it lives (a file size limit is a CheckpointError).
One at a time, made on the main thread; leaving the ``with`` (or ``close()``) puts the
previous handlers back.
"""
import threading

from gradagg._core import _StopSignals
from gradagg.errors import InvalidArgument

__all__ = ["StopSignals"]


class StopSignals:
    """Stop signals as a request: ``requested``, ``signal``, ``hold()`` (see the module)."""

    def __init__(self, patience=0.1):
        if threading.current_thread() is not threading.main_thread():
            raise InvalidArgument(
                "gradagg.StopSignals: make it on the main thread (Python runs signal handlers "
                "there, and a handler installed from another thread would not be the "
                "program's)")
        if isinstance(patience, bool) or not isinstance(patience, (int, float)):
            raise InvalidArgument(
                f"patience: expected seconds >= 0, got {type(patience).__name__}")
        self._core = _StopSignals(float(patience))  # InvalidArgument while another lives

    @property
    def requested(self):
        """Whether a stop signal came."""
        return self._core.requested

    @property
    def signal(self):
        """The first stop signal's number (signal.SIGINT, SIGTERM, SIGHUP); 0 before one."""
        return self._core.signal

    def hold(self):
        """A context manager: while it lives, a second stop signal waits (for the stop
        checkpoint to be in place: save() and wait() inside it); it kills when the hold ends."""
        return self._core.hold()

    def close(self):
        """Puts the previous handlers back (idempotent)."""
        self._core.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        if self._core.closed:
            return "gradagg.StopSignals(closed)"
        return f"gradagg.StopSignals(requested={self.requested}, signal={self.signal})"
