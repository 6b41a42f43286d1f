"""Shared helpers for the GPU benchmarks: timing, bandwidth ceiling, environment record.

Every benchmark measures its BF16 baseline in the same process, right next to the FP8 path, and
reports ratios; absolute numbers only make sense together with ``environment()``.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import math
import platform
from collections.abc import Callable, Sequence

import torch

__all__ = ["TRAINING_KERNEL_KINDS", "bench_ms", "bench_graph_ms", "cold_copies", "copy_bandwidth_gbs", "cycling", "environment",
           "dump", "kernels_by_kind", "profile_kernels", "tflops"]


# Qwen3-8B's layer shapes, for the benchmarks' random models (build_tiny_qwen3(..., **QWEN3_8B_SHAPE)).
QWEN3_8B_SHAPE = dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, vocab_size=151936, tie_word_embeddings=False)  # fmt: skip


def environment() -> dict:
    info = {
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sm_count=props.multi_processor_count,
                    capability=".".join(map(str, torch.cuda.get_device_capability())),
                    memory_gib=round(props.total_memory / 2**30, 1))
    return info


def bench_ms(fn: Callable[[], object], warmup_ms: int = 25, rep_ms: int = 200) -> float:
    """Median milliseconds per call (CUDA events; triton.testing.do_bench when Triton is there)."""
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    except ImportError:
        return _events_ms(fn)


def _events_ms(fn: Callable[[], object], iters: int = 50) -> float:
    for _ in range(5):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[len(times) // 2]


def bench_graph_ms(fn: Callable[[], object], calls: int = 20, replays: int = 30) -> float:
    """Milliseconds per call with launch gaps removed: ``calls`` calls captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return bench_ms(graph.replay, rep_ms=100) / calls


def cold_copies(
    tensors: Sequence[torch.Tensor], cold: bool = True, l2_bytes: int | None = None, read_bytes: int | None = None
) -> list[tuple]:
    """``tensors`` and enough clones of them that the calls between two reads of one copy read three
    times the L2 cache (``read_bytes``: what one call reads of them, all their bytes by default), or
    just ``[tensors]`` when ``cold`` is False.

    A decode step reads each layer's weights once between 7 GB of others, so they come from DRAM. A
    benchmark that calls one projection back to back reads a weight that fits in L2 (50 MB on an
    H200: Qwen3-8B's q/k/v in FP8 is 25 MB) from L2 from the second call on. Cycling the calls
    through these copies (:func:`cycling`) keeps every read cold."""
    tensors = tuple(tensors)
    if not cold:
        return [tensors]
    l2 = l2_bytes if l2_bytes is not None else int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20))
    size = max(1, read_bytes if read_bytes is not None else sum(t.numel() * t.element_size() for t in tensors))
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(math.ceil(3 * l2 / size) - 1)]


def cycling(fn: Callable[..., object], operands: Sequence[tuple]) -> Callable[[], object]:
    """A call of ``fn(*operands[i])`` with ``i`` advancing at each call: the calls a CUDA graph captures
    (:func:`bench_graph_ms`) each read the next copy of :func:`cold_copies`."""
    counter = itertools.count()
    return lambda: fn(*operands[next(counter) % len(operands)])


def profile_kernels(step: Callable[[], object], steps: int, warmup: int = 1):
    """``torch.profiler`` CUDA events of ``steps`` calls of ``step`` after ``warmup`` calls: its ``key_averages()``."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof.key_averages()


TRAINING_KERNEL_KINDS = (  # for kernels_by_kind on training steps: (kind, substrings of a kernel name), first match wins
    ("fused_norm_swiglu", ("rmsnorm_quant", "swiglu_quant", "rmsnorm_backward")),  # before fp8_quant's "quant_kernel"
    ("fp8_transpose", ("requant_transpose", "transpose_u8")),
    ("fp8_quant", ("act_quant", "weight_quant", "quant_kernel")),
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("optimizer", ("multi_tensor", "adam", "foreach", "fused_")),
    ("softmax", ("softmax", "log_softmax", "logsumexp", "cross_entropy", "nll")),
    ("gemm", ("gemm", "sm90", "cutlass", "nvjet", "cublas", "xmma", "splitK")),
    ("reduce", ("reduce",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "copy", "fill", "index", "cat", "where")),
)


def kernels_by_kind(step: Callable[[], object], steps: int, kinds: tuple, top: int = 25) -> dict:
    """GPU ms and launches per call of ``step``, grouped by kind: ``kinds`` is ``((kind, substrings), ...)`` of
    kernel names, first match wins, the rest is "other"; with the ``top`` kernels by time."""
    totals: dict[str, list[float]] = {}
    rows = []
    for event in profile_kernels(step, steps):
        us = event.self_device_time_total
        if us <= 0 or event.count == 0:
            continue
        name = event.key
        kind = next((k for k, subs in kinds if any(s in name for s in subs)), "other")
        slot = totals.setdefault(kind, [0.0, 0])
        slot[0] += us / steps / 1e3
        slot[1] += event.count / steps
        rows.append((us / steps / 1e3, event.count / steps, name[:80]))
    rows.sort(reverse=True)
    return dict(
        gpu_ms=round(sum(v[0] for v in totals.values()), 3),
        launches=round(sum(v[1] for v in totals.values())),
        by_kind={k: dict(ms=round(v[0], 3), launches=round(v[1]))
                 for k, v in sorted(totals.items(), key=lambda kv: -kv[1][0])},
        top=[dict(ms=round(ms, 3), launches=round(n), name=name) for ms, n, name in rows[:top]],
    )


def copy_bandwidth_gbs(n_bytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written (GB/s, 1e9)."""
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * n_bytes / (ms * 1e-3) / 1e9


def tflops(m: int, n: int, k: int, ms: float) -> float:
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def dump(result: dict) -> None:
    """Print a benchmark's result as JSON (run_all.py collects them into one file)."""
    print(json.dumps(result, indent=1, default=str), flush=True)


def replaced_settings(base, text: str):
    """A frozen settings object (``kernels/settings.py``) with fields replaced from ``"waves=1,num_warps=8"``
    (integers; ``""``: ``base`` itself), what a benchmark compares against the shipped defaults.
    Raises ValueError naming the fields on an unknown field or a value that is not an integer."""
    fields = {f.name for f in dataclasses.fields(base)}
    changes = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in fields or not value.lstrip("-").isdigit():
            raise ValueError(f"{item!r} is not FIELD=<int> with FIELD one of {', '.join(sorted(fields))}")
        changes[name] = int(value)
    return dataclasses.replace(base, **changes)
