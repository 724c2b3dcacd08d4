"""Kept inputs and the kept_bytes() ledger."""
import gc
import inspect
import warnings

import pytest
import torch
from torch import nn

import actsave
from actsave import ConfigError
from actsave.codecs import sqnr_db
from actsave.runtime.keep_rules import EXACT, CallerTensors, KeepPolicy, should_encode
from actsave.runtime.store import KeptInputs
from support import codes_and_scales


def test_kept_inputs_count_tensors_and_keep_other_values():
    x = torch.randn(4, 4, requires_grad=True) * 1
    kept = KeptInputs((x, 3, "s"), {"mask": None, "bias": torch.ones(2, dtype=torch.float64)}, EXACT, False)
    assert kept.nbytes == 4 * 4 * 4 + 2 * 8 == actsave.kept_bytes()["device"]
    with torch.enable_grad():
        (y, n, s), kwargs = kept.restore()
    assert torch.equal(y, x) and y.requires_grad and y.grad_fn is None
    assert (n, s, kwargs["mask"]) == (3, "s", None)
    kept.release()
    assert actsave.kept_bytes() == {"device": 0, "host": 0}
    with pytest.raises(actsave.RecomputeError, match="already released"):
        kept.restore()


def test_ledger_is_settled_when_kept_inputs_are_garbage_collected():
    kept = KeptInputs((torch.randn(8),), {}, EXACT, False)
    assert actsave.kept_bytes()["device"] == 32
    del kept
    gc.collect()
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


def test_stored_bytes_is_kept_bytes_under_its_old_name_with_a_warning():
    kept = KeptInputs((torch.randn(8),), {}, EXACT, False)
    with pytest.warns(DeprecationWarning, match=r"actsave.stored_bytes\(\) is deprecated .* use actsave.kept_bytes\(\)"):
        assert actsave.stored_bytes() == actsave.kept_bytes() == {"device": 32, "host": 0}
    kept.release()


def test_private_copy_is_unaffected_by_later_in_place_changes():
    x = torch.randn(4)
    kept = KeptInputs((x,), {}, EXACT, private_copy=True)
    original = x.clone()
    x.zero_()
    (restored,), _ = kept.restore()
    assert torch.equal(restored, original)


@pytest.mark.parametrize("offload", [1, "yes", None])
def test_offload_must_be_a_bool(offload):
    with pytest.raises(ConfigError, match="offload=.* must be True or False"):
        KeepPolicy.resolve(offload=offload)


def _kept_packed(tensor, codec="int8"):
    kept = KeptInputs((tensor,), {}, KeepPolicy.resolve(compress=codec), False)
    return kept.tensors[0].storage.fetch()


def test_a_relu_output_is_kept_on_the_unsigned_grid():
    # Known by its autograd node, without reading it (codecs, NOTE [ Unsigned grids ]).
    x = torch.randn(4, 64, requires_grad=True)
    assert _kept_packed(torch.relu(x)).unsigned
    assert _kept_packed(torch.relu(x), "fp8_e5m2").unsigned
    assert not _kept_packed(x * 1).unsigned
    changed = torch.relu(x)
    changed.sub_(1)  # no longer a ReLU output: its node is the subtraction's
    assert not _kept_packed(changed).unsigned


def test_unsigned_kept_input_restores_closer_with_the_same_bytes():
    x = torch.relu(torch.randn(16, 128, requires_grad=True))
    signed = KeptInputs((x * 1,), {}, KeepPolicy.resolve(compress="fp8_e4m3"), False)
    unsigned = KeptInputs((x,), {}, KeepPolicy.resolve(compress="fp8_e4m3"), False)
    assert unsigned.nbytes == signed.nbytes
    (from_signed,), _ = signed.restore()
    (from_unsigned,), _ = unsigned.restore()
    assert sqnr_db(x, from_unsigned) >= sqnr_db(x, from_signed) + 5.0  # 38 vs 32 dB


def test_a_chain_activation_that_needs_no_grad_is_encoded_the_callers_tensors_are_not():
    # An activation made by a frozen prefix has no grad_fn; it is still the chain's, not
    # the caller's, so it follows its codec and offload (a leaf would be held exactly).
    frozen = torch.nn.Linear(8, 8).requires_grad_(False)
    owner = torch.nn.Sequential(frozen)
    owner.register_buffer("table", torch.randn(8, 8))
    batch = torch.randn(16, 8)
    made_by = CallerTensors(batch, owner)
    activation = frozen(batch)
    assert activation.grad_fn is None and not should_encode(activation)  # outside a chain: anyone's
    assert should_encode(activation, made_by) and should_encode(activation.t(), made_by)
    # The caller's own tensors (and views of them) stay held by reference.
    for held in (batch, batch[1:], frozen.weight, frozen.weight.t(), owner.table, torch.randn(4, requires_grad=True)):
        assert not should_encode(held, made_by)
    assert not should_encode(activation.long(), made_by)  # never an integer tensor
    kept = KeptInputs((activation,), {}, KeepPolicy.resolve("int8"), False, made_by)
    assert kept.lossy and kept.nbytes == codes_and_scales(16 * 8)
    kept.release()


def test_a_keep_policy_has_no_default_fields():
    # Dynamo of torch 2.11 binds a constructor's defaults where a traced forward builds
    # a policy and cannot wrap the default codec: a graph break per layer (seen in
    # bench/compile_memory.py with torch 2.11: 3 graphs and 7 breaks where 2.13 has 1 and 1).
    assert all(p.default is inspect.Parameter.empty for p in inspect.signature(KeepPolicy).parameters.values())
    assert EXACT == KeepPolicy(actsave.codecs.get_codec(None), False)


@pytest.mark.parametrize("codec", [None, "int8"])
def test_an_offloaded_kept_input_comes_back_in_its_layout(codec):
    # NOTE [ Kept layouts ]: the packed value's strides travel with it to the host and back.
    x = torch.randn(2, 8, 4, 4, requires_grad=True).to(memory_format=torch.channels_last) * 1
    restored = []
    for tensor in (x, x.contiguous()):
        kept = KeptInputs((tensor,), {}, KeepPolicy.resolve(compress=codec, offload=True), False)
        assert kept.tensors[0].storage.where == "host"
        (back,), _ = kept.restore()
        restored.append(back)
        kept.release()
    assert restored[0].stride() == x.stride() and torch.equal(*restored)


class _AddsThenMultiplies(torch.nn.Module):
    inplace = True  # changes its first argument in place: kept by a private copy

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, a, b):
        a.add_(self.w)
        return a * b  # b shares a's memory: it sees the change


_ALIASES = {
    "the same tensor twice": lambda h: (h, h),
    "a tensor and a view of it": lambda h: (h, h.view(2, 3).view(6)),
    "a view that needs no grad": lambda h: (h, h.detach()),
}


@pytest.mark.parametrize("aliases", ["the same tensor twice", "a tensor and a view of it", "a view that needs no grad"])
@pytest.mark.parametrize("compress", [None, "int8"])
def test_inputs_that_share_memory_share_it_in_the_recompute(aliases, compress):
    # Kept one by one, a private copy or a codec gives each argument its own memory, and
    # the recompute of ``a.add_(w); a * b`` multiplies by b as it was before the change.
    def step(wrap):
        torch.manual_seed(0)
        block, x = _AddsThenMultiplies(), torch.randn(6, requires_grad=True)
        out = wrap(block)(*_ALIASES[aliases](x * 1.0))
        out.sum().backward()
        return out.detach(), x.grad, block.w.grad

    plain = step(lambda m: m)
    kept = step(lambda m: actsave.Checkpoint(m, compress=compress))
    if compress is None:
        assert all(torch.equal(p, k) for p, k in zip(plain, kept))
    else:
        assert torch.equal(plain[0], kept[0]) and all(sqnr_db(p, k) >= 33 for p, k in zip(plain[1:], kept[1:]))


@pytest.mark.parametrize("compress", [None, "int8"])
def test_inputs_that_share_memory_are_kept_once(compress):
    h = torch.randn(64, 64, requires_grad=True) * 1
    alone = KeptInputs((h,), {}, KeepPolicy.resolve(compress, False), False)
    one = alone.nbytes
    alone.release()
    together = KeptInputs((h, h.t(), h[::2], h), {}, KeepPolicy.resolve(compress, False), False)
    assert together.nbytes == one == actsave.kept_bytes()["device"]
    with torch.enable_grad():
        (a, b, c, d), _ = together.restore()
    assert b.data_ptr() == a.data_ptr() == c.data_ptr() and torch.equal(b, a.t()) and torch.equal(c, a[::2])
    together.release()


def test_the_same_column_twice_shares_memory_in_the_recompute_and_is_kept_once():
    # A strided view whose span covers the whole matrix: kept once, as it is (its own
    # private copy: the block changes its first argument in place), not as that span.
    def step(wrap):
        block, x = _AddsThenMultiplies(), torch.randn(6, 64, requires_grad=True)
        column = (x * 1.0)[:, 3]
        out = wrap(block)(column, column)
        kept = actsave.kept_bytes()["device"]
        out.sum().backward()
        return kept, x.grad, block.w.grad

    torch.manual_seed(0)
    _, *plain = step(lambda m: m)
    torch.manual_seed(0)
    kept, *checkpointed = step(actsave.Checkpoint)
    assert kept == 6 * 4  # a private copy of the column, once
    assert all(torch.equal(p, c) for p, c in zip(plain, checkpointed))


@pytest.mark.parametrize("compress", [None, "int8"])
def test_columns_that_share_no_element_are_kept_each_alone(compress):
    # Their span would be every column between them.
    h = torch.randn(4096, 64, requires_grad=True) * 1
    alone = KeptInputs((h[:, 0],), {}, KeepPolicy.resolve(compress, False), False)
    one = alone.nbytes
    alone.release()
    kept = KeptInputs((h[:, 0], h[:, 1]), {}, KeepPolicy.resolve(compress, False), False)
    assert kept.nbytes == 2 * one < h.numel()
    kept.release()


def test_a_checkpoint_with_two_tensor_arguments_runs_under_vmap():
    # vmap's batched tensors have no storage to group by.
    def f(a, b):
        return torch.tanh(a) * b

    x = torch.randn(4, 8)
    out = torch.func.vmap(lambda x: actsave.checkpoint(f, x, x * 2))(x)
    assert torch.equal(out, f(x, x * 2))


class _ScalesThenProjects(torch.nn.Module):
    def __init__(self, inplace: bool):
        super().__init__()
        self.inplace = inplace  # changes its input in place: kept by a private copy
        self.w, self.proj = torch.nn.Parameter(torch.tensor(2.0)), torch.nn.Linear(16, 16)

    def forward(self, a):
        a = a.mul_(self.w) if self.inplace else a * self.w
        return torch.tanh(self.proj(a))


@pytest.mark.parametrize("options", [dict(inplace=True), dict(offload=True), dict(inplace=True, offload=True)],
                         ids=["private copy", "offload", "both"])
def test_a_strided_slice_is_recomputed_in_its_own_strides(options):
    # q of qkv.chunk(3, -1): F.linear folds a 3-D slice otherwise than its dense copy,
    # and saves other tensors (NOTE [ Kept layouts ]).
    def step(wrap):
        torch.manual_seed(0)
        block, x = _ScalesThenProjects(options.get("inplace", False)), torch.randn(4, 4, 32, requires_grad=True)
        out = wrap(block)((x * 1.0)[..., :16])
        (out * torch.linspace(-1, 1, 16)).sum().backward()
        return out.detach(), x.grad, block.w.grad, block.proj.weight.grad

    plain = step(lambda m: m)
    kept = step(lambda m: actsave.Checkpoint(m, offload=options.get("offload", False)))
    assert all(torch.equal(p, k) for p, k in zip(plain, kept))


class _Scale(nn.Module):
    """Scales its input by a vector: the multiply saves the input as it came."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16))

    def forward(self, x):
        return x * self.weight


class _ScalesThenNorms(nn.Module):
    """Projects and scales its input (the scale a kept call under selective, whose save
    is its argument), then norms and projects their sum."""

    def __init__(self):
        super().__init__()
        self.first, self.scale = nn.Linear(16, 16), _Scale()
        self.norm, self.proj = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.proj(self.norm(self.first(x) + self.scale(x))))


@pytest.mark.parametrize("keep", ["inputs", "selective"])
@pytest.mark.parametrize("compress", ["int8", "fp8_e4m3"])
def test_an_expanded_input_kept_by_a_codec_is_recomputed_expanded(keep, compress):
    # A codec gives an expanded input back dense: F.linear then folds it otherwise and
    # saved other shapes (RecomputeError), and a kept call's save of it could not be made
    # again in its strides (a RuntimeError of overlapping memory): NOTE [ Kept layouts ].
    def step(wrap):
        torch.manual_seed(0)
        block, x = _ScalesThenNorms(), torch.randn(4, 3, 16, requires_grad=True)
        wrap(block)(x.sum(1, keepdim=True).expand(4, 8, 16)).pow(2).sum().backward()
        return [x.grad, *(p.grad for p in block.parameters())]

    kept_ops = actsave.KeptOps(modules=(_Scale,)) if keep == "selective" else keep
    plain = step(lambda m: m)
    kept = step(lambda m: actsave.Checkpoint(m, keep=kept_ops, compress=compress))
    assert min(sqnr_db(p, k) for p, k in zip(plain, kept)) > (33 if compress == "int8" else 20)


def test_a_strided_input_with_a_size_one_dimension_of_stride_zero_keeps_its_gaps_in_a_private_copy():
    # Not expanded (a size-1 dimension's stride is any): a private copy for an in-place
    # first layer keeps its layout, or F.linear folds the recompute's input otherwise
    # and the recompute saves other tensors (a RecomputeError).
    def step(wrap):
        torch.manual_seed(0)
        model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 5))
        base = torch.randn(96, requires_grad=True)
        wrap(model)((base * 1.0).as_strided((2, 1, 3, 8), (48, 0, 16, 2))).pow(2).sum().backward()
        return [base.grad, *(p.grad for p in model.parameters())]

    for plain, kept in zip(step(lambda m: m), step(actsave.Checkpoint)):
        assert torch.equal(plain, kept)


@pytest.mark.parametrize("aliases", [
    lambda h: (h[:, 0:2], h[:, 1:3]),  # overlapping columns, a span far larger than they are
    lambda h: (h[:, 0:4], h[:, 0:4].t()),  # a slice and its transpose
    lambda h: (h.reshape(-1)[:6], h.reshape(-1)[:6].view(2, 3).view(6), h.reshape(-1)[:6].detach().view(torch.int32)),
], ids=["overlapping columns", "slice and transpose", "an integer view beside"])
def test_arguments_that_share_elements_share_them_in_the_recompute(aliases):
    class AddsThenMultiplies(torch.nn.Module):
        inplace = True

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor(2.0))

        def forward(self, a, b, *others):
            a.add_(self.w)
            return (a.sum() * b).sum()

    def step(wrap):
        torch.manual_seed(0)
        block, x = AddsThenMultiplies(), torch.randn(8, 64, requires_grad=True)
        wrap(block)(*aliases(x * 1.0)).backward()
        return x.grad, block.w.grad

    assert all(torch.equal(p, k) for p, k in zip(step(lambda m: m), step(actsave.Checkpoint)))


def test_the_same_view_twice_comes_back_as_one_object_two_views_as_two():
    h = torch.randn(4, 8, requires_grad=True) * 1
    kept = KeptInputs((h, h, h.view(4, 8)), {}, EXACT, False)
    with torch.enable_grad():
        (a, b, c), _ = kept.restore()
    assert a is b and c is not a and c.data_ptr() == a.data_ptr()
    kept.release()


def test_a_tensor_kept_by_reference_by_several_calls_is_counted_once():
    # NOTE [ One stored copy per kept tensor ]: kept_bytes() never counts more than is held.
    h, size = torch.randn(64, 64, requires_grad=True) * 1, 64 * 64 * 4
    calls = [KeptInputs((h, torch.randn(4)), {}, EXACT, False) for _ in range(3)]
    assert [call.nbytes for call in calls] == [size + 16, 16, 16]
    assert actsave.kept_bytes()["device"] == size + 3 * 16
    calls[0].release()  # the others still hold it
    assert actsave.kept_bytes()["device"] == size + 2 * 16
    calls[1].release(), calls[2].release()
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


def test_an_expanded_tensor_kept_by_reference_is_counted_as_its_storage():
    # One row expanded to 2048: what is held is the row, not 2048 of them. A slice kept
    # by reference counts as its dense copy (docs/api.md).
    row = torch.randn(1, 256, requires_grad=True) * 1
    expanded = KeptInputs((row.expand(2048, 256),), {}, EXACT, False)
    sliced = KeptInputs((row[:, ::2],), {}, EXACT, False)
    # A private copy for an in-place first layer is dense: its own storage counts.
    copied = KeptInputs((row.expand(2048, 256),), {}, EXACT, True)
    assert (expanded.nbytes, sliced.nbytes, copied.nbytes) == (256 * 4, 128 * 4, 2048 * 256 * 4)
    expanded.release(), sliced.release(), copied.release()


@pytest.mark.parametrize("compress, offload", [("int8", False), ("fp8", False), (None, True), ("int8", True)])
def test_a_tensor_several_calls_keep_by_a_codec_or_on_the_host_is_stored_once(compress, offload):
    h, policy = torch.randn(64, 64, requires_grad=True) * 1, KeepPolicy.resolve(compress, offload)
    where = "host" if offload else "device"
    alone = KeptInputs((h,), {}, policy, False)
    with torch.enable_grad():
        (expected,), _ = alone.restore()
    one = alone.nbytes
    alone.release()
    calls = [KeptInputs((h,), {}, policy, False) for _ in range(3)]
    assert actsave.kept_bytes()[where] == one and sum(call.nbytes for call in calls) == one
    assert calls[0].tensors[0].storage is calls[2].tensors[0].storage
    restored = []
    for call in reversed(calls):  # in backward order, each released after its recompute
        with torch.enable_grad():
            (back,), _ = call.restore()
        assert torch.equal(back, expected) and back.is_leaf and back.requires_grad
        restored.append(back)
        call.release()
    assert len({id(back) for back in restored}) == 3  # a leaf of its own for each recompute
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


@pytest.mark.parametrize("offload", [False, True])
def test_a_tensor_changed_in_place_between_two_calls_is_stored_anew(offload):
    h, policy = torch.randn(64, 64, requires_grad=True) * 1, KeepPolicy.resolve("int8", offload)
    before = h.detach().clone()
    first = KeptInputs((h,), {}, policy, False)
    with torch.no_grad():
        h.mul_(-2)
    second = KeptInputs((h,), {}, policy, False)
    assert first.tensors[0].storage is not second.tensors[0].storage and second.nbytes == first.nbytes > 0
    (was,), _ = first.restore()
    (now,), _ = second.restore()
    assert sqnr_db(before, was) > 33 and sqnr_db(before * -2, now) > 33
    first.release(), second.release()


class _CrossAttends(torch.nn.Module):
    """A decoder block's cross-attention: every block takes the one encoder output."""

    def __init__(self):
        super().__init__()
        self.q, self.kv = torch.nn.Linear(16, 16), torch.nn.Linear(16, 32)

    def forward(self, y, memory):
        k, v = self.kv(memory).chunk(2, -1)
        return y + torch.nn.functional.scaled_dot_product_attention(self.q(y), k, v)


def _cross_attention_step(options: dict, blocks: int = 4) -> tuple:
    torch.manual_seed(0)
    encoder, decoder = torch.nn.Linear(16, 16), torch.nn.ModuleList(_CrossAttends() for _ in range(blocks))
    actsave.wrap(decoder, _CrossAttends, **options)
    memory, y = encoder(torch.randn(2, 64, 16)) * 1.0, torch.randn(2, 4, 16, requires_grad=True)
    for block in decoder:
        y = block(y, memory)
    kept = actsave.kept_bytes()
    y.square().sum().backward()
    return kept, [p.grad for p in (*encoder.parameters(), *decoder.parameters())]


@pytest.mark.parametrize("options", [{}, {"compress": "int8"}, {"offload": True}, {"compress": "fp8", "offload": True}],
                         ids=["exact", "int8", "offload", "fp8 offloaded"])
def test_an_encoder_output_every_block_keeps_is_kept_once_and_changes_no_bit(options, monkeypatch):
    kept, gradients = _cross_attention_step(options)
    monkeypatch.setattr("actsave.runtime.store.sharing_key", lambda *args: None, raising=False)  # each its own
    kept_apart, gradients_apart = _cross_attention_step(options)
    # The encoder output as stored: 2 x 64 x 16 fp32 values, or their codes and scales.
    memory = codes_and_scales(2 * 64 * 16) if options.get("compress") else 2 * 64 * 16 * 4
    where = "host" if options.get("offload") else "device"
    assert kept_apart[where] - kept[where] == 3 * memory  # stored once for the 4 blocks, not 4 times
    assert all(torch.equal(a, b) for a, b in zip(gradients, gradients_apart))
    assert actsave.kept_bytes() == {"device": 0, "host": 0}


def test_a_trace_of_a_wrapped_model_leaves_the_ledger_holding_ints():
    # torch.jit.trace records the sizes a checkpoint counts as tensors.
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.fc(x))

    model = actsave.wrap(nn.Sequential(Block(), Block()), Block).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the trace's own warnings
        torch.jit.trace(model, (torch.randn(4, 8),), check_trace=False)
    assert all(type(value) is int for value in actsave.kept_bytes().values())


class _DoublesItsInput(nn.Module):
    """Changes its input in place without an ``inplace = True`` attribute."""

    def forward(self, h):
        return h.mul_(2.0)


@pytest.mark.parametrize("compress", [None, "int8", "fp8_e5m2"])
def test_an_input_changed_in_place_by_a_function_that_does_not_say_so_is_refused_in_the_forward(compress):
    # Kept by a codec's copy, its recompute would change a leaf that requires grad:
    # torch's error in the backward, naming neither actsave nor the way out.
    block = nn.Sequential(_DoublesItsInput(), nn.Linear(16, 8))
    x = torch.randn(4, 16, requires_grad=True)
    with pytest.raises(actsave.RecomputeError,
                       match="modified in place by Sequential during its forward.*inplace = True"):
        actsave.checkpoint(block, x * 1.0, compress=compress)
