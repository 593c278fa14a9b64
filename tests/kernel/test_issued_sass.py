"""The SASS warp-instructions a live slab issues (``mamba3_step.tools.sass_trips.issued_path``), which the latency
model's issue side counts: the walk on a synthetic persistent loop whose answer is known, and
``mamba3_step.tools.issue_model.ISSUED_SASS`` held equal to the sm_90a cubins (the register kernel, the
asynchronous state copy, the slab pipeline's loop and the D split's CTA, and the T = 4 verify step on the
register kernel and the slab pipeline; the figures the model's bf16
stochastic-rounding rows rest on run by default, the rest with ``--full-matrix``)."""

from __future__ import annotations

import pytest
from async_state_cases import compile_facts

from mamba3_step.slab_pipeline import PIPELINE_DEFAULT_CTAS
from mamba3_step.spec import flagship_spec
from mamba3_step.tools.issue_model import ISSUED_SASS, STATE_FORMS_EXECUTED, verify_spec
from mamba3_step.tools.sass_trips import issued_path

# A persistent CTA: a prologue, then the slab loop (head .L_x_1): a spin wait retried by a backward branch
# (counted once), a forward branch skipping another warp's work (fall through: counted), an if/else whose
# else arm is jumped over by an unconditional branch (not counted), the FFMA-bearing backward branch that
# closes the loop; after the EXIT, the self-branch ptxas appends (no FFMA: not a slab loop).
LOOP = """
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   MOV R1, 0x1 ;
.L_x_1:
        /*0020*/                   IADD3 R2, R2, 0x1, RZ ;
.L_x_2:
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3 ;
        /*0040*/              @!P0 BRA `(.L_x_2) ;
        /*0050*/               @P1 BRA `(.L_x_3) ;
        /*0060*/                   UBLKCP.S.G [UR8], [UR10], UR12 ;
.L_x_3:
        /*0070*/                   FFMA R4, R5, R6, R4 ;
        /*0080*/                   BRA `(.L_x_4) ;
        /*0090*/                   FMUL R4, R4, R4 ;
        /*00a0*/                   FMUL R4, R4, R4 ;
.L_x_4:
        /*00b0*/                   NOP ;
        /*00c0*/                   FFMA R7, R5, R6, R7 ;
        /*00d0*/                   ISETP.NE.AND P2, PT, R2, R1, PT ;
        /*00e0*/               @P2 BRA `(.L_x_1) ;
        /*00f0*/                   EXIT ;
.L_x_5:
        /*0100*/                   BRA `(.L_x_5);
"""


def test_the_slab_loop_is_walked_once_with_its_waits_passing_at_once():
    path = [ins.base for ins in issued_path(LOOP)]
    assert path == ["IADD3", "SYNCS", "BRA", "BRA", "UBLKCP", "FFMA", "BRA", "FFMA", "ISETP", "BRA"]


def test_a_kernel_without_a_slab_loop_issues_its_live_path():
    straight = LOOP.replace("@P2 BRA `(.L_x_1) ;", "ISETP.NE.AND P3, PT, R2, R1, PT ;")
    path = [ins.base for ins in issued_path(straight)]
    # from the top, every branch falling through (the spin wait's too), up to the first unconditional EXIT;
    # the unconditional forward branch falls through as well: live_path's rule
    assert path[:4] == ["S2R", "MOV", "IADD3", "SYNCS"] and path[-1] == "EXIT" and "NOP" not in path
    assert len(path) == 15


def test_an_unconditional_branch_back_inside_the_loop_is_refused():
    bad = LOOP.replace("BRA `(.L_x_4) ;", "BRA `(.L_x_3) ;")
    with pytest.raises(ValueError, match="unconditional backward branch"):
        issued_path(bad)


#: each form's specialisation: the flagship's state forms, and its T = 4 verify step
FORMS = {"fp32": flagship_spec(), "bf16, round to nearest": flagship_spec(state_dtype="bfloat16"),
         "bf16, stochastic rounding": flagship_spec(state_dtype="bfloat16", stochastic_rounding=True),
         "fp32 verify T = 4": verify_spec()}
DEFAULT = {("bf16, stochastic rounding", "registers"), ("bf16, stochastic rounding", "pipeline"), ("fp32", "registers")}


def _kernel_spec(form: str, kernel):
    spec = FORMS[form]
    return {"registers": spec, "async": spec.replace(async_state_copy=True),
            "pipeline": spec.replace(pipeline_ctas=PIPELINE_DEFAULT_CTAS)}.get(kernel) or spec.replace(
        tile_D=spec.headdim // kernel)


@pytest.mark.parametrize("form, kernel", [
    pytest.param(f, k, id=f"{f}-{k}", marks=[] if (f, k) in DEFAULT else [pytest.mark.full_matrix])
    for f in ISSUED_SASS for k in ISSUED_SASS[f]])
def test_issued_sass_is_what_the_cubin_issues(form, kernel):
    f = compile_facts(_kernel_spec(form, kernel), "sm_90a")
    assert len(issued_path(f.sass_text)) * f.threads // 32 == ISSUED_SASS[form][kernel]


def test_ptxas_issues_fewer_instructions_than_the_ptx_executes_where_it_fuses_them():
    """Stochastic rounding's Philox rounds fuse (multiply pairs, XOR chains): its SASS is 0.69x its PTX, fp32's 0.95x."""
    ratio = {form: ISSUED_SASS[form]["registers"] / STATE_FORMS_EXECUTED[form][0] for form in STATE_FORMS_EXECUTED}
    assert 0.68 < ratio["bf16, stochastic rounding"] < 0.70 and 0.94 < ratio["fp32"] < 0.96
