"""The Python attributes of the modules a checkpointed forward ran that its recompute
must find as the forward found them: their ``training`` flags (:func:`set_modes`)."""
from __future__ import annotations


# NOTE [ Train and eval in a recompute ]
# A module's ``training`` flag decides what its forward does (Dropout draws or not,
# BatchNorm uses the batch's statistics or its running ones, a block branches on it),
# and a caller may switch it between the forward and the backward (``model.eval()`` for
# an evaluation between the two). The recompute must do the forward's work, so each
# module it runs has the flag the forward ran it with, and every module the forward ran
# gets the caller's flag back as the recompute ends, or stops early before the code that
# would have set it back (torch.utils.checkpoint recomputes in the new mode: wrong
# gradients, or an error where the saves' shapes change). Under global hooks the flag is
# noted as each module's first call starts. Under known layers, read without hooks, it
# is the flag the forward left: the one it ran with, unless the forward itself changed it
# after running the module (used in train mode, then put in eval), where the recompute
# runs it in the mode set after (docs/limits.md, "The in-place check").

def set_modes(modes) -> None:
    """Give each module of ``modes`` (``(module, training)`` pairs) its flag, writing
    only those that differ: nn.Module's __setattr__ is slow, and a recompute's modules
    mostly have their flag already."""
    for module, training in modes:
        if module.training is not training:
            module.training = training
