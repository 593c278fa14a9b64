"""The peer in suite ``step`` (``--upstream PATH``): upstream's own CuteDSL ``mamba3_step_fn``
(state-spaces/mamba, ``mamba_ssm/ops/cute/mamba3/mamba3_step_fn.py``), run as a server without pool
indexing must run it: gather the batch's state, Bstate and Xstate rows, the dense step in place on
the gathered copies, scatter the new state back and store this step's B and x into the Bstate and
Xstate rows (upstream's ``Mamba3.step`` copies them after the step).

The file is loaded at run time from the checkout the benchmark is given, never vendored here: the
benchmark executes the Python code at that path, so give it a checkout you trust. Upstream's file
imports ``quack`` (``pip install quack-kernels``) and ``cuda.bindings``; without them loading fails
with a message that names them. Its dense step takes the flagship's tensors in this project's
order and layout (the contract mirrors upstream's signature) and CUDA tensors only.

Before it is timed the peer is checked at every batch size (``check``): its ``out`` and new state
rows within PyTorch float32's error of the float64 evaluation, like pool mode's (its arithmetic is
not this project's, so not bit for bit), and its Bstate/Xstate rows exactly this step's B and x.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Callable

import torch

#: the upstream file holding the dense CuteDSL step, relative to a checkout's root
UPSTREAM_FILE = "mamba_ssm/ops/cute/mamba3/mamba3_step_fn.py"
#: the tiling upstream's Mamba3.step launches its step with
UPSTREAM_TILING = dict(tile_D=64, num_warps=4)


def load_upstream_step(checkout: str) -> Callable:
    """``mamba3_step_fn`` of the state-spaces/mamba checkout at ``checkout``, loaded from its file alone
    (the ``mamba_ssm`` package's own imports are not needed). ValueError names ``--upstream`` when the
    file is missing or its imports are not installed."""
    path = Path(checkout).expanduser() / UPSTREAM_FILE
    if not path.is_file():
        raise ValueError(f"--upstream: expected a state-spaces/mamba checkout holding {UPSTREAM_FILE}, got {checkout!r}")
    spec = importlib.util.spec_from_file_location("upstream_mamba3_step_fn", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise ValueError(f"--upstream: {path} needs {e.name or e} (upstream's file imports quack "
                         f"(pip install quack-kernels) and cuda.bindings): {e}") from e
    fn = getattr(module, "mamba3_step_fn", None)
    if not callable(fn):
        raise ValueError(f"--upstream: {path} defines no mamba3_step_fn")
    sys.modules.setdefault("upstream_mamba3_step_fn", module)
    return fn


def upstream_step(fn: Callable, spec, pool: dict, scratch: dict, shared: dict, lanes: dict, idx64: torch.Tensor):
    """One server step through upstream's dense step: rows ``idx64`` (B,) int64 of ``pool`` gathered into
    ``scratch``, stepped in place, the new state scattered back, B and x stored into Bstate/Xstate."""
    for k in ("state", "Bstate", "Xstate"):
        torch.index_select(pool[k], 0, idx64, out=scratch[k])
    fn(scratch["state"], scratch["Bstate"], scratch["Xstate"], lanes["A"], lanes["B"], lanes["C"], shared["D"],
       lanes["x"], lanes["dt"], lanes["trap"], shared["xproj"], outproj=shared["outproj"], state_out=None,
       out=lanes["out"], z=lanes["z"], zproj=shared["zproj"], **UPSTREAM_TILING)
    pool["state"].index_copy_(0, idx64, scratch["state"])
    if spec.update_kv_state:
        pool["Bstate"].index_copy_(0, idx64, lanes["B"])
        pool["Xstate"].index_copy_(0, idx64, lanes["x"])
