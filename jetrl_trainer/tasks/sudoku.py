"""4×4 sudoku with a unique solution.

Grid format (prompt and answer alike): four rows of four cells joined by ``/``, digits ``1``–``4``
and ``.`` for an empty cell. A puzzle reads ``"4..2/1234/.1../342."`` and its reference answer is
the solved grid in the same format, ``"4312/1234/2143/3421"`` (19 characters, cheap for the
character-level tiny models).

Generation: a random solved grid (randomised backtracking), then cells are emptied in random
order, keeping a removal only while a counting solver still finds exactly one solution.

Reward: the fraction of the puzzle's empty cells that the completion fills correctly. The
completion (or its last ``\\boxed{}`` / ``<answer>`` span) is read as the sequence of its cell
characters (``1``–``4``, ``.``, ``0``) in reading order, ignoring separators; cells beyond the
ones written count as wrong, so a truncated answer earns credit for what it did write.
"""

from __future__ import annotations

from typing import Any, Sequence

from jetrl_trainer.tasks._common import Task, completion_text, extract_answer_span, rng_for, user_prompt

__all__ = [
    "TASK",
    "count_solutions",
    "format_grid",
    "make_dataset",
    "make_puzzle",
    "parse_grid",
    "reference_answer",
    "reward",
    "score",
    "sudoku_reward",
]

SIZE, BOX = 4, 2
_CELL_CHARS = set("1234.0")
Grid = list[int]  # 16 cells in reading order, 0 = empty


def format_grid(grid: Sequence[int]) -> str:
    cells = "".join(str(v) if v else "." for v in grid)
    return "/".join(cells[r * SIZE:(r + 1) * SIZE] for r in range(SIZE))


def parse_grid(text: str) -> Grid:
    """The cells written in ``text``, in order (at most 16; separators and other characters skipped)."""
    return [0 if ch in ".0" else int(ch) for ch in text if ch in _CELL_CHARS][: SIZE * SIZE]


def _candidates(grid: Grid, i: int) -> list[int]:
    r, c = divmod(i, SIZE)
    br, bc = r - r % BOX, c - c % BOX
    used = {grid[r * SIZE + k] for k in range(SIZE)} | {grid[k * SIZE + c] for k in range(SIZE)}
    used |= {grid[(br + a) * SIZE + bc + b] for a in range(BOX) for b in range(BOX)}
    return [v for v in range(1, SIZE + 1) if v not in used]


def count_solutions(grid: Sequence[int], limit: int = 2) -> int:
    """Number of completions of ``grid`` (0 = empty), counting no further than ``limit``."""
    grid = list(grid)
    if len(grid) != SIZE * SIZE or any(v not in range(SIZE + 1) for v in grid):
        raise ValueError(f"a grid is {SIZE * SIZE} cells with values 0..{SIZE}, got {grid!r}")

    def search() -> int:
        try:
            i = grid.index(0)
        except ValueError:
            return 1
        found = 0
        for v in _candidates(grid, i):
            grid[i] = v
            found += search()
            grid[i] = 0
            if found >= limit:
                break
        return found

    # a grid whose givens already clash has no solution even if it is full
    for i, v in enumerate(grid):
        if v:
            grid[i] = 0
            ok = v in _candidates(grid, i)
            grid[i] = v
            if not ok:
                return 0
    return search()


def _random_solution(rng) -> Grid:
    grid = [0] * (SIZE * SIZE)

    def fill(i: int) -> bool:
        if i == len(grid):
            return True
        options = _candidates(grid, i)
        rng.shuffle(options)
        for v in options:
            grid[i] = v
            if fill(i + 1):
                return True
        grid[i] = 0
        return False

    fill(0)
    return grid


def make_puzzle(rng, *, holes: int = 10) -> tuple[Grid, Grid]:
    """``(puzzle, solution)`` with exactly ``holes`` empty cells and a unique solution."""
    if not 1 <= holes <= 12:  # a 4x4 sudoku needs at least 4 givens to be unique
        raise ValueError(f"holes must be in [1, 12], got {holes}")
    for _ in range(2_000):
        solution = _random_solution(rng)
        puzzle = list(solution)
        order = list(range(SIZE * SIZE))
        rng.shuffle(order)
        emptied = 0
        for i in order:
            puzzle[i] = 0
            if count_solutions(puzzle) == 1:
                emptied += 1
                if emptied == holes:
                    return puzzle, solution
            else:
                puzzle[i] = solution[i]
    raise ValueError(f"could not build a unique puzzle with {holes} holes; use fewer holes")


def make_dataset(n: int, seed: int = 0, *, holes: int = 10, prompt_style: str = "short"):
    """``n`` puzzles; columns ``prompt``, ``puzzle``, ``solution`` (grid strings)."""
    from datasets import Dataset

    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if prompt_style not in ("short", "instruct"):
        raise ValueError(f"prompt_style must be 'short' or 'instruct', got {prompt_style!r}")
    rng = rng_for(seed)
    rows: dict[str, list] = {"prompt": [], "puzzle": [], "solution": []}
    for _ in range(n):
        puzzle, solution = make_puzzle(rng, holes=holes)
        shown = format_grid(puzzle)
        content = shown if prompt_style == "short" else (
            "Solve this 4x4 sudoku (rows separated by '/', '.' is empty; each row, column and 2x2 "
            f"box holds 1-4 once): {shown}\nAnswer with the full grid in the same format."
        )
        rows["prompt"].append(user_prompt(content))
        rows["puzzle"].append(shown)
        rows["solution"].append(format_grid(solution))
    return Dataset.from_dict(rows)


def reference_answer(row: dict) -> str:
    return row["solution"]


def score(text: str, puzzle: str, solution: str) -> float:
    """Fraction of the empty cells of ``puzzle`` that ``text`` fills with the ``solution`` digit."""
    given, truth, written = parse_grid(puzzle), parse_grid(solution), parse_grid(extract_answer_span(text))
    empty = [i for i, v in enumerate(given) if v == 0]
    if len(given) != SIZE * SIZE or len(truth) != SIZE * SIZE or not empty:
        raise ValueError(f"puzzle/solution are not 4x4 grids with empty cells: {puzzle!r}, {solution!r}")
    right = sum(1 for i in empty if i < len(written) and written[i] == truth[i])
    return right / len(empty)


def sudoku_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    puzzle: Sequence[str],
    solution: Sequence[str],
    **kwargs: Any,
) -> list[float]:
    """TRL reward function: reads the ``puzzle`` and ``solution`` columns."""
    if not len(completions) == len(puzzle) == len(solution):
        raise ValueError(f"got {len(completions)} completions, {len(puzzle)} puzzles, {len(solution)} solutions")
    return [score(completion_text(c), p, s) for c, p, s in zip(completions, puzzle, solution)]


reward = sudoku_reward  # TRL logs a reward under its __name__, so the function keeps the task name

TASK = Task(
    name="sudoku",
    make_dataset=make_dataset,
    reward_fn=sudoku_reward,
    reference_answer=reference_answer,
    max_completion_length=24,
    description="4x4 sudoku with a unique solution; reward = fraction of empty cells filled right",
    difficulty_knobs=("holes", "prompt_style"),
)
