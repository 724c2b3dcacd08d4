"""A module that wraps one other and hides nothing of it (:class:`TransparentWrapper`),
the base of :class:`~actsave.Checkpoint`.

- **Attributes**: a name the wrapper does not have is looked up on the wrapped module.
  One the module has is set and deleted there (``block.fc = LoRA(block.fc)`` after
  wrap), and so are a new submodule, parameter or tensor (``block.adapter = ...``,
  ``add_module``, ``register_buffer``) and a new public attribute (``block.scale =
  3.0``): the module's forward reads its own, never the wrapper's. A new private name
  stays the wrapper's: libraries that hook a module keep their bookkeeping on it
  under such names and read it back from it (accelerate's ``_old_forward`` beside
  the ``forward`` it sets on the wrapper); its names are never read through either
  (``HOOK_BOOKKEEPING``). The wrapper keeps the names it has (its
  class's, and those its ``__init__`` set). ``training`` set on it is set on the
  module too; ``train()`` and ``eval()`` set the wrapper's and call the module's,
  as for any child (a block whose ``train`` is disabled stays as it is). The
  wrapper's own public names yield to the module's where the module has one
  (:class:`yields_to_wrapped`), and are read-only otherwise; indexing goes to the
  module (a wrapped ``nn.Sequential``), as torch's ``checkpoint_wrapper`` does.
- **State dicts**: their keys are the wrapped module's own; the wrapper's child name
  (``WRAPPED_CHILD``) is taken out when saving and put back when loading, so a state
  dict saved with the wrapper loads without it and the other way round. What a load
  tells the user is in those keys too: the load hooks registered on the wrapper, the
  missing and unexpected keys, the error messages. A saved state dict's metadata (the
  modules' versions) is held under both names; one saved without the wrapper gives
  the wrapped module none (docs/limits.md, "Wrapped modules").
"""
from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from ._torch_graphs import uncompiled
from .runtime.layers import WRAPPED_CHILD


# The names under which a library that sets ``forward`` on an instance keeps what it
# replaced and its hook (accelerate's): they tell how that one object's forward is
# hooked, so neither wrapper nor module sees the other's. Read through, the wrapper
# looked hooked already: a hook added to it replaced the module's and ran the
# module's forward without the checkpoint, and removing hooks from every module set
# the module's own forward on the wrapper.
HOOK_BOOKKEEPING = frozenset({"_hf_hook", "_old_forward"})


class yields_to_wrapped(property):
    """A read-only property of a :class:`TransparentWrapper` that gives the wrapped
    module's attribute of the same name where the module has one."""

    def __get__(self, wrapper, owner=None):
        if wrapper is None:
            return self
        wrapped = wrapper._modules.get(WRAPPED_CHILD)
        name = self.fget.__name__
        if wrapped is not None and has_own(wrapped, name):
            return getattr(wrapped, name)
        return self.fget(wrapper)


def has_own(module: nn.Module, name: str) -> bool:
    """Whether ``module`` has an attribute ``name`` (a child, parameter, buffer, instance
    or class attribute), without calling a property to find out."""
    return (name in module.__dict__ or name in module._modules or name in module._parameters
            or name in module._buffers or hasattr(type(module), name))


class TransparentWrapper(nn.Module):
    """Wraps one module, registered as the child ``WRAPPED_CHILD`` by :meth:`_wrap`,
    and hides nothing of it (module docstring)."""

    def _wrap(self, module: nn.Module) -> None:
        self.add_module(WRAPPED_CHILD, module)
        self.register_state_dict_post_hook(_strip_wrapper_prefix)
        self.register_load_state_dict_post_hook(_load_report_without_wrapper)
        self.__dict__["_own_names"] = frozenset(self.__dict__)  # from here, new names are the module's

    def train(self, mode: bool = True):
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        nn.Module.__setattr__(self, "training", mode)  # the wrapper's flag; the module's train() sets its own
        for child in self.children():
            child.train(mode)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # The wrapper's load hooks (run by nn.Module's) see the keys as saved. The wrapper
        # has no state of its own: the keys under its prefix that nn.Module's strict check
        # finds unexpected here are the module's, which the child loads once renamed.
        checked = len(unexpected_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        moved = _add_wrapper_prefix(state_dict, prefix)
        unexpected_keys[checked:] = [key for key in unexpected_keys[checked:] if key not in moved]
        self.__dict__["_load_messages"] = error_msgs  # renamed with the keys (_load_report_without_wrapper)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self._modules.get(WRAPPED_CHILD)
            if wrapped is None or name in HOOK_BOOKKEEPING:  # still inside __init__; the wrapper's alone
                raise
            return getattr(wrapped, name)

    def __getitem__(self, index):
        return self._modules[WRAPPED_CHILD][index]

    def __setattr__(self, name: str, value) -> None:
        # Set on the wrapper, an attribute of the module would shadow the module's, and
        # new state would never be read: the module's forward reads its own.
        module = self._module_for(name, isinstance(value, (nn.Module, torch.Tensor)))
        if module is not None:
            self.__dict__.pop(name, None)  # a private name's earlier value (``self._gate = None``)
            setattr(module, name, value)
        if module is not None and name != "training":
            return
        if isinstance(getattr(type(self), name, None), yields_to_wrapped):
            raise AttributeError(f"{name!r} of a {type(self).__name__} is read-only (the module it wraps has no "
                                 f"attribute {name!r}): wrap another module in a new {type(self).__name__}")
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        module = self._module_for(name)
        if module is not None:
            delattr(module, name)
        else:
            super().__delattr__(name)

    def add_module(self, name: str, module: Optional[nn.Module]) -> None:
        # register_module calls this too.
        owner = self._module_for(name, state=True)
        if owner is not None:
            owner.add_module(name, module)
        else:
            super().add_module(name, module)

    def register_parameter(self, name: str, param) -> None:
        owner = self._module_for(name, state=True)
        if owner is not None:
            owner.register_parameter(name, param)
        else:
            super().register_parameter(name, param)

    def register_buffer(self, name: str, tensor, persistent: bool = True) -> None:
        owner = self._module_for(name, state=True)
        if owner is not None:
            owner.register_buffer(name, tensor, persistent)
        else:
            super().register_buffer(name, tensor, persistent)

    def _module_for(self, name: str, state: bool = False) -> Optional[nn.Module]:
        """The wrapped module (under torch.compile's wrapper, the module compiled) where
        ``name`` is the module's, else None (module docstring); ``state``: it names a
        submodule, parameter or tensor. Before the module is wrapped, every name is the
        wrapper's."""
        wrapped = self.__dict__.get("_modules", {}).get(WRAPPED_CHILD)
        if wrapped is None:
            return None
        module = uncompiled(wrapped)
        if name == "training":
            return module
        if name in HOOK_BOOKKEEPING:
            return None
        if isinstance(getattr(type(self), name, None), yields_to_wrapped):
            return module if has_own(module, name) else None
        owned = (name in self.__dict__.get("_own_names", ()) or hasattr(type(self), name) or name in self._modules
                 or name in self._parameters or name in self._buffers)
        if owned:
            return None
        return module if state or not name.startswith("_") or has_own(module, name) else None


def _strip_wrapper_prefix(module, state_dict, prefix, local_metadata) -> None:
    inner = prefix + WRAPPED_CHILD + "."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # kept too: a wrapped model's load reads the inner names
        for key in [k for k in metadata if (k + ".").startswith(inner)]:
            metadata[(prefix + key[len(inner):]).rstrip(".")] = metadata[key]


def _add_wrapper_prefix(state_dict, prefix: str) -> set:
    """Puts the wrapper's child name into the keys under ``prefix``; the keys renamed."""
    inner = prefix + WRAPPED_CHILD + "."
    moved = {k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)}
    for key in moved:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)
    return moved


def _load_report_without_wrapper(module, incompatible_keys) -> None:
    """The missing and unexpected keys of a load, and its error messages, in the names
    of the state dict as saved (without the wrapper's child name, at any depth)."""
    messages = module.__dict__.pop("_load_messages", [])
    for found in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys, messages):
        found[:] = [_CHILD_IN_A_NAME.sub("", text) for text in found]


# The child's name as a whole component of a dotted name (not the end of another's).
_CHILD_IN_A_NAME = re.compile(r"(?<!\w)" + re.escape(WRAPPED_CHILD) + r"\.")
