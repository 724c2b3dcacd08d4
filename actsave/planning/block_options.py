"""What each keep option costs each block of a block plan (blocks.py): the bytes it
keeps from its forward to its backward, its largest events, the seconds it adds, for
every option a plan may choose (runtime/keep_modes.py, NOTE [ Keep modes ]).

NOTE [ Block options priced ]
A block plan chooses for each block one option: plain (its saves as autograd keeps
them); its inputs kept, exactly, by a codec or on the host (a checkpoint); selective
(its inputs and the outputs of its linear layers and attention kept, exactly, by a
codec or on the host; exactly, of some of them: NOTE [ Kept subsets ]); its saves kept by
a codec (all of them, or its linear layers' inputs only) or on the host, with no
recompute. Each is priced by what it does to the peak formula of memory_model.py,
``X + max_j (R_0 + ... + R_{j-1} + W_j)``, with segments of one block each:

- plain and inputs kept: the cost model's own terms of the one-block segment (a plain
  middle segment, a checkpointed one), from the chain's profiled step, as any chain
  plan prices them, a checkpoint's forward too (NOTE [ A checkpointed segment's
  forward ] in memory_model.py); but for a checkpoint kept on the device, the seconds
  measured as the other options' are (below): its recompute stops after its last save
  (the early stop: a transformer block's last matmul and residual add are not run
  again), which the profile's forward time of the block does not tell. An offloaded one keeps the
  model's seconds: its copies hide behind the next blocks, which a block timed alone
  does not have;
- the others (selective, alone or with a codec or offload of what it keeps; saves
  kept), measured: the block runs once with the option, alone, on an input like
  the profiled step's, its live bytes counted as the profile counts them
  (live_bytes.py): R is what stays allocated after its forward beside its output (its
  input too where the option keeps it: a selective block keeps it, a codec encodes it
  instead); its forward event is the input and the forward's peak rise; its backward
  event, beside the output gradient O and what the loss leaves (as the model's), the
  incoming gradient, R and the backward's peak rise (recompute, decodes and fetches
  included); F, for offload, the bytes its backward fetches back (its carry, as the
  model's). The seconds it adds are its measured step less the plain block's, timed
  together (medians of interleaved runs); on meta tensors, none.

Blocks alike are measured once: the same class, parameters of the same names and
shapes, arguments of the same shapes, the same rises and saves in the profiled step
(its forward's and backward's rises, plain, and the bytes and count of the tensors it
is the first to save), and the same modules called, in order, in a forward of the block
under no_grad. Those tell apart blocks of one class whose forward takes another path (a
Python flag per instance calls a wide layer in some, or a layer's function instead of
the layer, or ends in a tanh, which saves its output where a residual add saves
nothing: the same rises), whose options priced as the first one's would put a plan far
over its budget (a selective option keeps what the layers it calls make), and whose
kept subsets, found on the first, could name modules the others never call. A block
after a plain one whose saves hold its input (memory_model.py, "A tensor at a stored
boundary") counts that input there, not again: each option's terms come in both forms.

A block whose next block changes its input in place (declares ``inplace = True``, or
starts with an in-place layer: runtime/keep_rules.py, modifies_input) is offered no
selective option (:func:`options_at`): selective keeps the outputs of its linear layers
and attention as they were, by reference or stored with their versions checked, and
its own output may be one of them, which the next block changes before the backward
reads it (the recompute raises RecomputeError). Its other options keep nothing of its
output beyond what the plain block's saves keep, with autograd's version checks: they
raise only where the plain block does.
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, TypeVar

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from .._torch import fsdp_shards
from ..devices import host_is_separate, synchronize
from ..errors import ConfigError, RecomputeError
from ..runtime.function import qualified_name
from ..runtime.keep_modes import BlockOption, call_block
from ..runtime.recompute_options import DEFAULT_RECOMPUTE
from ..runtime.kept_ops import DEFAULT_KEPT_OPS
from ..runtime.keep_rules import KeepPolicy, modifies_input
from ..runtime.kept_nothing import kept_nothing_noted
from ..runtime.store import kept_bytes
from .allocator_rises import AllocatorRises
from .gradient_layout import GradientLayout, ones_like
from .live_bytes import LiveBytes, allocation_bytes
from .memory_model import CostModel
from .step_isolation import isolated_steps, user_stacklevel
from .tensor_specs import TensorSpec

# The repeats of each measured option's timed step (and the plain block's), interleaved
# after one that warms up: the median difference is what the option adds.
_TIMED_REPEATS = 5
# What an option that does more work than the plain block adds at least, where its
# measured difference is lost in the noise: a plan never takes it for free, so where
# the budget allows the plain block, it keeps the block plain.
_LEAST_EXTRA_SECONDS = 1e-9

# An option the block cannot run with: one that does not apply to it (ConfigError: a
# selective one that keeps nothing, or of a function), or one whose recompute refuses
# what the block does (RecomputeError: a kept Linear's weight clamped in place before
# its call). The plan leaves it out; the second it says, once per kind of block and
# option (a user who allowed it would otherwise not learn why no block takes it).
_CANNOT_RUN = (ConfigError, RecomputeError)
T = TypeVar("T")


@dataclass(frozen=True)
class OptionTerms:
    """One option of one block in the peak formula's terms (module docstring), for a
    block whose input a plain block before it holds (``held``) or not."""

    kept: float  # R: device bytes kept from its forward to its backward
    forward_event: float  # its largest forward event, beside X and the R before it
    backward_event: float  # its largest backward event, less the carry
    fetched: float  # F: bytes its backward fetches from the host (offload), 0 else
    seconds: float  # what it adds to the step
    holds_output: bool  # a plain block whose saves hold the next block's input

    def working_set(self, carry: float) -> float:
        """W + C."""
        return max(self.forward_event, self.backward_event + carry)


def candidate_options(levers: Sequence[str], codecs: Sequence[str], device) -> list:
    """The BlockOptions a plan may choose besides plain, given the levers allowed
    (``"recompute"``, ``"selective"``, ``"offload"``) and the lossy codecs allowed."""
    offload = "offload" in levers and host_is_separate(device)
    places = [False, True] if offload else [False]
    options = []
    if "recompute" in levers:
        options += [BlockOption("inputs", KeepPolicy.resolve(codec, place)) for codec in ("none", *codecs)
                    for place in places]
    if "selective" in levers:
        options += [BlockOption("selective", KeepPolicy.resolve(codec, place), DEFAULT_KEPT_OPS)
                    for codec in ("none", *codecs) for place in places]
    for codec in codecs:
        for place in places:
            options.append(BlockOption("saves", KeepPolicy.resolve(codec, place)))
        options.append(BlockOption("linear_inputs", KeepPolicy.resolve(codec)))
    if offload:
        options.append(BlockOption("saves", KeepPolicy.resolve(None, True)))
    return options


def options_at(options: Sequence, layers: Sequence[nn.Module], a: int) -> list:
    """The ``options`` a plan may choose at block ``a`` of the chain ``layers``: none
    selective where the next block changes its input in place (module docstring)."""
    if a + 1 < len(layers) and modifies_input(layers[a + 1]):
        return [option for option in options if option is None or option.keep != "selective"]
    return list(options)


def model_terms(model: CostModel, a: int, option: Optional[BlockOption], held: bool) -> Optional[OptionTerms]:
    """The cost model's terms of block ``a`` kept plain (``option`` None) or keeping its
    inputs as ``option.policy`` says; None where the model does not allow it there."""
    if option is None:
        working, kept = model.segment_plain_middle(a, a + 1, 0.0, held)
        big = 2.0 * (working + 1.0)
        backward = model.segment_plain_middle(a, a + 1, big, held)[0] - big
        forward = float((model.tables.held_plain_forward if held else model.tables.plain_forward)[a, a + 1])
        holds = bool(model.plain_middle_holds_output(a, a + 1))
        return OptionTerms(kept, forward, backward, 0.0, 0.0, holds)
    o = model.options.index(option.policy)
    if not model.allowed[o, a]:
        return None
    kept = float(model.kept(o, a, a + 1, held))
    fetched = float(model.fetched(o, a, a + 1))
    # The model charges the carry C to every backward event, W(C) = max(events + C,
    # encode), and allows an offloaded option only where C covers its fetch F: the
    # events alone are read at a C above every one of them.
    big = 2.0 * (model.segment_working_set(o, a, a + 1, fetched, held) + 1.0)
    backward = model.segment_working_set(o, a, a + 1, big, held) - big
    forward = float(model.forward_working_set(o, a, a + 1, held))
    return OptionTerms(kept, forward, backward, fetched, float(model.seconds(o, a, a + 1)), False)


@dataclass(frozen=True)
class _Measured:
    kept: float
    input_kept: bool
    forward_rise: float
    backward_rise: float
    fetched: float
    seconds: float


class BlockMeasurer:
    """Measures options on the chain's layers (blocks.py's BlockCall), each distinct
    (layer kind, input) once (module docstring)."""

    def __init__(self, chain: nn.Sequential, inputs: Sequence[TensorSpec], device, timed: bool,
                 profiled: Optional[Sequence] = None, output_grad_layout: Optional[GradientLayout] = None):
        self.layers, self.inputs, self.device, self.timed = list(chain), list(inputs), torch.device(device), timed
        # The layout of the gradient the step's loss hands the last block (NOTE [ The
        # output gradient's layout ]); the others get ones like their output, as the next
        # block's backward makes them.
        self._last_layout = output_grad_layout
        # What the profiled step measured of each block run plain (its LayerProfile's rises
        # and saves), if given; not where FSDP2 shards the block: what its ranks' steps count of the
        # gathers moves from run to run, and ranks that measured other kinds of block
        # would run other steps, their gathers out of step.
        seen = ([(p.forward_rise, p.backward_rise, p.saved_bytes, p.saves) for p in profiled] if profiled
                else [()] * len(self.layers))
        self._seen_plain = [() if fsdp_shards(layer) else plain for layer, plain in zip(self.layers, seen)]
        self._cache = {}
        self._paths = {}  # block index -> the modules its forward calls (_modules_called)
        self._left_out = set()  # (block type, keep, codec, offload) already warned of
        self._quiet = False  # while pricing options the user did not allow (quietly)

    def terms(self, model: CostModel, a: int, option: BlockOption, held: bool) -> Optional[OptionTerms]:
        """The measured terms of ``option`` at block ``a`` (None where it fails there)."""
        measured = self.measured(a, option)
        if measured is None:
            return None
        x_bytes = float(model.input[a])
        kept = measured.kept
        if measured.input_kept and (a == 0 or held):
            kept -= x_bytes  # the caller holds it (X), or the plain block before does
        forward = (0.0 if a == 0 or held else x_bytes) + measured.forward_rise
        backward = model.held_in_backward + float(model.grad[a + 1]) + kept + measured.backward_rise
        return OptionTerms(kept, forward, backward, measured.fetched, measured.seconds, False)

    def seconds(self, a: int, option: BlockOption) -> Optional[float]:
        """What ``option`` adds to the step at block ``a``, measured (as :meth:`terms`
        measures it) without its bytes: for a checkpoint, whose bytes the cost model
        gives (None where the block cannot run with it)."""
        layer, spec = self.layers[a], self.inputs[a]
        key = (self.signature(a), option, "seconds")
        if key not in self._cache:
            self._cache[key] = self._unless_refused(a, option, lambda: self._seconds(layer, spec, option,
                                                                                     self._layout(a)))
        return self._cache[key]

    def measured(self, a: int, option: BlockOption) -> Optional[_Measured]:
        """``option`` at block ``a`` measured (None where it fails there), once per
        kind of block."""
        key = (self.signature(a), option)
        if key not in self._cache:
            self._cache[key] = self._measure(a, option)
        return self._cache[key]

    def at_least(self, a: int, option: BlockOption, seconds: float) -> None:
        """Price ``option`` at block ``a`` at ``seconds`` or more, where it is known to do
        at least the work of an option measured at ``seconds`` (NOTE [ Kept subsets ])."""
        measured = self.measured(a, option)
        if measured is not None and measured.seconds < seconds:
            self._cache[(self.signature(a), option)] = dataclasses.replace(measured, seconds=seconds)

    def priced(self, a: int, option: BlockOption, seconds: float) -> Optional[_Measured]:
        """``option`` at block ``a`` measured untimed, as :meth:`measured` counts its
        bytes, and priced at ``seconds`` (None where it fails there): NOTE [ Kept
        subsets ]."""
        key = (self.signature(a), option)
        if key not in self._cache:
            self._cache[key] = self._measure(a, option, timed=False)
        if self._cache[key] is not None:
            self._cache[key] = dataclasses.replace(self._cache[key], seconds=seconds)
        return self._cache[key]

    def sized(self, a: int, option: BlockOption) -> Optional[tuple]:
        """``(R, FLOPs)`` of ``option`` at block ``a``, untimed (None where it fails
        there): the bytes it keeps as :meth:`measured` counts them, and the FLOPs of its
        step's matmuls and attention (``torch.utils.flop_counter``), a recompute's among
        them."""
        key = (self.signature(a), option, "sized")
        if key not in self._cache:
            self._cache[key] = self._unless_refused(a, option, lambda: (
                self._bytes_at(a, option)[0], self._flops(self.layers[a], self.inputs[a], option)))
        return self._cache[key]

    def signature(self, a: int) -> tuple:
        """What block ``a`` costs alike with: blocks of one signature are measured once
        (NOTE [ Block options priced ])."""
        if a not in self._paths:
            self._paths[a] = _modules_called(self.layers[a], self.example(a))
        return _signature(self.layers[a]), self.inputs[a], self._seen_plain[a], self._paths[a], self._layout(a)

    def _layout(self, a: int) -> Optional[GradientLayout]:
        """The layout of block ``a``'s output gradient (None: as ``torch.ones_like``)."""
        return self._last_layout if a == len(self.layers) - 1 else None

    def example(self, a: int) -> torch.Tensor:
        """An input like block ``a``'s profiled one."""
        spec = self.inputs[a]
        return _input_from(_source_like(spec, self.device), spec)

    def _measure(self, a: int, option: BlockOption, timed: bool = True) -> Optional[_Measured]:
        """``option`` at block ``a``: its bytes and, ``timed``, its seconds; None where
        the block cannot run with it."""
        layer, spec = self.layers[a], self.inputs[a]
        if option.keep == "linear_inputs" and not any(isinstance(m, nn.Linear) for m in layer.modules()):
            return None  # no Linear input to keep: the option is plain's, and would warn so

        def steps() -> _Measured:
            kept, input_kept, forward, backward, fetched = self._bytes_at(a, option)
            seconds = self._seconds(layer, spec, option, self._layout(a)) if self.timed and timed else 0.0
            return _Measured(kept, input_kept, forward, backward, fetched, seconds)

        return self._unless_refused(a, option, steps)

    @contextlib.contextmanager
    def quietly(self):
        """While open, the options measured are ones the user did not allow (priced for
        an infeasible budget's message): one the block refuses is left out unsaid, as a
        user who did not ask for it needs no news of it."""
        self._quiet = True
        try:
            yield
        finally:
            self._quiet = False

    def _unless_refused(self, a: int, option: BlockOption, steps: Callable[[], T]) -> Optional[T]:
        """``steps()``, block ``a``'s measuring steps with ``option``, or None where the
        block cannot run with it (``_CANNOT_RUN``) in any of them, a refused recompute
        said once per kind of block and option. One refusal is enough: a block whose
        recompute takes its routes from its input (top-k experts under a lossy codec)
        refuses on some inputs only, and training would meet them."""
        try:
            return steps()
        except _CANNOT_RUN as error:
            name, policy = qualified_name(self.layers[a]), option.policy
            left_out = (name, option.keep, policy.codec.name, policy.offload)
            if isinstance(error, RecomputeError) and not self._quiet and left_out not in self._left_out:
                self._left_out.add(left_out)
                kept_how = "".join((f", compress={policy.codec.name!r}" if policy.lossy else "",
                                    ", offload=True" if policy.offload else ""))
                warnings.warn(f"actsave: the block plan leaves keep={option.keep!r}{kept_how} out for blocks of "
                              f"type {name}: they cannot run with it ({type(error).__name__}: {error})",
                              stacklevel=user_stacklevel())
            return None

    def _bytes_at(self, a: int, option: BlockOption) -> tuple:
        """:meth:`_bytes` of ``option`` at block ``a``, once per kind of block (what
        :meth:`sized` counts and :meth:`measured` prices are one step)."""
        key = (self.signature(a), option, "bytes")
        if key not in self._cache:
            self._cache[key] = self._bytes(self.layers[a], self.inputs[a], option, self._layout(a))
        return self._cache[key]

    def _bytes(self, layer: nn.Module, spec: TensorSpec, option: BlockOption,
               layout: Optional[GradientLayout]) -> tuple:
        """(R with the input where kept, whether the input is kept, forward rise,
        backward rise, bytes fetched from the host) of one step of ``layer``, its output
        gradient laid out as ``layout`` says (:meth:`_layout`)."""
        with _measuring(layer) as kept_nothing:
            source = _source_like(spec, self.device)
            known = [*layer.parameters(), *layer.buffers(), source,
                     *(p.grad for p in layer.parameters() if p.grad is not None)]
            tracker, allocator = LiveBytes(self.device, known=known), AllocatorRises(self.device)
            with tracker:
                _as_the_step_finds_autocast()
                x = _input_from(source, spec)
                storage = weakref.ref(x.untyped_storage())
                host_before = kept_bytes()["host"]
                with tracker.span() as forward, allocator.span() as forward_counted:
                    y, _ = call_block(option, layer, (x,), {}, DEFAULT_RECOMPUTE, modifies_input(layer))
                fetched = float(kept_bytes()["host"] - host_before)  # what its backward brings back
                del x
                input_kept = storage() is not None
                output_bytes = allocation_bytes(y.untyped_storage().nbytes(), self.device)
                held = tracker.live - output_bytes
                gradient = ones_like(y, layout)
                with tracker.span() as backward, allocator.span() as backward_counted:
                    _as_the_step_finds_autocast()  # its casts go: the backward makes its own again
                    _backward(y, gradient)
                del y, gradient
        if kept_nothing:  # a selective option that keeps what a checkpoint of its inputs does, more slowly
            raise ConfigError(f"selective keeps nothing of {type(layer).__name__}: {kept_nothing[0]}")
        # A rise is the larger of the live storages' and the allocator's: NOTE [ Allocator rises ].
        return (float(held), input_kept, float(max(forward[0], forward_counted[0])),
                float(max(backward[0], backward_counted[0])), fetched)

    def _flops(self, layer: nn.Module, spec: TensorSpec, option: BlockOption) -> int:
        counting = FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION_FLOPS)
        with _measuring(layer), counting as counter:
            x = _input_from(_source_like(spec, self.device), spec)
            y = call_block(option, layer, (x,), {}, DEFAULT_RECOMPUTE, modifies_input(layer))[0]
            _backward(y, torch.ones_like(y))
        return counter.get_total_flops()

    def _seconds(self, layer: nn.Module, spec: TensorSpec, option: BlockOption,
                 layout: Optional[GradientLayout]) -> float:
        """The option's step less the plain block's, medians of interleaved runs."""
        runs = {"option": [], "plain": []}
        with _measuring(layer):
            for _ in range(_TIMED_REPEATS + 1):  # the first of each warms up
                for name, chosen in (("option", option), ("plain", None)):
                    runs[name].append(self._timed_step(layer, spec, chosen, layout))
        extra = statistics.median(runs["option"][1:]) - statistics.median(runs["plain"][1:])
        return max(extra, 0.0) + _LEAST_EXTRA_SECONDS

    def _timed_step(self, layer: nn.Module, spec: TensorSpec, option: Optional[BlockOption],
                    layout: Optional[GradientLayout]) -> float:
        x = _input_from(_source_like(spec, self.device), spec)
        _as_the_step_finds_autocast()
        synchronize(self.device)
        start = time.perf_counter()
        if option is None:
            y = layer(x)
        else:
            y = call_block(option, layer, (x,), {}, DEFAULT_RECOMPUTE, modifies_input(layer))[0]
        gradient = ones_like(y, layout)
        _as_the_step_finds_autocast()
        _backward(y, gradient)
        synchronize(self.device)
        return time.perf_counter() - start


def _cpu_attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_attention_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


# The CPU's fused attention, which torch.utils.flop_counter (torch 2.13) does not count:
# its FLOPs are the other fused attentions'.
_CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flops,
}


@contextlib.contextmanager
def _measuring(layer: nn.Module):
    """A step of ``layer`` alone, as the planner runs one (isolated, grad on), yielding
    the reasons a selective checkpoint in it kept nothing, noted instead of warned."""
    with isolated_steps(layer), torch.enable_grad(), kept_nothing_noted() as kept_nothing:
        yield kept_nothing


def _modules_called(layer: nn.Module, x: torch.Tensor) -> Optional[tuple]:
    """The names of the modules under ``layer`` that its forward on ``x`` calls, in order
    (under no_grad, isolated as the planner's steps are); None where it cannot run so."""
    names = {module: name for name, module in layer.named_modules()}
    called = []
    handle = register_module_forward_pre_hook(lambda module, _: called.append(names.get(module)))
    try:
        with isolated_steps(layer), torch.no_grad():
            layer(x)
    except Exception:  # noqa: BLE001 - the measurements say why, where an option is tried
        return None
    finally:
        handle.remove()
    return tuple(called)


def _as_the_step_finds_autocast() -> None:
    """Drop the casts autocast's cache holds (nothing outside autocast), as a training
    step finds it at its forward's start (its region just entered) and at its backward's
    (after the region's exit dropped them; NOTE [ Casts autocast caches ] in
    runtime/replay.py). Measured with the cache as an earlier measurement left it, an
    option would find the block's weight casts made already, in its forward and in its
    recompute, and count neither (a selective block whose matmuls are not nn.Linear:
    docs/limits.md, "Meta estimates", on autocast)."""
    torch.clear_autocast_cache()


def _backward(y: torch.Tensor, gradient: torch.Tensor) -> None:
    """The block's backward from ``y``; none where nothing in it needs a gradient (a
    frozen first block: its input and parameters need none, so it saves nothing)."""
    if y.requires_grad:
        torch.autograd.backward(y, gradient)


def _source_like(spec: TensorSpec, device) -> torch.Tensor:
    """A leaf like the profiled input, requiring grad as it did."""
    if not spec.dtype.is_floating_point:
        return torch.zeros(spec.shape, dtype=spec.dtype, device=device)
    return torch.randn(spec.shape, dtype=spec.dtype, device=device).requires_grad_(spec.requires_grad)


def _input_from(source: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The input a step runs on: a tensor autograd made from ``source`` where the
    profiled input was one (a codec encodes such an input, not a leaf), allocated
    where it is called (inside a byte count)."""
    return source * 1 if spec.encodable and source.requires_grad else source.clone()


def _signature(layer: nn.Module) -> tuple:
    """What makes two layers cost alike, as their modules tell: their block's class,
    parameters' names and shapes, their other arguments' shapes (blocks.py's BlockCall
    holds them as buffers), and which of their other outputs get gradients (NOTE [
    Outputs the caller holds ])."""
    block = getattr(layer, "block", layer)
    parameters = tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in block.named_parameters())
    arguments = tuple((name, tuple(b.shape), b.dtype) for name, b in layer.named_buffers(recurse=False))
    return type(block), parameters, arguments, getattr(layer, "other_gradients", ())


__all__ = ["OptionTerms", "BlockMeasurer", "candidate_options", "model_terms", "options_at"]
