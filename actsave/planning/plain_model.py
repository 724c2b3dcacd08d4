"""The terms of the memory model's plain segments (memory_model.py, module
docstring): the last segment, its saves kept by autograd as they are or by a lossy
codec (runtime/kept_saves.py), and plain middle segments, which run plainly
and keep autograd's saves from their forward to their backward.
"""
from __future__ import annotations

from functools import cached_property
from typing import Sequence

import numpy as np

from ..errors import InternalError
from .layer_events import Events, LayerEvents
from .profiler import Profile


class PlainTerms(LayerEvents):
    """The terms of the plain segments (memory_model.py): the last, [s, n), its saves
    kept as they are or by a lossy codec k (W_plain(s, k), its seconds), and plain
    middle ones, their saves as they are (R = Saved(a, b-1), W + C, whether they hold
    the next segment's input) or by k (R = Saved_k(a, b-1), W + C, seconds): for one
    plan, from its own events (:meth:`plain_working_set`, :meth:`segment_plain_middle`,
    :meth:`segment_coded_middle`), and for the solvers, every start or segment at once
    from the tables (:attr:`plain_peaks`, :meth:`plain_middle_working_set`,
    :meth:`coded_middle_working_set`)."""

    def __init__(self, prof: Profile, stored_codecs: Sequence[str] = ("none",), plain_middle: bool = False):
        """``stored_codecs``: how the plain segment may keep autograd's saves, "none"
        (as they are) first, then lossy codec names (the profile's StoredSaves).
        ``plain_middle``: whether the solvers may run segments before the last plainly
        (a plan's prediction prices them either way)."""
        super().__init__(prof)
        self.plain_middle = plain_middle
        self.stored_codecs = list(stored_codecs)
        if self.stored_codecs[0] != "none":
            raise InternalError(f"stored_codecs={stored_codecs!r} must start with 'none'")
        if len(self.stored_codecs) > 1 and prof.stored_saves is None:
            raise InternalError("this profile records no stored saves: its plain segment can only be exact")
        self._stored_by_codec = [_CodedSaves(prof, codec) for codec in self.stored_codecs[1:]]
        self.plain_middle_reach = self._plain_middle_reach()

    def _plain_middle_reach(self) -> np.ndarray:
        """[a]: the farthest end a plain middle segment from a needs: the first boundary
        b > a where two plain segments [., b) [b, .) are one (else n - 1).

        They are where Saved is additive across b: no storage is saved on both sides
        but x_b's (held by the first, left out by the second: memory_model.py, "A tensor
        at a plain boundary"), and x_b's storage is not x_{b+1}'s too (a view), which the second
        would count again as U(b+1). There the plain middle segment [a, c), c > b,
        has the events, R and bit of [a, b) then [b, c): the solvers stop at b and
        go on with [b, c), the same plans in fewer steps."""
        n = self.n
        boundaries = np.arange(1, n)
        # Storages saved on both sides of b: first <= b-1 and last >= b.
        crossing = np.zeros(n + 1)
        np.add.at(crossing, self.saved_first + 1, 1)
        np.add.at(crossing, np.maximum(self.saved_last + 1, self.saved_first + 1), -1)
        crossing = np.cumsum(crossing)[boundaries]
        input_crosses = (self.input_first[boundaries] < boundaries) & (self.input_last[boundaries] >= boundaries)
        next_first = np.append(self.input_first[2:], self.output_first)
        next_last = np.append(self.input_last[2:], self.output_last)
        view = ((self.input_first[boundaries] < n) & (next_first == self.input_first[boundaries])
                & (next_last == self.input_last[boundaries]))
        joins = (crossing == input_crosses) & ~view
        reach = np.full(n, n - 1)
        join_at = boundaries[joins]
        later = np.searchsorted(join_at, np.arange(n), side="right")  # the first join b > a
        found = later < join_at.size
        reach[found] = join_at[later[found]]
        return reach

    def plain_working_set(self, s: int, k: int = 0, input_held: bool = False) -> float:
        """W_plain(s, k): the largest event of the plain segment [s, n), its saves kept
        by ``stored_codecs[k]``; ``input_held``: after a plain middle segment whose
        saves hold x_s."""
        if k == 0:
            return self._plain_events_from(s, input_held).plain_peak
        return float(self._coded_plain_working_sets(k, np.array([s]), input_held)[0])

    def _plain_events_from(self, a: int, input_held: bool) -> Events:
        """events_from(a), with ``input_held`` as a plain segment reads them: x_a,
        held by the plain middle segment before, taken off its first forward event
        and, where Saved(a, .) counts it, off every event and Saved."""
        events = self.events_from(a)
        if not input_held:
            return events
        return events.without_input(self.reused_input[a], self.reused_saved[a])

    def _coded_plain_working_sets(self, k: int, starts: np.ndarray, input_held: bool = False) -> np.ndarray:
        """W_plain(s, k) for each s in ``starts``, k > 0 (a lossy codec), from the
        coded events of the layers from s alone (:meth:`_coded_events`): one plan's."""
        forward, backward, saved = self._coded_events(k, starts, input_held)
        return self._with_loss_event(k, starts, np.maximum(forward, backward).max(axis=1), saved[:, -1])

    def _coded_plain_peaks(self, k: int, input_held: bool) -> np.ndarray:
        """W_plain(s, k) for every start s, from the tables the solvers read."""
        table, bit = self._coded_tables[k - 1], int(input_held)
        events = np.maximum(table[0][bit, :, -1], table[1][bit, :, -1])
        return self._with_loss_event(k, np.arange(self.n), events, table[2][bit, :, -1])

    def _with_loss_event(self, k: int, starts: np.ndarray, events: np.ndarray, saved_by_all: np.ndarray) -> np.ndarray:
        """The larger of ``events`` and the loss event of the plain segment from each
        of ``starts`` whose saves (``saved_by_all``: Saved_k(s, n-1)) codec k keeps."""
        coded = self._stored_by_codec[k - 1]
        output_held_at_end = (coded.output_first <= self.n - 1) & (coded.output_last >= starts)
        loss = saved_by_all + np.where(output_held_at_end, 0.0, self.output) + self.loss_rise
        return np.maximum(events, loss)

    def _coded_events(self, k: int, starts: np.ndarray, input_held=False) -> tuple:
        """(forward, backward, Saved_k): [s, i], for each s in ``starts`` (rows) and
        layer i (columns), the events of layer i in a plain segment from s whose saves
        lossy codec k keeps (memory_model.py; -inf for i < s; the backward's without
        the carry C) and Saved_k(s, i). ``input_held``: after a plain middle segment
        whose saves hold x_s, which the segment's events then leave out (as its
        input, the caller's or a save as it is). A plain middle segment [a, b) reads
        layers a .. b-1 of row a, the last one every layer of its row."""
        coded, n = self._stored_by_codec[k - 1], self.n
        s, i = starts[:, None], np.arange(n)[None, :]
        reused = np.where(input_held, self.reused_input[s], 0.0)
        input_as_is = (coded.input_first[s] <= i) & (coded.input_last[s] >= s)  # x_s held by a save as it is
        saved = coded.saved_table()[starts] - np.where(input_as_is, reused, 0.0)  # [s, i] = Saved_k(s, i), i >= s
        held = (coded.input_first[i] <= i - 1) & (coded.input_last[i] >= s)
        unsaved = np.where(i == s, np.where(s > 0, self.input[s] - reused, 0.0),  # the chain input is in X
                           np.where(held, 0.0, self.input[i]))
        # The caller holds the segment's input until the segment's forward returns
        # (sequential.py), which no save holds here: X holds the chain input.
        caller_held = np.where((i > s) & (s > 0) & ~input_as_is, self.input[s] - reused, 0.0)
        forward = saved + unsaved + caller_held + np.maximum(self.forward_rise[i], coded.encode_rise[i])
        output_held = (coded.output_first <= i) & (coded.output_last >= s)
        backward = (self.held_in_backward - np.where(output_held, self.output, 0.0) + saved + self.grad[i + 1]
                    + np.maximum(coded.backward_rise[i], coded.decode_rise[i]))
        return np.where(i >= s, forward, -np.inf), np.where(i >= s, backward, -np.inf), saved

    def plain_seconds(self, s: int, k: int) -> float:
        """What keeping the saves of the plain segment [s, n) by ``stored_codecs[k]``
        adds to the step (0 for "none")."""
        return 0.0 if k == 0 else float(self._stored_by_codec[k - 1].seconds_from[s])

    @cached_property
    def plain_peaks(self) -> np.ndarray:
        """[k, s]: W_plain(s, k) for every stored codec k and start s."""
        codecs = range(1, len(self.stored_codecs))
        return np.array([self.tables.plain_peak, *(self._coded_plain_peaks(k, False) for k in codecs)])

    @cached_property
    def held_plain_peaks(self) -> np.ndarray:
        """[k, s]: W_plain(s, k) after a plain middle segment whose saves hold x_s
        (where none can, as plain_peaks)."""
        codecs = range(1, len(self.stored_codecs))
        return np.array([self.tables.held_plain_peak, *(self._coded_plain_peaks(k, True) for k in codecs)])

    @cached_property
    def plain_time(self) -> np.ndarray:
        """[k, s]: plain_seconds(s, k)."""
        return np.array([np.zeros(self.n), *(coded.seconds_from[:self.n] for coded in self._stored_by_codec)])

    def plain_middle_holds_output(self, a, b) -> np.ndarray:
        """Whether the saves of the plain middle segment [a, b), Saved(a, b-1), hold
        x_b, the next segment's input (a layer of [a, b) saves its storage)."""
        return self.saved_within(b, a, b - 1)

    def plain_middle_working_set(self, a, b, carries: np.ndarray, input_held=False) -> np.ndarray:
        """W of the plain middle segment [a, b) + C on its backward events, for each C
        in ``carries`` (the last axis), for broadcastable arrays of starts and ends (and
        ``input_held``: after a plain middle segment whose saves hold x_a)."""
        tables = self.tables
        forward = np.where(input_held, tables.held_plain_forward[a, b], tables.plain_forward[a, b])
        backward = tables.backward[a, b] - np.where(input_held, self.reused_saved[a], 0.0)
        return _plain_middle_events(forward, backward, carries)

    def plain_middle_kept(self, a, b, input_held=False) -> np.ndarray:
        """R of the plain middle segment [a, b): Saved(a, b-1), for broadcastable
        arrays of starts and ends (less x_a where ``input_held``: the plain middle
        segment before holds it)."""
        return self.tables.saved[a, b] - np.where(input_held, self.reused_saved[a], 0.0)

    @property
    def coded_middle(self) -> bool:
        """Whether the solvers may keep a plain middle segment's saves by a lossy codec
        (memory_model.py, "plain middle [a, b), saves kept by lossy codec k")."""
        return self.plain_middle and len(self.stored_codecs) > 1

    @cached_property
    def _coded_tables(self) -> np.ndarray:
        """[k - 1, term, bit, a, i]: for each lossy codec k, a plain segment's largest
        forward event (term 0) and backward event less C (term 1) over layers a .. i,
        and Saved_k(a, i) (term 2), without (bit 0) and with (bit 1) ``input_held``:
        for the plain segment [a, n) (i = n - 1) and a plain middle one [a, i + 1)."""
        every = np.arange(self.n)
        tables = []
        for k in range(1, len(self.stored_codecs)):
            terms = [self._coded_events(k, every, held) for held in (False, True)]
            tables.append([[np.maximum.accumulate(term[kind], axis=1) if kind < 2 else term[kind]
                            for term in terms] for kind in range(3)])
        return np.array(tables)

    def coded_middle_working_set(self, k: int, a, b, carries: np.ndarray, input_held=False) -> np.ndarray:
        """W + C of the plain middle segment [a, b) whose saves lossy codec k keeps, for
        each C in ``carries`` (the last axis), for broadcastable arrays of starts and
        ends (and ``input_held``: after a plain middle segment whose saves hold x_a)."""
        bit = np.asarray(input_held).astype(np.int64)
        table = self._coded_tables[k - 1]
        return _plain_middle_events(table[0][bit, a, b - 1], table[1][bit, a, b - 1], carries)

    def coded_middle_backward(self, k: int, a, b, input_held=False) -> np.ndarray:
        """The largest backward event of that segment, less C: a bound below W + C."""
        return self._coded_tables[k - 1][1][np.asarray(input_held).astype(np.int64), a, b - 1]

    def coded_middle_kept(self, k: int, a, b, input_held=False) -> np.ndarray:
        """R of that segment: Saved_k(a, b-1), its saves as codec k keeps them."""
        return self._coded_tables[k - 1][2][np.asarray(input_held).astype(np.int64), a, b - 1]

    def coded_middle_seconds(self, k: int, a, b) -> np.ndarray:
        """What keeping the saves of the plain middle segment [a, b) by codec k adds to
        the step: encoding them and decoding them."""
        return self._stored_by_codec[k - 1].seconds_between(a, b)

    def coded_middle_keys(self, k: int, a, input_held=False) -> tuple:
        """(R, t) of the plain middle segments [a, b) kept by codec k less the parts of
        b alone (:meth:`coded_middle_ends`): R(a, b) = Saved_k(a, b-1) is the tensors
        saved at or before b-1 less those last saved before a, exact in whole bytes,
        and t the encodes of the tensors last saved from a on less those first saved
        from b on, with the decodes of [a, b). pareto.Sweep orders labels by them."""
        bit = np.asarray(input_held).astype(np.int64)
        kept = self._coded_tables[k - 1][2]
        key = kept[bit, a, a] - kept[0, 0, a]  # R(a, b) - R(0, b) at b = a + 1
        return key, self._stored_by_codec[k - 1].seconds_from_start(a)

    def coded_middle_ends(self, k: int, b) -> tuple:
        """The parts of b alone of (R, t) of those segments (:meth:`coded_middle_keys`)."""
        return self._coded_tables[k - 1][2][0, 0, b - 1], self._stored_by_codec[k - 1].seconds_to_end(b)

    @cached_property
    def coded_middle_separable(self) -> np.ndarray:
        """[k - 1, bit, a]: whether R(a, b) of codec k is its key plus its end's for every
        b > a (not where a save holds x_a as it is from a later layer on, and the plain
        segment before holds x_a: the part taken off then starts with that layer)."""
        n, i = self.n, np.arange(self.n)[None, :]
        separable = []
        for kept in self._coded_tables[:, 2]:
            rows = kept - kept[0, 0][None, None, :]  # [bit, a, i]: R(a, i + 1) - R(0, i + 1)
            at_start = rows[:, i[0], i[0]][:, :, None]
            separable.append(np.where(i[None] >= i[0][None, :, None], rows == at_start, True).all(axis=2))
        return np.array(separable).reshape(len(separable), 2, n)

    def segment_coded_middle(self, a: int, b: int, k: int, carry: float, input_held: bool = False) -> tuple:
        """(W + C, R) of the plain middle segment [a, b) whose saves lossy codec k
        keeps, from its own layers' events (``input_held``: after a plain middle
        segment whose saves hold x_a)."""
        forward, backward, saved = (term[0] for term in self._coded_events(k, np.array([a]), input_held))
        working = _plain_middle_events(forward[a:b].max(), backward[a:b].max(), np.array([carry]))[0]
        return float(working), float(saved[b - 1])

    def segment_plain_middle(self, a: int, b: int, carry: float, input_held: bool = False) -> tuple:
        """(W + C, R) of the plain middle segment [a, b), from its own layers' events
        (``input_held``: after a plain middle segment whose saves hold x_a)."""
        events, stop = self._plain_events_from(a, input_held), b - a
        working = _plain_middle_events(events.plain_forward[:stop].max(), events.backward[:stop].max(),
                                        np.array([carry]))[0]
        return float(working), float(events.saved[stop - 1])


def _plain_middle_events(forward, backward, carries: np.ndarray) -> np.ndarray:
    """A plain middle segment's largest event, given its largest forward and backward
    events, for each C in ``carries`` (the last axis): C is charged to the backward."""
    return np.maximum(np.expand_dims(forward, -1), np.expand_dims(backward, -1) + carries)


class _CodedSaves:
    """The terms of a plain segment whose saves one lossy codec keeps (memory_model.py:
    Saved_k, U_k, O_k, enc_k, dec_k, bwd_k), from the profile's StoredSaves."""

    def __init__(self, prof: Profile, codec: str):
        n, stored = len(prof.layers), prof.stored_saves
        self.n = n
        tensors = stored.tensors
        self.first = np.array([t.first for t in tensors], dtype=np.int64)
        self.last = np.array([t.last for t in tensors], dtype=np.int64)
        self.kept = np.array([t.kept_bytes[codec] for t in tensors], dtype=np.float64)
        self.signs = np.array([t.sign_bytes for t in tensors], dtype=np.float64)
        self.encode_rise = np.array([rises[codec] for rises in stored.encode_rise], dtype=np.float64)
        self.decode_rise = np.array([rises[codec] for rises in stored.decode_rise], dtype=np.float64)
        self.backward_rise = np.array([rises[codec] for rises in stored.backward_rise], dtype=np.float64)
        spans = [span or (n, -1) for span in stored.input_held_by]  # (n, -1): held by no save
        self.input_first = np.array([first for first, _ in spans])
        self.input_last = np.array([last for _, last in spans])
        self.output_first, self.output_last = stored.output_held_by or (n, -1)
        # Each stored tensor is encoded once per segment whose layers save it (at its
        # first save there), each save decoded once: a segment [a, b) encodes the
        # tensors with last >= a and first < b, and decodes the saves of its layers.
        encode_s = np.array([t.encode_s[codec] for t in tensors], dtype=np.float64)
        decode_s = np.array([seconds[codec] for seconds in stored.decode_s], dtype=np.float64)
        self._encoded_last_from = _from(np.bincount(self.last, weights=encode_s, minlength=n))  # [x]: last >= x
        self._encoded_first_from = _from(np.bincount(self.first, weights=encode_s, minlength=n))  # first >= x
        self._decoded_from = _from(decode_s)
        self.seconds_from = self._encoded_last_from + self._decoded_from

    def seconds_between(self, a, b) -> np.ndarray:
        """The encode and decode seconds of a plain segment [a, b) (b = n: the last),
        for broadcastable arrays of starts and ends."""
        return self.seconds_from_start(a) - self.seconds_to_end(b)

    def seconds_from_start(self, a) -> np.ndarray:
        """seconds_between(a, b) + seconds_to_end(b): encodes of the tensors last saved
        from a on, decodes from a on."""
        return self._encoded_last_from[a] + self._decoded_from[a]

    def seconds_to_end(self, b) -> np.ndarray:
        """Encodes of the tensors first saved from b on, decodes from b on."""
        return self._encoded_first_from[b] + self._decoded_from[b]

    @cached_property
    def _table(self) -> np.ndarray:
        n = self.n
        by_span = np.zeros((n, n))
        np.add.at(by_span, (self.first, self.last), self.kept)
        first_at_most = by_span.cumsum(axis=0)  # [i, last]: first <= i
        last_at_least = first_at_most[:, ::-1].cumsum(axis=1)[:, ::-1]  # [i, s]: first <= i, last >= s
        # A tensor first saved before s is the segment's input: it keeps no ReLU bits.
        crossing = np.zeros(n + 1)
        np.add.at(crossing, self.first + 1, self.signs)
        np.add.at(crossing, self.last + 1, -self.signs)
        return last_at_least.T - np.cumsum(crossing)[:n, None]

    def saved_table(self) -> np.ndarray:
        """[s, i] = Saved_k(s, i) for i >= s: the stored tensors whose saving layers meet
        [s, i], each counted once (undefined for i < s)."""
        return self._table


def _from(values: np.ndarray) -> np.ndarray:
    """[x] = the sum of ``values[x:]``, for x = 0 .. len(values)."""
    return np.append(np.cumsum(values[::-1])[::-1], 0.0)
