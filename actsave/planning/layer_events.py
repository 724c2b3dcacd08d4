"""The memory model's events that no keep option changes (memory_model.py, module
docstring): the profile's per-layer terms as arrays (:class:`LayerEvents`), for a
segment starting at a each layer's forward, recompute, backward and loss events
(:class:`Events`), and for every segment [a, b) the largest of them (:class:`Tables`,
where a recompute stops at its last save: :func:`until_last_save`). Both segment
kinds' terms are built on these: plain_model.py and memory_model.py (CostModel).
"""
from __future__ import annotations

from functools import cached_property
from typing import NamedTuple

import numpy as np

from .fsdp_gathers import prefetched_layers
from .profiler import Profile


class LayerEvents:
    """The profile's per-layer terms as numpy arrays (memory_model.py's X, x_i, g_i,
    O, L, fwd_i, nfwd_i, bwd_i, Saved, U, S, M, Q, the times), the events of the layers from each
    start (:meth:`events_from`) and, for the solvers, the largest of them over every
    segment [a, b) (:attr:`tables`, built on first use). Every segment kind's terms
    (plain_model.py, memory_model.py) are built on these."""

    def __init__(self, prof: Profile):
        layers = prof.layers
        n = self.n = len(layers)
        self.chain_input = prof.input_bytes

        def column(attr: str) -> np.ndarray:
            return np.array([getattr(layer, attr) for layer in layers], dtype=np.float64)

        self.input = column("input_bytes")
        # g_0 .. g_n: g_n, the output's gradient, is in held_in_backward where the caller
        # holds it through the backward, else the last layer's (memory_model.py, O).
        held_grad = prof.output_grad_bytes if prof.output_grad_held else 0
        self.grad = np.append(column("input_grad_bytes"), float(prof.output_grad_bytes - held_grad))
        # O, the gradients pending between two uses of a parameter (profiler.py, NOTE
        # [ Gradients pending between two uses ]) and the loss (live_bytes.py, NOTE [ What a
        # step's loss holds ]).
        self.held_in_backward = prof.output_bytes + held_grad + prof.pending_gradient_bytes + prof.loss_held_bytes
        self.loss_rise = prof.loss_rise
        self.output = prof.output_bytes
        self.output_first, self.output_last = prof.output_saved_by or (n, -1)
        self.forward_rise, self.backward_rise = column("forward_rise"), column("backward_rise")
        self.rise_to_last_save = column("forward_rise_to_last_save")
        self.no_grad_rise = column("no_grad_rise")
        # One restore at a time: a ReLU's or a max pool's (runtime/relu_signs.py, pool_decisions.py).
        self.restore = np.maximum(column("relu_restore_bytes"), column("pool_restore_bytes"))
        spans = [layer.input_saved_by or (n, -1) for layer in layers]  # (n, -1): saved by no layer
        self.input_first = np.array([first for first, _ in spans])
        self.input_last = np.array([last for _, last in spans])
        # A plain middle segment ending at a may hold x_a in its saves (memory_model.py,
        # "A tensor at a plain boundary"): x_a where a layer before a saves it, and the
        # part of it that Saved(a, .) counts (a layer from a on saves it too).
        layer_index = np.arange(n)
        self.reused_input = np.where(self.input_first < layer_index, self.input, 0.0)
        self.reused_saved = np.where(self.input_last >= layer_index, self.reused_input, 0.0)
        saving = np.where([layer.saves_for_backward for layer in layers], np.arange(n), -1)
        self.last_saver = np.maximum.accumulate(saving)  # the last saving layer at or before i
        # FSDP2's units a recompute gathers stay gathered to their backward:
        # NOTE [ Gathered parameters ] (fsdp_gathers.py).
        gathered = column("gathered_bytes")
        self.gathered_before = np.concatenate(([0.0], np.cumsum(gathered)))  # over [0, i)
        self.prefetched_layer = np.array(prefetched_layers(gathered.tolist()), dtype=np.int64)
        self.prefetched = np.where(self.prefetched_layer >= 0, gathered[self.prefetched_layer], 0.0)
        decisions = column("relu_sign_bytes") + column("pool_decision_bytes")
        self.signs_before = np.concatenate(([0.0], np.cumsum(decisions)))  # S over [0, i)
        # M over [0, i): the module state snapshotted, and the weight casts autocast caches.
        held = column("mutated_state_bytes") + column("cached_cast_bytes")
        self.state_before = np.concatenate(([0.0], np.cumsum(held)))
        self.forward_s_before = np.concatenate(([0.0], np.cumsum(column("forward_s"))))
        self.backward_s_before = np.concatenate(([0.0], np.cumsum(column("backward_s"))))
        # A checkpointed segment's (or nested range's) time beyond its layers' first run:
        # call_s, and its layers' forward again with the runtime's work on each of their
        # saves (checkpoint_host.py), over [0, i).
        self.call_s = prof.checkpoint_host.call_s
        self.recompute_s_before = self.forward_s_before + prof.checkpoint_host.save_s * np.concatenate(
            ([0.0], np.cumsum(column("saves"))))
        # A checkpoint whose first layer changes its input in place keeps a copy of the
        # input (runtime/keep_rules.py, modifies_input), and its recompute, where the input needs a gradient,
        # runs on one more copy (Q).
        self.kept_copy = np.array([layer.dense_input_bytes if layer.modifies_input else 0 for layer in layers],
                                  dtype=np.float64)
        self.private_copy = np.where(column("input_grad_bytes") > 0, self.kept_copy, 0.0)
        self.saved_first, self.saved_last, self.saved_bytes = (
            np.array([getattr(s, field) for s in prof.saved], dtype=dtype)
            for field, dtype in (("first", np.int64), ("last", np.int64), ("nbytes", np.float64)))

    def saved_from(self, a: int) -> np.ndarray:
        """Saved(a, i) for i = a .. n-1: the storages whose saving layers meet [a, i]
        (first <= i and last >= a), each counted from max(first, a)."""
        meets = self.saved_last >= a
        counted_from = np.maximum(self.saved_first[meets], a) - a
        return np.cumsum(np.bincount(counted_from, weights=self.saved_bytes[meets], minlength=self.n - a))

    def events_from(self, a: int) -> "Events":
        """The option-independent events of every layer i = a .. n-1 in a segment
        starting at a (index i - a)."""
        i = np.arange(a, self.n)
        saved = self.saved_from(a)
        unsaved = self._unsaved(a, i)
        unsaved_input = 0.0 if a == 0 else self.input[a]  # the chain input is in X
        caller_held = self._held_by_caller(a, i)
        plain_forward = (np.concatenate(([unsaved_input], saved[:-1] + unsaved[1:])) + caller_held
                          + self.forward_rise[a:])
        before_recompute = self._held_before_layers(a, saved, unsaved) + self._gathered_between(a, i)
        backward = self._backward_events(a, saved, i)
        # A checkpointed forward holds one layer's input at a time, the segment's own
        # beside it (NOTE [ A checkpointed segment's forward ], memory_model.py).
        checkpointed_forward = np.where(i > a, self.input[i], 0.0) + self.no_grad_rise[a:]
        return Events(saved=saved,
                       plain_forward=plain_forward,
                       caller_held=caller_held,
                       loss=self._loss_event(a, saved[-1]),
                       backward=backward,
                       checkpointed_backward=backward + self._gathered_in_backward(a, i),
                       recompute=before_recompute + self.forward_rise[a:],
                       recompute_to_last_save=before_recompute + self.rise_to_last_save[a:],
                       checkpointed_forward=checkpointed_forward)

    def _gathered_between(self, a: int, i) -> np.ndarray:
        """The gathered parameters of layers a .. i-1, which a recompute from a keeps
        gathered until their backward (NOTE [ Gathered parameters ]): beside layer i's
        recompute."""
        return self.gathered_before[i] - self.gathered_before[a]

    def _gathered_in_backward(self, a: int, i: np.ndarray) -> np.ndarray:
        """Those beside layer i's backward in a checkpointed segment from a: of layers
        a .. i-1, less the prefetched layer's, which the rise bwd_i holds."""
        source = self.prefetched_layer[i]
        return self._gathered_between(a, i) - np.where(source >= a, self.prefetched[i], 0.0)

    def _held_by_caller(self, a: int, i: np.ndarray) -> np.ndarray:
        """[x_a] for i = a .. n-1: after its first layer, the segment's input, which the
        caller holds until the segment's forward returns (sequential.py), where no save
        of layers a .. i-1 holds it (X holds the chain input)."""
        return np.where((i > a) & (a > 0) & ~self.saved_within(a, a, i - 1), self.input[a], 0.0)

    def _held_before_layers(self, a: int, saved: np.ndarray, unsaved: np.ndarray) -> np.ndarray:
        """Saved'(a, i-1) + U(i), for i = a .. n-1: what a recompute from a
        holds as layer i starts, beyond the segment input (counted by the option)."""
        i = np.arange(a, self.n)
        saved_without_input = saved - np.where(self.saved_within(a, a, i), self.input[a], 0.0)
        return np.concatenate(([0.0], saved_without_input[:-1] + unsaved[1:]))

    def saved_within(self, k, a, last) -> np.ndarray:
        """Whether a save of the layers a .. ``last`` holds x_k: the span of the layers
        that save it (input_first .. input_last) meets [a, last]. Broadcastable arrays."""
        return (self.input_first[k] <= last) & (self.input_last[k] >= a)

    def _unsaved(self, a: int, i: np.ndarray) -> np.ndarray:
        """U(i) for i = a .. n-1: layer i's input, unless a layer in [a, i) saved it."""
        return np.where(self.saved_within(i, a, i - 1), 0.0, self.input[i])

    def _loss_event(self, s: int, saved_by_all: float) -> float:
        """Saved(s, n-1) + U(n) + L: the plain segment [s, n) while the loss runs."""
        output_saved = self.output_first <= self.n - 1 and self.output_last >= s
        return saved_by_all + (0.0 if output_saved else self.output) + self.loss_rise

    def _backward_events(self, a: int, saved: np.ndarray, i: np.ndarray) -> np.ndarray:
        """O + Saved(a, i) + g_{i+1} + bwd_i for i = a .. n-1, O less the output where
        Saved counts it."""
        output_in_saved = (self.output_first <= i) & (self.output_last >= a)
        held = self.held_in_backward - np.where(output_in_saved, self.output, 0.0)
        return held + saved + self.grad[i + 1] + self.backward_rise[i]

    def saves(self, a, b) -> np.ndarray:
        """Whether any layer of [a, b) saves a tensor (else nothing is kept or recomputed)."""
        return self.last_saver[b - 1] >= a

    @cached_property
    def tables(self) -> "Tables":
        """The largest events of every segment [a, b), from each start's events by
        running maxima over the ends."""
        n = self.n
        recompute, lossy_recompute, backward, checkpointed_backward, plain_forward, saved, checkpointed_forward = (
            np.full((n, n), np.inf) for _ in range(7))
        plain_peak, held_plain_peak = np.empty(n), np.empty(n)
        held_plain_forward = plain_forward.copy()
        for a in range(n):
            events = self.events_from(a)
            plain_peak[a] = events.plain_peak
            held = events.without_input(self.reused_input[a], self.reused_saved[a]) if self.reused_input[a] else events
            held_plain_peak[a] = held.plain_peak
            held_plain_forward[a, a + 1:] = np.maximum.accumulate(held.plain_forward)[:n - 1 - a]
            last = self.last_saver[a:n - 1] - a  # for ends b = a+1 .. n-1
            recompute[a, a + 1:] = until_last_save(events.recompute, events.recompute_to_last_save, last)
            lossy_recompute[a, a + 1:] = until_last_save(events.recompute + self.restore[a:],
                                                          events.recompute_to_last_save + self.restore[a:], last)
            backward[a, a + 1:] = np.maximum.accumulate(events.backward)[:n - 1 - a]
            checkpointed_backward[a, a + 1:] = np.maximum.accumulate(events.checkpointed_backward)[:n - 1 - a]
            plain_forward[a, a + 1:] = np.maximum.accumulate(events.plain_forward)[:n - 1 - a]
            checkpointed_forward[a, a + 1:] = np.maximum.accumulate(events.checkpointed_forward)[:n - 1 - a]
            saved[a, a + 1:] = events.saved[:n - 1 - a]
        return Tables(recompute, lossy_recompute, backward, checkpointed_backward, plain_forward,
                      held_plain_forward, saved, plain_peak, held_plain_peak, checkpointed_forward)

    @property
    def backward(self) -> np.ndarray:
        """[a, b]: the largest backward event of the segment [a, b)."""
        return self.tables.backward


class Events(NamedTuple):
    """The option-independent events of the layers i = a .. n-1 of a segment starting
    at a, one array each (index i - a), in the terms of memory_model.py's docstring."""

    saved: np.ndarray  # Saved(a, i): a plain middle segment [a, i+1) keeps these
    plain_forward: np.ndarray  # Saved(a, i-1) + U(i) + [x_a] + fwd_i: a plain segment's forward
    caller_held: np.ndarray  # [x_a]: the segment's input, held by the caller and no save
    loss: float  # Saved(a, n-1) + U(n) + L: the plain segment's loss
    backward: np.ndarray  # O + Saved(a, i) + g_{i+1} + bwd_i
    checkpointed_backward: np.ndarray  # the same in a checkpointed segment: + G'(a, i-1)
    recompute: np.ndarray  # Saved'(a, i-1) + U(i) + G(a, i-1) + fwd_i: the option adds its held bytes
    recompute_to_last_save: np.ndarray  # the same, the layer's rise up to its last save
    checkpointed_forward: np.ndarray  # [i > a] x_i + nfwd_i: the option adds what the segment holds

    @property
    def plain_peak(self) -> float:
        """W_plain(a): the largest event of the plain segment [a, n)."""
        return float(max(self.plain_forward.max(), self.loss, self.backward.max()))

    def without_input(self, first: float, saved: float) -> "Events":
        """The plain segment's events when the plain middle segment before holds x_a:
        ``first`` (x_a) off its first forward event (U(a)) and those where the caller
        holds it ([x_a]), ``saved`` (x_a where Saved(a, .) counts it, else 0) off Saved
        and every other event counting it."""
        forward = self.plain_forward - np.where(self.caller_held > 0, first, saved)
        forward[0] = self.plain_forward[0] - first
        return self._replace(saved=self.saved - saved, plain_forward=forward, loss=self.loss - saved,
                             backward=self.backward - saved, checkpointed_backward=self.checkpointed_backward - saved)


class Tables(NamedTuple):
    """[a, b]: the largest event of the segment [a, b) (inf below the diagonal); [s]:
    of the plain segment [s, n), its saves as they are."""

    recompute: np.ndarray  # -inf where nothing is recomputed
    lossy_recompute: np.ndarray  # with the ReLU restores of a lossy codec
    backward: np.ndarray
    checkpointed_backward: np.ndarray  # with the gathered parameters a recompute holds
    plain_forward: np.ndarray  # the largest forward event of a plain middle segment
    held_plain_forward: np.ndarray  # the same after a plain middle segment whose saves hold x_a
    saved: np.ndarray  # Saved(a, b-1): what a plain middle segment keeps
    plain_peak: np.ndarray  # [s]: W_plain(s)
    held_plain_peak: np.ndarray  # [s]: the same after a plain middle segment whose saves hold x_s
    checkpointed_forward: np.ndarray  # the largest forward event of a checkpointed segment


def until_last_save(full: np.ndarray, truncated: np.ndarray, last: np.ndarray) -> np.ndarray:
    """For each segment end, the largest recompute event: layers before the segment's
    last saving layer (``last``, relative to the start) run whole (``full``), that
    layer up to its last save (``truncated``: the early stop), the rest not at all;
    -inf when no layer saves."""
    running = np.maximum.accumulate(full)
    whole = np.where(last > 0, running[np.maximum(last - 1, 0)], -np.inf)
    return np.where(last >= 0, np.maximum(whole, truncated[np.maximum(last, 0)]), -np.inf)
