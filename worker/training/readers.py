"""``ReadTrace``: which module's forward reads each parameter, found by watching the first step.

Under overlap a parameter's new values arrive while the next forward runs, so that forward must
wait for them before it reads them, in the forward pre-hook of a module whose forward starts
before the read. The owner's pre-hook is not always that module: ``nn.MultiheadAttention``
reads ``out_proj.weight`` inside ``F.multi_head_attention_forward`` and never calls
``out_proj``, so ``out_proj``'s pre-hook never runs; ``nn.TransformerEncoderLayer`` and many
user models (tied embeddings, ``F.linear(x, self.proj.weight)``) do the same.

The rule, derived from one watched step (the first; nothing is in flight then):

- a parameter that a torch function received as an argument while module ``M``'s forward was
  the innermost one running is awaited in ``M``'s pre-hook (every such ``M``);
- a parameter no function read (its use depends on the data: an expert no token was routed to)
  is awaited in its owner's pre-hook, and, when the owner's forward did not run, also in that of
  the nearest enclosing module whose forward did.

Reads are seen through a ``torch.overrides.TorchFunctionMode`` entered only while a module of
the model runs its forward, so code outside the model is never intercepted. A parameter read
outside every forward of the model (a penalty in the loss, say) cannot be waited for by any
hook: the contract is to read parameters outside a forward only after
``PSModel.synchronize()``.

    trace = ReadTrace(model, params)      # hooks in, before the first forward
    ...                                   # the first step's forwards run
    waits = trace.finish()                # {module: [parameter index, ...]}; hooks out
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

__all__ = ["ReadTrace"]


class _Reads(TorchFunctionMode):
    def __init__(self, trace: ReadTrace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.trace._read((args, kwargs))
        return func(*args, **kwargs)


class ReadTrace:
    """Watches the forwards of ``model`` until :meth:`finish` and maps each of ``params``
    (registration order) to the modules whose pre-hooks must wait for it."""

    def __init__(self, model: torch.nn.Module, params: Sequence[torch.Tensor]) -> None:
        self.model = model
        self._index = {id(p): i for i, p in enumerate(params)}
        self._readers: list[set[torch.nn.Module]] = [set() for _ in params]
        self._ran: set[torch.nn.Module] = set()
        self._stack: list[torch.nn.Module] = []
        self._mode: _Reads | None = None
        self._hooks = []
        for module in model.modules():
            self._hooks.append(module.register_forward_pre_hook(self._enter))
            self._hooks.append(module.register_forward_hook(self._leave, always_call=True))

    def _enter(self, module, args) -> None:
        self._ran.add(module)
        if not self._stack:
            self._mode = _Reads(self)
            self._mode.__enter__()
        self._stack.append(module)

    def _leave(self, module, args, output) -> None:
        if not self._stack or self._stack[-1] is not module:
            return  # a forward that raised before our pre-hook ran
        self._stack.pop()
        if not self._stack:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def _read(self, tree) -> None:
        inner = self._stack[-1] if self._stack else None
        for leaf in tree_leaves(tree):
            i = self._index.get(id(leaf))
            if i is not None and inner is not None:
                self._readers[i].add(inner)

    def finish(self) -> dict[torch.nn.Module, list[int]]:
        """Remove the hooks; return, per module, the parameter indices its pre-hook awaits."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._mode is not None:  # finished from inside a forward (a backward within it)
            self._mode.__exit__(None, None, None)
            self._mode = None
            self._stack.clear()
        parent: dict[torch.nn.Module, torch.nn.Module] = {}
        owner: dict[int, torch.nn.Module] = {}
        for module in self.model.modules():
            for child in module.children():
                parent.setdefault(child, module)
            for p in module.parameters(recurse=False):
                i = self._index.get(id(p))
                if i is not None:
                    owner.setdefault(i, module)
        waits: dict[torch.nn.Module, set[int]] = {}
        for i, readers in enumerate(self._readers):
            if not readers and i in owner:
                readers = {owner[i]}
                ancestor = owner[i]
                while ancestor not in self._ran and ancestor in parent:
                    ancestor = parent[ancestor]
                if ancestor in self._ran:
                    readers.add(ancestor)
            for module in readers:
                waits.setdefault(module, set()).add(i)
        return {m: sorted(idx) for m, idx in waits.items()}
