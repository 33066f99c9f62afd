"""How lazyzero's per-rank step metrics become the values written to DeepSpeed's monitor
(lazyzero/engine/monitor_metrics.py); the files themselves: tests/app/test_trainers.py."""

from lazyzero.engine.monitor_metrics import monitor_events, numeric_metrics, reduce_over_ranks, reduction_of


def test_seconds_peaks_and_overflows_take_the_largest_rank_the_rest_the_mean():
    assert [reduction_of(key) for key in ("grad_exchange_s", "activation_offload_buffer_peak_bytes",
                                          "grad_overflow", "grad_wire_bytes", "optimizer_state_bytes")] == [
        "max", "max", "max", "mean", "mean"]
    ranks = [{"grad_exchange_s": 0.5, "grad_wire_bytes": 100.0, "grad_overflow": 0.0},
             {"grad_exchange_s": 0.25, "grad_wire_bytes": 300.0, "grad_overflow": 1.0}]
    assert reduce_over_ranks(ranks) == {"grad_exchange_s": 0.5, "grad_wire_bytes": 200.0, "grad_overflow": 1.0}


def test_a_metric_only_some_ranks_report_is_reduced_over_those():
    ranks = [{"checkpoint_bytes": 10.0}, {}, {"checkpoint_bytes": 30.0, "checkpoint_write_s": 2.0}]
    assert reduce_over_ranks(ranks) == {"checkpoint_bytes": 20.0, "checkpoint_write_s": 2.0}


def test_only_finite_numbers_are_written_booleans_as_0_and_1():
    metrics = {"checkpoint_tag": "global_step2", "grad_overflow": True, "grad_wire_bytes": 12,
               "plan_ratio": float("nan"), "nothing": None}
    assert numeric_metrics(metrics) == {"grad_overflow": 1.0, "grad_wire_bytes": 12.0}


def test_events_are_named_under_lazyzero_at_the_optimizer_step():
    assert monitor_events({"grad_wire_bytes": 12.0}, 7) == [("lazyzero/grad_wire_bytes", 12.0, 7)]
