"""runtime/shared_copies.py: which calls share a stored copy, and when it goes. Kept
inputs sharing one, their bytes and gradients, are tested in test_store.py."""
import gc

import torch

from actsave.runtime.keep_rules import EXACT, KeepPolicy
from actsave.runtime.shared_copies import StoredCopy, _SharedCopies, sharing_key


class _Storage:
    def __init__(self):
        self.releases = 0

    def release(self):
        self.releases += 1


def _made(copies, key, source=None):
    def make():
        copy = StoredCopy(_Storage(), 8, source)
        copy.settle = lambda: setattr(copy, "settled", True)
        return copy
    return copies.held(key, make)


def test_the_same_tensor_has_one_key_a_view_of_other_geometry_or_a_change_another():
    h = torch.randn(4, 8)
    key = sharing_key(h, EXACT, False, False)
    assert sharing_key(h.view(4, 8), EXACT, False, False) == key
    others = [sharing_key(h.t(), EXACT, False, False), sharing_key(h[1:], EXACT, False, False),
              sharing_key(h, KeepPolicy.resolve("int8"), False, False), sharing_key(h, EXACT, True, False),
              sharing_key(h, EXACT, False, True), sharing_key(torch._neg_view(h), EXACT, False, False),
              sharing_key(h.clone(), EXACT, False, False)]
    assert key not in others
    h.add_(1)
    assert sharing_key(h, EXACT, False, False) != key


def test_a_shared_copy_is_released_by_its_last_holder_once():
    copies = _SharedCopies()
    first, made = _made(copies, ("k",))
    second, made_again = _made(copies, ("k",))
    assert second is first and made and not made_again
    copies.let_go(first)
    assert first.storage.releases == 0 and not hasattr(first, "settled")
    copies.let_go(second)
    assert first.storage.releases == 1 and first.settled
    third, made = _made(copies, ("k",))  # gone: stored anew
    assert third is not first and made


def test_a_copy_made_from_a_tensor_that_is_gone_is_not_shared():
    # Its storage's identity may name another storage now.
    copies, source = _SharedCopies(), torch.randn(16)
    key = sharing_key(source, KeepPolicy.resolve("int8"), False, False)
    first, _ = _made(copies, key, source)
    assert first.stands_for(key) and _made(copies, key, source)[0] is first
    del source
    gc.collect()
    assert not first.stands_for(key) and _made(copies, key)[0] is not first


def test_a_copy_whose_tensor_took_another_storage_is_not_shared():
    copies, source = _SharedCopies(), torch.randn(16)
    key = sharing_key(source, KeepPolicy.resolve("int8"), False, False)
    first, _ = _made(copies, key, source)
    source.set_(torch.randn(16))
    assert not first.stands_for(key) and _made(copies, key)[0] is not first


def test_a_tensor_without_a_storage_to_name_is_never_shared():
    seen = []
    torch.func.vmap(lambda x: seen.append(sharing_key(x, EXACT, False, False)) or x)(torch.randn(3, 4))
    assert seen == [None]
