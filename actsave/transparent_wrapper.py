"""A module that wraps one other and hides nothing of it (:class:`TransparentWrapper`),
the base of :class:`~actsave.Checkpoint`.

- **Attributes**: a name the wrapper does not have is looked up on the wrapped module,
  and one the module has is set and deleted there (``block.fc = LoRA(block.fc)`` after
  wrap). The wrapper's own public names yield to the module's where the module has
  one (:class:`yields_to_wrapped`).
- **State dicts**: their keys are the wrapped module's own; the wrapper's child name
  (``WRAPPED_CHILD``) is taken out when saving and put back when loading, so a state
  dict saved with the wrapper loads without it and the other way round.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from ._torch_graphs import uncompiled
from .runtime.layers import WRAPPED_CHILD


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
        self.register_load_state_dict_pre_hook(_add_wrapper_prefix)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self._modules.get(WRAPPED_CHILD)
            if wrapped is None:  # still inside __init__
                raise
            return getattr(wrapped, name)

    def __setattr__(self, name: str, value) -> None:
        # An attribute the module has is set on the module (``block.fc = LoRA(block.fc)``
        # after wrap): set on the wrapper, it would shadow the module's, which the
        # forward never reads. The wrapper's own attributes and methods stay its own.
        module = self._module_having(name)
        if module is not None:
            setattr(module, name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        module = self._module_having(name)
        if module is not None:
            delattr(module, name)
        else:
            super().__delattr__(name)

    def _module_having(self, name: str) -> Optional[nn.Module]:
        """The wrapped module (under torch.compile's wrapper, the module compiled) where
        it has ``name`` and the wrapper has not, or yields it (yields_to_wrapped)."""
        wrapped = self.__dict__.get("_modules", {}).get(WRAPPED_CHILD)
        if wrapped is None:  # inside __init__
            return None
        module = uncompiled(wrapped)
        yields = isinstance(getattr(type(self), name, None), yields_to_wrapped)
        return module if (yields or not has_own(self, name)) and has_own(module, name) else None


def _strip_wrapper_prefix(module, state_dict, prefix, local_metadata):
    inner = prefix + WRAPPED_CHILD + "."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def _add_wrapper_prefix(module, state_dict, prefix, *args):
    inner = prefix + WRAPPED_CHILD + "."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)
