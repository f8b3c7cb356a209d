"""gradagg.Checkpoint: a training's state in one file, for Python.

The file is the C++ ``gradagg::Checkpoint``'s envelope (checkpoint/durable_file.h,
bound by the _core extension): written to ``<path>.tmp-<pid>.<n>``, fsync'ed,
renamed over ``<path>``, the directory fsync'ed; read back only after its length
and CRC-64 are checked, before ``torch.load`` parses a byte. Inside it is what
``torch.save`` makes of one dict: the model's state_dict, the optimizer's and the
scheduler's, the step and the data's position, torch's and Python's random
states, your ``user`` values and the ``settings`` a resume must share.

``save()`` returns once that content is serialised in memory; the C++
Checkpoint's writer thread writes the file while training goes on. One write at
a time: a save waits for the one before it; ``wait()`` waits for the last. A
failed write (a full disk, a file-size limit, an I/O error) leaves the file as
it was and is raised by the next ``save()``, ``wait()`` or ``load()``. Call
``wait()`` where the file must be in place (before the program exits with a
stop checkpoint, before copying the file); ``load()``, ``identity()`` and
``exists()`` wait for it themselves, and so does the interpreter's exit.

``load()`` checks that everything fits before it changes anything, then tells
the model's Aggregator that the run goes on from the checkpoint's step and
position: no ``start_step=`` to give (with an optimizer: a resume; weights alone are an initialisation and say
nothing). An Aggregator made after the load takes the checkpoint's step, position and torch
seed; one made before takes the step and position at its next step, and refuses (InvalidArgument)
where its workers' seed is not the checkpoint's or it spans several nodes. Every failure is a
:class:`CheckpointError` naming the file (its ``path``).

The content is a pickle: ``torch.load`` runs what it names. The CRC catches
damage, not intent, so load only checkpoints you (or your run) wrote.
"""
import atexit
import dataclasses
import io
import operator
import os
import random
import sys
import weakref

import torch

from gradagg._core import (BatchPosition, _check_writable, _CheckpointLock, _CheckpointWriter,
                           _note_resumed, _read_verified)
from gradagg.errors import CheckpointError, InvalidArgument

_FORMAT = "gradagg Python checkpoint v1"


@dataclasses.dataclass
class TrainingState:
    """What :meth:`Checkpoint.load` returns: where the run was and what it was started with."""

    step: int = 0  #: optimizer steps done in all (the model's Aggregator goes on from it)
    user: dict = dataclasses.field(default_factory=dict)  #: the ``user`` values given to save()
    settings: dict = dataclasses.field(default_factory=dict)  #: the saved settings
    identity: str = ""  #: the file's identity() (NodeOptions.resume_identity)
    #: The data's next batch (``Aggregator.position`` when saved): go on with
    #: ``data.steps(epoch, state.position)`` for ``epoch`` from ``state.position.epoch``. One
    #: saved at an epoch's last step is (epoch, steps_per_epoch): that epoch has no step left
    #: and the loop runs what followed it (its scheduler step) first. (0, 0) for a file saved
    #: without one. (Last, so that the fields before keep their places.)
    position: BatchPosition = dataclasses.field(default_factory=BatchPosition)


def _identity(crc, length):
    """The C++ Checkpoint::identity(): the content's CRC-64 and length in hex."""
    return f"{crc:016x}-{length:x}"


def _type_name(obj):
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def _describe(value):
    """A tensor as "[8, 5] torch.float32" (else its repr)."""
    if isinstance(value, torch.Tensor):
        return f"[{', '.join(str(s) for s in value.shape)}] {value.dtype}"
    return repr(value)


# Every Checkpoint with a write that may be in flight: the interpreter's exit waits for them
# (a forked worker leaves with _exit and never does).
_writing = weakref.WeakSet()


@atexit.register
def _wait_for_writes():
    for ckpt in list(_writing):
        try:
            ckpt.wait()
        except CheckpointError as e:
            print(f"{e} (nobody called Checkpoint.wait() to collect it)", file=sys.stderr)


def _own(value):
    """A tensor whose storage is its own: a view of a larger storage is copied (torch.save
    writes a view's whole storage), any other is serialised as it is (before save() returns:
    training never changes it under the writer)."""
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach()
    if (value.storage_offset() != 0 or not value.is_contiguous()
            or value.storage().nbytes() != value.numel() * value.element_size()):
        return value.clone()
    return value


def _same(a, b):
    try:
        return bool(a == b)
    except Exception:  # e.g. tensors, whose == is not a truth value
        return False


class Checkpoint:
    """A checkpoint file at ``path``: ``save()`` writes it whole or not at all,
    ``load()`` verifies it and refuses one that does not fit, changing nothing.

    Unless ``read_only``, the constructor checks that the file can be written (its
    directory exists and accepts a new file), so a bad path fails when the run
    starts, not at its first save, and takes the path's lock ``<path>.lock`` for
    as long as the object lives: another live process writing the same path is a
    :class:`CheckpointError` naming it (two objects of one path in one process
    share the lock; a forked child holds none); with ``read_only=True`` only ``load()``,
    ``exists()`` and ``identity()`` are allowed.

    ``save()`` hands the file to a writer thread and returns; ``wait()`` waits for it and
    raises its failure (see the module's docstring).
    """

    def __init__(self, path, *, read_only=False):
        try:
            self._path = os.fsdecode(os.fspath(path))
        except TypeError:
            raise InvalidArgument(
                f"path: expected a str or os.PathLike, got {type(path).__name__}") from None
        self._read_only = bool(read_only)
        self._lock = None
        self._real_path = os.path.realpath(self._path)
        self._writer = _CheckpointWriter()
        self._failure = None  # a failed write that identity() or exists() waited for
        if not self._read_only:
            _check_writable(self._path)
            # Two runs never write one path: the other live one is named (C++ CheckpointLock).
            self._lock = _CheckpointLock(self._path)

    @property
    def path(self):
        """The file, as given."""
        return self._path

    @property
    def read_only(self):
        return self._read_only

    def exists(self):
        """Whether there is a file at path (not whether it is intact: load() checks that),
        once the writes in flight to it are done."""
        self._settle_path()
        return os.path.exists(self._path)

    def identity(self):
        """The file's content CRC-64 and length in hex, as C++'s identity() ("" when there is no
        file), once the writes in flight to it are done; verifies the file as load() does."""
        if not self.exists():
            return ""
        payload, crc = _read_verified(self._path)
        return _identity(crc, len(payload))

    def save(self, model, optimizer=None, *, step, position=None, scheduler=None, user=None,
             settings=None):
        """Saves ``model``'s state_dict, ``optimizer``'s and ``scheduler``'s (when given), the
        ``step`` (optimizer steps done in all), the ``position`` of the data's next batch (a
        BatchPosition: ``agg.position``; None: (0, 0)), torch's default CPU generator and
        Python's ``random`` state, ``user`` (a dict of your own values: epoch sums...) and
        ``settings`` (a dict of what a resume must share: seed, batch, data...).

        It returns once the content is serialised in memory (training may change the model
        right after); a writer thread writes the file. First it waits for the previous save's
        write and raises its failure, if any. The file is replaced whole or not at all: on
        any failure (a full disk, a file-size limit, an I/O error) it keeps its previous
        content and CheckpointError names it, raised by the next save(), wait() or load().
        """
        if self._read_only:
            self._fail("was opened read-only (read_only=True): save() is not allowed")
        step = self._step(step)
        if position is None:
            position = BatchPosition()
        elif not isinstance(position, BatchPosition):
            raise InvalidArgument(
                f"position: expected a gradagg.BatchPosition or None, got "
                f"{type(position).__name__}")
        self._check_model_type(model)
        self._collect()
        content = {
            "format": _FORMAT,
            "step": step,
            "epoch": position.epoch,
            "index": position.index,
            "model": {k: _own(v) for k, v in model.state_dict().items()},
            "optimizer": None if optimizer is None else {
                "type": _type_name(optimizer), "state": optimizer.state_dict()},
            "scheduler": None if scheduler is None else {
                "type": _type_name(scheduler), "state": scheduler.state_dict()},
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "user": dict(user or {}),
            "settings": dict(settings or {}),
        }
        buffer = io.BytesIO()
        try:
            torch.save(content, buffer)
        except Exception as e:
            self._fail(f"serialising failed: {type(e).__name__}: {e}", e)
        self._writer.start(self._path, buffer.getvalue(), step)
        _writing.add(self)

    def wait(self):
        """Waits until the last save's file is in place; raises its CheckpointError (once)."""
        self._collect()

    def load(self, model, optimizer=None, *, scheduler=None, settings=None):
        """Verifies the file and loads it into ``model``, ``optimizer`` and ``scheduler`` (None:
        not loaded), restores torch's and Python's random states and returns a
        :class:`TrainingState`.

        ``settings`` must equal the saved ones key for key (a key missing on either side
        differs too). Before anything is changed, every parameter and buffer of ``model`` must
        be in the file with its shape and dtype, the optimizer and scheduler of the saved types
        and parameter groups, every entry well formed and the random states valid; else
        CheckpointError names the first that differs and both values, and nothing is changed.

        It waits for the writes in flight to the file first (raising this object's failure,
        if its last write failed: the file is then the one before it). Then, when an
        ``optimizer`` is loaded too (a resume), the Aggregator of ``model`` goes on from the
        checkpoint's step and ``position`` (``TrainingState.position``): ``start_step`` need
        not be given, and another than the checkpoint's is an InvalidArgument. Make the
        Aggregator after the load (it then takes the checkpoint's torch seed too).
        """
        self._check_model_type(model)
        self._settle_path()
        self._collect()
        payload, crc = _read_verified(self._path)  # a missing, truncated or corrupt file
        content = self._parse(payload)
        self._check_settings(content["settings"], dict(settings or {}))
        self._check_model(model, content["model"])
        self._check_optimizer(optimizer, content["optimizer"])
        self._check_scheduler(scheduler, content["scheduler"])
        self._apply(model, optimizer, scheduler, content)
        position = BatchPosition(content.get("epoch", 0), content.get("index", 0))
        if optimizer is not None:  # a resume; weights alone are an initialisation
            _note_resumed(model, content["step"], position.epoch, position.index, self._path)
        return TrainingState(step=content["step"], position=position, user=content["user"],
                             settings=content["settings"],
                             identity=_identity(crc, len(payload)))

    def __del__(self):
        # A failure that exists() or identity() waited for and nobody collected (the writer
        # prints its own uncollected one when it goes).
        failure = getattr(self, "_failure", None)
        if failure is not None:
            print(f"{failure} (nobody called Checkpoint.wait() to collect it)", file=sys.stderr)

    def __repr__(self):
        return f"gradagg.Checkpoint({self._path!r}{', read_only=True' if self._read_only else ''})"

    # -- what load() checks, in order -----------------------------------------------------

    def _parse(self, payload):
        try:
            content = torch.load(io.BytesIO(payload), map_location="cpu")
        except Exception as e:
            self._fail(f"cannot be parsed: {type(e).__name__}: {e}", e)
        keys = ("step", "model", "optimizer", "scheduler", "torch_rng", "python_rng", "user",
                "settings")
        if (not isinstance(content, dict) or content.get("format") != _FORMAT
                or any(k not in content for k in keys)):
            self._fail(f"is not a {_FORMAT} file (a C++ gradagg::Checkpoint is read by C++)")
        self._check_entries(content)
        return content

    def _check_entries(self, content):
        """Every entry of the kind save() writes, the random states valid: what load() then
        applies cannot fail halfway for a malformed entry."""
        def fail(key, expected):
            self._fail(f"its '{key}' is {_type_name(content[key])}, not {expected}")

        for key in ("step", "epoch", "index"):
            value = content.get(key, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                self._fail(f"its '{key}' is {value!r}, not an int >= 0")
        for key in ("model", "user", "settings"):
            if not isinstance(content[key], dict):
                fail(key, "a dict")
        for key in ("optimizer", "scheduler"):
            saved = content[key]
            if saved is not None and not (isinstance(saved, dict)
                                          and isinstance(saved.get("type"), str)
                                          and isinstance(saved.get("state"), dict)):
                fail(key, "None or a dict of 'type' and 'state'")
        optimizer = content["optimizer"]
        if optimizer is not None and not (
                isinstance(optimizer["state"].get("state"), dict)
                and isinstance(optimizer["state"].get("param_groups"), list)
                and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                        for g in optimizer["state"]["param_groups"])):
            self._fail("its optimizer state is not a torch.optim state_dict (state, "
                       "param_groups)")
        # On generators of their own: the process's states are set only once all fits.
        try:
            torch.Generator().set_state(content["torch_rng"])
        except Exception as e:
            self._fail(f"its torch random state is not valid: {type(e).__name__}: {e}", e)
        try:
            random.Random().setstate(content["python_rng"])
        except Exception as e:
            self._fail(f"its Python random state is not valid: {type(e).__name__}: {e}", e)

    def _apply(self, model, optimizer, scheduler, content):
        """Loads what the checks passed. Should a step still fail, the ones before it are
        undone (the optimizer, scheduler and random states: the model goes last)."""
        undo = []
        try:
            if optimizer is not None:
                before = optimizer.state_dict()  # its tensors: load_state_dict copies new ones
                optimizer.load_state_dict(content["optimizer"]["state"])
                undo.append(lambda: optimizer.load_state_dict(before))
            if scheduler is not None:
                scheduler_before = scheduler.state_dict()
                scheduler.load_state_dict(content["scheduler"]["state"])
                undo.append(lambda: scheduler.load_state_dict(scheduler_before))
            torch_rng, python_rng = torch.get_rng_state(), random.getstate()
            torch.set_rng_state(content["torch_rng"])
            random.setstate(content["python_rng"])
            undo.append(lambda: (torch.set_rng_state(torch_rng), random.setstate(python_rng)))
            model.load_state_dict(content["model"], strict=True)
        except Exception as e:
            for step in reversed(undo):
                step()
            self._fail(f"loading failed: {type(e).__name__}: {e}", e)

    def _check_settings(self, theirs, mine):
        for key, value in mine.items():
            if key not in theirs or not _same(theirs[key], value):
                saved = repr(theirs[key]) if key in theirs else "(not set)"
                self._fail(f"was written with {key} = {saved}, this run has {key} = {value!r}; "
                           f"resume with the settings of the run that saved it")
        for key, value in theirs.items():
            if key not in mine:
                self._fail(f"was written with {key} = {value!r}, this run does not set {key}")

    def _check_model(self, model, saved):
        mine = model.state_dict()
        for name, tensor in mine.items():
            if name not in saved:
                self._fail(f"holds no '{name}' ({_describe(tensor)} in this model): it is a "
                           f"checkpoint of another model")
            theirs = saved[name]
            if isinstance(tensor, torch.Tensor) != isinstance(theirs, torch.Tensor) or (
                    isinstance(tensor, torch.Tensor) and (theirs.shape != tensor.shape
                                                          or theirs.dtype != tensor.dtype)):
                self._fail(f"'{name}' is {_describe(theirs)} there, {_describe(tensor)} in this "
                           f"model")
        for name, theirs in saved.items():
            if name not in mine:
                self._fail(f"holds '{name}' ({_describe(theirs)}), which this model does not "
                           f"have: it is a checkpoint of another model")

    def _check_optimizer(self, optimizer, saved):
        if optimizer is None:
            return
        if saved is None:
            self._fail("holds no optimizer state (it was saved without an optimizer)")
        if saved["type"] != _type_name(optimizer):
            self._fail(f"holds the state of a {saved['type']}, this optimizer is a "
                       f"{_type_name(optimizer)}")
        groups, their_groups = optimizer.param_groups, saved["state"]["param_groups"]
        if len(groups) != len(their_groups):
            self._fail(f"holds {len(their_groups)} parameter groups, this optimizer has "
                       f"{len(groups)}")
        params = {}
        for i, (group, theirs) in enumerate(zip(groups, their_groups)):
            if len(group["params"]) != len(theirs["params"]):
                self._fail(f"parameter group {i} has {len(theirs['params'])} parameters there, "
                           f"{len(group['params'])} in this optimizer")
            params.update(zip(theirs["params"], group["params"]))
        # Per-parameter state (Adam's moments, SGD's momentum) of each parameter's shape.
        for index, state in saved["state"]["state"].items():
            param = params.get(index)
            for key, value in state.items():
                if (param is not None and isinstance(value, torch.Tensor) and value.dim() > 0
                        and value.shape != param.shape):
                    self._fail(f"optimizer state '{key}' of parameter {index} is "
                               f"{_describe(value)} there, the parameter is {_describe(param)} "
                               f"in this optimizer")

    def _check_scheduler(self, scheduler, saved):
        if scheduler is None:
            return
        if saved is None:
            self._fail("holds no scheduler state (it was saved without a scheduler)")
        if saved["type"] != _type_name(scheduler):
            self._fail(f"holds the state of a {saved['type']}, this scheduler is a "
                       f"{_type_name(scheduler)}")

    # -- helpers ------------------------------------------------------------------------------

    def _settle(self):
        """Waits for the write in flight; keeps its failure for the next save, wait or load."""
        if self._failure is None:
            try:
                self._writer.wait()
            except CheckpointError as e:
                self._failure = e

    def _settle_path(self):
        """Waits for every write in flight to this file in this process (another Checkpoint
        object of the same path too)."""
        for ckpt in list(_writing):
            if ckpt is self or ckpt._real_path == self._real_path:
                ckpt._settle()

    def _collect(self):
        """Waits for the write in flight and raises its failure (or one _settle kept)."""
        self._settle()
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def _fail(self, what, cause=None):
        raise CheckpointError(f"gradagg: checkpoint {self._path}: {what}", self._path) from cause

    @staticmethod
    def _step(step):
        try:
            step = operator.index(step)
        except TypeError:
            raise InvalidArgument(
                f"step: expected an int >= 0, got {type(step).__name__}") from None
        if step < 0:
            raise InvalidArgument(f"step: expected an int >= 0, got {step}")
        return step

    @staticmethod
    def _check_model_type(model):
        if not callable(getattr(model, "state_dict", None)) or not callable(
                getattr(model, "load_state_dict", None)):
            raise InvalidArgument(
                f"model: expected a torch.nn.Module, got {type(model).__name__}")
