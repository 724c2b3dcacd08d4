"""Buffers that share memory share it in the copies a recompute runs on (runtime/
buffer_copies.py, NOTE [ Buffers that share memory ]): a change the recompute makes
through one is read through the other, as in the forward; never silently apart."""
import gc

import pytest
import torch
from torch import nn

import actsave
from actsave.errors import RecomputeError
from actsave.runtime.buffer_copies import copies_keeping_shared_memory, distinct_storage_bytes
from support import assert_same_steps


def sharing(kind: str) -> tuple:
    """Two tensors sharing memory, ``kind``: the tensor twice, a view, a detached alias,
    two views of a tensor neither is, or one set on the other's storage (no shared
    version counter, no autograd view)."""
    t = torch.arange(16.0)
    if kind == "same":
        return t, t
    if kind == "view":
        return t, t[2:10]
    if kind == "detach":
        return t, t.detach()
    if kind == "local_views":
        return t[:12], t[4:]
    return t, torch.empty(0).set_(t.untyped_storage(), 3, (8,), (1,))


KINDS = ["same", "view", "detach", "local_views", "set"]


@pytest.mark.parametrize("kind", KINDS)
def test_copies_of_tensors_sharing_memory_share_the_copy_and_not_the_original(kind):
    a, b = sharing(kind)
    alone = torch.ones(3)
    (copy_a, copy_b, copy_alone), shared = copies_keeping_shared_memory([a, b, alone])
    assert shared
    for original, copy in ((a, copy_a), (b, copy_b), (alone, copy_alone)):
        assert torch.equal(copy, original) and copy.stride() == original.stride()
        assert copy.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()
    copy_a.add_(100)  # through one copy: seen through the other as through the originals
    want_a, want_b = sharing(kind)
    want_a.add_(100)
    assert torch.equal(copy_b, want_b) and torch.equal(a, sharing(kind)[0])
    assert distinct_storage_bytes([copy_a, copy_b, copy_alone]) == (
        copy_a.untyped_storage().nbytes() + copy_alone.untyped_storage().nbytes())


def test_copies_of_tensors_sharing_nothing_are_made_apart():
    tensors = [torch.ones(3), torch.arange(4), torch.zeros(2, 2).t()]
    copies, shared = copies_keeping_shared_memory(tensors)
    assert not shared and len({c.untyped_storage().data_ptr() for c in copies}) == 3
    assert all(torch.equal(c, t) and c.stride() == t.stride() for c, t in zip(copies, tensors))


def test_a_view_of_a_whole_buffer_is_copied_as_a_view_of_its_copy():
    # So the copy of the view shares the copy of the buffer's version counter, as the
    # view does the buffer's: the stale-read check reads one through the other.
    base = torch.arange(16.0)
    (copy_base, copy_view), _ = copies_keeping_shared_memory([base, base[4:12:2]])
    assert not copy_base._is_view() and copy_view._base is copy_base
    assert copy_view.stride() == (2,) and torch.equal(copy_view, base[4:12:2])


def test_a_view_of_another_dtype_shares_the_copy():
    base = torch.arange(8, dtype=torch.int32)
    other = torch.empty(0, dtype=torch.float32).set_(base.untyped_storage(), 2, (4,), (1,))
    (copy_base, copy_other), _ = copies_keeping_shared_memory([base, other])
    copy_base[2:6] = torch.tensor([1.5, -2.0, 0.0, 7.0]).view(torch.int32)
    assert copy_other.tolist() == [1.5, -2.0, 0.0, 7.0] and torch.equal(base, torch.arange(8, dtype=torch.int32))


def test_later_copies_join_earlier_ones_while_they_live():
    base = torch.arange(16.0)
    table = {}
    (copy_base,), shared = copies_keeping_shared_memory([base], table)
    assert not shared
    (copy_view,), shared = copies_keeping_shared_memory([base[8:]], table)
    assert shared
    copy_base.add_(1)
    assert torch.equal(copy_view, base[8:] + 1)
    del copy_base, copy_view
    gc.collect()
    (alone,), _ = copies_keeping_shared_memory([base[8:]], table)  # the earlier copy is gone: copied alone
    assert torch.equal(alone, base[8:]) and alone.untyped_storage().nbytes() == 8 * 4


def test_a_wider_tensor_copied_later_widens_the_earlier_copy_keeping_its_values():
    # A parent's slice of its child's statistics is copied as the parent's call starts,
    # the child's whole buffer as the child's starts: one copy of the two, whose bytes of
    # the slice are the earlier copy's (what the recompute changes through the slice).
    base = torch.arange(8.0)
    table = {}
    (copy_slice,), _ = copies_keeping_shared_memory([base[2:4]], table)
    copy_slice.fill_(-1)  # stands for what the earlier copy holds, apart from the buffer now
    (copy_base,), shared = copies_keeping_shared_memory([base], table)
    assert shared and copy_base.tolist() == [0, 1, -1, -1, 4, 5, 6, 7] and torch.equal(base, torch.arange(8.0))
    copy_base.add_(10)
    (joined,), _ = copies_keeping_shared_memory([base[5:]], table)  # later ones join the wider copy
    assert joined.tolist() == [15, 16, 17]


def test_meta_tensors_sharing_memory_share_the_copy():
    base = torch.empty(16, device="meta")
    (copy_base, copy_view), _ = copies_keeping_shared_memory([base, base[:8]])
    assert copy_view.device.type == "meta" and copy_view._base is copy_base


class Ema(nn.Module):
    """An EMA of its input's mean kept in ``stat``, which may share memory with another's buffer."""

    def __init__(self, stat: torch.Tensor):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("stat", stat)

    def forward(self, x):
        h = self.linear(x)
        with torch.no_grad():
            self.stat[:8].mul_(0.5).add_(h.mean(0))
        return torch.tanh(h)


class Scaled(nn.Module):
    """Reads ``scale`` by a product (saved for backward) or a sum (not saved)."""

    def __init__(self, scale: torch.Tensor, saved: bool = True):
        super().__init__()
        self.linear, self.saved = nn.Linear(8, 8), saved
        self.register_buffer("scale", scale)

    def forward(self, x):
        h = self.linear(x)
        return torch.tanh(h * self.scale[:8] if self.saved else h + self.scale[:8])


def model_sharing(kind: str, segments) -> nn.Module:
    """A sum reads the shared memory before the EMA updates it and a product after."""
    torch.manual_seed(0)
    stat, scale = sharing(kind)
    layers = [Scaled(scale, saved=False), Ema(stat), nn.Linear(8, 8), Scaled(scale), nn.Linear(8, 8)]
    if segments == "checkpoint_module":
        inner = nn.Sequential(*layers)
        return _Calls(inner, lambda x: actsave.checkpoint(inner, x))
    if segments == "checkpoint_function":
        inner = nn.Sequential(*layers)
        return _Calls(inner, lambda x: actsave.checkpoint(lambda t: inner(t), x))
    if segments is None:
        return nn.Sequential(*layers)
    return actsave.CheckpointedSequential(*layers, segments=segments)


class _Calls(nn.Module):
    def __init__(self, inner: nn.Module, call):
        super().__init__()
        self.inner, self.call = inner, call

    def forward(self, x):
        return self.call(x)


def batches(count: int = 3) -> list:
    return [torch.randn(4, 8, generator=torch.Generator().manual_seed(step)) + step for step in range(count)]


@pytest.mark.parametrize("segments", ["checkpoint_module", "checkpoint_function", [0, 4], [0, 2, 4]])
@pytest.mark.parametrize("kind", KINDS)
def test_buffers_sharing_memory_train_as_plain(kind, segments):
    # The recompute replays the EMA through ``stat`` and must read the change through
    # ``scale``: copied apart, it would read the values the forward started from.
    assert_same_steps(model_sharing(kind, None), model_sharing(kind, segments), batches())


@pytest.mark.parametrize("kind", ["same", "view", "detach", "local_views"])
def test_a_buffer_another_segment_changes_through_shared_memory_raises_naming_it(kind):
    # The sum's segment read ``scale`` and dropped its copy; the EMA's segment then
    # changed that memory through ``stat``. Its recompute would read the new values:
    # autograd's in-place error, naming the buffer, not a silent wrong gradient.
    model = model_sharing(kind, [0, 1, 2])
    with pytest.raises(RecomputeError, match="buffer 'scale' of Scaled"):
        model(torch.randn(4, 8, requires_grad=True)).square().sum().backward()


class FlaggedView(nn.Module):
    """A scale initialized from its first batch behind a Python flag, through ``packed``,
    and read through ``scale``, a view of it registered as a buffer too."""

    def __init__(self):
        super().__init__()
        self.linear, self.initialized = nn.Linear(8, 8), False
        self.register_buffer("packed", torch.ones(16))
        self.register_buffer("scale", self.packed[:8])

    def forward(self, x):
        h = self.linear(x)
        if not self.initialized:
            with torch.no_grad():
                self.packed[:8].copy_(1 / (h.std(0) + 1))
            self.initialized = True
        return torch.tanh(h * self.scale)


@pytest.mark.parametrize("segments", ["checkpoint_module", "checkpoint_function", [0, 1]])
def test_a_view_initialized_behind_a_python_flag_through_its_base_trains_as_plain(segments):
    # The recompute finds the flag unset with the buffers (NOTE [ Python attributes a
    # forward sets ]) and initializes ``packed`` again, which ``scale`` must show: copied
    # apart, the view would keep the ones the forward started from.
    def make(checkpointed):
        torch.manual_seed(0)
        layers = [FlaggedView(), nn.Linear(8, 8)]
        if not checkpointed:
            return nn.Sequential(*layers)
        if segments == [0, 1]:
            return actsave.CheckpointedSequential(*layers, segments=segments)
        inner = nn.Sequential(*layers)
        call = inner if segments == "checkpoint_module" else (lambda t: inner(t))
        return _Calls(inner, lambda x: actsave.checkpoint(call, x))

    assert_same_steps(make(False), make(True), batches())


def test_aliases_of_two_dtypes_at_odd_offsets_are_made_on_the_bytes_they_span():
    # An int16 buffer from byte 2 and a float32 one from byte 4 of one storage: neither
    # can be made on the other at a whole number of its elements.
    storage = torch.zeros(16, dtype=torch.uint8).untyped_storage()
    shorts = torch.empty(0, dtype=torch.int16).set_(storage, 1, (7,), (1,))
    single = torch.empty(0, dtype=torch.float32).set_(storage, 1, (1,), (1,))
    (copy_shorts, copy_single), shared = copies_keeping_shared_memory([shorts, single])
    assert shared and torch.equal(copy_shorts, shorts) and torch.equal(copy_single, single)
    copy_shorts[1:3] = torch.tensor([1.5]).view(torch.int16)
    assert copy_single.item() == 1.5 and single.item() == 0


class SliceOfChildStatistics(nn.Module):
    """Registers a slice of its child BatchNorm's running mean as its own buffer and reads
    it after the BatchNorm updated it."""

    def __init__(self):
        super().__init__()
        self.linear, self.norm = nn.Linear(8, 8), nn.BatchNorm1d(8)
        self.register_buffer("stat", self.norm.running_mean[:4])

    def forward(self, x):
        h = self.norm(self.linear(x))
        return torch.tanh(h[:, :4] + self.stat)


@pytest.mark.parametrize("how", ["checkpoint_module", "checkpoint_function"])
def test_a_slice_of_a_childs_buffer_read_after_the_child_updates_it_trains_as_plain(how):
    # Under global hooks the parent's slice is copied first, as its call starts; the
    # child's wider buffer, copied as the child's starts, must join it (the copies of a
    # partial buffer span its whole storage), else the recompute read the slice as the
    # forward found it.
    def make(checkpointed):
        torch.manual_seed(0)
        model = SliceOfChildStatistics()
        if not checkpointed:
            return model
        call = model if how == "checkpoint_module" else (lambda t: model(t))
        return _Calls(model, lambda x: actsave.checkpoint(call, x))

    assert_same_steps(make(False), make(True), batches())


@pytest.mark.parametrize("transform", ["jvp", "vmap"])
def test_buffers_sharing_memory_under_torch_func(transform):
    # Copies made under a transform are its wrappers, whose storage cannot be read: they
    # are made apart (read-only here, so the gradients are plain's).
    torch.manual_seed(0)
    stat, scale = sharing("view")
    model = nn.Sequential(Scaled(scale), Scaled(stat[:8]))
    x, tangent = torch.randn(4, 8), torch.randn(4, 8)
    run = {"jvp": lambda f: torch.func.jvp(f, (x,), (tangent,)),
           "vmap": lambda f: torch.func.vmap(f)(x.unsqueeze(1))}[transform]
    want = run(model)
    got = run(lambda t: actsave.checkpoint(model, t))
    for a, b in zip(want, got):
        assert torch.equal(a, b)


class FlaggedViewInADict(FlaggedView):
    """FlaggedView with its flag in a dict changed in place, which the attributes' put-back
    does not reach: the stale-read check's case."""

    def __init__(self):
        super().__init__()
        del self.initialized
        self.flags = {"initialized": False}

    def forward(self, x):
        h = self.linear(x)
        if not self.flags["initialized"]:
            with torch.no_grad():
                self.packed[:8].copy_(1 / (h.std(0) + 1))
            self.flags["initialized"] = True
        return torch.tanh(h * self.scale)


@pytest.mark.parametrize("how", ["checkpoint_module", "checkpoint_function"])
def test_a_start_over_for_a_stale_base_takes_its_view_with_it(how):
    # The recompute reads ``scale`` unchanged, starts over with ``packed`` as the forward
    # left it (NOTE [ Buffers read after the forward changed them ]), and ``scale``, whose
    # copy shares ``packed``'s, with it (StaleReads.stand_ins).
    def make(checkpointed):
        torch.manual_seed(0)
        inner = nn.Sequential(FlaggedViewInADict(), nn.Linear(8, 8))
        if not checkpointed:
            return inner
        call = inner if how == "checkpoint_module" else (lambda t: inner(t))
        return _Calls(inner, lambda x: actsave.checkpoint(call, x))

    assert_same_steps(make(False), make(True), batches())
