"""Int8 gradient exchange in the engine, every ZeRO stage, real 2-rank runs (docs/gradients.md;
docs/reliability.md row 9).

One launch runs every setting (tests/gradients/int8_gradients_worker.py): for each, 6 steps with fp32
gradients, the same with int8, and int8 again with a NaN injected into rank 1's loss at step 2.
Settings cover each DeepSpeed reduction method and its predivide arithmetic
(gradient_predivide_factor 4 with W = 2 takes every branch that differs from plain averaging;
DeepSpeed itself refuses it with a reduce-scatter at stages 1-3).
"""

import json
import math
from pathlib import Path

import pytest

from lazyzero.testing import TOLERANCES, run_distributed

WORKER = Path(__file__).resolve().parent / "int8_gradients_worker.py"
# setting -> the DeepSpeed full-precision method its fp32 run reduces buckets with
SETTINGS = {
    "0": "allreduce_bucket",
    "0+predivide": "allreduce_bucket",
    "0+bf16": "allreduce_bucket",
    "1": "average_tensor",
    "1+bf16": "allreduce_bucket",  # DeepSpeed's BF16_Optimizer reduces through the engine
    "2": "average_tensor",
    "2+bf16": "average_tensor",  # owner slices land in the compact fp32 partition buffer
    "2+cpu": "average_tensor",
    "2+allreduce+predivide": "average_tensor",
    "3": "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads",
    "3+contiguous+predivide": "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_contiguous_grads",
    "3+stochastic": "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads",
    "3+cpu": "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads",
    "0+ef": "allreduce_bucket",
    "2+ef": "average_tensor",
    "3+ef": "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads",
}
# One setting per stage, precision path and DeepSpeed method in the default suite (a setting costs
# about 4 s of the one launch); the rest are slow.
DEFAULT_SETTINGS = {"0+predivide", "1+bf16", "2+cpu", "3", "3+contiguous+predivide", "2+ef"}
ERROR_FEEDBACK = [setting for setting in SETTINGS if "ef" in setting.split("+")]


def params(settings) -> list:
    return [pytest.param(setting, id=setting, marks=() if setting in DEFAULT_SETTINGS else pytest.mark.slow)
            for setting in settings]


def selected_settings(request) -> list[str]:
    """The settings of this module's tests that were selected (-m, -k): only they are launched."""
    chosen = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if item.module is request.module and callspec is not None:
            chosen.add(callspec.params.get("setting"))
    return [setting for setting in SETTINGS if setting in chosen] or sorted(DEFAULT_SETTINGS)
NAN_STEP = 2
# The largest floating-point tensor an int8 run may hand to a torch.distributed reduction: the
# scalars of the gradient norm and of the overflow agreement, never a gradient bucket.
SCALAR = 1


@pytest.fixture(scope="module")
def ranks(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("int8_gradients")
    proc = run_distributed("deepspeed", 2, [str(WORKER), str(out), *selected_settings(request)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.multiproc
@pytest.mark.parametrize("setting", params(SETTINGS))
def test_int8_run_never_calls_deepspeeds_full_precision_reduction(ranks, setting):
    for result in ranks:
        runs = result[setting]
        assert runs["fp32"]["calls"].get(SETTINGS[setting], 0) > 0, "the wrapper saw no fp32 call"
        assert max(runs["fp32"]["largest_reduced"].values()) > 1000
        assert runs["int8"]["calls"] == {}
        assert max(runs["int8"]["largest_reduced"].values(), default=0) <= SCALAR


@pytest.mark.multiproc
@pytest.mark.parametrize("setting", params(SETTINGS))
def test_int8_averaged_gradient_matches_deepspeeds_fp32_average(ranks, setting):
    # Same parameters and data in both runs at step 0: only the reduction differs. Also checks
    # that the averaging and predivide factors are DeepSpeed's.
    for result in ranks:
        assert 0 < result[setting]["first_gradient_relative_error"] <= TOLERANCES["int8_gradients_relative_norm"]


@pytest.mark.multiproc
@pytest.mark.parametrize("setting", params(SETTINGS))
def test_int8_run_trains_close_to_fp32_with_a_quarter_of_the_bytes(ranks, setting):
    for result in ranks:
        fp32, int8 = result[setting]["fp32"]["losses"], result[setting]["int8"]["losses"]
        assert all(math.isfinite(loss) for loss in int8)
        assert int8 != fp32, "int8 rounding changed nothing: was it used?"
        assert sum(int8) / len(int8) == pytest.approx(sum(fp32) / len(fp32), **TOLERANCES["int8_gradients_loss"])
        assert result[setting]["fp32"]["metrics"] == [{}] * len(result[setting]["fp32"]["metrics"])
        for step in result[setting]["int8"]["metrics"]:
            assert step["grad_wire_bytes"] <= 0.27 * step["grad_fp32_wire_bytes"]
            assert step["grad_exchange_s"] > 0
            assert step["grad_overflow"] is False


@pytest.mark.multiproc
@pytest.mark.parametrize("setting", params(SETTINGS))
def test_nan_on_one_rank_skips_the_step_on_every_rank(ranks, setting):
    for result in ranks:
        nan = result[setting]["nan"]
        assert nan["unchanged"] == [step == NAN_STEP for step in range(len(nan["unchanged"]))]
        assert all(nan["finite"])
        assert [step["grad_overflow"] for step in nan["metrics"]] == nan["unchanged"]
        assert nan["skipped_steps"] == 1


@pytest.mark.multiproc
def test_stage_2_without_contiguous_gradients_is_refused_not_sent_in_fp32(ranks):
    for result in ranks:
        # Refused by config validation, before the engine (which also refuses) is built.
        assert ("lazyzero.gradients.enabled: got true; allowed: false while "
                "zero_optimization.contiguous_gradients is false on stage 1 or 2"
                in result["refusal_without_contiguous_gradients"])


@pytest.mark.multiproc
@pytest.mark.parametrize("setting", params(ERROR_FEEDBACK))
def test_error_feedback_carries_residuals_and_drops_them_after_a_skipped_step(ranks, setting):
    for result in ranks:
        carried = result[setting]["int8"]["residual_norms"]
        assert all(0 < norm < math.inf for norm in carried)
        after_nan = result[setting]["nan"]["residual_norms"]
        assert [norm == 0 for norm in after_nan] == [step == NAN_STEP for step in range(len(after_nan))]
        assert result[setting]["fp32"]["residual_norms"] == [None] * len(carried)
