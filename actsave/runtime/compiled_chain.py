"""A CheckpointedSequential's forward under torch.compile (sequential.py): the forward
as Dynamo traces it, with each segment kept by a codec annotated for the graph hooks
beside it (graph_codecs.py, NOTE [ Codecs in a compiled graph ]), or eagerly at one
graph break where the graph cannot hold what eager actsave keeps (NOTE [ Checkpoints
in a compiled graph ] in function.py).

What these read of the chain: chain.py's module docstring; and its per-input cache
``chain._decisions_by_input``: (the layers it is for, {input: decisions found}).
"""
from __future__ import annotations

from typing import Optional

import torch

from .._torch_graphs import untraced_frame
from . import decision_probes, graph_codecs
from .compiled_calls import checkpoint_in_graph, warn_eager_under_compile
from .chain import ChainCall, run_eagerly, segments_and_policies, starts_for_call
from .function import eager_checkpointed_call
from .layers import LayerRun
from .recompute_options import DEFAULT_RECOMPUTE


def traced_forward(chain, input, layers: list, starts: list):
    """The forward as Dynamo traces it (NOTE [ Checkpoints in a compiled graph ] in
    runtime/function.py), no layer keeping on the host: each checkpointed segment as
    torch's checkpoint of the same layers, a nested one as one checkpoint of its
    layers; each segment kept by a codec annotated for actsave's graph hooks (NOTE
    [ Codecs in a compiled graph ] in runtime/graph_codecs.py); no offload tape and
    no kept-bytes ledger, which the compiled graph replaces."""
    chain._last_call = ChainCall(traced=True)
    segments, policies = segments_and_policies(chain, starts, layers)
    for j, (segment, policy) in enumerate(zip(segments, policies)):
        run = LayerRun(layers[segment.start:segment.stop])
        with graph_codecs.annotation(policy, segment.checkpointed):
            if segment.checkpointed:
                input = checkpoint_in_graph(run, (input,), {}, DEFAULT_RECOMPUTE, eager_call=eager_checkpointed_call,
                                            eager_args=(policy, False, DEFAULT_RECOMPUTE))
            else:
                input = run(input)
        if policy.lossy and j + 1 < len(segments) and not segments[j + 1].checkpointed \
                and not policies[j + 1].lossy:
            input = graph_codecs.output_copied(input)
    return input


@torch.compiler.disable  # NOTE [ torch.compile ] in runtime/compiled_calls.py
def eager_forward_under_compile(chain, input, layers: list):
    """The forward under torch.compile where a layer keeps on the host: run eagerly,
    as without torch.compile, so that offload applies as it does there, in one
    graph break however many segments keep so (one warning per process)."""
    warn_eager_under_compile("a CheckpointedSequential that keeps inputs on the host",
                             "one graph break, at its forward", "offload is not an op a compiled graph holds")
    return run_eagerly(chain, input, layers, starts_for_call(chain, input, layers))


# The forward's one graph break: NOTE [ Codecs in a compiled graph ] in
# runtime/graph_codecs.py.
@untraced_frame
def forward_with_graph_codecs(chain, input, layers: list):
    """The forward under torch.compile where a layer keeps by a codec."""
    eager_output, starts = _codecs_in_graph_on(chain, input, layers)
    if eager_output is not None:
        return eager_output
    try:
        return traced_forward(chain, input, layers, starts)
    finally:
        graph_codecs.hooks_off()


@torch.compiler.disable  # planning and probing run eagerly
def _codecs_in_graph_on(chain, input, layers: list) -> tuple:
    """Where a layer keeps by a codec: the segments looked up, then actsave's graph
    hooks set and ``(None, starts)`` returned; or, where the graph cannot hold what
    eager actsave keeps, the forward run eagerly and ``(output, starts)`` returned
    (one warning per process, naming why)."""
    starts = starts_for_call(chain, input, layers)
    why = _why_codecs_run_eagerly(chain, input, layers, starts)
    if why is None:
        if graph_codecs.hooks_on():
            return None, starts
        why = "other saved-tensor hooks are set, which the compiled graph would not apply"
    warn_eager_under_compile("a CheckpointedSequential that keeps inputs by a codec",
                             "one graph break, at its forward", why)
    return run_eagerly(chain, input, layers, starts), starts


def _why_codecs_run_eagerly(chain, input, layers: list, starts: list) -> Optional[str]:
    """Why the segments of ``starts`` cannot keep by their codecs in a compiled
    graph, or None (NOTE [ Codecs in a compiled graph ])."""
    missing = graph_codecs.missing_pieces()
    if missing is not None:
        return missing
    segments, policies = segments_and_policies(chain, starts, layers)
    key = (tuple(input.shape), input.stride(), input.dtype, tuple(starts), tuple(policies),
           tuple(layer.training for layer in layers))
    found_for, found = chain._decisions_by_input
    if found_for != tuple(layers):  # a layer inserted, replaced or deleted: look again
        found = {}
        chain._decisions_by_input = (tuple(layers), found)
    if key not in found:
        found[key] = decision_probes.decisions_made(
            [(layers[s.start:s.stop], policy) for s, policy in zip(segments, policies)], input)
    decisions = found[key]
    if decisions is not None:
        return f"a segment kept by a codec makes {decisions}, which a recompute in the graph cannot keep"
    return None


__all__ = ["eager_forward_under_compile", "forward_with_graph_codecs", "traced_forward"]
