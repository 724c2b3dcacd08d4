"""The autograd mechanism: saved-tensor hooks, frames and recompute (function.py),
which tensors may be kept by a codec or on the host (keep_rules.py), kept inputs and
the stored-bytes ledger (store.py), replayed and touched state (state.py), ReLU and
max-pool decisions under a codec (relu_signs.py, pool_decisions.py), what a
checkpoint keeps (keep_modes.py): selective recompute (selective.py) and saves kept
instead of recomputed, by a codec or on the host (kept_saves.py), torch's checkpoint
keywords (recompute_options.py).
Imports nothing from actsave.planning.
"""
