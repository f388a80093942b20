"""Count the host synchronisations a piece of training code would make on a GPU, on the CPU.

On a GPU a host synchronisation (the host waits until the device has run everything queued) stops
the host from queueing the next step's kernels while the device works: the loop then costs its
Python time on top of the device time instead of beside it. On the CPU nothing waits, so the calls
that would wait are counted instead, each with the line of dstrain, DeepSpeed or torch that made it:

- a device tensor read on the host: ``item``, ``tolist``, ``bool``/``int``/``float`` of a tensor,
  ``numpy``, ``cpu``, ``.to("cpu")`` (a string target; see :func:`_to_host`), ``nonzero``,
  ``equal`` (a data-dependent result);
- an explicit wait: ``torch.cuda.synchronize`` and DeepSpeed's ``get_accelerator().synchronize``.

A CPU run cannot tell a device tensor from a host one (everything is on the CPU), so a call on a
tensor that is on the host on a GPU node too (a gloo flag, a Python-side counter) is counted as
well; the tests name such call sites with the reason they cost nothing on a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.equal,
    torch.is_nonzero,
}
HERE = Path(__file__).resolve()


def call_site() -> str:
    """``package/file.py:line`` of the innermost frame outside this module and torch's own
    plumbing (torch/overrides.py, torch/utils/_contextlib.py): the line that asked for the value."""
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path != HERE and not path.match("torch/overrides.py") and "_contextlib" not in path.name:
            parts = path.parts
            for root in ("dstrain", "deepspeed", "torch", "tests", "bench"):
                if root in parts:
                    index = len(parts) - 1 - parts[::-1].index(root)
                    return f"{'/'.join(parts[index:])}:{frame.f_lineno}"
            return f"{path.name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _to_host(args, kwargs) -> bool:
    """``.to("cpu")``, spelt as a string: a copy to the host wherever the code runs. A target held in
    a variable (``.to(self.device)``) is the model's device on a GPU node (a copy to the device, no
    wait), so it is not counted: on the CPU the two cannot be told apart."""
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, str) and torch.device(target).type == "cpu"


class HostSyncs(TorchFunctionMode):
    """``with HostSyncs() as syncs: ...``; ``syncs.sites`` counts each call site's synchronisations."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()
        self._patches = contextlib.ExitStack()
        self._waiting = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS or (func is torch.Tensor.to and _to_host(args, kwargs)):
            self.sites[call_site()] += 1
        return func(*args, **kwargs)

    def _count_wait(self, real):
        def wait(*args, **kwargs):
            if self._waiting:  # DeepSpeed's CUDA accelerator waits through torch.cuda.synchronize:
                return real(*args, **kwargs)  # one wait, counted once (the H100 pass counted 2)
            self.sites[call_site()] += 1
            self._waiting = True
            try:
                return real(*args, **kwargs)
            finally:
                self._waiting = False

        return wait

    def __enter__(self):
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        from unittest import mock

        self._patches.enter_context(
            mock.patch.object(accelerator, "synchronize", self._count_wait(accelerator.synchronize))
        )
        self._patches.enter_context(
            mock.patch.object(torch.cuda, "synchronize", self._count_wait(torch.cuda.synchronize))
        )
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.close()

    def total(self) -> int:
        return sum(self.sites.values())
