"""LiveBytes (planning/live_bytes.py): storages counted from the operator that makes
them until they die, and at their new size when resized in place (NOTE [ Storage
resizes ] in _torch.py)."""
import torch

from actsave.planning.live_bytes import LiveBytes


def test_a_storage_resized_in_place_is_counted_at_its_new_size():
    # As FSDP2 frees a unit's gathered parameters (resize_(0)) and refills them.
    tracker = LiveBytes("cpu")
    with tracker:
        gathered = torch.zeros(1024, dtype=torch.uint8)
        assert tracker.live == 1024
        gathered.untyped_storage().resize_(0)
        assert tracker.live == 0
        gathered.untyped_storage().resize_(1024)
        other = torch.zeros(512, dtype=torch.uint8)
        assert (tracker.live, tracker.peak) == (1536, 1536)
        del gathered, other
    assert tracker.live == 0  # dead storages leave at the size they had


def test_storages_not_counted_are_not_counted_when_resized():
    known = torch.zeros(256, dtype=torch.uint8)
    tracker = LiveBytes("cpu", known=[known])
    with tracker:
        known.untyped_storage().resize_(4096)
        outside = torch.zeros(64, dtype=torch.uint8)
    before = tracker.live
    outside.untyped_storage().resize_(4096)  # after the tracker: not observed
    assert tracker.live == before == 64


def test_resizes_are_observed_only_while_a_tracker_is_active_and_by_each():
    outer, inner = LiveBytes("cpu"), LiveBytes("cpu")
    with outer:
        shared = torch.zeros(100, dtype=torch.uint8)
        with inner:
            made_inside = torch.zeros(200, dtype=torch.uint8)
            shared.untyped_storage().resize_(300)
            made_inside.untyped_storage().resize_(0)
        assert (outer.live, inner.live) == (300, 0)
    assert "resize_" not in vars(torch.UntypedStorage)  # the inherited method again


def test_a_mark_holds_the_highest_count_of_its_own_stretch_and_a_storage_says_what_is_counted_of_it():
    # Marks need not nest (saves_as_stored.py cuts a backward into stretches at
    # frees, inside the byte count's per-layer spans).
    tracker = LiveBytes("cpu")
    with tracker:
        first = torch.zeros(1024, dtype=torch.uint8)
        counted = tracker.counted_bytes(first.untyped_storage())
        assert counted == [1024] and tracker.counted_bytes(torch.empty(0).untyped_storage()) == [0]
        outer = tracker.mark()
        second = torch.zeros(2048, dtype=torch.uint8)
        del second
        inner = tracker.mark(less=1024)  # as if ``first`` were about to go
        del first
        assert counted == [0]  # gone from the count
        third = torch.zeros(512, dtype=torch.uint8)
        tracker.unmark(outer)
        assert outer == [3072]
        del third
        tracker.unmark(inner)
        assert inner == [512]
        assert tracker.peak == 3072


def test_a_sparse_tensor_is_counted_by_the_storages_of_its_indices_and_values():
    # NOTE [ Sparse tensors' storages ]: as nn.Embedding(sparse=True)'s gradient, whose
    # indices view the embedding's input (known: not counted).
    ids = torch.tensor([[1, 5, 7]])
    tracker = LiveBytes("cpu", known=[ids, torch.ones(2, 2).to_sparse()])  # known sparse tensors too
    with tracker:
        values = torch.ones(3, 4)
        grad = torch.sparse_coo_tensor(ids, values, (10, 4), check_invariants=True)
        del values
        assert tracker.live == 3 * 4 * 4  # the values, once; the indices are the input's
        coalesced = grad.coalesce()  # fresh indices and values
        assert tracker.live == 2 * 3 * 4 * 4 + 3 * 8
        del grad, coalesced
    assert tracker.live == 0
