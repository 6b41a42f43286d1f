"""jetrl_trainer.tasks.chain: seeded sums, completion lengths and budgets, and every reward rule."""

from __future__ import annotations

import pytest

from jetrl_trainer.tasks import chain, get_task

TERMS = [482, 517, 905]
REFERENCE = "482+517=999\n999+905=1904\n=1904"  # two step lines, then the sum


def _as_chat(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_chain_is_seeded_and_follows_its_knobs():
    knobs = dict(min_terms=3, max_terms=6, digits=2)
    a = chain.make_dataset(60, seed=3, **knobs)
    assert a.to_list() == chain.make_dataset(60, seed=3, **knobs).to_list()
    assert a.to_list() != chain.make_dataset(60, seed=4, **knobs).to_list()
    counts = set()
    for row in a.to_list():
        terms = row["terms"]
        counts.add(len(terms))
        assert all(10 <= t <= 99 for t in terms)  # exactly `digits` digits, no leading zero
        assert row["answer"] == sum(terms)
        assert row["prompt"] == [{"role": "user", "content": "sum " + "+".join(map(str, terms)) + "="}]
        lines = chain.reference_answer(row).split("\n")
        assert len(lines) == len(terms) and lines[-1] == f"={sum(terms)}"
    assert counts == {3, 4, 5, 6}
    assert get_task("chain") is chain.TASK


def test_chain_step_lines_carry_the_running_total():
    assert chain.step_lines(TERMS) == REFERENCE.split("\n")
    assert chain.step_lines([5, 7]) == ["5+7=12", "=12"]


def test_chain_instruct_prompt_states_the_format():
    row = chain.make_dataset(1, seed=0, prompt_style="instruct")[0]
    content = row["prompt"][0]["content"]
    assert content.startswith("Add these numbers from left to right.")
    assert content.endswith("+".join(map(str, row["terms"])))
    assert chain.reference_answer(row) == "\n".join(chain.step_lines(row["terms"]))  # same answer either way


def test_chain_default_completions_average_at_least_200_characters():
    # The point of the task (issue 39): long completions at the default difficulty. One character is
    # one token for the tiny tokenizer.
    lengths = [len(chain.reference_answer(row)) for row in chain.make_dataset(400, seed=0)]
    assert sum(lengths) / len(lengths) >= 200


@pytest.mark.parametrize("knobs", [{}, dict(min_terms=3, max_terms=4, digits=2), dict(min_terms=2, max_terms=2,
                                   digits=1), dict(min_terms=20, max_terms=40, digits=5)])  # fmt: skip
def test_chain_budget_fits_every_reference(knobs):
    budget = chain.TASK.completion_budget(**knobs)
    longest = max(len(chain.reference_answer(row)) for row in chain.make_dataset(300, seed=1, **knobs))
    assert longest + 1 <= budget  # + the end-of-turn token
    worst = chain.reference_answer({"terms": [10 ** knobs.get("digits", 3) - 1] * knobs.get("max_terms", 18)})
    assert len(worst) + 1 <= budget  # also the longest possible one
    assert chain.TASK.completion_budget() == chain.TASK.max_completion_length


def test_chain_full_reward_for_the_reference():
    for text in (REFERENCE, f" {REFERENCE}\n", REFERENCE.replace("\n", " \r\n\n"), f"<answer>{REFERENCE}</answer>"):
        assert chain.score(text, TERMS) == 1.0, repr(text)


def test_chain_partial_credit_counts_leading_right_steps():
    cases = {
        "482+517=999\n999+905=1904\n=1905": 0.5 * 2 / 2,  # every step right, the final line wrong
        "482+517=999\n999+905=1904": 0.5 * 2 / 2,  # every step right, no final line
        "482+517=999\n999+905=1904\n1904+1=1905\n=1905": 0.5 * 2 / 2,  # an extra step
        "482+517=999\n999+905=1903\n=1903": 0.5 * 1 / 2,  # the second addition wrong
        "482+517=999\n999+950=1949\n=1949": 0.5 * 1 / 2,  # the next term copied wrong
        "482+517=999\n=1904": 0.5 * 1 / 2,  # stopped after one step, with the right sum
        "482+517=999": 0.5 * 1 / 2,  # stopped after one step
        "482+517=1000\n1000+905=1905\n=1905": 0.0,  # the first step wrong: nothing after it counts
        "482+905=1387\n=1387": 0.0,  # a term skipped
        "=1904": 0.0,  # the right sum with no scratchpad
    }
    for text, want in cases.items():
        assert chain.score(text, TERMS) == pytest.approx(want), repr(text)


def test_chain_malformed_outputs_earn_nothing():
    for text in (
        "",
        "   \n",
        "the sum is 1904",
        "482 + 517 = 999\n999 + 905 = 1904\n=1904",  # spaces inside a line
        "482+517=999\n999+9",  # cut off inside a line
        "482+517=999\n=999\n999+905=1904",  # an '=' line before the last
        "482+517=999\n999+905=1904\n1904",  # a bare number is not the final line
        "482+517=999\n999+905=-1904\n=1904",  # signs
        "٤٨٢+٥١٧=٩٩٩",  # non-ASCII digits
    ):
        assert chain.score(text, TERMS) == 0.0, repr(text)


def test_chain_reward_reads_the_terms_column():
    prompts = [[{"role": "user", "content": "sum 482+517+905="}]] * 2
    got = chain.chain_reward(prompts, [_as_chat(REFERENCE), "482+517=999"], terms=[TERMS, TERMS], answer=[1904] * 2)
    assert got == [1.0, 0.25]
    with pytest.raises(ValueError, match="got 1 completions but 2 answers"):
        chain.chain_reward(prompts, ["1"], terms=[TERMS, TERMS])
    with pytest.raises(ValueError, match="at least two terms"):
        chain.score("=5", [5])


@pytest.mark.parametrize("knobs, message", [
    (dict(min_terms=1), "2 <= min_terms <= max_terms"),
    (dict(min_terms=9, max_terms=8), "2 <= min_terms <= max_terms"),
    (dict(max_terms=8.5), "2 <= min_terms <= max_terms"),
    (dict(digits=0), "digits must be an int >= 1"),
    (dict(digits=True), "digits must be an int >= 1"),
    (dict(prompt_style="long"), "prompt_style must be"),
])  # fmt: skip
def test_chain_bad_knobs_are_refused(knobs, message):
    with pytest.raises(ValueError, match=message):
        chain.make_dataset(4, **knobs)
    with pytest.raises(ValueError, match=message):
        chain.TASK.completion_budget(**knobs)
