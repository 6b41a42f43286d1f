"""Launch settings of the Triton kernel families: one frozen object per family.

Settings change how fast a kernel runs, and some (the decode GEMM's K split, the attention's tile
size and warps) the order in which it sums. So they are never module globals that a benchmark or a
test flips: whoever launches the kernels owns one of these objects and passes it down, as torchao's
float8 modules each hold their config.

* :class:`QuantKernelSettings` and :class:`DecodeGemmSettings`: held by an FP8 recipe
  (``quant/recipe.py``), read by every ``QuantLinear`` that runs it.
* :class:`DecodeAttentionSettings`: held by the decode engine (``rollout/engine``).
* :class:`TritonGemmSettings`: the portable Triton GEMM backend's tiles, an argument of
  ``triton_fp8_gemm_nt`` (the GEMM registry calls it with the defaults).
* :class:`InvariantMatmulSettings`, :class:`ExactAttentionSettings`, :class:`RowSumSettings` and
  :class:`ExactRopeSettings`: the exact ops' kernels, held by ``jetrl_trainer.exact`` (one object
  each for both phases: their tiles are part of the exact contract).

A benchmark that compares two settings builds two objects (``dataclasses.replace``). Pure Python:
importing this module imports no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DecodeAttentionSettings",
    "DecodeGemmSettings",
    "ExactAttentionSettings",
    "ExactRopeSettings",
    "InvariantMatmulSettings",
    "QuantKernelSettings",
    "RowSumSettings",
    "TritonGemmSettings",
]


def _positive(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{type(owner).__name__}.{name} must be a positive int; got {value!r}.")


@dataclass(frozen=True)
class DecodeGemmSettings:
    """The split-K FP8 GEMM for decode-sized M (``kernels/triton_decode_gemm.py``).

    Defaults from sweeps of ``benchmarks/bench_decode_gemm.py`` on an H200 and an H100 (Qwen3-8B
    shapes; docs/performance.md).

    Parameters:
        max_m: rows up to which a ``QuantLinear`` takes this kernel instead of the general path
            (``benchmarks/bench_decode_gemm.py`` measures the crossover on the GPU at hand).
        block_n: weight rows per program.
        max_block_m: the largest M tile (beyond ``max_m`` a benchmark knob only).
        swap_below_m: W is the MMA's M operand while the M tile is below this (measured faster below
            64 rows, where the activation is too short for the MMA's M).
        waves: programs per SM the K split aims for, among splits that load the busiest SM equally
            (one program per SM measured slower on the long-K down projection).
        min_groups_per_split: the fewest 128-wide K groups a split streams (shorter splits measured
            slower on the narrow k/v projections).
        num_warps, num_stages: Triton launch parameters.
    """

    max_m: int = 64
    block_n: int = 64
    max_block_m: int = 64
    swap_below_m: int = 64
    waves: int = 2
    min_groups_per_split: int = 4
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        _positive(self, "max_m", "block_n", "max_block_m", "swap_below_m", "waves", "min_groups_per_split",
                  "num_warps", "num_stages")  # fmt: skip


@dataclass(frozen=True)
class DecodeAttentionSettings:
    """The split-KV decode attention (``kernels/triton_decode_attention.py``).

    ``num_warps`` share a tile's row sums, so it can change the order of the sums; the tile size
    and tile order are not settings: the engine derives them from the training forward's attention.

    Parameters:
        num_warps: warps per program (8 measured slower).
        loop_stages: software-pipelining depth of the tile loop: 2 overlaps the next tile's loads with
            this tile's math (faster than 1 and 3, the same sums).
        min_tiles_per_split: the fewest KV tiles a split reads (a split costs a partial write and a
            reduce; it pays only while each split still gets several tiles).
    """

    num_warps: int = 4
    loop_stages: int = 2
    min_tiles_per_split: int = 4

    def __post_init__(self) -> None:
        _positive(self, "num_warps", "loop_stages", "min_tiles_per_split")


@dataclass(frozen=True)
class QuantKernelSettings:
    """The FP8 quantization kernels (``kernels/triton_quant.py``); none of them changes a bit.

    Defaults from sweeps of ``benchmarks/tune_quant_kernels.py`` on an H200 (docs/performance.md),
    which prints its winners as a ``QuantKernelSettings(...)`` to put here. Every entry is a power of two.

    Parameters:
        act: (rows per program, 128-groups per program, warps) of the activation quant.
        act_transposed: the same for an input with stride(0) == 1 (``dY.t()``).
        weight_warps: warps of the 128×128 weight quant.
        requant_block_k, requant_warps: features per program and warps of the WGrad operand's
            transpose + re-quant.
        transpose: (BLOCK_R, BLOCK_C, warps) of the FP8 block transpose (DGrad's weight).
    """

    act: tuple[int, int, int] = (16, 2, 4)
    act_transposed: tuple[int, int, int] = (64, 1, 4)
    weight_warps: int = 16
    requant_block_k: int = 32
    requant_warps: int = 4
    transpose: tuple[int, int, int] = (64, 256, 8)

    def __post_init__(self) -> None:
        _positive(self, "weight_warps", "requant_block_k", "requant_warps")
        for name in ("act", "act_transposed", "transpose"):
            value = getattr(self, name)
            if not (isinstance(value, tuple) and len(value) == 3 and all(isinstance(v, int) and v > 0 for v in value)):
                raise ValueError(f"QuantKernelSettings.{name} must be a tuple of three positive ints; got {value!r}.")
        for name in ("act", "act_transposed", "weight_warps", "requant_block_k", "requant_warps", "transpose"):
            value = getattr(self, name)
            if any(v & (v - 1) for v in (value if isinstance(value, tuple) else (value,))):
                raise ValueError(f"QuantKernelSettings.{name} must be powers of two (Triton tile sizes); got {value!r}.")


@dataclass(frozen=True)
class TritonGemmSettings:
    """The portable Triton FP8 GEMM (``kernels/triton_gemm.py``) above 64 rows; it sums each 128-wide
    K group in one tile whatever the tiles, so none of the tile fields changes a bit. (At decode-sized M a fixed
    rule picks narrow N tiles: that GEMM is bound by reading the weight.)

    ``benchmarks/tune_quant_kernels.py gemm`` times a few of these on the GPU at hand.

    Parameters:
        block_m, block_n: the output tile.
        group_m: M tiles launched next to each other, so that they share weight tiles in L2.
        num_warps, num_stages: Triton launch parameters.
        split_k_groups: the 128-wide K groups are summed in chunks of this many, each from zero, the
            chunks added in order (the split plan, fixed by K; it changes the bits, alike at every M).
            A decode-sized launch with fewer tiles than SMs runs the chunks in separate programs.
    """

    block_m: int = 128
    block_n: int = 128
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4
    split_k_groups: int = 16

    def __post_init__(self) -> None:
        _positive(self, "block_m", "block_n", "group_m", "num_warps", "num_stages", "split_k_groups")


@dataclass(frozen=True)
class ExactAttentionSettings:
    """The exact attention kernel (``kernels/triton_exact_attention.py``). Its key tile and row block
    fix every query's summation order, so the rollout and the training forward must launch it with
    the same object: ``jetrl_trainer.exact`` holds the one both use.

    Parameters:
        block_m: query rows per program (a decode step's GQA group is padded up to it).
        block_n: keys per tile, counted from each batch row's first real key.
        num_warps, num_stages: Triton launch parameters.
        dot: ``"fp32"``: the score and value products in FP32 FMA (no TF32); ``"bf16"``: on tensor
            cores, the operands (and the probabilities) rounded to BF16 and the products summed in
            FP32, as flash attention computes them; ``"auto"``: tensor cores where the queries are
            BF16 (a BF16 model), so only the probabilities are rounded, or where the exact ops run
            under BF16 autocast (whose plain attention computes in BF16 too), and FP32 FMA otherwise.
            All keep the contract (both phases run the same instructions under the same autocast).
            Measured on an H100 (docs/performance.md): the tensor-core products are 20-100x faster
            than FP32 FMA and as fast as the split-KV decode kernel, 1k-16k positions.
        split_keys: each query's keys run in splits of this many positions from its row's first key,
            one program each, merged in order by a second launch (a multiple of ``block_n``; 0: one
            program walks all of a row's keys). The split plan is fixed by the key positions alone,
            so both phases keep the same bits; it gives a decode step of few rows over long contexts
            more programs, at the price of the states written out and the merge. 2048 measured on an
            H100 (one layer of the 8B shape, FP8 cache, docs/performance.md): 8 rows 1.7x (4k
            positions) and 2.7x (16k) faster than 0, 64 rows 1.4-3.7% slower, the training forward
            level. A decode that keeps far more rows than 64 live throughout may prefer 0.
        combine_rows: queries per program of the merge launch.
        max_split_state_bytes: the most memory the splits' FP32 states take at once; a longer query run
            (a training forward or a prefill) is split and merged a chunk of positions at a time, which
            changes no bit (each query's result is its own). Without it a training forward would hold
            ``B x H x S x splits x (D + 2) x 4`` bytes per attention call: 0.65 GiB per 8k sequence of
            the 8B shape, 2.3 GiB per 16k one.
    """

    block_m: int = 16
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    dot: str = "auto"
    split_keys: int = 2048
    combine_rows: int = 16
    max_split_state_bytes: int = 256 * 2**20

    def __post_init__(self) -> None:
        _positive(self, "block_m", "block_n", "num_warps", "num_stages", "combine_rows", "max_split_state_bytes")
        if self.dot not in ("auto", "fp32", "bf16"):
            raise ValueError(f"ExactAttentionSettings.dot must be 'auto', 'fp32' or 'bf16'; got {self.dot!r}.")
        if self.split_keys < 0 or self.split_keys % self.block_n:
            raise ValueError(f"ExactAttentionSettings.split_keys must be 0 or a positive multiple of block_n "
                             f"({self.block_n}); got {self.split_keys}.")  # fmt: skip


@dataclass(frozen=True)
class InvariantMatmulSettings:
    """The batch-invariant matmul (``kernels/triton_invariant_matmul.py``). Its K step fixes each
    output's summation order, so the rollout and the training forward must launch it with the same
    object: ``jetrl_trainer.exact`` holds the one both use.

    Parameters:
        block_m, block_n: the output tile (any M is padded up to a multiple of ``block_m`` by masking).
        block_k: the K step for BF16/FP16 operands; ``block_k_fp32`` for FP32 ones.
        split_k: K is summed in chunks of this many positions, each from zero, and the chunks added
            in order (a multiple of both K steps): the split plan, fixed by K alone. A launch with
            fewer tiles than the GPU has SMs (a decode step) runs the chunks in separate programs.
        num_warps, num_stages: Triton launch parameters.
        wide_from_rows: launches of at least this many rows (a prefill, a training forward) with
            BF16/FP16 operands take the wide tile below, which runs closer to cuBLAS there; 0 keeps
            the one tile everywhere. The
            K step and chunks stay the same, so each output is the same sum in the same order:
            whether the tensor cores also give it the same bits at either tile size is what the GPU
            test checks (tests/kernels/test_invariant_matmul.py).
        wide_block_m, wide_block_n, wide_num_warps: that tile and its warps.
    """

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    block_k_fp32: int = 32
    split_k: int = 2048
    num_warps: int = 4
    num_stages: int = 4  # q/o, k/v, gate/up at 64 rows: 1.05-1.47x cuBLAS, 3 stages 1.17-1.78x (H100)
    wide_from_rows: int = 256
    wide_block_m: int = 128
    # 128x256 with 8 warps: 1.4-1.6x cuBLAS at 12,288 rows; 128x128 with 4: 1.8-2.5x (H100, 2026-12-06)
    wide_block_n: int = 256
    wide_num_warps: int = 8

    def __post_init__(self) -> None:
        _positive(self, "block_m", "block_n", "block_k", "block_k_fp32", "split_k", "num_warps", "num_stages",
                  "wide_block_m", "wide_block_n", "wide_num_warps")  # fmt: skip
        if self.wide_from_rows < 0:
            raise ValueError(f"InvariantMatmulSettings.wide_from_rows must be >= 0 (0: never); got {self.wide_from_rows}.")
        if self.split_k % self.block_k or self.split_k % self.block_k_fp32:
            raise ValueError(f"InvariantMatmulSettings.split_k ({self.split_k}) must be a multiple of block_k "
                             f"({self.block_k}) and block_k_fp32 ({self.block_k_fp32}).")


@dataclass(frozen=True)
class RowSumSettings:
    """The batch-invariant row sum (``kernels/triton_row_sum.py``). Its chunk width fixes each row's
    summation order, so the rollout and the training forward must launch it with the same object:
    ``jetrl_trainer.exact`` holds the one both use.

    Parameters:
        block_k: the widest chunk of a row that one step loads (narrower where K is smaller).
        num_warps: Triton launch parameter (one row per program).
    """

    block_k: int = 1024
    num_warps: int = 4

    def __post_init__(self) -> None:
        _positive(self, "block_k", "num_warps")
        if self.block_k & (self.block_k - 1):
            raise ValueError(f"RowSumSettings.block_k must be a power of two (a Triton block); got {self.block_k!r}.")


@dataclass(frozen=True)
class ExactRopeSettings:
    """The exact RoPE (``kernels/triton_exact_rope.py``): one program per (position, head), no sums, so
    no setting changes a bit. ``jetrl_trainer.exact`` holds the one both phases launch.

    Parameters:
        num_warps: Triton launch parameter (a program rotates one head vector).
    """

    num_warps: int = 1

    def __post_init__(self) -> None:
        _positive(self, "num_warps")
