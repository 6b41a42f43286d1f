"""jetrl_trainer.tasks: seeded generators, solvability, and every reward rule on hand-written completions."""

from __future__ import annotations

import json
import re

import pytest

from jetrl_trainer.tasks import TASKS, completion_text, get_task, load_gsm8k
from jetrl_trainer.tasks import arithmetic, countdown, gsm8k, reverse, sudoku
from jetrl_trainer.tasks._common import extract_answer_span, parse_number


def _as_chat(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


# ---------------------------------------------------------------- registry and shared parsers


def test_registry_has_the_six_tasks_and_rejects_unknown_names():
    assert sorted(TASKS) == ["arithmetic", "chain", "countdown", "gsm8k", "reverse", "sudoku"]
    assert get_task("countdown") is countdown.TASK
    with pytest.raises(ValueError, match="choose one of"):
        get_task("chess")


def test_reward_functions_are_named_after_their_task():
    # TRL logs rewards/<__name__>/mean; distinct names keep several tasks apart.
    assert {name: t.reward_fn.__name__ for name, t in TASKS.items()} == {
        name: f"{name}_reward" for name in TASKS
    }


def test_completion_text_accepts_strings_messages_and_content_blocks():
    assert completion_text("42") == "42"
    assert completion_text(_as_chat("42")) == "42"
    blocks = [{"type": "text", "text": "4"}, {"type": "text", "text": "2"}]
    assert completion_text([{"role": "assistant", "content": blocks}]) == "42"
    assert completion_text([{"role": "user", "content": "no"}, {"role": "assistant", "content": "7"}]) == "7"
    with pytest.raises(ValueError, match="string or a list of chat messages"):
        completion_text(42)


def test_parse_number_and_answer_span():
    assert parse_number("1,234") == 1234
    assert parse_number(" -3. ") == -3
    assert parse_number("$2.50") == parse_number("2.5")
    for bad in ("", "12a", "1 2", "1,23", "--1"):
        assert parse_number(bad) is None, bad
    assert extract_answer_span("work... \\boxed{1} then \\boxed{ 7 }") == "7"
    assert extract_answer_span("x <answer>3*5</answer>") == "3*5"
    assert extract_answer_span("  19\n") == "19"


# ---------------------------------------------------------------- reverse


def test_reverse_is_seeded_and_as_long_as_asked():
    a = reverse.make_dataset(40, seed=3, min_digits=100, max_digits=120)
    assert a.to_list() == reverse.make_dataset(40, seed=3, min_digits=100, max_digits=120).to_list()
    assert a.to_list() != reverse.make_dataset(40, seed=4, min_digits=100, max_digits=120).to_list()
    for row in a.to_list():
        assert 100 <= len(row["digits"]) <= 120 and row["digits"].isdigit()
        assert row["answer"] == row["digits"][::-1] == reverse.reference_answer(row)
        assert row["prompt"] == [{"role": "user", "content": f"reverse {row['digits']}="}]
    assert reverse.TASK.completion_budget(max_digits=120) == 128
    assert reverse.TASK.completion_budget() == reverse.TASK.max_completion_length == 40
    assert arithmetic.TASK.completion_budget(max_operand=99) == arithmetic.TASK.max_completion_length
    instruct = reverse.make_dataset(1, seed=0, prompt_style="instruct")[0]["prompt"][0]["content"]
    assert instruct.startswith("Write these digits in reverse order")


def test_reverse_reward_rules():
    cases = {
        "4321": 1.0,
        " 4321\n": 1.0,
        "\\boxed{4321}": 1.0,
        "4399": 0.5 * 2 / 4,  # first two digits right
        "43": 0.5 * 2 / 4,  # right but stopped early
        "432111": 0.5 * 4 / 4,  # right, then kept going
        "9321": 0.0,  # digits, none right from the start
        "43 21": 0.0,
        "4321.": 0.0,
        "": 0.0,
        "four": 0.0,
        "٤٣٢١": 0.0,  # non-ASCII digits are not digits here
    }
    for text, want in cases.items():
        assert reverse.score(text, "4321") == want, text
    assert reverse.reverse_reward([None, None], [_as_chat("21"), "1"], answer=["21", "21"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="got 1 completions but 2 answers"):
        reverse.reverse_reward([None], ["1"], answer=["1", "2"])


@pytest.mark.parametrize("knobs, message", [
    (dict(min_digits=0), "1 <= min_digits <= max_digits"),
    (dict(min_digits=9, max_digits=8), "1 <= min_digits <= max_digits"),
    (dict(max_digits=8.5), "1 <= min_digits <= max_digits"),
    (dict(prompt_style="long"), "prompt_style must be"),
])  # fmt: skip
def test_reverse_bad_knobs_are_refused(knobs, message):
    with pytest.raises(ValueError, match=message):
        reverse.make_dataset(4, **knobs)


# ---------------------------------------------------------------- arithmetic


def test_arithmetic_is_seeded_and_answers_are_right():
    a, b = arithmetic.make_dataset(50, seed=3), arithmetic.make_dataset(50, seed=3)
    assert a.to_list() == b.to_list()
    assert a.to_list() != arithmetic.make_dataset(50, seed=4).to_list()
    for row in arithmetic.make_dataset(200, seed=0, max_operand=12, ops="+-*").to_list():
        x, op, y = re.fullmatch(r"(\d+)([-+*])(\d+)", row["expression"]).groups()
        assert 0 <= int(x) <= 12 and 0 <= int(y) <= 12
        assert row["answer"] == {"+": int(x) + int(y), "-": int(x) - int(y), "*": int(x) * int(y)}[op]
        assert row["answer"] >= 0  # allow_negative=False orders a - b
        assert row["prompt"] == [{"role": "user", "content": row["expression"] + "="}]
        assert arithmetic.reference_answer(row) == str(row["answer"])


def test_arithmetic_instruct_prompt_and_bad_knobs():
    row = arithmetic.make_dataset(1, seed=0, prompt_style="instruct")[0]
    assert row["prompt"][0]["content"] == f"What is {row['expression']}? Answer with the number only."
    with pytest.raises(ValueError, match="ops"):
        arithmetic.make_dataset(3, ops="+/")
    with pytest.raises(ValueError, match="max_operand"):
        arithmetic.make_dataset(3, max_operand=0)
    with pytest.raises(ValueError, match="prompt_style"):
        arithmetic.make_dataset(3, prompt_style="chatty")


def test_arithmetic_reward_rules():
    score = arithmetic.score
    assert score("19", 19) == 1.0
    assert score(" 19\n", 19) == 1.0
    assert score("\\boxed{19}", 19) == 1.0
    assert score("18", 19) == pytest.approx(0.1 + 0.4 * (1 - 1 / 19))  # close: relative error 1/19
    assert score("3", 0) == pytest.approx(0.1 + 0.4 * (1 - 3 / 10))  # floor of 10 for small answers
    assert score("100", 19) == pytest.approx(0.1)  # well-formed but far: format credit only
    for malformed in ("", "nineteen", "19 20", "19abc", "=19"):
        assert score(malformed, 19) == 0.0, malformed
    prompts = [[{"role": "user", "content": "12+7="}]] * 3
    completions = [_as_chat("19"), "18", _as_chat("x")]
    got = arithmetic.arithmetic_reward(prompts, completions, answer=[19, 19, 19], trainer_state=None)
    assert got == pytest.approx([1.0, 0.1 + 0.4 * (1 - 1 / 19), 0.0])
    with pytest.raises(ValueError, match="answers"):
        arithmetic.arithmetic_reward(prompts, ["1"], answer=[1, 2])


# ---------------------------------------------------------------- countdown


def test_countdown_is_seeded_and_every_puzzle_is_solved_by_its_reference():
    ds = countdown.make_dataset(300, seed=11)
    assert ds.to_list() == countdown.make_dataset(300, seed=11).to_list()
    counts = set()
    for row in ds.to_list():
        counts.add(len(row["numbers"]))
        assert all(1 <= n <= 10 for n in row["numbers"]) and 1 <= row["target"] <= 100
        assert row["prompt"][0]["content"] == " ".join(map(str, row["numbers"])) + f" -> {row['target']}"
        assert countdown.evaluate_expression(row["solution"]) == row["target"]
        assert countdown.score(countdown.reference_answer(row), row["numbers"], row["target"]) == 1.0
    assert counts == {3, 4}


def test_countdown_difficulty_knobs():
    ds = countdown.make_dataset(50, seed=0, min_count=4, max_count=4, max_number=5, ops="+*")
    assert all(len(ns) == 4 and max(ns) <= 5 for ns in ds["numbers"])
    assert all(set(s) <= set("0123456789+*()") for s in ds["solution"])
    with pytest.raises(ValueError, match="min_count"):
        countdown.make_dataset(2, min_count=5, max_count=4)
    with pytest.raises(ValueError, match="ops"):
        countdown.make_dataset(2, ops="+^")


def test_countdown_reward_tiers():
    nums, target = [3, 5, 7], 22
    cases = {
        "3*5+7": 1.0,
        "7+3*5": 1.0,
        "3*5+7=22": 1.0,  # cut at '='
        " (3*5)+7 ": 1.0,
        "<answer>3*5+7</answer>": 1.0,
        "3×5+7": 1.0,
        "(3+5)*7": 0.3,  # right numbers, value 56
        "3+5": 0.1,  # valid, a number missing
        "3*5+7+0": 0.1,  # valid, an extra number
        "3*5+5": 0.1,  # 5 used twice, 7 unused
        "": 0.0,
        "3 5 7": 0.0,
        "3*5+-7": 0.0,  # unary minus is not allowed
        "3**5+7": 0.0,
        "__import__('os').system('true')": 0.0,
        "abs(3)*5+7": 0.0,
    }
    for text, want in cases.items():
        assert countdown.score(text, nums, target) == want, text
    assert countdown.score("6/3*4", [3, 4, 6], 8) == 1.0
    assert countdown.score("4/3*6", [3, 4, 6], 8) == 1.0  # exact fractions, no float round-off
    assert countdown.score("5/(2-2)", [2, 2, 5], 1) == 0.3  # right numbers, undefined value
    got = countdown.countdown_reward([None, None], [_as_chat("3*5+7"), "3+5"], numbers=[nums, nums], target=[22, 22])
    assert got == [1.0, 0.1]


def test_countdown_evaluator_is_not_eval():
    ev = countdown.evaluate_expression
    assert ev("(1+2)*3") == 9
    assert ev("7/2") == pytest.approx(3.5)
    for unsafe in ("True+1", "1.5+1", "x+1", "[1][0]", "1 if 1 else 2", "1/0", "1" * 201):
        assert ev(unsafe) is None, unsafe


# ---------------------------------------------------------------- sudoku


def _is_valid_solution(grid: list[int]) -> bool:
    rows = [grid[r * 4:(r + 1) * 4] for r in range(4)]
    cols = [grid[c::4] for c in range(4)]
    boxes = [[grid[(br + a) * 4 + bc + b] for a in range(2) for b in range(2)] for br in (0, 2) for bc in (0, 2)]
    return all(sorted(unit) == [1, 2, 3, 4] for unit in rows + cols + boxes)


def test_sudoku_solver_counts_known_cases():
    assert sudoku.count_solutions([0] * 16, limit=10_000) == 288  # number of 4x4 sudoku grids
    solved = sudoku.parse_grid("1234/3412/2143/4321")
    assert sudoku.count_solutions(solved) == 1
    clash = list(solved)
    clash[1] = 1  # two 1s in the first row
    assert sudoku.count_solutions(clash) == 0
    with pytest.raises(ValueError, match="16 cells"):
        sudoku.count_solutions([0] * 15)


@pytest.mark.parametrize("holes", [1, 6, 10])
def test_sudoku_puzzles_are_unique_and_consistent(holes):
    ds = sudoku.make_dataset(40, seed=5, holes=holes)
    assert ds.to_list() == sudoku.make_dataset(40, seed=5, holes=holes).to_list()
    for row in ds.to_list():
        puzzle, solution = sudoku.parse_grid(row["puzzle"]), sudoku.parse_grid(row["solution"])
        assert puzzle.count(0) == holes
        assert _is_valid_solution(solution)
        assert all(p in (0, s) for p, s in zip(puzzle, solution))
        assert sudoku.count_solutions(puzzle) == 1
        assert row["prompt"] == [{"role": "user", "content": row["puzzle"]}]
        assert sudoku.format_grid(solution) == row["solution"]


def test_sudoku_bad_holes():
    with pytest.raises(ValueError, match="holes"):
        sudoku.make_dataset(1, holes=13)


def test_sudoku_reward_is_fraction_of_empty_cells_filled_right():
    puzzle, solution = "4..2/1234/.1../342.", "4312/1234/2143/3421"  # 6 empty cells
    assert sudoku.score(solution, puzzle, solution) == 1.0
    assert sudoku.score("4312\n1234\n2143\n3421", puzzle, solution) == 1.0  # separators are free
    assert sudoku.score("4312/1234/1111/3421", puzzle, solution) == pytest.approx(3 / 6)  # row 3's three blanks wrong
    assert sudoku.score("4312/1234", puzzle, solution) == pytest.approx(2 / 6)  # truncated
    assert sudoku.score(puzzle, puzzle, solution) == 0.0  # copied the puzzle
    assert sudoku.score("no idea", puzzle, solution) == 0.0
    got = sudoku.sudoku_reward([None], [_as_chat(solution)], puzzle=[puzzle], solution=[solution])
    assert got == [1.0]


# ---------------------------------------------------------------- gsm8k (local files only)

_ROWS = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
     "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn total 48+24 = <<48+24=72>>72.\n#### 72"},
    {"question": "A car costs $1,000 and a bike $234. Total?", "answer": "1000+234=<<1000+234=1234>>1234\n#### 1,234"},
    {"question": "Half of 5?", "answer": "5/2 = 2.5\n#### 2.5"},
]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _write_jsonl(path, rows=_ROWS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_loads_local_jsonl(tmp_path):
    ds = load_gsm8k(path_or_name=str(_write_jsonl(tmp_path / "train.jsonl")))
    assert ds.column_names == ["prompt", "answer", "solution"]
    assert ds["answer"] == ["72", "1234", "2.5"]
    assert ds[0]["prompt"] == [{"role": "user", "content": _ROWS[0]["question"] + "\n" + gsm8k.DEFAULT_INSTRUCTION}]
    assert gsm8k.reference_answer(ds[0]) == "In May she sold 48/2 = 24 clips.\nIn total 48+24 = 72.\n#### 72"
    bare = load_gsm8k(path_or_name=str(tmp_path / "train.jsonl"), instruction=None)
    assert bare[1]["prompt"][0]["content"] == _ROWS[1]["question"]


def test_gsm8k_loads_parquet_data_files_and_directories(tmp_path):
    from datasets import Dataset

    Dataset.from_list(_ROWS).to_parquet(str(tmp_path / "test.parquet"))
    ds = load_gsm8k(split="test", data_files=str(tmp_path / "test.parquet"))
    assert ds["answer"] == ["72", "1234", "2.5"]
    folder = tmp_path / "gsm8k_local"
    folder.mkdir()
    _write_jsonl(folder / "train.jsonl")
    assert load_gsm8k(split="train", path_or_name=str(folder))["answer"] == ["72", "1234", "2.5"]
    sub = load_gsm8k(path_or_name=str(folder / "train.jsonl"), n=2, seed=1)
    again = load_gsm8k(path_or_name=str(folder / "train.jsonl"), n=2, seed=1)
    assert len(sub) == 2 and sub.to_list() == again.to_list()


def test_gsm8k_bad_inputs(tmp_path):
    _write_jsonl(tmp_path / "bad.jsonl", [{"question": "q", "solution": "#### 1"}])
    with pytest.raises(ValueError, match="'question' and 'answer'"):
        load_gsm8k(path_or_name=str(tmp_path / "bad.jsonl"))
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ValueError, match="must end in one of"):
        load_gsm8k(path_or_name=str(tmp_path / "x.txt"))
    with pytest.raises(ValueError, match="####"):
        gsm8k.parse_reference("the answer is 3")


def test_gsm8k_reward_reads_the_final_answer():
    cases = {
        "48/2 = 24, so 48+24 = 72.\n#### 72": 1.0,
        "So the total is \\boxed{72}.": 1.0,
        "24 in May, 72 in total.": 1.0,  # last number
        "#### 72\nbecause 48 + 24": 1.0,  # '####' beats the last number
        "The answer is 72.0": 1.0,
        "#### 73": 0.0,
        "24 in May, 72 in total, so 96.": 0.0,
        "no number here": 0.0,
        "": 0.0,
    }
    for text, want in cases.items():
        assert gsm8k.score(text, "72") == want, text
    assert gsm8k.score("It costs $1,234.", "1234") == 1.0
    assert gsm8k.score("#### 2.50", "2.5") == 1.0
    got = gsm8k.gsm8k_reward([None, None], [_as_chat("#### 72"), "71"], answer=["72", "72"])
    assert got == [1.0, 0.0]


def test_every_task_rewards_its_reference_answer_fully():
    for name in ("arithmetic", "countdown", "sudoku", "reverse", "chain"):
        task = get_task(name)
        ds = task.make_dataset(20, seed=2)
        columns = {k: ds[k] for k in ds.column_names if k != "prompt"}
        refs = [_as_chat(task.reference_answer(row)) for row in ds]
        assert task.reward_fn(ds["prompt"], refs, **columns) == [1.0] * 20, name
        assert max(len(task.reference_answer(row)) for row in ds) < task.max_completion_length, name


def test_generators_do_not_touch_global_random_state():
    import random

    random.seed(0)
    expected = random.random()
    random.seed(0)
    for name in ("arithmetic", "countdown", "sudoku", "reverse", "chain"):
        get_task(name).make_dataset(5, seed=1)
    assert random.random() == expected
