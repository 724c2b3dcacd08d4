"""Every private PyTorch API actsave touches, in one place, each behind a feature check.

actsave needs a few things PyTorch does not publish: which saved-tensor hooks are set, a
storage's identity, tensors' version counters and view bases, a sparse tensor's
components, parametrize.cached()'s cache, modules' own parameter and buffer tables (to
swap a tensor for a copy unregistered), the autograd node type of a ReLU, the node a
backward runs and whether that backward keeps its graph, the dispatch-mode and pytree
utilities, FSDP2's per-unit state (the handles of its forward hooks), storages' in-place
resizes (``UntypedStorage.resize_``, which no dispatch mode sees), and Dynamo's choice
whether compiled code runs compiled (to run it eagerly on one thread).
They are read here and nowhere else (those of compiled graphs and the module
``torch.compile`` returns in _torch_graphs.py), so that a PyTorch release that moves one
breaks this file with a clear error, not the library at a distance.

Tested with PyTorch 2.13 (CI) and written for 2.11 (the GPU image), the minimum in
pyproject.toml.
"""
from __future__ import annotations

import contextlib
import importlib
import threading
from typing import Callable, Optional

import torch
import torch._dynamo  # noqa: F401  (torch.compile imports it too; named here for eval_frame)
from torch.utils import _pytree as pytree  # noqa: F401  (re-exported)
from torch._ops import OpOverload  # noqa: F401  (re-exported)
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass  # noqa: F401

from .errors import ActsaveError
from .settings import CountedChange

MINIMUM_TORCH = "2.11"


def _require(feature, what: str):
    if feature is None:
        raise ActsaveError(
            f"PyTorch {torch.__version__} lacks {what}, which actsave needs; install "
            f"torch>={MINIMUM_TORCH}"
        )
    return feature


_top_saved_tensors_hooks = _require(
    getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None),
    "torch._C._autograd._top_saved_tensors_default_hooks",
)
_current_autograd_node = _require(getattr(torch._C, "_current_autograd_node", None),
                                  "torch._C._current_autograd_node")
# Optional: without it every backward counts as keeping its graph (backward_keeps_graph).
_graph_task_keeps_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
_require(getattr(torch.Tensor, "_version", None), "Tensor._version")
_require(getattr(torch.nn.Module(), "_buffers", None), "Module._buffers")
_require(getattr(torch.nn.Module(), "_modules", None), "Module._modules")
_foreach_mul = _require(getattr(torch, "_foreach_mul", None), "torch._foreach_mul")
_len_torch_function_stack = _require(getattr(torch._C, "_len_torch_function_stack", None),
                                     "torch._C._len_torch_function_stack")
_GLOBAL_DEVICE_CONTEXT = _require(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "torch._GLOBAL_DEVICE_CONTEXT")
_CPU = torch.device("cpu")

# The autograd node a ReLU leaves on its output (``relu`` and ``relu_`` alike).
_RELU_NODE_NAMES = frozenset({"ReluBackward0"})


def aten_overloads(*names: str) -> frozenset:
    """The aten overloads named (``"mm.default"``) that this torch has."""
    found = set()
    for name in names:
        packet, overload = name.split(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload, None)
        if op is not None:
            found.add(op)
    return frozenset(found)


def saved_tensor_hooks_active() -> bool:
    """Whether some ``saved_tensors_hooks`` (an outer checkpoint's, ``save_on_cpu``,
    the caller's) are set on this thread now."""
    return _top_saved_tensors_hooks(False) is not None


_TORCH_CHECKPOINT = "torch.utils.checkpoint"  # its private hook classes make its hooks there
# Optional: without that class there, any hooks count as a checkpoint's (the saves are left to them).
_checkpoint_hooks_known = hasattr(importlib.import_module(_TORCH_CHECKPOINT), "_recomputation_hook")


def saved_tensor_hooks_of_a_checkpoint(ours: Callable[[Callable, Callable], bool]) -> bool:
    """Whether the innermost ``saved_tensors_hooks`` on this thread are a checkpoint's
    forward or recompute hooks, whose saves it drops and recomputes: torch.utils.checkpoint's
    (known by their module) or those ``ours(pack, unpack)`` says are actsave's. False
    under none, and under any others (the caller's, ``save_on_cpu``)."""
    hooks = _top_saved_tensors_hooks(False)
    if hooks is None:
        return False
    pack, unpack = hooks
    return not _checkpoint_hooks_known or getattr(pack, "__module__", None) == _TORCH_CHECKPOINT or ours(pack, unpack)


def current_autograd_node():
    """The autograd node whose backward runs on this thread now (None outside one): in
    an unpack hook, the node that unpacks its saved tensors."""
    return _current_autograd_node()


def backward_keeps_graph() -> bool:
    """Whether the backward running on this thread keeps its graph (``retain_graph`` or
    ``create_graph``): a saved tensor it unpacks may be unpacked again. True outside a
    backward, where torch cannot tell, and in a trace (the builtin breaks Dynamo's graph)."""
    return _graph_task_keeps_graph is None or torch.compiler.is_compiling() or _graph_task_keeps_graph()


def default_device() -> torch.device:
    """``torch.get_default_device()``, read cheaply where nothing sets it: a device
    context (``with torch.device(...)``, ``set_default_device``) is a torch function
    mode, so with no mode on this thread's stack and no global context it is the CPU.
    (``get_default_device`` imports and walks the stack at every call.)"""
    if _len_torch_function_stack() == 0 and getattr(_GLOBAL_DEVICE_CONTEXT, "device_context", None) is None:
        return _CPU
    return torch.get_default_device()


def storage_identity(tensor: torch.Tensor) -> int:
    """An integer naming ``tensor``'s storage while the storage lives (views share it)."""
    return tensor.untyped_storage()._cdata


# Where this torch lacks it, storage_identity_or_none still tells wrappers by their missing storage.
_is_functorch_wrapper = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", lambda tensor: False)


def in_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements lie in memory that a kernel or a copy can read: not
    an efficient zero tensor (forward AD's zero tangents: a storage with no memory), nor
    a wrapper whose elements lie in the tensors it wraps (vmap's BatchedTensor, jvp's
    TensorWrapper; a subclass that flattens into others, DTensor's kind). Traced by
    torch.compile, a tensor is taken to be (Dynamo traces none of these tests)."""
    if torch.compiler.is_compiling():
        return True
    return not (tensor._is_zerotensor() or _is_functorch_wrapper(tensor) or is_traceable_wrapper_subclass(tensor))


def forward_ad_on() -> bool:
    """Whether a forward-mode AD level is open (``torch.autograd.forward_ad.dual_level``);
    False where this PyTorch cannot tell."""
    return getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0


_DisableFuncTorch = getattr(torch._C, "_DisableFuncTorch", None)


def outside_transforms():
    """A context in which torch.func's transforms (vmap, jvp) neither wrap the tensors
    made nor see the ops run: for actsave's own buffers and their copies of saves, which
    saved-tensor hooks get unwrapped."""
    return contextlib.nullcontext() if _DisableFuncTorch is None else _DisableFuncTorch()


def storage_identity_or_none(tensor: torch.Tensor) -> Optional[int]:
    """:func:`storage_identity`, or None for a tensor with no storage to read (torch.func's
    vmap and jvp wrappers: BatchedTensor, TensorWrapper)."""
    try:
        return storage_identity(tensor)
    except (NotImplementedError, RuntimeError):
        return None


# The dense tensors a sparse layout keeps its memory in. COO's through the private
# accessors: the public ones refuse an uncoalesced tensor (an embedding's sparse gradient).
_SPARSE_COMPONENTS = {torch.sparse_coo: (torch.Tensor._indices, torch.Tensor._values)}
for _layout, _indices in ((torch.sparse_csr, torch.Tensor.crow_indices), (torch.sparse_bsr, torch.Tensor.crow_indices),
                          (torch.sparse_csc, torch.Tensor.ccol_indices), (torch.sparse_bsc, torch.Tensor.ccol_indices)):
    _plain = torch.Tensor.col_indices if _indices is torch.Tensor.crow_indices else torch.Tensor.row_indices
    _SPARSE_COMPONENTS[_layout] = (_indices, _plain, torch.Tensor.values)


def sparse_components(tensor: torch.Tensor) -> Optional[tuple]:
    """The dense tensors that hold a sparse ``tensor``'s memory, or None for a strided one."""
    components = _SPARSE_COMPONENTS.get(tensor.layout)
    return None if components is None else tuple(component(tensor) for component in components)


def parametrize_cache() -> Optional[dict]:
    """parametrize.cached()'s cache, keyed by ``(id(module), name)``: a private global,
    replaced as each cached() block ends; None where this torch keeps it otherwise."""
    cache = getattr(torch.nn.utils.parametrize, "_cache", None)
    return cache if isinstance(cache, dict) else None


def parametrize_cache_keys(module: torch.nn.Module) -> set:
    """The keys of parametrize.cached()'s cache that ``module``'s parametrized tensors
    read: ``(id(m), name)`` of the module ``m`` each parametrization was registered on,
    which torch's property closes over. A deep copy shares its class's property, and with
    it the original's key. Where the property is not built so (another torch), the key of
    ``module`` itself."""
    keys = set()
    for name in getattr(module, "parametrizations", {}):
        getter = getattr(type(module).__dict__.get(name), "fget", None)
        registered_on = _closed_over(_closed_over(getter, "get_cached_parametrization"), "module")
        keys.add((id(module), name))
        if registered_on is not None:
            keys.add((id(registered_on), name))
    return keys


def _closed_over(function, name: str):
    """The value ``function`` closes over as ``name``, or None."""
    code = getattr(function, "__code__", None)
    if code is None or name not in code.co_freevars:
        return None
    return function.__closure__[code.co_freevars.index(name)].cell_contents


def version(tensor: torch.Tensor) -> int:
    """The tensor's version counter: it moves on every in-place change (views share it)."""
    return tensor._version


def version_counter_of(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """A tensor of no elements that shares ``tensor``'s version counter (its views',
    too) and holds none of its storage: ``version()`` of it follows every in-place
    change of ``tensor`` after it is freed, as autograd's saved-tensor check does. None
    where the tensor's type does not allow it (a subclass). Made as an alias of the
    tensor (``_make_subclass`` shares the counter, and lets the alias's metadata
    change), whose storage is then swapped for an empty one; the swap's own version
    bump is undone (``_unsafe_preserve_version_counter``)."""
    try:
        alias = torch.Tensor._make_subclass(torch.Tensor, tensor.detach())
        with _preserve_version_counter(alias):
            alias.set_(tensor.new_empty(0))
    except (TypeError, RuntimeError):
        return None
    return alias


_preserve_version_counter = _require(getattr(torch.autograd, "_unsafe_preserve_version_counter", None),
                                     "torch.autograd._unsafe_preserve_version_counter")


def leaf_base(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """The leaf ``tensor`` is, or is a view of; None for a tensor autograd produced."""
    base = tensor._base if tensor._is_view() else tensor
    return base if base.is_leaf else None


def is_relu_node(grad_fn) -> bool:
    """Whether ``grad_fn`` is the autograd node of a ReLU output."""
    return type(grad_fn).__name__ in _RELU_NODE_NAMES


# Dtypes whose values a multiply by one gives back (-0.0 and inf included, NaN as a NaN:
# on CUDA as the canonical one, its payload not kept): not bool (promoted to int64),
# not complex (inf * 0 in the imaginary part is NaN).
_EXACT_TIMES_ONE = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                              torch.int32, torch.int16, torch.int8, torch.uint8})


def copies_of(tensors: list) -> list:
    """A copy of the values of each of ``tensors``, in order, made by one foreach call
    per device rather than one clone per tensor: scratch copies of module state for a
    recompute (state.py), which only the recompute reads. PyTorch has no foreach clone;
    a foreach multiply by one copies the values in the dtypes listed above (a NaN stays
    a NaN, on CUDA the canonical one), and any other tensor is cloned. One call for
    mixed dtypes: on CUDA it launches a kernel per tensor (the multi-tensor kernel
    takes one dtype), as the clones did, for one host call. Those that require grad
    apart: autograd refuses a foreach call mixing them with integer tensors."""
    copies = [None] * len(tensors)
    groups = {}  # (device, requires grad) -> positions
    for i, tensor in enumerate(tensors):
        if tensor.dtype in _EXACT_TIMES_ONE:
            groups.setdefault((tensor.device, tensor.requires_grad), []).append(i)
        else:
            copies[i] = tensor.clone()
    for positions in groups.values():
        for i, copy in zip(positions, _foreach_mul([tensors[i] for i in positions], 1)):
            copies[i] = copy
    return copies


def children_of(module: torch.nn.Module):
    """The module's own table of submodules' values (``None`` entries included), read
    without building names as ``named_children`` does."""
    return module._modules.values()


def named_children_of(module: torch.nn.Module):
    """``(name, child)`` of each entry of the module's own table of submodules, in order,
    a module placed under two names included (``named_children`` yields it once)."""
    return ((name, child) for name, child in module._modules.items() if child is not None)


def own_tensors(module: torch.nn.Module, kind: str) -> dict:
    """The module's own table of ``kind`` (``"parameters"`` or ``"buffers"``): the live
    dict, so that a write swaps a tensor in place without registering it anew."""
    return module._parameters if kind == "parameters" else module._buffers


def _distributed(module: str, name: str):
    """``name`` of ``torch.distributed``'s ``module`` (FSDP2's module class, DTensor), or
    None where torch has no distributed package."""
    return getattr(importlib.import_module(module), name) if torch.distributed.is_available() else None


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (a parameter FSDP2 sharded, for one): its
    ``shape`` is the whole tensor's, which a forward sees once FSDP2 gathers it."""
    dtensor = _distributed("torch.distributed.tensor", "DTensor")
    return dtensor is not None and isinstance(tensor, dtensor)


def is_fsdp_unit(module: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` made ``module`` a unit of FSDP2: it gathers the sharded
    parameters it manages around its forward and backward."""
    fsdp_module = _distributed("torch.distributed.fsdp", "FSDPModule")
    return fsdp_module is not None and isinstance(module, fsdp_module)


def fsdp_shards(module: torch.nn.Module) -> bool:
    """Whether FSDP2 shards ``module`` or a module in it: a unit (its parameters are
    unsharded while it runs) or a holder of a sharded parameter."""
    return any(is_fsdp_unit(m) or any(map(is_sharded, m.parameters(recurse=False))) for m in module.modules())


def fsdp_param_dtype(unit: torch.nn.Module) -> Optional[torch.dtype]:
    """The dtype FSDP2 gathers ``unit``'s parameters in (its ``MixedPrecisionPolicy``'s
    ``param_dtype``), or None: their own."""
    policy = _require(getattr(unit._get_fsdp_state(), "_mp_policy", None), "FSDPState._mp_policy")
    return policy.param_dtype


@contextlib.contextmanager
def fsdp_forward_hooks_paused(model: torch.nn.Module):
    """While active, the modules of ``model`` that FSDP2's ``fully_shard`` made run
    without its forward hooks (which would gather the sharded parameters over
    whatever the module holds now, and reshard them after); every other hook stays.
    The hooks are put back in their order on exit."""
    units = [m for m in model.modules() if is_fsdp_unit(m)]
    saved = []
    for unit in units:
        state = unit._get_fsdp_state()
        handles = [_require(getattr(state, name, None), f"FSDPState.{name}")
                   for name in ("_pre_forward_hook_handle", "_post_forward_hook_handle")]
        ids = {h.id for handle in handles for h in getattr(handle, "handles", (handle,))}
        for module in _require(getattr(state, "_modules", None), "FSDPState._modules"):
            for table in (module._forward_pre_hooks, module._forward_hooks):
                saved.append((table, dict(table)))
                for key in ids & table.keys():
                    del table[key]
    try:
        yield
    finally:
        for table, entries in reversed(saved):
            table.clear()
            table.update(entries)


# The fused attention kernels of CUDA and the CPU, called on meta tensors where a meta
# step stands for such a device (NOTE [ Attention on a simulated device ] in meta.py);
# None where this torch has none, and such steps keep the math path's estimate.
flash_attention = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)
efficient_attention = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None)
cpu_flash_attention = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


# NOTE [ Storage resizes ]
# FSDP2 frees a unit's gathered parameters with ``storage.resize_(0)`` and refills them
# with ``storage.resize_(n)``: a call on the storage, not an operator, so no dispatch
# mode sees it, and a byte count that follows operators counts the storage whole for
# as long as it lives. While a counter observes resizes, ``UntypedStorage.resize_``
# reports each (the storage, its bytes before and after) to every active observer.
# The method is replaced on the class only while one observes (AttributeSwap), so for
# every thread; observers hear every thread's resizes, since FSDP2 resizes in backward
# on autograd's device threads, not the thread that observes. Each observer acts on
# the storages it counts alone (LiveBytes, the profile's ledger), so a resize of
# another thread's storage changes nothing for it.
_resize_observers = []


def _observed_resize(storage, size):
    before = storage.nbytes()
    result = _resize_swap.original(storage, size)
    for observer in list(_resize_observers):
        observer(storage, before, storage.nbytes())
    return result


class AttributeSwap(CountedChange):
    """``owner.name`` replaced by ``replacement`` while one or more :meth:`active`
    contexts are open (they nest, on any threads), and put back as it was when the last
    one closes: an attribute ``owner`` inherits (a C base class's method) is deleted
    from it again, not set on it. ``original`` is what it was when the swap was made.

    The attribute is the process's, so every thread sees ``replacement`` while one is
    open: it must do what ``original`` does for the threads that did not ask for it
    (meta.py's attention reads its own thread's simulated device). The open contexts
    are counted as :class:`~actsave.settings.CountedChange` counts them."""

    def __init__(self, owner, name: str, replacement):
        super().__init__()
        self.owner, self.name, self.replacement = owner, name, replacement
        self.original = _require(getattr(owner, name, None), f"{getattr(owner, '__name__', owner)}.{name}")
        self._own = name in vars(owner)

    def make(self) -> None:
        setattr(self.owner, self.name, self.replacement)

    def undo(self) -> None:
        if self._own:
            setattr(self.owner, self.name, self.original)
        else:
            delattr(self.owner, self.name)

_resize_swap = AttributeSwap(torch.UntypedStorage, "resize_", _observed_resize)


@contextlib.contextmanager
def storage_resizes_observed(observer):
    """While active, ``observer(storage, bytes_before, bytes_after)`` hears of every
    ``UntypedStorage.resize_``, on any thread: NOTE [ Storage resizes ]."""
    _resize_observers.append(observer)  # list.append and .remove are atomic
    try:
        with _resize_swap.active():
            yield
    finally:
        _resize_observers.remove(observer)


# NOTE [ Compiled code run eagerly on one thread ]
# actsave runs compiled code's eager code where a graph would hide what it must see:
# the planner's steps and the probe of a compiled model (meta tensors, its saves) and
# a lossy checkpoint of compiled layers whose decisions it keeps (compiled_layers.py).
# torch.compiler.set_stance("force_eager") does that for the whole process: the stance
# is a module global of torch._dynamo.eval_frame (read in torch 2.13), read whenever any
# thread enters compiled code, so another thread's compiled model would run eagerly
# meanwhile, and two threads setting and restoring it out of order could leave it
# forced for good. What decides, at each entry into compiled code (torch.compile's
# wrapper, ``module.compile()``, an OptimizedModule), is
# ``eval_frame._callback_from_stance(callback)``, whose result becomes Dynamo's frame
# callback, which is per thread. So while some thread runs eagerly that function is
# replaced (AttributeSwap) by one that gives None on the threads inside
# :func:`compiled_code_eager` (what "force_eager" gives: run the frame eagerly) and
# defers to torch's on every other thread. Compiled autograd, which reads the stance
# itself, is not covered: actsave never enables it. Where a torch lacks the function,
# the stance is set while any thread runs eagerly (counted, under a lock): other
# threads' compiled code then runs eagerly meanwhile, no worse.
_eval_frame = importlib.import_module("torch._dynamo.eval_frame")
_eager_here = threading.local()


def _callback_for_this_thread(callback):
    if getattr(_eager_here, "depth", 0):
        return None
    return _stance_swap.original(callback)


_stance_swap = (AttributeSwap(_eval_frame, "_callback_from_stance", _callback_for_this_thread)
                if getattr(_eval_frame, "_callback_from_stance", None) is not None else None)
_stance_lock = threading.Lock()
_stance_forced = [0, None]  # without _stance_swap: threads running eagerly, the stance's context


@contextlib.contextmanager
def compiled_code_eager():
    """While active, compiled code called on this thread runs its eager code (compiled
    modules, ``module.compile()``, compiled functions); other threads' compiled code
    runs compiled. NOTE [ Compiled code run eagerly on one thread ]."""
    if _stance_swap is None:
        with _stance_forced_while_open():
            yield
        return
    _eager_here.depth = getattr(_eager_here, "depth", 0) + 1
    try:
        with _stance_swap.active():
            yield
    finally:
        _eager_here.depth -= 1


@contextlib.contextmanager
def _stance_forced_while_open():
    with _stance_lock:
        if not _stance_forced[0]:
            context = torch.compiler.set_stance("force_eager")
            context.__enter__()
            _stance_forced[1] = context
        _stance_forced[0] += 1
    try:
        yield
    finally:
        with _stance_lock:
            _stance_forced[0] -= 1
            if not _stance_forced[0]:
                _stance_forced[1].__exit__(None, None, None)
                _stance_forced[1] = None


def top_saved_tensor_hooks():
    """The innermost ``(pack, unpack)`` set on this thread, or None."""
    return _top_saved_tensors_hooks(False)
