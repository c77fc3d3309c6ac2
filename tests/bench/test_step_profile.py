"""Where a worker step's time goes (scripts/bench/step_profile.py), from torch profiler traces."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from scripts.bench import shared_prefix_engine, step_profile

DECODE = "execute_context_0(0)_generation_64(64)"  # vLLM's worker annotates each step so
PREFILL = "execute_context_2(100)_generation_0(0)"
MIXED = "execute_context_1(50)_generation_63(63)"


def test_steps_are_read_from_a_real_torch_profiler_trace(tmp_path):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for name in (PREFILL, DECODE, DECODE, MIXED):
            with record_function(name):
                torch.randn(128, 128) @ torch.randn(128, 128)
    path = tmp_path / "worker.pt.trace.json"
    prof.export_chrome_trace(str(path))
    gz = tmp_path / "worker.pt.trace.json.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))  # vLLM writes them gzipped

    steps = step_profile.steps_of(step_profile.read_trace(gz))
    assert [s.kind for s in steps] == ["prefill", "decode", "decode", "mixed"]
    assert all(s.host_ms > 0 and s.gpu_busy_ms == 0 and s.launches == 0 for s in steps)  # no GPU here
    assert steps[0].gap_ms is None and all(s.gap_ms >= 0 for s in steps[1:])
    summary = step_profile.profile_sides({"stock": tmp_path})["stock"]  # a folder: both copies read
    assert summary["decode"]["steps"] == 4 and summary["prefill"]["steps"] == 2


def trace_with_kernels(next_step: bool = False) -> dict:
    """The events a CUDA trace holds for one step, in the format torch writes (kernel records come from
    CUPTI, only on a GPU): the step's host span 0-1000 us, two launches in it, one after it."""

    def event(cat, name, ts, dur, correlation=None):
        args = {} if correlation is None else {"correlation": correlation}
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}

    return {
        "traceEvents": [
            event("user_annotation", DECODE, 0, 1000),
            event("cuda_runtime", "cudaStreamSynchronize", 50, 5, 4),  # no GPU work: not a launch
            event("cuda_runtime", "cudaLaunchKernel", 100, 5, 1),
            event("cuda_runtime", "cudaLaunchKernel", 200, 5, 2),
            event("cuda_runtime", "cudaLaunchKernel", 1200, 5, 3),  # after the next step's start (1150)
            event("kernel", "void flash::FlashAttnFwdSm90<Params>(Params)", 500, 300, 1),
            # launched in the step, run after its host span ended (async): still the step's
            event("kernel", "void vllm::merge_attn_states_kernel<bf16>(...)", 1100, 100, 2),
            event("kernel", "nvjet_tst_128x64_64x4_gemm", 1300, 50, 3),
            event("gpu_user_annotation", DECODE, 500, 700),  # GPU-side copy of the annotation
            *([event("user_annotation", DECODE, 1150, 400)] if next_step else []),  # 150 us after the first
        ]
    }


def test_a_steps_gpu_work_is_what_it_launched_grouped_by_kernel():
    step, after = step_profile.steps_of(trace_with_kernels(next_step=True))
    assert step.kind == "decode" and step.host_ms == 1.0 and step.launches == 2 and step.gap_ms is None
    assert step.groups_ms["attention"] == pytest.approx(0.3)
    assert step.groups_ms["merge"] == pytest.approx(0.1)  # vLLM's merge names "attn" too
    assert step.groups_ms["gemm"] == 0  # launched by the next step
    assert after.groups_ms["gemm"] == pytest.approx(0.05) and after.gap_ms == pytest.approx(0.15)
    assert step.gpu_busy_ms == pytest.approx(0.4) and step.gpu_span_ms == pytest.approx(0.7)
    summary = step_profile.summarize([step])["decode"]
    assert summary["gpu_idle_share"] == pytest.approx(1 - 0.4 / 0.7)


def test_a_cuda_graph_replay_is_one_launch_with_all_its_kernels():
    def event(cat, name, ts, dur, correlation):
        return {
            "ph": "X",
            "cat": cat,
            "name": name,
            "ts": ts,
            "dur": dur,
            "args": {"correlation": correlation},
        }

    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "user_annotation", "name": DECODE, "ts": 0, "dur": 100, "args": {}},
            event("cuda_runtime", "cudaGraphLaunch", 10, 5, 9),
            event("kernel", "fused_moe_kernel", 200, 300, 9),  # every kernel of the replay: correlation 9
            event("kernel", "void flash::FlashAttnFwdSm90<P>(P)", 500, 400, 9),
            event("kernel", "nvjet_tst_gemm", 900, 200, 9),
        ]
    }
    (step,) = step_profile.steps_of(trace)
    assert step.launches == 1 and step.gpu_busy_ms == pytest.approx(0.9)
    assert (step.groups_ms["moe"], step.groups_ms["attention"], step.groups_ms["gemm"]) == pytest.approx(
        (0.3, 0.4, 0.2)
    )


def test_busy_time_is_the_union_of_kernel_intervals():
    assert step_profile.busy_ms([(0, 1000), (500, 1500), (2000, 2500), (2100, 2200)]) == 2.0


@pytest.mark.parametrize(
    "kernel, group",
    [
        ("void flash::FlashAttnFwdCombine<...>", "attention"),
        ("flash_fwd_splitkv_mla_kernel", "attention"),
        ("merge_attn_states_kernel", "merge"),
        ("fused_moe_kernel", "moe"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", "gemm"),
        ("Memcpy HtoD (Pinned -> Device)", "copies"),
        ("triton_poi_fused_add_rms_norm_0", "other"),
    ],
)
def test_kernel_groups(kernel, group):
    assert step_profile.group_of(kernel) == group


def test_the_report_has_a_row_per_side_and_kind():
    summaries = {"stock": step_profile.summarize(step_profile.steps_of(trace_with_kernels()))}
    lines = step_profile.profile_lines(summaries)
    assert lines[0].startswith("| side | kind | steps | host ms | between ms | GPU busy ms | GPU idle |")
    assert lines[2].startswith(
        "| stock | decode | 1 | 1.00 | - | 0.45 | 47% | 3 |"
    )  # the gemm too: no next step


def test_the_cli_reads_a_trace_and_writes_its_summary(tmp_path, capsys):
    trace = tmp_path / "stock.json"
    trace.write_text(json.dumps(trace_with_kernels()))
    out = tmp_path / "profile.json"
    assert step_profile.main([str(trace), "--label", "stock", "--json", str(out)]) == 0
    assert "| stock | decode | 1 |" in capsys.readouterr().out
    assert json.loads(out.read_text())["profile"]["stock"]["decode"]["launches"] == 3


def test_the_engine_benchmark_profiles_with_vllms_own_profiler_config(tmp_path):
    from vllm.config import ProfilerConfig

    steps = shared_prefix_engine.profile_steps("8:16")
    config = ProfilerConfig(
        **step_profile.profiler_config(tmp_path, *steps)
    )  # what LLM(profiler_config=...) builds
    # vLLM records from the step its count reaches delay_iterations: 8 skipped means 9
    assert (config.profiler, config.delay_iterations, config.max_iterations) == ("torch", 9, 16)
    assert config.torch_profiler_dir == str(tmp_path.resolve()) and not config.torch_profiler_with_stack


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--profile-steps", "8"], "two whole numbers"),
        (["--profile-steps", "0:0"], "COUNT >= 1"),
        (["--sides", "stock,FLASH_ATTN,FLASH_ATTN:pause"], "run in another side's engine"),
    ],
)
def test_the_engine_benchmark_refuses_a_profile_it_cannot_take(tmp_path, flags, message):
    args = shared_prefix_engine.make_parser().parse_args(["--profile", str(tmp_path), *flags])
    with pytest.raises(ValueError, match=message):
        shared_prefix_engine.plan(args)
