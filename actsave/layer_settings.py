"""A CheckpointedSequential's per-layer settings: the codec and the offload of what is
kept where a segment starts (its input; the last segment's saves), one
:class:`LayerSettings` per chain.

Settings are keyed by the module object, not its child name: ``nn.Sequential``
renumbers names on insert and delete, and the user chose the layer. A module placed
twice in the chain has one setting. They are resolved once, as they are set: every
forward reads them per layer.
"""
from __future__ import annotations

from typing import Iterable

from torch import nn

from .checks import integral
from .codecs import Codec
from .errors import ConfigError
from .runtime.keep_rules import KeepPolicy


class LayerSettings:
    """The chain's ``default`` policy, and per module the codec and offload set on it."""

    def __init__(self, default: KeepPolicy):
        self.default = default
        self._codecs = {}  # module -> Codec
        self._offload = {}  # module -> bool

    def set_codec(self, modules: Iterable[nn.Module], codec: Codec) -> None:
        for module in modules:
            self._codecs[module] = codec

    def set_offload(self, modules: Iterable[nn.Module], flag: bool) -> None:
        for module in modules:
            self._offload[module] = flag

    def policy(self, layer: nn.Module) -> KeepPolicy:
        """How what is kept at ``layer`` is kept: its settings, else the default (the
        default object itself, so that a plan's key of many layers compares by identity)."""
        if layer not in self._codecs and layer not in self._offload:
            return self.default
        return KeepPolicy(self._codecs.get(layer, self.default.codec), self._offload.get(layer, self.default.offload))

    def policies(self, layers) -> tuple:
        return tuple(self.policy(layer) for layer in layers)

    def any_set(self) -> bool:
        """Whether a codec or an offload is set on any module of its own."""
        return bool(self._codecs or self._offload)

    def layers_set(self, kind: str) -> set:
        """The modules with a codec (``kind="codec"``) or an offload (``"offload"``) set on them."""
        return set(self._codecs if kind == "codec" else self._offload)

    def keeps_on_host(self, layers) -> bool:
        """Whether one of ``layers`` keeps on the host (whatever the segments)."""
        return any(self.policy(layer).offload for layer in layers)

    def keeps_by_codec(self, layers) -> bool:
        """Whether one of ``layers`` keeps by a lossy codec (whatever the segments)."""
        return any(self.policy(layer).lossy for layer in layers)

    def keep_only(self, present: set) -> None:
        """Forget the settings of modules no longer in the chain (replaced or deleted)."""
        self._codecs = {m: c for m, c in self._codecs.items() if m in present}
        self._offload = {m: f for m, f in self._offload.items() if m in present}

    def carry_to(self, other: "LayerSettings", present: set, codecs: bool, offload: bool) -> None:
        """Give ``other`` (a chain over some of these modules, ``present``) the codecs
        and/or offload set here on them."""
        if codecs:
            other._codecs = {m: c for m, c in self._codecs.items() if m in present}
        if offload:
            other._offload = {m: f for m, f in self._offload.items() if m in present}


def modules_named(chain: nn.Sequential, layer) -> list:
    """The modules ``layer`` (an index, child name or slice of ``chain``) names now; a
    slice that names none is refused, as an index out of range is (setting nothing is
    never what was meant)."""
    names = list(chain._modules)
    if isinstance(layer, slice):
        modules = list(chain)[layer]
        if not modules:
            raise ConfigError(f"layer {layer!r} selects no layer of this CheckpointedSequential of {len(names)} "
                              f"layers; use a slice that selects at least one of the layers [0, {len(names) - 1}]")
        return modules
    if isinstance(layer, nn.Module):
        raise ConfigError(f"layer {layer!r} is a module, which is not accepted as a layer key; use its index in "
                          f"the chain or its child name (one of {names[:8]}{'...' if len(names) > 8 else ''})")
    if isinstance(layer, str) and layer in chain._modules:
        return [chain._modules[layer]]
    index = integral(layer)
    if index is not None and -len(names) <= index < len(names):
        return [chain._modules[names[index]]]
    raise ConfigError(
        f"layer {layer!r} is not in this CheckpointedSequential; use an index in "
        f"[0, {len(names) - 1}], a child name (one of {names[:8]}"
        f"{'...' if len(names) > 8 else ''}) or a slice"
    )


__all__ = ["LayerSettings", "modules_named"]
