import logging
import os
import re
from pathlib import Path

import pytest
import torch

from tests.helpers import load_script
from trainer.metrics import profiling as profiling_module
from trainer.metrics.profiling import TRACE_SUFFIX, maybe_enable_profiling, maybe_record_memory_history
from trainer.metrics.trace_summary import (
    classify, format_summary, fp8_warning, is_fp8_gemm, load_trace_events, profiler_steps, summarize_events,
)

STEP_MARKER = re.compile(r"train_step_(\d+)$")


class _Model(torch.nn.Module):
    """Two Linear layers: exactly two aten::addmm per forward."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 16)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _fp32_step(model):
    model(torch.randn(8, 32)).square().mean().backward()


def _fp8_step(model):
    # What torchao's Float8Linear runs on CPU: a GEMM of float8_e4m3fn operands with fp32 scales.
    a = torch.randn(16, 32).to(torch.float8_e4m3fn)
    b = torch.randn(16, 32).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
    one = torch.tensor(1.0)
    torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def _train(trace_dir, *, num_steps=8, start_step=3, end_step=5, rank=0, body=_fp32_step,
           expect_fp8=False, logger=None, first_step=1, record_shapes=False, on_summary=None):
    model = _Model()
    with maybe_enable_profiling(enable=True, start_step=start_step, end_step=end_step,
                                trace_dir=str(trace_dir), rank=rank, record_shapes=record_shapes,
                                with_stack=False, profile_memory=False, expect_fp8=expect_fp8,
                                logger=logger, on_summary=on_summary) as prof:
        for step in range(first_step, num_steps + 1):
            with torch.profiler.record_function(f"train_step_{step}"):
                body(model)
            prof.step(step)


def _step_markers(events):
    return sorted(int(m.group(1)) for e in events if (m := STEP_MARKER.match(e["name"])))


@pytest.fixture
def profiling_logger(caplog):
    # Our own logger, which propagates to caplog whatever setup_logging did to "trainer".
    caplog.set_level(logging.INFO)
    return logging.getLogger("test_profiling")


# --- the window ---------------------------------------------------------------------------------


def test_window_3_to_5_records_exactly_steps_3_to_5(fp32_trace_dir):
    assert sorted(os.listdir(fp32_trace_dir)) == [f"rank0_step3-5{TRACE_SUFFIX}", "summary_step3-5.txt"]
    events = load_trace_events(str(fp32_trace_dir / f"rank0_step3-5{TRACE_SUFFIX}"))
    assert _step_markers(events) == [3, 4, 5]
    assert profiler_steps(events) == [3, 4, 5]  # the profiler's own markers are train steps too
    # Exactly the ops of 3 steps: each forward runs two aten::addmm.
    assert sum(e["name"] == "aten::addmm" for e in events) == 3 * 2
    summary_text = (fp32_trace_dir / "summary_step3-5.txt").read_text()
    assert summary_text.startswith("Kernel summary of steps 3-5 (3 steps)")
    assert summary_text.rstrip().endswith("FP8 GEMMs ran: no (only bf16/fp32 GEMMs)")


@pytest.mark.parametrize(("start_step", "end_step"), [(1, 1), (1, 3), (2, 4), (8, 8)])
def test_window_edges(tmp_path, start_step, end_step):
    # start_step 1 has no warmup step; 8 is the loop's last step.
    _train(tmp_path, start_step=start_step, end_step=end_step)
    events = load_trace_events(str(tmp_path / f"rank0_step{start_step}-{end_step}{TRACE_SUFFIX}"))
    assert _step_markers(events) == list(range(start_step, end_step + 1))


def test_kineto_start_and_stop_lines_stay_off_the_console(tmp_path, capfd):
    _train(tmp_path)
    assert "profiler_st" not in capfd.readouterr().err
    # Only those two lines: anything else written to fd 2 meanwhile comes through, in order.
    from trainer.metrics.profiling import _without_kineto_markers

    with _without_kineto_markers():
        os.write(2, b"USDT:2026-11-25 10:57:05 15145:15145 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
                    b"ERROR:2026-11-25 10:57:05 15145:15145 CuptiActivityProfiler.cpp:9] kept\n"
                    b"USDT:2026-11-25 10:57:05 15145:15145 SyncActivityProfilerHandler.cpp:59] profiler_stop\n")
    assert capfd.readouterr().err == "ERROR:2026-11-25 10:57:05 15145:15145 CuptiActivityProfiler.cpp:9] kept\n"


def test_other_ranks_write_a_trace_but_no_summary(tmp_path):
    _train(tmp_path, rank=3)
    assert os.listdir(tmp_path) == [f"rank3_step3-5{TRACE_SUFFIX}"]


def test_on_summary_gets_every_ranks_own_summary_and_other_ranks_read_no_trace_without_it(tmp_path, monkeypatch):
    # The event log's on_summary: rank 3 summarizes its own trace, as rank 0 does, but writes no summary file.
    got = []
    _train(tmp_path / "with", rank=3, on_summary=lambda summary, trace: got.append((summary, trace)))
    trace = str(tmp_path / "with" / f"rank3_step3-5{TRACE_SUFFIX}")
    assert os.listdir(tmp_path / "with") == [f"rank3_step3-5{TRACE_SUFFIX}"]
    [(summary, path)] = got
    assert path == trace
    assert summary == summarize_events(load_trace_events(trace), num_steps=3, steps=(3, 5))
    assert (summary.device, summary.comm_us, summary.exposed_comm_us) == ("cpu", 0.0, 0.0)
    # Without it, a rank other than 0 never reads its trace back; rank 0 still does (for its summary file).
    read = []
    real = profiling_module.summarize_events
    monkeypatch.setattr(profiling_module, "summarize_events", lambda *a, **k: read.append(k["steps"]) or real(*a, **k))
    _train(tmp_path / "without", rank=3)
    assert read == []
    _train(tmp_path / "rank0", rank=0)
    assert read == [(3, 5)]


def test_run_ending_inside_the_window_flushes_what_it_recorded(tmp_path, profiling_logger, caplog):
    _train(tmp_path, num_steps=4, logger=profiling_logger)
    assert sorted(os.listdir(tmp_path)) == [f"rank0_step3-4{TRACE_SUFFIX}", "summary_step3-4.txt"]
    events = load_trace_events(str(tmp_path / f"rank0_step3-4{TRACE_SUFFIX}"))
    assert _step_markers(events) == [3, 4]
    assert "trace of window 3-5 holds steps 3-4 only: the run ended after step 4" in caplog.text


def test_run_failing_inside_the_window_flushes_the_failing_step(tmp_path, profiling_logger, caplog):
    steps_run = []

    def body(model):
        steps_run.append(len(steps_run) + 1)
        _fp32_step(model)
        if steps_run[-1] == 5:
            raise RuntimeError("boom in step 5")

    with pytest.raises(RuntimeError, match="boom in step 5"):
        _train(tmp_path, body=body, logger=profiling_logger)
    events = load_trace_events(str(tmp_path / f"rank0_step3-5{TRACE_SUFFIX}"))
    assert _step_markers(events) == [3, 4, 5]  # step 5 up to the failure
    assert "trace of window 3-5 holds steps 3-5; the run failed during step 5, which is incomplete" in caplog.text


def test_run_ending_before_the_window_says_no_trace(tmp_path, profiling_logger, caplog):
    _train(tmp_path, num_steps=2, logger=profiling_logger)
    assert os.listdir(tmp_path) == []
    assert ("No profiler trace written for profiling window 3-5: the run ended before it finished a "
            "step of it") in caplog.text


def test_resumed_run_is_profiled_by_train_step(tmp_path, profiling_logger, caplog):
    # Resumed from a checkpoint at step 4: the window is still train steps, not loop iterations.
    # Step 4 ran before the profiler could know it was not step 1, so the trace starts at 5.
    _train(tmp_path, first_step=4, start_step=3, end_step=6, logger=profiling_logger)
    events = load_trace_events(str(tmp_path / f"rank0_step5-6{TRACE_SUFFIX}"))
    assert _step_markers(events) == profiler_steps(events) == [5, 6]
    assert "trace of window 3-6 holds steps 5-6 only: the run resumed at step 4" in caplog.text


def test_run_resumed_after_the_window_says_no_trace(tmp_path, profiling_logger, caplog):
    _train(tmp_path, first_step=11, num_steps=16, logger=profiling_logger)
    assert os.listdir(tmp_path) == []
    assert "No profiler trace written for profiling window 3-5: the run started at step 11" in caplog.text


def test_disabled_does_nothing(tmp_path, monkeypatch, caplog):
    def no_profiler(*args, **kwargs):
        raise AssertionError("profiling.enable=false started a profiler")

    monkeypatch.setattr(torch.profiler, "profile", no_profiler)
    with caplog.at_level(logging.DEBUG):
        with maybe_enable_profiling(enable=False, start_step=3, end_step=5, trace_dir=str(tmp_path / "t"),
                                    rank=0, record_shapes=False, with_stack=False, profile_memory=False,
                                    expect_fp8=True) as prof:
            for step in range(1, 8):
                _fp32_step(_Model())
                prof.step(step)
    assert os.listdir(tmp_path) == []  # no trace folder, no summary
    assert caplog.records == []  # not "Profiling steps ...", not the FP8 verdict


# --- the FP8 verdict ----------------------------------------------------------------------------

# The trainer's warning: its fp8 runs compute in bf16 around the FP8 GEMMs, so without them in bf16.
WARNING = ("mixed_precision='fp8' but no FP8 GEMM ran in steps 3-5: its 15 GEMM calls (aten::mm, aten::addmm) "
           "ran in bf16. See docs/fp8.md#troubleshooting")
# summarize_trace.py knows nothing of the run: the dtype comes from the trace, or is said to be unknown.
SCRIPT_WARNING = ("no FP8 GEMM ran in steps 3-5: its 15 GEMM calls were aten::mm, aten::addmm, none of them FP8 "
                  "(their dtype is not in the trace: profile with profiling.record_shapes=true to see it). "
                  "See docs/fp8.md#troubleshooting")


def test_fp8_run_says_yes_and_does_not_warn(tmp_path, profiling_logger, caplog):
    _train(tmp_path, body=_fp8_step, expect_fp8=True, logger=profiling_logger)
    verdict = (tmp_path / "summary_step3-5.txt").read_text().rstrip().splitlines()[-1]
    # On CPU, _scaled_mm may run a nested aten::mm: that is FP8 GEMM time, not bf16 GEMM time.
    assert verdict == "FP8 GEMMs ran: yes (3 calls, 100.0% of GEMM time: aten::_scaled_mm)"
    assert "no FP8 GEMM" not in caplog.text


def test_fp32_run_expecting_fp8_warns(tmp_path, profiling_logger, caplog):
    _train(tmp_path, expect_fp8=True, logger=profiling_logger)
    assert WARNING in caplog.text
    assert [r.levelno for r in caplog.records if WARNING in r.getMessage()] == [logging.WARNING]


def test_fp32_run_not_expecting_fp8_does_not_warn(tmp_path, profiling_logger, caplog):
    _train(tmp_path, expect_fp8=False, logger=profiling_logger)
    assert "FP8 GEMMs ran: no (only bf16/fp32 GEMMs)" in caplog.text
    assert "no FP8 GEMM kernel ran" not in caplog.text


def test_torchao_float8_training_counts_as_fp8(tmp_path):
    # The trainer's FP8 path; if torchao stops calling aten::_scaled_mm, the detector must follow.
    from torchao.float8 import convert_to_float8_training

    model = convert_to_float8_training(_Model())
    with torch.profiler.profile() as prof:
        _fp32_step(model)
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    summary = summarize_events(load_trace_events(str(tmp_path / "t.json")), num_steps=1)
    assert summary.fp8_gemm_ran and summary.fp8_gemm_names == ["aten::_scaled_mm"]
    # Each of the 2 Linear layers runs 1 FP8 GEMM forward and 2 backward: 6, torchao's wrapper not counted.
    assert summary.fp8_gemm_calls == summary.num_gemm_calls == 6
    assert {s.category for s in summary.ops if "float8" in s.name or s.name == "PythonSubclass"} <= {
        "gemm_fp8", "other"}  # other: the subclass's dispatch of views (aten::t), and the casts
    assert all(s.category == "gemm_fp8" for s in summary.ops if s.name.endswith("float8_argsBackward"))
    assert fp8_warning(summary) is None


def test_fp8_warning_text(fp32_trace_dir):
    events = load_trace_events(str(fp32_trace_dir / f"rank0_step3-5{TRACE_SUFFIX}"))
    assert fp8_warning(summarize_events(events, num_steps=3), compute_dtype="bf16") == WARNING
    assert fp8_warning(summarize_events(events, num_steps=3)) == SCRIPT_WARNING


def test_fp8_warning_names_the_recorded_dtype(tmp_path):
    # With record_shapes the trace holds each op's input dtypes: an fp32 run is called fp32, even by a
    # caller that believed the run computed in bf16.
    _train(tmp_path, record_shapes=True)
    summary = summarize_events(load_trace_events(str(tmp_path / f"rank0_step3-5{TRACE_SUFFIX}")), num_steps=3)
    assert summary.gemm_dtypes == {"fp32": 15}
    expected = ("no FP8 GEMM ran in steps 3-5: its 15 GEMM calls (aten::mm, aten::addmm) ran in fp32. "
                "See docs/fp8.md#troubleshooting")
    assert fp8_warning(summary) == expected
    assert fp8_warning(summary, compute_dtype="bf16") == "mixed_precision='fp8' but " + expected
    assert format_summary(summary).splitlines()[-1] == "FP8 GEMMs ran: no (only fp32 GEMMs)"


# --- classifying kernel names -------------------------------------------------------------------


@pytest.mark.parametrize(("name", "category", "fp8"), [
    # H100 cuBLASLt and cuBLAS 13 (nvjet) GEMMs; the qq/qr nvjet names were seen with _scaled_mm.
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_execute_segment_k_off"
     "_kernel__5x_cublas", "gemm", True),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off"
     "_kernel__5x_cublas", "gemm", False),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", "gemm", False),
    ("nvjet_sm90_tst_128x64_64x8_1x2_h_bz_bias_TNT", "gemm", False),
    ("nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT", "gemm", True),
    ("nvjet_sm90_qrtst_64x128_128x8_2x1_v_bz_algo2_TNN", "gemm", True),
    ("cutlass3x_sm90_tensorop_gemm_e4m3_e4m3_f32_bf16_bf16_128x128x128_1x1x1_0_tnn_align16", "gemm", True),
    ("triton_tem_fused__scaled_mm_0", "gemm", True),
    # Inductor's elementwise kernels named after the _scaled_mm whose casts they fuse: no GEMM (8B fp8 on an H100).
    ("triton_poi_fused__fused_rms_norm__scaled_mm__to_copy_add_clamp_clone_mul_reciprocal_silu_t_view_2", "other",
     False),
    ("triton_red_fused__log_softmax__log_softmax_backward_data__to_copy_arange_blockwise_fp8_gemm_0", "other", False),
    ("triton_per_fused__scaled_mm_abs_amax_0", "other", False),
    ("aten::_scaled_mm", "gemm", True),
    ("aten::_scaled_grouped_mm", "gemm", True),
    # The blockwise recipe: F.scaled_mm's op, torchao's custom op around it, and its Triton quantization
    # kernels (named fp8, but casts, not GEMMs).
    ("aten::_scaled_mm_v2", "gemm", True),
    ("torchao::blockwise_scaled_mm", "gemm", True),
    ("triton_fp8_blockwise_act_quant_lhs_kernel", "other", False),
    ("torchao::triton_fp8_blockwise_weight_quant_transposed_rhs", "other", False),
    ("aten::mm", "gemm", False),
    ("aten::addmm", "gemm", False),
    ("triton_tem_fused_mm_0", "gemm", False),
    # The eager cast to float8 is not a GEMM, though its name says float8.
    ("void at::native::vectorized_elementwise_kernel<4, at::native::float8_copy_kernel_cuda("
     "at::TensorIteratorBase&)::{lambda(c10::BFloat16)#2}, std::array<char*, 2ul> >", "other", False),
    ("ncclDevKernel_AllGather_RING_LL", "communication", False),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "communication", False),
    ("c10d::allreduce_", "communication", False),
    ("aten::broadcast_tensors", "other", False),
    ("flash_fwd_kernel", "attention", False),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
     "cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> > >", "attention", False),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<>::Params)",
     "attention", False),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_cga1x1x1_kernel0_0",
     "attention", False),
    ("aten::communication_free_summary_op", "other", False),
])
def test_classify(name, category, fp8):
    assert (classify(name), is_fp8_gemm(name)) == (category, fp8)


def _event(name, cat, ts, dur, external_id=None, tid=1):
    return {"name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": tid,
            "external_id": external_id}


def test_summary_of_a_gpu_trace():
    events = [
        _event("ProfilerStep#7", "user_annotation", 0, 200),
        _event("aten::_scaled_mm", "cpu_op", 0, 5, external_id=42),
        _event("aten::mm", "cpu_op", 5, 5, external_id=43),
        # An FP8 GEMM kernel of a name no pattern knows: it counts through the op that launched it.
        _event("some_future_kernel", "kernel", 10, 50, external_id=42, tid=7),
        _event("nvjet_sm90_tst_128x64_64x8_1x2_h_bz_NNT", "kernel", 60, 30, external_id=43, tid=7),
        _event("flash_fwd_kernel", "kernel", 100, 40, tid=7),
        _event("ncclDevKernel_AllGather_RING_LL", "kernel", 110, 20, tid=9),  # overlaps on another stream
        _event("void at::native::vectorized_elementwise_kernel<4>", "kernel", 190, 10, tid=7),
    ]
    summary = summarize_events(events, num_steps=1)
    assert summary.device == "cuda" and summary.steps == (7, 7)
    assert summary.total_us == 150 and summary.wall_us == 200 and summary.busy_us == 130
    assert summary.category_us == {"gemm_fp8": 50, "gemm": 30, "attention": 40, "communication": 20, "other": 10}
    assert (summary.fp8_gemm_calls, summary.fp8_gemm_names) == (1, ["some_future_kernel"])
    text = format_summary(summary, top=2)
    assert "device idle 35.0% of wall" in text
    assert "GEMM fp8 33.3% | GEMM bf16/other 20.0% | attention 26.7% | communication 13.3%" in text
    assert "  GEMM time 0.08 ms/step (53.3% of device time), 62.5% of it in FP8 GEMMs" in text.splitlines()
    assert text.splitlines()[-1] == "FP8 GEMMs ran: yes (1 calls, 62.5% of GEMM time: some_future_kernel)"
    assert (summary.comm_us, summary.exposed_comm_us) == (20, 0)  # the all-gather ran beside attention
    assert "  communication 0.02 ms/step, of it exposed (no other kernel running) 0.00 ms/step (0.0% of wall)" in text
    assert len(text.splitlines()) == 6 + 2 + 1


def test_inductors_cast_kernels_named_after_scaled_mm_are_no_fp8_gemms():
    # Compiled, inductor's launch of a fused cast kernel is a CPU record of the kernel's own name, which carries the
    # op it feeds (seen on 2x H200, moe_16b fp8): neither that record nor its kernel is a GEMM.
    cast = "triton_poi_fused__fused_rms_norm__scaled_mm__to_copy_clamp_clone_mul_reciprocal_t_view_2"
    events = [
        _event(cast, "cpu_op", 0, 5, external_id=7),
        _event("aten::_scaled_mm", "cpu_op", 5, 5, external_id=8),
        _event(cast, "kernel", 10, 20, external_id=7, tid=7),
        _event("nvjet_sm90_qqtst_256x128_128x4_1x2_h_bz_coopA_TNT", "kernel", 30, 50, external_id=8, tid=7),
    ]
    summary = summarize_events(events, num_steps=1)
    assert summary.category_us == {"gemm_fp8": 50, "gemm": 0, "attention": 0, "communication": 0, "other": 20}
    assert summary.fp8_gemm_calls == 1


def test_exposed_communication_is_the_time_no_other_kernel_runs_beside_it():
    events = [
        _event("ProfilerStep#1", "user_annotation", 0, 400),
        _event("nvjet_sm90_tst_128x64_64x8_1x2_h_bz_NNT", "kernel", 0, 100, tid=7),
        _event("nvjet_sm90_tst_128x64_64x8_1x2_h_bz_NNT", "kernel", 150, 100, tid=7),
        # 80-180: hidden 80-100 and 150-180, exposed 100-150; two overlapping comm kernels count once.
        _event("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "kernel", 80, 100, tid=9),
        _event("ncclDevKernel_AllGather_RING_LL", "kernel", 90, 40, tid=10),
        _event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 300, 20, tid=9),  # wholly exposed
    ]
    summary = summarize_events(events, num_steps=2)
    assert (summary.comm_us, summary.exposed_comm_us) == (120, 70)
    assert ("  communication 0.06 ms/step, of it exposed (no other kernel running) 0.04 ms/step (17.5% of wall)"
            in format_summary(summary))


def test_gemm_time_splits_into_fp8_and_bf16_on_h100_kernel_names():
    fp8 = ["nvjet_sm90_qqtst_128x128_128x6_1x2_h_bz_coopA_algo2_TNT",
           "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_execute_kernel",
           "cutlass3x_sm90_tensorop_gemm_e4m3_e4m3_f32_bf16_bf16_128x128x128_1x1x1_0_tnn_align16",
           "triton_tem_fused__scaled_mm_mul_3"]
    bf16 = ["nvjet_sm90_tst_128x64_64x8_1x2_h_bz_bias_TNT",
            "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_kernel",
            "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_nn"]
    events = [_event("ProfilerStep#3", "user_annotation", 0, 1000)]
    ts = 0
    for name in fp8:
        events.append(_event(name, "kernel", ts, 100, tid=7))  # 400 us of FP8 GEMMs
        ts += 100
    for name in bf16:
        events.append(_event(name, "kernel", ts, 50, tid=7))  # 150 us of bf16 GEMMs
        ts += 50
    # A kernel name the patterns do not know: FP8 for the call aten::_scaled_mm launched, bf16 for the other.
    events += [_event("aten::_scaled_mm", "cpu_op", 0, 5, external_id=1),
               _event("aten::mm", "cpu_op", 5, 5, external_id=2),
               _event("gemm_of_the_future", "kernel", 600, 30, external_id=1, tid=7),
               _event("gemm_of_the_future", "kernel", 630, 20, external_id=2, tid=7),
               _event("flash_fwd_kernel", "kernel", 650, 200, tid=7),
               _event("void at::native::vectorized_elementwise_kernel<4>", "kernel", 850, 200, tid=7)]
    summary = summarize_events(events, num_steps=1)
    assert summary.category_us == {"gemm_fp8": 430, "gemm": 170, "attention": 200, "communication": 0, "other": 200}
    rows = {(s.name, s.category): s.total_us for s in summary.ops}
    assert rows[("gemm_of_the_future", "gemm_fp8")] == 30 and rows[("gemm_of_the_future", "gemm")] == 20
    assert {s.name for s in summary.ops if s.category == "gemm_fp8"} == {*fp8, "gemm_of_the_future"}
    assert {s.name for s in summary.ops if s.category == "gemm"} == {*bf16, "gemm_of_the_future"}
    lines = format_summary(summary, top=20).splitlines()
    assert lines[2] == ("  GEMM fp8 43.0% | GEMM bf16/other 17.0% | attention 20.0% | communication 0.0% | "
                        "elementwise/other 20.0%")
    assert lines[3] == "  GEMM time 0.60 ms/step (60.0% of device time), 71.7% of it in FP8 GEMMs"
    table = {line.split()[-1]: line for line in lines[5:-1]}
    assert "GEMM fp8" in table["nvjet_sm90_qqtst_128x128_128x6_1x2_h_bz_coopA_algo2_TNT"]
    assert "GEMM bf16/other" in table["nvjet_sm90_tst_128x64_64x8_1x2_h_bz_bias_TNT"]
    assert lines[-1].startswith("FP8 GEMMs ran: yes (5 calls, 71.7% of GEMM time: ")


def test_cpu_fp8_gemm_time_includes_what_scaled_mm_runs_inside():
    events = [
        _event("aten::_scaled_mm", "cpu_op", 0, 100),
        _event("aten::mm", "cpu_op", 10, 80),  # inside _scaled_mm: its upcast GEMM, FP8 GEMM time
        _event("aten::addmm", "cpu_op", 200, 50),
        _event("autograd::engine::evaluate_function: AddmmBackward0", "cpu_op", 300, 40),
        _event("aten::mm", "cpu_op", 305, 30),
    ]
    summary = summarize_events(events, num_steps=1)
    assert {(s.name, s.category): s.total_us for s in summary.ops} == {
        ("aten::_scaled_mm", "gemm_fp8"): 100, ("aten::addmm", "gemm"): 50, ("aten::mm", "gemm"): 30,
        ("autograd::engine::evaluate_function: AddmmBackward0", "other"): 10}
    assert (summary.num_gemm_calls, summary.fp8_gemm_calls) == (3, 1)
    assert format_summary(summary).splitlines()[-1] == (
        "FP8 GEMMs ran: yes (1 calls, 55.6% of GEMM time: aten::_scaled_mm)")


def test_cpu_fp8_gemm_counts_once_through_torchao_and_its_backward():
    # The nesting of a CPU trace of torchao's Float8Linear (torchao 0.18, seen in a real trace): the autograd
    # Function, the aten::mm on its Float8 tensor, the subclass dispatch, then the one FP8 GEMM. Its
    # backward runs two. Start and duration in us; the comment is the op's self time.
    nest = [  # (name, ts, dur), indented by depth
        ("matmul_with_hp_or_float8_args", 0, 100),  # 100 - 10 - 70 = 20
        ("  aten::abs", 5, 10),  # the cast's amax: elementwise, 10
        ("  aten::mm", 20, 70), ("    PythonSubclass", 22, 66), ("      aten::_scaled_mm", 30, 50),  # 4, 16, 50
        ("        aten::mm", 40, 30),  # folded into the aten::_scaled_mm around it
        ("autograd::engine::evaluate_function: matmul_with_hp_or_float8_argsBackward", 200, 200),  # 4
        ("  matmul_with_hp_or_float8_argsBackward", 202, 196),  # 196 - 80 - 90 = 26
        ("    aten::mm", 210, 80), ("      PythonSubclass", 212, 76), ("        aten::_scaled_mm", 220, 60),
        ("    aten::mm", 300, 90), ("      PythonSubclass", 302, 86), ("        aten::_scaled_mm", 310, 70),
        ("aten::matmul", 500, 60), ("  aten::mm", 505, 50),  # a bf16 GEMM through aten::matmul: one call
        # A compiled region is no layer around its GEMM: its self time is its own (inductor's kernels).
        ("CompiledFunction", 600, 100), ("  aten::_scaled_mm", 610, 40),  # 60, 40
    ]
    summary = summarize_events([_event(n.strip(), "cpu_op", ts, dur) for n, ts, dur in nest], num_steps=1)
    rows = {(s.name, s.category): (s.calls, s.total_us) for s in summary.ops}
    assert rows == {
        ("aten::_scaled_mm", "gemm_fp8"): (4, 50 + 60 + 70 + 40),
        ("PythonSubclass", "gemm_fp8"): (3, 16 * 3),
        ("aten::mm", "gemm_fp8"): (3, 4 * 3),
        ("matmul_with_hp_or_float8_args", "gemm_fp8"): (1, 20),
        ("matmul_with_hp_or_float8_argsBackward", "gemm_fp8"): (1, 26),
        ("autograd::engine::evaluate_function: matmul_with_hp_or_float8_argsBackward", "gemm_fp8"): (1, 4),
        ("aten::mm", "gemm"): (1, 50), ("aten::matmul", "gemm"): (1, 10),
        ("aten::abs", "other"): (1, 10), ("CompiledFunction", "other"): (1, 60),
    }
    assert (summary.fp8_gemm_calls, summary.num_gemm_calls, summary.fp8_gemm_names) == (4, 5, ["aten::_scaled_mm"])
    assert summary.category_us == {"gemm_fp8": 330, "gemm": 60, "attention": 0, "communication": 0, "other": 70}
    # torchao's wrapper with only a bf16 GEMM inside ran no FP8 GEMM, and its GEMM is one call.
    fallback = summarize_events([_event("matmul_with_hp_or_float8_args", "cpu_op", 0, 100),
                                 _event("aten::mm", "cpu_op", 10, 80)], num_steps=1)
    assert not fallback.fp8_gemm_ran and fallback.num_gemm_calls == 1
    assert {(s.name, s.category) for s in fallback.ops} == {("matmul_with_hp_or_float8_args", "gemm"),
                                                            ("aten::mm", "gemm")}


def test_summary_of_a_cpu_trace_counts_self_time():
    events = [
        _event("aten::linear", "cpu_op", 0, 100),
        _event("aten::t", "cpu_op", 2, 8),
        _event("aten::addmm", "cpu_op", 10, 80),
        _event("aten::relu", "cpu_op", 150, 50),
    ]
    summary = summarize_events(events, num_steps=2)
    assert summary.device == "cpu" and summary.steps is None
    assert {s.name: s.total_us for s in summary.ops} == {
        "aten::addmm": 80, "aten::relu": 50, "aten::linear": 12, "aten::t": 8}
    assert summary.category_us["gemm"] == 80 and summary.total_us == 150 and summary.busy_us == 150
    assert format_summary(summary).splitlines()[-1] == "FP8 GEMMs ran: no (only bf16/fp32 GEMMs)"


# --- scripts/summarize_trace.py -----------------------------------------------------------------


summarize_trace = load_script("summarize_trace")


def test_script_on_a_dir_without_traces_exits_2(tmp_path, capsys):
    (tmp_path / "summary_step3-5.txt").write_text("not a trace")
    assert summarize_trace.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"summarize_trace.py: no trace files (*.json, *.json.gz) under {tmp_path}\n"


def test_script_expect_fp8_fails_a_bf16_trace(fp32_trace_dir, capsys):
    assert summarize_trace.main([str(fp32_trace_dir), "--expect-fp8"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == f"WARNING: {SCRIPT_WARNING}"


# --- memory snapshots ---------------------------------------------------------------------------


def test_memory_snapshot_on_cpu_warns_once_and_does_nothing(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(logging.getLogger("trainer"), "propagate", True)
    caplog.set_level(logging.INFO)
    with maybe_record_memory_history(enable=True, snapshot_dir=str(tmp_path / "s"), rank=0) as memory:
        assert memory.dump("step3") is None
    assert [r.getMessage() for r in caplog.records] == [
        "profiling.memory_snapshot=true needs CUDA: this run records no memory snapshot"]
    assert not (tmp_path / "s").exists()


def test_oom_dumps_a_snapshot_and_points_to_it(tmp_path, monkeypatch):
    # The CUDA calls are faked; the wrapper's behaviour around them is what is pinned here.
    history = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", **kwargs: history.append((enabled, kwargs)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: Path(path).write_text("snapshot"))
    path = tmp_path / "s" / "rank2_oom.pickle"
    with pytest.raises(torch.cuda.OutOfMemoryError) as info:
        with maybe_record_memory_history(enable=True, snapshot_dir=str(tmp_path / "s"), rank=2) as memory:
            assert memory.dump("step3") == str(tmp_path / "s" / "rank2_step3.pickle")
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert path.read_text() == "snapshot"
    message = str(info.value)
    assert str(path) in message and "docs/debug.md" in message and "Tried to allocate 2.00 GiB" in message
    assert history == [("all", {"max_entries": 100_000}), (None, {})]
