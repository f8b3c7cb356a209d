"""gradagg for PyTorch: train one model with several forked worker processes.

The parent keeps the model and one optimizer. gradagg forks N persistent
workers once; every step each worker runs your shard function on its copy of
the model (forward and loss), backward writes its gradient into shared memory,
the gradients are summed in a fixed order and averaged by sample count, and the
result lands in your parameters' ``.grad``; then you call ``optimizer.step()``::

    import torch, gradagg
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    def shard(ctx):                      # runs in worker ctx.rank, on its copy of model
        x, y = xs[ctx.rank::ctx.workers], ys[ctx.rank::ctx.workers]
        return torch.nn.functional.mse_loss(model(x), y), len(x)
    with gradagg.Aggregator(model, shard, workers=4) as agg:
        for _ in range(100):
            agg.step()                   # model's .grad = full-batch mean gradient
            opt.step()

Errors are the classes of :mod:`gradagg.errors`, also exported here. Each
worker's part of every global batch of a dataset: :mod:`gradagg.data`
(``gradagg.data.ShardedBatches``), whose ``steps(epoch)`` gives the
:class:`BatchPosition` of each step for ``agg.step(position)``. A run that stops
and resumes: :class:`Checkpoint` (saved off the training thread) and
:class:`StopSignals` (Ctrl-C, SIGTERM and SIGHUP as a request to stop after the step).
"""

from gradagg.errors import (Error, InternalError, InvalidArgument, NodeFailed,  # noqa: F401
                            NonFiniteGradient, NotUsable, StepTimeout, WorkerDied, WorkerError,
                            WorkerFailed)
from gradagg._core import (NodeOptions, Options, ShardContext, StepReport,  # noqa: F401
                           WorkerReport, _Aggregator, __version__, BlasInfo, blas_info,
                           set_blas_threads, BatchPosition, worker_seed)
from gradagg.errors import CheckpointError, FileError  # noqa: F401
from gradagg.checkpoint import Checkpoint, TrainingState  # noqa: F401
from gradagg import data  # noqa: F401  (gradagg.data.ShardedBatches)
from gradagg.stop_signals import StopSignals  # noqa: F401
from gradagg.population import (CopyEvent, DecisionRng, MemberContext,  # noqa: F401
                                MemberSnapshot, Policy, PolicyInput, Population)

__all__ = [
    "Aggregator", "Options", "NodeOptions", "ShardContext", "StepReport", "WorkerReport",
    "Error", "InvalidArgument", "NotUsable", "InternalError", "WorkerError", "WorkerFailed",
    "NonFiniteGradient", "WorkerDied", "StepTimeout", "NodeFailed",
    "Checkpoint", "TrainingState", "FileError", "CheckpointError", "data",
    "Population", "Policy", "PolicyInput", "DecisionRng", "MemberContext", "CopyEvent",
    "MemberSnapshot", "BlasInfo", "blas_info", "set_blas_threads", "BatchPosition",
    "worker_seed", "StopSignals",
]


# The keyword options that are Options fields of the same name (nodes aside).
_OPTION_NAMES = ("workers", "weighting", "buffers", "threads_per_worker", "parent_threads",
                 "keep_worker_memory", "keep_parent_memory", "step_timeout", "shutdown_timeout",
                 "non_finite", "max_consecutive_skips",
                 "max_restarts", "accumulation_steps", "seed_workers", "seed",
                 "check_parameter_list", "start_step", "message_bytes")


class Aggregator(_Aggregator):
    """Forks ``workers`` workers that compute the gradient of ``model`` on their shards.

    ``model`` is a ``torch.nn.Module`` on the CPU with float32, float64,
    bfloat16 or float16 parameters, mixed as you like (a TorchScript
    ``ScriptModule`` too). Its parameters and buffers
    move into shared memory, keeping their identity: an optimizer created before
    or after sees the same tensors. Do not replace them afterwards (an error at
    the next step); create a new Aggregator for a new layout.

    ``shard(ctx)`` runs in worker ``ctx.rank`` (of ``ctx.workers``) for step
    ``ctx.step`` on that worker's copy of ``model`` and of everything else the
    parent had when it forked. It returns the loss of its shard (a scalar that
    requires grad; gradagg calls backward) or ``(loss, samples)``, the number of
    samples that loss averages over (default 1), which weights the mean. An
    exception it raises reaches the parent as :class:`WorkerFailed` with the
    rank and the traceback text; the aggregator stays usable.

    ``step()`` runs one step; ``step(position)`` runs it at a :class:`BatchPosition`
    of the data (``ShardedBatches.steps(epoch)``), which the shard functions read as
    ``ctx.position`` (``ShardedBatches.batch(ctx)`` reads that batch, whatever the
    steps before: leaving an epoch early does not shift the next one);
    ``step(message)`` or ``step(position, message)`` passes a dict the shard
    functions read as ``ctx.message``. ``.position`` is where the data go on (the
    position after the last ``step(position)``, a resumed checkpoint's, else
    (0, 0)): save it with the step. A position before it is an InvalidArgument.
    When every worker's gradient of a step was the same, bit for bit (they all
    read the same batch), gradagg prints a warning to stderr once.

    Keyword options (``gradagg::Options`` in C++):
      workers: worker processes (default 2).
      weighting: "samples" (w_i = n_i / sum n, the full-batch mean) or "equal" (1/N, as DDP).
      buffers: after a step the parent's buffers become worker 0's ("rank0"), the
        weighted "mean" of the workers', or stay as they were ("keep").
      threads_per_worker: intra-op threads per worker; 0: max(1, cores / workers).
      parent_threads: the parent's intra-op and BLAS threads while the aggregator
        lives (1: libgomp's spinning threads would take the workers' cores; -1:
        every core this process may use, for a long optimizer step; 0 leaves
        them alone); restored by close().
      keep_worker_memory: each worker keeps the memory its steps free for the next
        step (glibc malloc: no per-step mmap, page faults and zeroing of large
        temporaries; True).
      keep_parent_memory: the parent's heap does the same while the aggregator
        lives, for its optimizer step (True); restored by close() of the last one.
      step_timeout: seconds a worker may take for a step (300); then StepTimeout.
      shutdown_timeout: seconds close() waits for the workers before killing them (2).
      non_finite: "raise" (NonFiniteGradient) or "skip" (the step's .grad stay None).
      max_consecutive_skips: with "skip", more skipped steps in a row raise (10).
      max_restarts: a dead or late worker group is forked anew and the step redone,
        this many times (0: raise WorkerDied / StepTimeout).
      accumulation_steps: each step every worker runs shard() this many times
        (ctx.micro_step = 0..k-1) and the gradients add up before the one reduction:
        .grad is the mean gradient over all those micro-batches (DDP's no_sync()).
      seed_workers: each worker seeds torch's generator before its shard function
        with ``worker_seed(seed, rank, step)`` (True): dropout differs between the
        workers and a redone or resumed step draws the same numbers.
      seed: the run's seed; None (the default): ``torch.initial_seed()`` when the
        aggregator is made, so ``torch.manual_seed(args.seed)`` changes the
        workers' dropout as it does in one process (and a checkpoint's load,
        which restores torch's generator, gives the saved run's seed back).
        Python starts with a random torch seed: across nodes an unset seed is
        node 0's (a given one must be the same on every node).
      check_parameter_list: compare model.parameters() with the list at
        construction each step (True).
      start_step: the global step of the first step() (ctx.step, the workers'
        seeds, StepReport.step) (0). After ``Checkpoint.load()`` into the model it
        is the checkpoint's step (and ``.position`` its position) without it,
        so the resumed run is bit for bit the run that was never stopped;
        another value than the checkpoint's is an InvalidArgument. A load into
        the model of a live aggregator moves it there before its next step.
      message_bytes: room for the message of a step, ``step(message)`` (64 KiB).
      nodes: a :class:`NodeOptions` for several machines (default one node).

    Use it as a context manager, or call :meth:`close`: the workers are stopped and
    reaped, the model gets its own memory back, nothing is left in /dev/shm.
    """

    def __init__(self, model, shard, *, workers=2, weighting="samples", buffers="rank0",
                 threads_per_worker=0, parent_threads=1, keep_worker_memory=True,
                 keep_parent_memory=True, step_timeout=300.0, shutdown_timeout=2.0,
                 non_finite="raise", max_consecutive_skips=10,
                 max_restarts=0, accumulation_steps=1, seed_workers=True, seed=None,
                 check_parameter_list=True, start_step=0, message_bytes=65536, nodes=None):
        given = locals()
        options = Options()
        for name in _OPTION_NAMES:
            setattr(options, name, given[name])
        if nodes is not None:
            options.nodes = nodes
        for method in ("named_parameters", "named_buffers", "parameters", "train"):
            if not callable(getattr(model, method, None)):
                raise InvalidArgument(
                    f"model: expected a torch.nn.Module, got {type(model).__name__} "
                    f"(it has no {method}())")
        super().__init__(model, shard, options)
        self._constructed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        # One whose __init__ raised (a traceback's frames still hold it) has
        # no C++ Aggregator behind it: reading its properties would crash.
        if not self.__dict__.get("_constructed", False):
            return "gradagg.Aggregator(not constructed)"
        state = "usable" if self.usable else "closed"
        at = self.position
        return (f"gradagg.Aggregator(workers={self.workers}, steps_done={self.steps_done}, "
                f"position=({at.epoch}, {at.index}), {state})")
