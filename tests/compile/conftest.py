"""The tests of actsave under torch.compile (one file per behaviour; what they share:
steps.py): gradients equal eager ones.

Two compositions:
- compile outside: ``torch.compile(model)`` over a CheckpointedSequential or over
  ``wrap()``-ed blocks. An exact checkpointed call becomes torch's checkpoint in the
  graph (NOTE [ Checkpoints in a compiled graph ] in runtime/compiled_calls.py): the forward
  is one graph (a CheckpointedSequential breaks once, before any compute, where it
  looks up its segments) and the compiled backward recomputes each segment. A call
  that keeps its input by a codec or on the host runs eagerly: a CheckpointedSequential
  runs its whole forward eagerly at its one break, a wrapped block breaks the graph.
- compile inside: the blocks compiled first, then checkpointed. Forward and recompute
  run the same compiled code, so they save the same tensors, and codecs and offload
  apply.

The backend is ``aot_eager``: it runs Dynamo and AOTAutograd, the two layers that
meet actsave's saved-tensor hooks, and compiles in about a second. Inductor only
changes the generated kernels, and on this CPU-only machine each of its graphs is a
C++ build of 10-20 s, so one test covers it.
"""
import pytest
import torch

from actsave.runtime import graph_codecs


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Compiled code and its guards do not leak from one test into the next, nor do
    actsave's graph hooks where a test fails inside a compiled forward."""
    torch._dynamo.reset()
    yield
    graph_codecs.hooks_off()
    torch._dynamo.reset()
