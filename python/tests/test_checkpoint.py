"""gradagg.Checkpoint: the C++ Checkpoint's envelope and guarantees from Python.

A round trip is bit for bit; a damaged, truncated or foreign file, another model,
optimizer or settings are a CheckpointError naming the file and change nothing; a
bad path fails at construction; a failed save keeps the previous file and leaves
no temporary one. Resuming: test_resume.py.
"""
import io
import os
import random
import shutil
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

import gradagg
from gradagg import Checkpoint, CheckpointError
from models import data, mlp

PYTHONPATH = os.pathsep.join(p for p in sys.path if p)
MAGIC = b"GRADAGG CKPT v1\n"
SETTINGS = {"seed": 7, "batch": 24, "data": "models.data(24)"}


def crc64_xz(data_bytes):
    """CRC-64/XZ (ECMA-182 reflected), written here independently of the library."""
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0xC96C5795D7870F42 if c & 1 else c >> 1
        table.append(c)
    crc = 0xFFFFFFFFFFFFFFFF
    for b in data_bytes:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFFFFFFFFFF


def trained(seed=7, steps=3, batchnorm=True):
    """A model with buffers, Adam and StepLR after `steps` single-process steps."""
    model = mlp(seed=seed, batchnorm=batchnorm)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    x, y = data(24)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
    return model, opt, sched


def tensors_of(model, opt):
    """Every parameter, buffer and optimizer state tensor, cloned, in a fixed order."""
    out = [t.detach().clone() for t in model.state_dict().values()]
    for state in opt.state_dict()["state"].values():
        out += [v.clone() for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
    return out


def identical(a, b):
    return len(a) == len(b) and all(torch.equal(s, t) and s.dtype == t.dtype
                                    for s, t in zip(a, b))


def expect_error(fn, path, *fragments):
    with pytest.raises(CheckpointError) as e:
        fn()
    assert e.value.path == str(path)
    assert str(path) in str(e.value)
    for fragment in fragments:
        assert fragment in str(e.value)
    return e.value


# -- round trip and file format --------------------------------------------------------------

def test_a_round_trip_restores_model_adam_steplr_and_rng_bit_for_bit(tmp_path):
    model, opt, sched = trained(steps=3)
    ckpt = Checkpoint(tmp_path / "run.ckpt")
    torch.manual_seed(123)
    random.seed(456)
    torch_rng, python_rng = torch.get_rng_state(), random.getstate()
    ckpt.save(model, opt, step=3, scheduler=sched, user={"epoch_loss": 0.25, "cursor": 72},
              settings=SETTINGS)

    other, other_opt, other_sched = trained(seed=99, steps=1)
    torch.manual_seed(0)
    random.seed(0)
    state = ckpt.load(other, other_opt, scheduler=other_sched, settings=dict(SETTINGS))
    assert (state.step, state.user, state.settings) == (3, {"epoch_loss": 0.25, "cursor": 72},
                                                        SETTINGS)
    assert state.identity == ckpt.identity()
    assert identical(tensors_of(other, other_opt), tensors_of(model, opt))
    assert other_sched.state_dict() == sched.state_dict()
    assert other_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.005
    assert torch.equal(torch.get_rng_state(), torch_rng) and random.getstate() == python_rng

    # Both go on identically: the optimizer's moments and step counts came back too.
    x, y = data(24, seed=5)
    for m, o, s in ((model, opt, sched), (other, other_opt, other_sched)):
        o.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.step()
        s.step()
    assert identical(tensors_of(other, other_opt), tensors_of(model, opt))


def test_the_file_is_the_cpp_envelope_and_identity_is_its_crc_and_length(tmp_path):
    assert crc64_xz(b"123456789") == 0x995DC9BBDF1939FA  # the catalogue's check value
    path = tmp_path / "run.ckpt"
    ckpt = Checkpoint(path)
    assert (ckpt.path, ckpt.exists(), ckpt.identity()) == (str(path), False, "")
    model, opt, _ = trained()
    ckpt.save(model, opt, step=3)
    ckpt.wait()  # the writer thread's file is in place
    raw = path.read_bytes()
    length, crc = struct.unpack("<QQ", raw[16:32])
    assert raw[:16] == MAGIC and length == len(raw) - 32
    assert crc == crc64_xz(raw[32:])
    assert ckpt.exists() and ckpt.identity() == f"{crc:016x}-{length:x}"
    # No probe, no temporary file; the lock is there while ckpt lives.
    assert sorted(os.listdir(tmp_path)) == ["run.ckpt", "run.ckpt.lock"]


def test_a_read_only_checkpoint_loads_but_does_not_save(tmp_path):
    path = tmp_path / "run.ckpt"
    model, opt, _ = trained()
    Checkpoint(path).save(model, opt, step=3)
    ro = Checkpoint(path, read_only=True)
    assert ro.load(model, opt).step == 3
    before = path.read_bytes()
    expect_error(lambda: ro.save(model, opt, step=4), path, "read-only")
    assert path.read_bytes() == before
    # A read-only checkpoint of a missing directory is fine until it is read.
    missing = tmp_path / "nowhere" / "run.ckpt"
    expect_error(lambda: Checkpoint(missing, read_only=True).load(model), missing,
                 "cannot be opened")


# -- damaged and foreign files ---------------------------------------------------------------

@pytest.fixture
def saved(tmp_path):
    """A good checkpoint's bytes, and a model + optimizer that differ from it."""
    model, opt, sched = trained()
    good = tmp_path / "good.ckpt"
    Checkpoint(good).save(model, opt, step=3, scheduler=sched, settings=SETTINGS)
    other, other_opt, other_sched = trained(seed=99, steps=1)
    return good.read_bytes(), other, other_opt, other_sched


def offsets(size):
    """Header bytes (magic, length, CRC), the first and last content bytes, and 24 drawn ones."""
    rng = random.Random(size)
    return sorted({0, 7, 15, 16, 20, 23, 24, 31, 32, 33, size // 2, size - 1}
                  | {rng.randrange(32, size) for _ in range(24)})


def test_a_flipped_byte_anywhere_is_a_checkpoint_error_naming_the_file(tmp_path, saved):
    raw, model, opt, sched = saved
    before = tensors_of(model, opt)
    bad = tmp_path / "bad.ckpt"
    ckpt = Checkpoint(bad)
    for offset in offsets(len(raw)):
        for bit in (0, 7):
            flipped = bytearray(raw)
            flipped[offset] ^= 1 << bit
            bad.write_bytes(bytes(flipped))
            expect_error(lambda: ckpt.load(model, opt, scheduler=sched, settings=SETTINGS), bad)
            expect_error(ckpt.identity, bad)
    assert identical(tensors_of(model, opt), before)
    bad.write_bytes(raw)
    assert ckpt.load(model, opt, scheduler=sched, settings=SETTINGS).step == 3


def test_a_truncated_file_is_a_checkpoint_error_naming_the_file(tmp_path, saved):
    raw, model, opt, sched = saved
    before = tensors_of(model, opt)
    bad = tmp_path / "bad.ckpt"
    for n in (0, 1, 15, 16, 31, 32, 33, len(raw) // 2, len(raw) - 1):
        bad.write_bytes(raw[:n])
        e = expect_error(lambda: Checkpoint(bad).load(model, opt, settings=SETTINGS), bad)
        assert any(w in str(e) for w in ("not a gradagg checkpoint", "truncated")), str(e)
    bad.write_bytes(raw + b"\0")  # one byte too many is as wrong
    expect_error(lambda: Checkpoint(bad).load(model, opt, settings=SETTINGS), bad, "truncated")
    assert identical(tensors_of(model, opt), before)


def test_files_that_are_not_python_checkpoints_are_named(tmp_path, saved):
    _, model, opt, _ = saved
    before = tensors_of(model, opt)
    path = tmp_path / "other"
    path.write_text("epoch,loss\n1,0.5\n")
    expect_error(lambda: Checkpoint(path).load(model), path, "is not a gradagg checkpoint")
    # Intact envelopes around foreign content.
    gradagg._core._write_durably(str(path), b"not a pickle at all")
    expect_error(lambda: Checkpoint(path).load(model), path, "cannot be parsed")
    Checkpoint(path).identity()  # the envelope itself is fine
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict()}, buffer)
    gradagg._core._write_durably(str(path), buffer.getvalue())
    expect_error(lambda: Checkpoint(path).load(model), path,
                 "is not a gradagg Python checkpoint v1 file")
    missing = tmp_path / "never.ckpt"
    expect_error(lambda: Checkpoint(missing).load(model), missing, "cannot be opened")
    assert identical(tensors_of(model, opt), before)


# -- what does not fit -----------------------------------------------------------------------

def test_another_model_is_named_with_both_shapes_and_nothing_changes(tmp_path, saved):
    raw, _, _, _ = saved
    path = tmp_path / "run.ckpt"
    path.write_bytes(raw)
    ckpt = Checkpoint(path)

    def attempt(model, fragments):
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        before = tensors_of(model, opt)
        expect_error(lambda: ckpt.load(model, opt, settings=SETTINGS), path, *fragments)
        assert identical(tensors_of(model, opt), before)

    wide = mlp(batchnorm=True)
    wide[3] = torch.nn.Linear(8, 4)  # the output layer: [3, 8] saved, [4, 8] here
    attempt(wide, ["'3.weight' is [3, 8] torch.float32 there, [4, 8] torch.float32 in this "
                   "model"])
    attempt(mlp(batchnorm=True, dtype=torch.float64),
            ["'0.weight' is [8, 5] torch.float32 there, [8, 5] torch.float64 in this model"])
    attempt(mlp(batchnorm=False), ["holds no '2.weight' ([3, 8] torch.float32 in this model)"])
    untracked = mlp(batchnorm=True)
    untracked[1] = torch.nn.BatchNorm1d(8, track_running_stats=False)  # no running stats
    attempt(untracked, ["holds '1.running_mean' ([8] torch.float32), which this model does "
                        "not have"])
    deeper = torch.nn.Sequential(*mlp(batchnorm=True), torch.nn.Linear(3, 2))
    attempt(deeper, ["holds no '4.weight' ([2, 3] torch.float32 in this model)"])


def test_another_optimizer_or_scheduler_is_named_and_nothing_changes(tmp_path, saved):
    raw, model, _, _ = saved
    path = tmp_path / "run.ckpt"
    path.write_bytes(raw)
    ckpt = Checkpoint(path)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = tensors_of(model, sgd)
    expect_error(lambda: ckpt.load(model, sgd, settings=SETTINGS), path,
                 "holds the state of a torch.optim.adam.Adam, this optimizer is a "
                 "torch.optim.sgd.SGD")
    half = torch.optim.Adam(list(model.parameters())[:2], lr=0.01)
    expect_error(lambda: ckpt.load(model, half, settings=SETTINGS), path,
                 "parameter group 0 has 6 parameters there, 2 in this optimizer")
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(adam, T_max=10)
    expect_error(lambda: ckpt.load(model, adam, scheduler=cosine, settings=SETTINGS), path,
                 "this scheduler is a torch.optim.lr_scheduler.CosineAnnealingLR")
    assert identical(tensors_of(model, sgd), before)
    assert adam.state_dict()["state"] == {} and cosine.last_epoch == 0

    # Saved without an optimizer: loading one is refused; loading without one is fine.
    bare = tmp_path / "bare.ckpt"
    Checkpoint(bare).save(model, step=1)
    expect_error(lambda: Checkpoint(bare).load(model, adam), bare, "holds no optimizer state")
    assert Checkpoint(bare).load(model).step == 1


@pytest.mark.parametrize("damage,fragment", [
    (lambda c: c.update(torch_rng=torch.full_like(c["torch_rng"], 0xAB)),
     "its torch random state is not valid"),
    (lambda c: c.update(torch_rng=torch.zeros(7, dtype=torch.uint8)),
     "its torch random state is not valid"),
    (lambda c: c.update(python_rng=(3, (1, 2), None)), "its Python random state is not valid"),
    (lambda c: c.update(settings=None), "its 'settings' is builtins.NoneType, not a dict"),
    (lambda c: c.update(optimizer=c["optimizer"]["state"]),
     "its 'optimizer' is builtins.dict, not None or a dict of 'type' and 'state'"),
    (lambda c: c.update(scheduler=[1]), "its 'scheduler' is builtins.list"),
    (lambda c: c.update(step=-1), "its 'step' is -1, not an int >= 0"),
], ids=["garbage-torch-rng", "short-torch-rng", "python-rng", "settings-none",
        "optimizer-unwrapped", "scheduler-list", "negative-step"])
def test_a_malformed_entry_is_a_checkpoint_error_and_changes_nothing(tmp_path, saved, damage,
                                                                     fragment):
    # A file intact as an envelope and a pickle whose content save() never writes: load()
    # raises CheckpointError naming it before anything changes (the parameters, the
    # optimizer, the scheduler, torch's and Python's random states).
    raw, model, opt, sched = saved
    content = torch.load(io.BytesIO(raw[32:]))
    damage(content)
    buffer = io.BytesIO()
    torch.save(content, buffer)
    path = tmp_path / "damaged.ckpt"
    gradagg._core._write_durably(str(path), buffer.getvalue())
    before, sched_before = tensors_of(model, opt), sched.state_dict()
    torch_rng, python_rng = torch.get_rng_state(), random.getstate()
    with pytest.raises(CheckpointError) as e:
        Checkpoint(path).load(model, opt, scheduler=sched, settings=SETTINGS)
    assert identical(tensors_of(model, opt), before), "the parameters or the optimizer changed"
    assert sched.state_dict() == sched_before
    assert torch.equal(torch.get_rng_state(), torch_rng) and random.getstate() == python_rng
    assert e.value.path == str(path) and fragment in str(e.value)


def test_different_settings_are_named_with_both_values_and_nothing_changes(tmp_path, saved):
    raw, model, opt, sched = saved
    path = tmp_path / "run.ckpt"
    path.write_bytes(raw)
    ckpt = Checkpoint(path)
    before = tensors_of(model, opt)
    expect_error(lambda: ckpt.load(model, opt, settings=dict(SETTINGS, seed=8)), path,
                 "was written with seed = 7, this run has seed = 8")
    expect_error(lambda: ckpt.load(model, opt, settings={"seed": 7, "batch": 24}), path,
                 "was written with data = 'models.data(24)', this run does not set data")
    expect_error(lambda: ckpt.load(model, opt, settings=dict(SETTINGS, epochs=3)), path,
                 "was written with epochs = (not set), this run has epochs = 3")
    expect_error(lambda: ckpt.load(model, opt, settings=dict(SETTINGS, batch="24")), path,
                 "batch = 24, this run has batch = '24'")
    assert identical(tensors_of(model, opt), before)
    assert ckpt.load(model, opt, scheduler=sched, settings=SETTINGS).step == 3


# -- bad paths and failed saves --------------------------------------------------------------

def test_a_bad_path_fails_at_construction_naming_it(tmp_path):
    expect_error(lambda: Checkpoint(tmp_path / "nowhere" / "run.ckpt"),
                 tmp_path / "nowhere" / "run.ckpt", "cannot be used")
    expect_error(lambda: Checkpoint(tmp_path), tmp_path, "is a directory")
    (tmp_path / "file").write_text("x")
    expect_error(lambda: Checkpoint(tmp_path / "file" / "run.ckpt"),
                 tmp_path / "file" / "run.ckpt", "is not a directory")
    expect_error(lambda: Checkpoint(""), "", "the path is empty")
    with pytest.raises(gradagg.InvalidArgument):
        Checkpoint(3)
    if os.geteuid() != 0:  # root writes into a read-only directory anyway
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        expect_error(lambda: Checkpoint(ro / "run.ckpt"), ro / "run.ckpt", "cannot be written")
    assert sorted(os.listdir(tmp_path)) == ["file"] + (["ro"] if os.geteuid() != 0 else [])
    assert issubclass(CheckpointError, gradagg.FileError)
    assert issubclass(CheckpointError, gradagg.Error)


# Runs in a child: holds a writable Checkpoint of argv[1] until its stdin closes.
HOLDER = """
import sys
from gradagg import Checkpoint
c = Checkpoint(sys.argv[1])
print("holding", flush=True)
sys.stdin.read()
"""


def test_a_path_another_live_process_writes_is_refused_naming_it(tmp_path):
    path = tmp_path / "run.ckpt"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env=dict(os.environ, PYTHONPATH=PYTHONPATH))
    try:
        assert holder.stdout.readline() == "holding\n"
        with pytest.raises(CheckpointError) as e:
            Checkpoint(path)
        assert str(path) in str(e.value) and f"process {holder.pid}" in str(e.value)
        # Reading is not writing: a read-only Checkpoint of it is allowed.
        assert not Checkpoint(path, read_only=True).exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    # The holder is gone: its lock with it (removed, since it exited cleanly).
    assert holder.returncode == 0
    mine = Checkpoint(path)
    again = Checkpoint(path)  # one process: the two share the lock
    assert os.path.exists(str(path) + ".lock")
    del mine, again
    assert not os.path.exists(str(path) + ".lock")


# Runs in a child: a checkpoint is saved, then saving again fails for want of room
# (a file-size limit, or a tmpfs that holds one and a half checkpoints).
FULL_DISK = """
import os, resource, sys, torch
from gradagg import Checkpoint, CheckpointError
from test_checkpoint import big_training
path, limit, want = sys.argv[1], int(sys.argv[2]), sys.argv[3]
model, opt, x, y = big_training()
ckpt = Checkpoint(path)
ckpt.save(model, opt, step=1)
good = ckpt.identity()
if limit:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
opt.zero_grad()
torch.nn.functional.mse_loss(model(x), y).backward()
opt.step()
try:
    ckpt.save(model, opt, step=2)  # serialised here, written by the writer thread
    ckpt.wait()                     # which failed
    sys.exit("the second save did not fail")
except CheckpointError as e:
    if want not in str(e) or e.path != path or path not in str(e):
        sys.exit(f"unexpected error: {e!r} (path {e.path!r})")
if ckpt.identity() != good:
    sys.exit("the previous checkpoint changed")
if ckpt.load(model, opt).step != 1:
    sys.exit("the previous step is lost")
left = sorted(f for f in os.listdir(os.path.dirname(path))
              if f not in (os.path.basename(path), os.path.basename(path) + ".lock"))
if left:
    sys.exit(f"left behind: {left}")
print("ok")
"""


def big_training():
    """A model whose checkpoint spans many pages, trained one step (Adam has its moments)."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 64), torch.randn(16, 8)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return model, opt, x, y


@pytest.mark.parametrize("limit", ["file_size_limit", "full_tmpfs"])
def test_a_failed_save_keeps_the_previous_checkpoint_and_leaves_no_temporary_file(tmp_path,
                                                                                  limit):
    model, opt, _, _ = big_training()
    sizing = tmp_path / "size.ckpt"
    Checkpoint(sizing).save(model, opt, step=1)
    size = sizing.stat().st_size
    sizing.unlink()
    env = dict(os.environ, PYTHONPATH=PYTHONPATH)
    script = textwrap.dedent(FULL_DISK)
    if limit == "file_size_limit":
        path = tmp_path / "run.ckpt"
        cmd = [sys.executable, "-c", script, str(path), str(size // 2), "File too large"]
    else:
        mnt = tmp_path / "tmpfs"
        mnt.mkdir()
        room = (size * 3 // 2 // 4096 + 1) * 4096
        probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
        if probe.returncode != 0 or shutil.which("mount") is None:
            pytest.skip("a mount namespace needs root (unshare -m)")
        path = mnt / "run.ckpt"
        cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
               f'mount -t tmpfs -o size={room} tmpfs "$0" && exec "$@"', str(mnt),
               sys.executable, "-c", script, str(path), "0", "No space left on device"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
