"""Programmatic dependent launch: ``griddepcontrol.wait`` and ``griddepcontrol.launch_dependents``.

On a GPU, a kernel launched with programmatic stream serialization may start before the previous
kernel of its stream has finished; ``griddepcontrol.wait`` returns once that kernel has completed
and its memory is visible, and ``launch_dependents`` lets the next kernel start early. The executor
runs one kernel, so neither changes what it computes: the wait records, per thread, that it was
passed, and the access log tags every global access with it (``after_dependency_wait``), so that
:func:`ptx_executor.analysis.pre_wait_accesses` lists what a thread touched before its wait: the
bytes a kernel may only touch when the caller guarantees the previous kernel does not write them.
``launch_dependents`` is executed as a no-op.
"""

from __future__ import annotations

import numpy as np

from .isa import handler, unsupported


def state(F) -> np.ndarray:
    """Per chunk thread: whether it passed ``griddepcontrol.wait``."""
    if F.griddep_waited is None:
        F.griddep_waited = np.zeros(F.n, bool)
    return F.griddep_waited


def log_sources(F) -> dict:
    """The access log's tag (``AccessLog.tag_sources``): whether each global thread passed the wait."""
    waited = state(F)
    return {"after_dependency_wait": lambda threads: waited[np.asarray(threads, np.int64) - F.first_thread].copy()}


@handler("griddepcontrol")
def _griddepcontrol(ins, ctx):
    if ins.mods not in (("wait",), ("launch_dependents",)) or ins.operands:
        raise unsupported(ins, "griddepcontrol.wait or griddepcontrol.launch_dependents, no operands")
    if ins.mods == ("launch_dependents",):
        return lambda F, idx: None

    def wait(F, idx):
        state(F)[F.threads(idx)] = True
    return wait
