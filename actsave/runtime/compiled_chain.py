"""A CheckpointedSequential's forward under torch.compile (sequential.py), a mixin of
its class: the forward as Dynamo traces it, with each segment kept by a codec
annotated for the graph hooks beside it (graph_codecs.py, NOTE [ Codecs in a compiled
graph ]), or eagerly at one graph break where the graph cannot hold what eager actsave
keeps (NOTE [ Checkpoints in a compiled graph ] in function.py).

The host class gives the segments and their policies (``_segments``,
``_segment_policy``, ``_starts_for``), its eager forward (``_eager_forward``), its
settings (``_settings``) and the per-input cache ``_decisions_by_input``. The methods
stay methods of the chain: Dynamo counts a disabled method called from one it inlined
as one graph break, where a free function called so would count twice.
"""
from __future__ import annotations

from typing import Optional

import torch

from .._torch_graphs import untraced_frame
from . import graph_codecs
from .compiled_calls import checkpoint_in_graph, warn_eager_under_compile
from .layers import LayerRun
from .recompute_options import DEFAULT_RECOMPUTE


class CompiledForwards:
    """The compiled forwards of a CheckpointedSequential (module docstring)."""

    def _traced_forward(self, input, layers: list, starts: list):
        """The forward as Dynamo traces it (NOTE [ Checkpoints in a compiled graph ] in
        runtime/function.py), no layer keeping on the host: each checkpointed segment as
        torch's checkpoint of the same layers, a nested one as one checkpoint of its
        layers; each segment kept by a codec annotated for actsave's graph hooks (NOTE
        [ Codecs in a compiled graph ] in runtime/graph_codecs.py); no offload tape and
        no kept-bytes ledger, which the compiled graph replaces."""
        self._last_kept_bytes, self._last_by_reference, self._last_traced = {}, {}, True
        segments = self._segments(starts, len(layers))
        for segment, next_segment in zip(segments, segments[1:] + [None]):
            run = LayerRun(layers[segment.start:segment.stop])
            policy = self._segment_policy(segment, layers)
            with graph_codecs.annotation(policy, segment.checkpointed):
                if segment.checkpointed:
                    input = checkpoint_in_graph(run, (input,), {}, DEFAULT_RECOMPUTE)
                else:
                    input = run(input)
            if policy.lossy and next_segment is not None and not next_segment.checkpointed \
                    and not self._segment_policy(next_segment, layers).lossy:
                input = graph_codecs.output_copied(input)
        return input

    @torch.compiler.disable  # NOTE [ torch.compile ] in runtime/compiled_calls.py
    def _eager_forward_under_compile(self, input, layers: list):
        """The forward under torch.compile where a layer keeps on the host: run eagerly,
        as without torch.compile, so that offload applies as it does there, in one
        graph break however many segments keep so (one warning per process)."""
        warn_eager_under_compile("a CheckpointedSequential that keeps inputs on the host",
                                 "one graph break, at its forward", "offload is not an op a compiled graph holds")
        return self._eager_forward(input, layers, self._starts_for(input, layers))

    # The forward's one graph break: NOTE [ Codecs in a compiled graph ] in
    # runtime/graph_codecs.py.
    @untraced_frame
    def _forward_with_graph_codecs(self, input, layers: list):
        """The forward under torch.compile where a layer keeps by a codec."""
        eager_output, starts = self._codecs_in_graph_on(input, layers)
        if eager_output is not None:
            return eager_output
        try:
            return self._traced_forward(input, layers, starts)
        finally:
            graph_codecs.hooks_off()

    @torch.compiler.disable  # planning and probing run eagerly
    def _codecs_in_graph_on(self, input, layers: list) -> tuple:
        """Where a layer keeps by a codec: the segments looked up, then actsave's graph
        hooks set and ``(None, starts)`` returned; or, where the graph cannot hold what
        eager actsave keeps, the forward run eagerly and ``(output, starts)`` returned
        (one warning per process, naming why)."""
        starts = self._starts_for(input, layers)
        why = self._why_codecs_run_eagerly(input, layers, starts)
        if why is None:
            if graph_codecs.hooks_on():
                return None, starts
            why = "other saved-tensor hooks are set, which the compiled graph would not apply"
        warn_eager_under_compile("a CheckpointedSequential that keeps inputs by a codec",
                                 "one graph break, at its forward", why)
        return self._eager_forward(input, layers, starts), starts

    def _why_codecs_run_eagerly(self, input, layers: list, starts: list) -> Optional[str]:
        """Why the segments of ``starts`` cannot keep by their codecs in a compiled
        graph, or None (NOTE [ Codecs in a compiled graph ])."""
        missing = graph_codecs.missing_pieces()
        if missing is not None:
            return missing
        segments = list(self._segments(starts, len(layers)))
        key = (tuple(input.shape), input.stride(), input.dtype, tuple(starts),
               tuple(self._segment_policy(s, layers) for s in segments), tuple(layer.training for layer in layers))
        if key not in self._decisions_by_input:
            self._decisions_by_input[key] = graph_codecs.decisions_made(
                [(layers[s.start:s.stop], self._segment_policy(s, layers)) for s in segments], input)
        decisions = self._decisions_by_input[key]
        if decisions is not None:
            return f"a segment kept by a codec makes {decisions}, which a recompute in the graph cannot keep"
        return None


__all__ = ["CompiledForwards"]
