"""Which raw ``torch._scaled_mm`` blockwise calls does cuBLASLt accept on this GPU/torch build?

No padding: each (M, N, K, granularity) is tried as is (scale layouts as ATen wants them) and
compared with the emulated backend. This is how ``kernels/scaled_mm.py`` chose its padding rules.
"""

from __future__ import annotations

import torch

from _common import dump, environment
from jetrl_trainer.kernels import fp8_gemm_nt
from jetrl_trainer.quant.fp8 import quantize_fp8_blocks, quantize_fp8_groups
from jetrl_trainer.quant.testing import relative_error


def _try(m, n, k, gran):
    a_q, a_s = quantize_fp8_groups(torch.randn(m, k, device="cuda"))
    b = torch.randn(n, k, device="cuda")
    b_q, b_s = quantize_fp8_blocks(b) if gran == "block" else quantize_fp8_groups(b)
    sa = torch.empty_strided(a_s.shape, (1, m), device="cuda").copy_(a_s)
    sb = b_s.t() if gran == "block" else torch.empty_strided(b_s.shape, (1, n), device="cuda").copy_(b_s).t()
    try:
        out = torch._scaled_mm(a_q, b_q.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    except RuntimeError as exc:
        return "error: " + str(exc).split("\n")[0][:60]
    ref = fp8_gemm_nt((a_q, a_s), (b_q, b_s), b_granularity=gran, out_dtype=torch.float32, backend="emulated")
    rel = relative_error(out, ref)
    return f"ok rel={rel:.1e}" if rel < 1e-2 else f"WRONG rel={rel:.1e}"


def run() -> dict:
    torch.manual_seed(0)
    rows = {}
    for gran in ("block", "group"):
        for m in (1, 2, 4, 8, 12, 16, 24, 7, 100, 256):
            rows[f"{gran} M={m} N=256 K=512"] = _try(m, 256, 512, gran)
        for n in (16, 48, 100, 112, 1008):
            rows[f"{gran} M=64 N={n} K=512"] = _try(64, n, 512, gran)
        for k in (128, 256, 384, 640, 1024, 1152):
            rows[f"{gran} M=64 N=256 K={k}"] = _try(64, 256, k, gran)
    return {"environment": environment(), "raw_scaled_mm": rows}


if __name__ == "__main__":
    dump(run())
