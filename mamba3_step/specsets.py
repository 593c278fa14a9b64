"""Naming specialisations: ``--config`` values, the shared command-line flags, short labels.

Letters (docs/contract.md): N state size, D head dim, R MIMO rank.

Every subcommand that works on specialisations (``precompile``, ``inspect``, ``demo``, and any
new one) names them the same way, through :func:`add_spec_arguments` and
:func:`specs_from_args`:

* ``--config flagship|all|N,D,R[,state,kv,x,proj]`` (repeatable; default ``flagship``). A named
  N,D,R takes the flagship's dtypes unless it lists its own;
* ``--state-dtype``, ``--kv-dtype``, ``--x-dtype``, ``--proj-dtype``: dtypes for every config
  (a config that names a different one is an error);
* ``--mode pool|dense``, ``--dst``, ``--no-update-kv-state``, ``--no-z``, ``--no-outproj``,
  ``--state-out``: the mode flags, applied to every config; ``--tokens T`` (a T-token step),
  ``--dst-per-token`` ((B, T) destinations) and ``--num-accepted`` ((B, K) sources picked by
  ``num_accepted_tokens``), the multi-token flags; ``--rope-angles S``, ``--rotate-pairwise``,
  ``--bc-bias``, ``--shared-bc``, the rotary flags; ``--stochastic-rounding`` (with a 16-bit
  ``--state-dtype``); ``--replay-ring F``, ``--replay-from-checkpoint``, ``--replay-draft T_MAX``,
  the replay flags; ``--materialize-ring L``: ``materialize_fn``'s flush forms for a replay pool
  whose rows the other flags name and whose rings hold L entries (``spec.flush_specs``);
* ``--tile-d``, ``--num-warps``: the tiling (default: per configuration);
* ``--arch``: the target (default: this machine's GPU, else sm_90a).

With no flag at all this names the flagship as servers run it: pool mode with update_kv_state,
z and outproj, fp32 state, bf16 everything else.
"""

from __future__ import annotations

import argparse
import itertools

from .arch import DEFAULT_ARCH, check_arch, current_arch
from .contract import KV_DTYPES, PROJ_DTYPES, STATE_DTYPES, SUPPORTED_D, SUPPORTED_N, SUPPORTED_R, X_DTYPES
from .spec import MAX_TOKENS, PREVIOUS_LOAD_LAYOUTS, StepSpec, flagship_spec, flush_specs, mode_problem
from .slab_pipeline import PIPELINE_DEFAULT_CTAS
from .tiling import shape_problem, tiling_problem

__all__ = ["CONFIG_HELP", "add_spec_arguments", "arch_from_args", "parse_spec_args", "spec_label",
           "specs_for_config", "specs_from_args"]

CONFIG_HELP = "flagship | all | N,D,R[,state_dtype[,kv_dtype[,x_dtype[,proj_dtype]]]] (repeatable)"
#: ``--kernel``: which kernels a command compiles, each as the StepSpec fields that select it (none of them public
#: options): the register kernel (the default), its previous load layouts (the loads unpinned; with that, the
#: epilogue's operands loaded late), the asynchronous state copy, the slab pipeline, the register kernel launched
#: programmatically; "both" the register kernel and the copy, "layouts" the register kernel in its three load
#: layouts, "pipelined" the register kernel and the slab pipeline, "programmatic-pair" the register kernel with and
#: without programmatic launch
_KERNEL_FIELDS = {"registers": {}, **PREVIOUS_LOAD_LAYOUTS, "async-copy": {"async_state_copy": True},
                  "pipeline": {"pipeline_ctas": PIPELINE_DEFAULT_CTAS}, "programmatic": {"programmatic_launch": True}}
KERNEL_CHOICES = {**{name: (name,) for name in _KERNEL_FIELDS}, "both": ("registers", "async-copy"),
                  "layouts": ("registers", "unpinned", "late-epilogue"), "pipelined": ("registers", "pipeline"),
                  "programmatic-pair": ("registers", "programmatic")}
KERNELS = tuple(KERNEL_CHOICES)
_DTYPE_FIELDS = (("state_dtype", STATE_DTYPES), ("kv_dtype", KV_DTYPES), ("x_dtype", X_DTYPES),
                 ("proj_dtype", PROJ_DTYPES))


def specs_for_config(config: str, **changes) -> list[StepSpec]:
    """Specs named by one ``--config`` value, with ``changes`` (StepSpec fields: mode flags,
    dtypes, tiling) applied over the flagship's.

    ``all`` is the supported cross product N x D x R (4 x 3 x 4 = 48), minus combinations
    whose tiling is impossible. Raises ValueError/TypeError naming the config.
    """
    if not isinstance(config, str):
        raise TypeError(f"config: expected a string ({CONFIG_HELP}), got {type(config).__name__}")
    text = config.strip()
    if text == "flagship":
        return [_checked(config, flagship_spec(**changes))]
    if text == "all":
        _checked(config, flagship_spec(**changes))  # the flags themselves (tokens, modes) first
        every = (flagship_spec(dstate=n, headdim=d, mimo=r, **changes)
                 for n, d, r in itertools.product(SUPPORTED_N, SUPPORTED_D, SUPPORTED_R))
        return [s for s in every if tiling_problem(s) is None]
    parts = [p.strip() for p in text.split(",")]
    if not 3 <= len(parts) <= 7:
        raise ValueError(f"config: expected {CONFIG_HELP}, got {config!r}")
    try:
        n, d, r = (int(p) for p in parts[:3])
    except ValueError:
        raise ValueError(f"config: N,D,R must be integers ({CONFIG_HELP}), got {config!r}") from None
    problem = shape_problem(n, d, r)
    if problem:
        raise ValueError(f"config {config!r}: {problem}")
    named = dict(dstate=n, headdim=d, mimo=r)
    for (field, allowed), value in zip(_DTYPE_FIELDS, parts[3:]):
        if value not in allowed:
            raise ValueError(f"config {config!r}: {field} must be one of {allowed}, got {value!r}")
        if changes.get(field, value) != value:
            raise ValueError(f"config {config!r} names {field}={value}, but the flags ask for "
                             f"{changes[field]}: drop one of them")
        named[field] = value
    return [_checked(config, flagship_spec(**{**changes, **named}))]


def _checked(config: str, spec: StepSpec) -> StepSpec:
    problem = mode_problem(spec) or tiling_problem(spec)
    if problem:
        raise ValueError(f"config {config!r}: {problem}")
    return spec


def spec_label(spec: StepSpec) -> str:
    """A short human-readable name: ``N128 D64 R4 float32/bfloat16/bfloat16/bfloat16 tD64 w8 pool+kv+z+outproj``."""
    flags = [n for n, on in (("pool", spec.pool), ("dst", spec.has_dst), ("dst/token", spec.dst_per_token),
                             ("accepted", spec.num_accepted), ("kv", spec.update_kv_state),
                             ("z", spec.has_z), ("outproj", spec.has_outproj),
                             ("state_out", spec.has_state_out),
                             (f"rope{spec.rope_angles}", spec.rope_angles > 0), ("pairwise", spec.rotate_pairwise),
                             ("bcbias", spec.has_bc_bias), ("sharedBC", spec.shared_bc),
                             ("sr", spec.stochastic_rounding), ("rand_rows", spec.has_rand_rows),
                             (f"replay{spec.replay_ring}", spec.replay_ring > 0),
                             ("fromCheckpoint", spec.replay_from_checkpoint),
                             (f"draft{spec.replay_draft}", spec.replay_draft > 0),
                             (f"{spec.min_ctas_per_sm}ctas", spec.min_ctas_per_sm > 0),
                             ("asyncState", spec.async_state_copy), ("unpinned", spec.unpinned_loads),
                             ("lateEpilogue", spec.late_epilogue),
                             (f"pipeline{spec.pipeline_ctas}", spec.pipeline_ctas > 0),
                             ("programmatic", spec.programmatic_launch)) if on]
    tokens = f"T{spec.tokens} " if spec.tokens > 1 else ""
    return (f"N{spec.dstate} D{spec.headdim} R{spec.mimo} {spec.state_dtype}/{spec.kv_dtype}/"
            f"{spec.x_dtype}/{spec.proj_dtype} tD{spec.tile_D} w{spec.num_warps} {tokens}"
            f"{'+'.join(flags) or 'dense'}")


def add_spec_arguments(parser: argparse.ArgumentParser, *, modes: bool = True, arch: bool = True) -> None:
    """Add the shared flags naming specialisations (module docstring) to ``parser``.

    ``modes=False`` leaves out the mode flags (for a command whose mode is fixed, like the demo);
    ``arch=False`` leaves out ``--arch``.
    """
    g = parser.add_argument_group("specialisation")
    g.add_argument("--config", action="append", default=None, metavar="CONFIG",
                   help=f"{CONFIG_HELP}; default flagship. 'all' = the 48 supported N x D x R "
                        "combinations")
    for field, allowed in _DTYPE_FIELDS:
        g.add_argument("--" + field.replace("_", "-"), default=None, choices=allowed,
                       help=f"{field} for every config (default: the config's, else the flagship's)")
    g.add_argument("--tile-d", type=int, default=0, help="rows of D per CTA (default: per config)")
    g.add_argument("--num-warps", type=int, default=0, help="warps per CTA (default: per config)")
    g.add_argument("--min-ctas", type=int, default=0,
                   help="launch bound: CTAs per SM the compiler keeps registers for (an experiment's; default: none)")
    g.add_argument("--kernel", choices=KERNELS, default="registers",
                   help="the register kernel (default); its loads unpinned (StepSpec.unpinned_loads: the kernel "
                        "without the barrier that pins its loads) or with that its epilogue loaded late (StepSpec.late_epilogue); "
                        "the asynchronous state copy (StepSpec.async_state_copy: not the default, slower on the "
                        "H200); the slab pipeline (StepSpec.pipeline_ctas: persistent CTAs, the next slab's state "
                        "in flight by a bulk copy; not the default, unmeasured on a GPU); programmatic (the register "
                        "kernel with programmatic dependent launch, StepSpec.programmatic_launch; unmeasured on a GPU); "
                        "both (the register kernel and the copy), layouts (the register kernel's three), pipelined "
                        "(the register kernel and the pipeline) or programmatic-pair, each specialisation once per kernel")
    if modes:
        g.add_argument("--mode", choices=("pool", "dense"), default="pool",
                       help="pool mode (state_batch_indices given; default) or dense mode")
        g.add_argument("--dst", action="store_true", help="pool mode with dst_state_batch_indices")
        g.add_argument("--no-update-kv-state", action="store_true", help="without update_kv_state")
        g.add_argument("--no-z", action="store_true", help="without the z gate")
        g.add_argument("--no-outproj", action="store_true", help="without outproj (out is (B, R, H, D))")
        g.add_argument("--state-out", action="store_true", help="dense mode with state_out")
        g.add_argument("--tokens", type=int, default=1, metavar="T",
                       help="tokens per lane (a multi-token step, e.g. speculative decoding's verify pass)")
        g.add_argument("--dst-per-token", action="store_true",
                       help="a destination row per token: dst_state_batch_indices (B, T) (implies --dst)")
        g.add_argument("--num-accepted", action="store_true",
                       help="state_batch_indices (B, K) with num_accepted_tokens picking each lane's source")
        g.add_argument("--rope-angles", type=int, default=0, metavar="S",
                       help="rotary angles per head (angle_state (rows, H, S), S <= N/2; 0: no rotary)")
        g.add_argument("--rotate-pairwise", action="store_true", help="rotary pairs (2i, 2i+1) (SISO)")
        g.add_argument("--bc-bias", action="store_true", help="with B_bias/C_bias (rotary)")
        g.add_argument("--shared-bc", action="store_true", help="B/C with a head axis of 1 (shared by the heads)")
        g.add_argument("--stochastic-rounding", action="store_true",
                       help="store a 16-bit state with stochastic rounding (rand_seed [seed, offset])")
        g.add_argument("--replay-ring", type=int, default=0, metavar="F",
                       help="replay: a checkpoint and a ring, the state written every F tokens (0: stepwise)")
        g.add_argument("--replay-from-checkpoint", action="store_true",
                       help="replay: an append's out from the checkpoint and the ring (needs --replay-ring)")
        g.add_argument("--replay-draft", type=int, default=0, metavar="T_MAX",
                       help="replay: a verify step on a ring made for T_MAX > T drafts (StepSpec.replay_draft; "
                            "needs --replay-ring and --num-accepted)")
        g.add_argument("--materialize-ring", type=int, default=0, metavar="L",
                       help="materialize_fn's flush forms for a replay pool with rings of L = F - 1 + T_MAX "
                            "entries (1 to 31), instead of the step the other flags name")
    if arch:
        g.add_argument("--arch", default=None, help=f"target architecture, e.g. sm_90a, sm_100a "
                                                    f"(default: this machine's GPU, else {DEFAULT_ARCH})")


def specs_from_args(args: argparse.Namespace) -> list[StepSpec]:
    """The specialisations the shared flags name, in order, without repeats.

    Raises ValueError (or TypeError) with a message naming the flag or config; a command
    passes it to ``parser.error``.
    """
    changes = {field: getattr(args, field) for field, _ in _DTYPE_FIELDS if getattr(args, field) is not None}
    changes.update(tile_D=args.tile_d, num_warps=args.num_warps, min_ctas_per_sm=args.min_ctas)
    if hasattr(args, "mode"):
        if args.dst and args.mode != "pool":
            raise ValueError("--dst needs --mode pool (dst_state_batch_indices exist in pool mode only)")
        if args.state_out and args.mode != "dense":
            raise ValueError("--state-out needs --mode dense")
        if (args.dst_per_token or args.num_accepted) and args.mode != "pool":
            raise ValueError("--dst-per-token and --num-accepted need --mode pool")
        if args.dst_per_token and args.tokens < 2:
            raise ValueError(f"--dst-per-token needs --tokens of at least 2, got --tokens {args.tokens}")
        if (args.rotate_pairwise or args.bc_bias) and args.rope_angles <= 0:
            raise ValueError("--rotate-pairwise and --bc-bias need --rope-angles S > 0")
        if args.rope_angles < 0:
            raise ValueError(f"--rope-angles: expected S >= 0, got {args.rope_angles}")
        if args.replay_from_checkpoint and args.replay_ring <= 0:
            raise ValueError("--replay-from-checkpoint needs --replay-ring F > 0")
        if args.replay_ring != 0 and not 2 <= args.replay_ring <= MAX_TOKENS:
            raise ValueError(f"--replay-ring: expected F = 0 or in [2, {MAX_TOKENS}], got {args.replay_ring} (F = 1 is "
                             f"materialize's flush form: --materialize-ring L)")
        _check_materialize_ring(args)
        changes.update(pool=args.mode == "pool", has_dst=args.dst or args.dst_per_token,
                       update_kv_state=not args.no_update_kv_state, has_z=not args.no_z,
                       has_outproj=not args.no_outproj, has_state_out=args.state_out, tokens=args.tokens,
                       dst_per_token=args.dst_per_token, num_accepted=args.num_accepted,
                       rope_angles=args.rope_angles, rotate_pairwise=args.rotate_pairwise,
                       has_bc_bias=args.bc_bias, shared_bc=args.shared_bc,
                       stochastic_rounding=args.stochastic_rounding, replay_ring=args.replay_ring,
                       replay_from_checkpoint=args.replay_from_checkpoint, replay_draft=args.replay_draft)
    specs = []
    L = getattr(args, "materialize_ring", 0)
    kernels = [_KERNEL_FIELDS[k] for k in KERNEL_CHOICES[getattr(args, "kernel", "registers")]]
    for config in args.config or ["flagship"]:
        for spec in specs_for_config(config, **changes):
            for named in flush_specs(spec, L) if L else [spec]:
                for fields in kernels:
                    if named.replace(**fields) not in specs:
                        specs.append(named.replace(**fields))
    return specs


def _check_materialize_ring(args: argparse.Namespace) -> None:
    """``--materialize-ring L``: L in [1, 2 * MAX_TOKENS - 1], with the flags of a replay pool's rows only
    (the flush form sets the step's own: a pool-mode verify step with update_kv_state, default tiling)."""
    L = args.materialize_ring
    if L == 0:
        return
    if not 1 <= L <= 2 * MAX_TOKENS - 1:
        raise ValueError(f"--materialize-ring: expected L = F - 1 + T_MAX in [1, {2 * MAX_TOKENS - 1}], got {L}")
    clashes = [flag for flag, on in (("--replay-ring", args.replay_ring), ("--tokens", args.tokens > 1),
                                     ("--num-accepted", args.num_accepted), ("--replay-draft", args.replay_draft),
                                     ("--replay-from-checkpoint", args.replay_from_checkpoint),
                                     ("--dst", args.dst or args.dst_per_token), ("--mode dense", args.mode != "pool"),
                                     ("--no-update-kv-state", args.no_update_kv_state),
                                     ("--tile-d", args.tile_d), ("--num-warps", args.num_warps)) if on]
    if clashes:
        raise ValueError(f"--materialize-ring names the flush forms, whose step flags and tiling are their own: "
                         f"leave out {', '.join(clashes)}")


def arch_from_args(args: argparse.Namespace) -> str:
    """``--arch`` checked, else this machine's GPU's architecture, else sm_90a."""
    return check_arch(args.arch) if args.arch is not None else current_arch()


def parse_spec_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[list[StepSpec], str | None]:
    """``(specs_from_args(args), arch_from_args(args))`` for a subcommand's ``run``; a bad flag goes
    to ``parser.error`` (message on stderr, exit status 2). ``arch`` is None without ``--arch``."""
    try:
        return specs_from_args(args), (arch_from_args(args) if hasattr(args, "arch") else None)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
