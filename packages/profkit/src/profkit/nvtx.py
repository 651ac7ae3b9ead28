"""NVTX ranges for Nsight Systems timelines, and ways to add them to code you do not want to edit.

A range goes to NVTX when CUDA is available, and to torch.profiler (as a ``record_function``
range) while a profiler records, so the same ranges show in Nsight Systems and in the traces of
:mod:`profkit.traces`. Without either it costs one check, so annotated code runs unchanged anywhere.

    with profkit.nvtx.range("attention"): ...          # a context manager
    @profkit.nvtx.range("loss")                         # or a decorator
    def loss_fn(...): ...

    with profkit.nvtx.annotate_modules(model, lambda name, m: name.count(".") <= 2), \\
         profkit.nvtx.annotate_functions("mypkg.model.attention_softmax"):
        train_step()
"""

from __future__ import annotations

import builtins
import functools
import importlib
import inspect
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["annotate_functions", "annotate_modules", "enabled", "range", "traced_names"]


class _Sink(Protocol):
    def range_push(self, msg: str) -> Any: ...
    def range_pop(self) -> Any: ...


def _cuda_sink() -> _Sink | None:
    return torch.cuda.nvtx if torch.cuda.is_available() else None


# Where ranges go: torch.cuda.nvtx when CUDA is available, else nowhere. Tests swap in a recorder.
_sink: Callable[[], _Sink | None] = _cuda_sink


def enabled() -> bool:
    """Whether ranges are emitted to NVTX (CUDA is available)."""
    return _sink() is not None


# The names of the ranges sent to a profiler, so that a trace can tell profkit's ranges from
# other record_function ranges; profkit.trace clears it when it starts recording.
traced_names: set[str] = set()
_Token = tuple["_Sink | None", "torch.autograd.profiler.record_function | None"]


def _push(name: str) -> _Token:
    """Open ``name`` in NVTX and in a running profiler; the token closes what was opened."""
    sink = _sink()
    if sink is not None:
        sink.range_push(name)
    profiled = None
    if torch.autograd.profiler._is_profiler_enabled:
        profiled = torch.autograd.profiler.record_function(name)
        profiled.__enter__()
        traced_names.add(name)
    return sink, profiled


def _pop(token: _Token) -> None:
    sink, profiled = token
    if profiled is not None:
        profiled.__exit__(None, None, None)
    if sink is not None:
        sink.range_pop()


class range:  # noqa: A001 - the name users expect, as torch.cuda.nvtx.range
    """A range: ``with range("name"):`` or ``@range("name")``, in NVTX and in a running profiler."""

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name={name!r} must be a non-empty string")
        self.name = name

    def __enter__(self) -> range:
        self._token = _push(self.name)
        return self

    def __exit__(self, *exc: object) -> None:
        _pop(self._token)

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with range(self.name):
                return fn(*args, **kwargs)

        return wrapped  # type: ignore[return-value]


ModuleFilter = Callable[[str, nn.Module], bool]


@contextmanager
def annotate_modules(model: nn.Module, include: ModuleFilter | Iterable[str] | None = None,
                     prefix: str = "") -> Iterator[list[str]]:
    """Wrap the forward of ``model``'s submodules in NVTX ranges named by their qualified name.

    ``include`` picks the modules: a predicate ``(name, module) -> bool``, an iterable of qualified
    names (each must exist), or None for every submodule except the root. Ranges are pushed by a
    forward pre-hook and popped by a forward hook; the hooks are removed on exit. Yields the names.
    """
    modules = dict(model.named_modules())
    modules.pop("", None)
    if include is None:
        chosen = list(modules)
    elif callable(include):
        chosen = [name for name, module in modules.items() if include(name, module)]
    else:
        chosen = list(include)
        unknown = [name for name in chosen if name not in modules]
        if unknown:
            raise ValueError(f"include names modules that {type(model).__name__} does not have: {unknown}")
    handles = []
    try:
        for name in chosen:
            label = f"{prefix}{name}"
            pre = functools.partial(_push_hook, label)
            handles.append(modules[name].register_forward_pre_hook(pre))
            handles.append(modules[name].register_forward_hook(_pop_hook, always_call=True))
        yield chosen
    finally:
        for handle in handles:
            handle.remove()


# Module hooks open and close ranges in separate calls: the open ones wait here, per thread.
_hook_tokens = threading.local()


def _hook_stack() -> list[_Token]:
    if not hasattr(_hook_tokens, "stack"):
        _hook_tokens.stack = []
    return _hook_tokens.stack


def _push_hook(label: str, module: nn.Module, args: Any) -> None:
    _hook_stack().append(_push(label))


def _pop_hook(module: nn.Module, args: Any, output: Any) -> None:
    stack = _hook_stack()
    if stack:
        _pop(stack.pop())


def resolve(dotted_name: str) -> tuple[Any, str]:
    """The object that holds ``dotted_name``'s last attribute, and that attribute's name.

    ``"pkg.mod.func"`` -> (module pkg.mod, "func"); ``"pkg.mod.Class.method"`` -> (Class, "method").
    """
    parts = dotted_name.split(".")
    if len(parts) < 2 or not all(parts):
        raise ValueError(f"{dotted_name!r} is not a dotted name like 'package.module.function'")
    for split in builtins.range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        try:
            owner: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and not module_name.startswith(exc.name):
                raise  # the module exists but one of its own imports is missing
            continue
        for attribute in parts[split:-1]:
            if not hasattr(owner, attribute):
                raise ValueError(f"{dotted_name!r}: {owner!r} has no attribute {attribute!r}")
            owner = getattr(owner, attribute)
        if not hasattr(owner, parts[-1]):
            raise ValueError(f"{dotted_name!r}: {owner!r} has no attribute {parts[-1]!r}")
        return owner, parts[-1]
    raise ValueError(f"{dotted_name!r}: no importable module among its prefixes")


@contextmanager
def annotate_functions(*dotted_names: str, names: dict[str, str] | None = None) -> Iterator[None]:
    """Replace each named function by one that runs it inside an NVTX range; restore them on exit.

    The range is named after the function (the last part of its dotted name) unless ``names`` maps
    the dotted name to another label. Callers that look the function up at call time (module
    globals, class attributes) see the annotated one; references taken earlier do not.
    """
    names = names or {}
    unknown = set(names) - set(dotted_names)
    if unknown:
        raise ValueError(f"names has labels for functions that are not annotated: {sorted(unknown)}")
    with ExitStack() as restore:
        for dotted in dotted_names:
            owner, attribute = resolve(dotted)
            original = inspect.getattr_static(owner, attribute)
            annotate = range(names.get(dotted, attribute))
            if isinstance(original, (staticmethod, classmethod)):
                replacement: Any = type(original)(annotate(original.__func__))
            elif callable(original):
                replacement = annotate(original)
            else:
                raise ValueError(f"{dotted!r} is not a function (it is {type(original).__name__})")
            if attribute in vars(owner):
                restore.callback(setattr, owner, attribute, original)
            else:  # inherited: remove the override to uncover the base class's attribute again
                restore.callback(delattr, owner, attribute)
            setattr(owner, attribute, replacement)
        yield
