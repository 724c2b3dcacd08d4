"""The backward's recompute of a selective checkpoint (selective.py, NOTE [ Selective
recompute ]): each kept call, matched in order, returns its forward output in place of
running, and the views it saved of its arguments are made again of the recomputed ones
(:class:`Skipper`)."""
from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import nn

from .._torch import version
from ..errors import RecomputeError
from ..layouts import copied_with_strides
from .forward_dispatch import forward_replaced
from .function import _AllSlotsFilled, qualified_name
from .kept_calls import KeptCall, attributes_put_back_after, described, keepable_now, replay_attributes
from .placeholders import Cursor
from .replay import generators_put_back
from .kept_ops import TAPPED_FUNCTIONS
from .nested import _GRAPH_ANCHOR, _RequiresGrad
from .store import input_tensors

if TYPE_CHECKING:  # the frame that makes a Skipper
    from .selective import SelectiveFrame


class Skipper:
    """The backward's recompute of a selective frame: each kept call, matched in order,
    returns its forward output and fills its placeholders instead of running."""

    def __init__(self, frame: SelectiveFrame, cursor: Cursor, into, count: int):
        self.frame, self.cursor, self.into, self.count = frame, cursor, into, count
        self.next = 0
        self.depth = 0

    @contextlib.contextmanager
    def active(self):
        with contextlib.ExitStack() as stack:
            stack.enter_context(attributes_put_back_after(self.frame.calls))
            stack.enter_context(generators_put_back(_passed_to_skipped(self.frame.calls)))
            for module in self.frame._watched:
                stack.enter_context(forward_replaced(module, functools.partial(self._module_call, module)))
            for name in self.frame.functions:
                stack.enter_context(TAPPED_FUNCTIONS[name].handled(self._function_call(name)))
            yield

    def _module_call(self, module: nn.Module, run: Callable) -> Callable:
        @functools.wraps(run)
        def call(*args, **kwargs):
            return self._skip_or_run(module, run, args, kwargs)
        return call

    def _function_call(self, name: str) -> Callable:
        def call(call_next, *args, **kwargs):
            return self._skip_or_run(name, call_next, args, kwargs)
        return call

    def _skip_or_run(self, target, run: Callable, args: tuple, kwargs: dict):
        if self.depth or not keepable_now(self.frame.meta_depth):  # inside a call run again, or not kept
            return run(*args, **kwargs)
        call = self._matching(target)
        if not call.skipped:
            follows = self._next_of(target) if call.raised else None
            self.depth += 1
            self.frame.run_in_place_of = follows
            try:
                output = run(*args, **kwargs)
            finally:
                self.depth -= 1
                self.frame.run_in_place_of = None
            if follows is not None:  # it returned: it stands for the fallback's call, after the ones that raised
                self.next = self.frame.calls.index(follows) + 1
            return output
        # A stored output (by a codec, or on the host: the copy may still read it on a
        # GPU) is checked by its counter as one kept as it is: NOTE [ Stored kept outputs ].
        counter = call.output if call.stored is None else call.stored.counter
        if counter is not None and version(counter) != call.version:
            raise RecomputeError(
                f"the output of {described(call.target)}, which a selective checkpoint of "
                f"{qualified_name(self.frame.function)} keeps instead of running it again, was changed in place "
                f"after the checkpointed forward returned (version {version(counter)}, expected {call.version}): "
                "the recompute would read it in place of the output the forward used. Change a copy (out.clone()), or "
                "use keep='inputs', which recomputes it.")
        arguments = input_tensors(args, kwargs)
        self._check_arguments(call, arguments)
        self._fill_views(call, arguments)  # the early stop may end the recompute in there
        if call.let_go:  # past the early stop, which the function caught (a try/except around an op)
            raise _AllSlotsFilled
        replay_attributes(call)
        if call.rng_after is not None:  # it drew in the forward: later calls draw after it
            call.rng_after.restore()
        output = call.kept_output()
        return _RequiresGrad.apply(_GRAPH_ANCHOR, output) if call.requires_grad else output

    def _matching(self, target) -> KeptCall:
        calls, frame = self.frame.calls, self.frame
        while self.next < len(calls) and calls[self.next].raised and calls[self.next].target is not target:
            self.next += 1  # not made again: the function took another way after it raised
        if self.next >= len(calls) or calls[self.next].target is not target:
            expected = "nothing" if self.next >= len(calls) else described(calls[self.next].target)
            raise frame._mismatch(
                f"the recompute of {qualified_name(frame.function)} called {described(target)} where the forward "
                f"called {expected} (kept call {self.next}): {self._not_the_same_work()}")
        self.next += 1
        return calls[self.next - 1]

    def _next_of(self, target) -> Optional[KeptCall]:
        """The next kept call that did not raise, past those that did (of any target),
        where it is one of ``target``: a call matched to one that raised in the forward
        stands for it if it returns, the recompute having taken the way the function took
        after the failures (a fallback to the same module or function). Run in full, it
        then makes that call's saves."""
        following = next((call for call in self.frame.calls[self.next:] if not call.raised), None)
        return following if following is not None and following.target is target else None

    def _check_arguments(self, call: KeptCall, arguments: list) -> None:
        """A kept call stands for the forward's only where the recompute passes it tensors
        of the forward's shapes: its output and its saves' views of its arguments are
        the forward's (a view made again of a longer argument reads other elements)."""
        shapes = [tuple(argument.shape) for argument in arguments]
        if shapes != [argument.shape for argument in call.arguments]:
            raise self.frame._mismatch(
                f"the recompute of {qualified_name(self.frame.function)} passed {described(call.target)} tensors of "
                f"shapes {shapes} where the forward passed {[argument.shape for argument in call.arguments]}: "
                f"{self._not_the_same_work()}")

    def _not_the_same_work(self) -> str:
        why = ("the function does not do the same work twice (state it reads and appends to runs again: Hugging "
               "Face's use_cache=True, pass use_cache=False to train")
        if self.frame.policy.lossy:  # a choice made again on decoded values (a router's top-k) may flip
            why += ("; or, under a lossy codec, a choice it makes again from decoded values, as a router's top-k, "
                    "went another way: keep it exactly (compress=None) or use keep='saves'")
        return why + "). Make it deterministic or do not checkpoint it."

    def _fill_views(self, call: KeptCall, arguments: list) -> None:
        """Fill the call's views of its arguments, made of the recomputed ones; move the
        cursor past its saves (the early stop may end the recompute at one of them)."""
        if self.cursor.position != call.start:
            raise self.frame._mismatch(
                f"the recompute of {qualified_name(self.frame.function)} saved {self.cursor.position} tensors before "
                f"{described(call.target)} where the forward saved {call.start}: the function does not do the "
                "same work twice. Make it deterministic or do not checkpoint it.")
        for index in range(call.start, call.stop):
            self.cursor.position = index + 1
            view = call.views.get(index)
            if view is not None:
                position, size, stride, offset = view
                argument = _in_layout(arguments[position], call.arguments[position].stride)
                made = argument.as_strided(size, stride, argument.storage_offset() + offset)
                self.frame.fill_view(index, made, self.into, self.count)


def _passed_to_skipped(calls: list) -> list:
    """The generators passed to the kept calls that drew in the forward, each once: a
    recompute that skips such a call sets them as the forward's call left them
    (RandomState.restore), and puts them back as it ends, as it does the default
    generators (replay.py): it draws for the code it runs again, not for the steps
    after it."""
    return list({id(generator): generator for call in calls if call.rng_after is not None
                 for generator, _ in call.rng_after.passed}.values())


def _in_layout(argument: torch.Tensor, strides: tuple) -> torch.Tensor:
    """``argument`` with ``strides``, its forward counterpart's, so that the forward's views
    of it can be made again: a copy where it came back otherwise (a kept input that was
    a strided slice comes back dense from a codec or the host: NOTE [ Kept layouts ])."""
    return argument if argument.stride() == strides else copied_with_strides(argument, strides)


__all__ = ["Skipper"]
