"""otb_train.tasks: the math-answer verifier, the synthetic problems and their rewards."""

import pytest

from otb_train.tasks import (
    CharTokenizer,
    copy_reward,
    extract_answer,
    math_reward,
    normalize_answer,
    synthetic_problem,
    synthetic_reward,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is \\boxed{42}.", "42"),
        ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # last box, nested braces
        ("\\boxed{7} and later 9", "7"),  # a box wins over a later number
        ("unbalanced \\boxed{3 and 12", "12"),  # no complete box: last number
        ("so 3 + 4 = 7", "7"),
        ("total: 1,234.50 dollars", "1,234.50"),
        ("it is -5", "-5"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "a, b",
    [
        ("1,000", "1000"),
        ("2.50", "2.5"),
        ("$7$", "7"),
        ("007", "7"),
        ("-0", "0"),
        ("+3", "3"),
        ("5.", "5"),
        (" 12 ", "12"),
        ("\\text{yes}", "yes"),
    ],
)
def test_normalize_answer_equivalences(a, b):
    assert normalize_answer(a) == normalize_answer(b)


def test_math_reward():
    assert math_reward("so the result is \\boxed{1,000}", "1000") == 1.0
    assert math_reward("3+4=7", "7") == 1.0
    assert math_reward("3+4=7", 7) == 1.0  # numeric answers from JSON
    assert math_reward("3+4=8", "7") == 0.0
    assert math_reward("seven", "7") == 0.0
    assert math_reward("2.5", "2.50") == 1.0


def test_copy_reward_grades_positions_and_halves_wrong_lengths():
    assert copy_reward("1234", "1234") == 1.0
    assert copy_reward("1204", "1234") == 0.75
    assert copy_reward("12", "1234") == pytest.approx(0.5 * 2 / 4)  # stopping early pays half
    assert copy_reward("123456", "1234") == pytest.approx(0.5 * 4 / 6)  # so does running on
    assert copy_reward("", "12") == 0.0
    assert synthetic_reward("copy", "1234", "1234", finished=False) == 0.0  # no EOS: no reward
    assert synthetic_reward("add", "13", "13", finished=True) == 1.0


def test_synthetic_problems_are_pure_functions_of_seed_and_index():
    assert synthetic_problem("copy", 3, 17) == synthetic_problem("copy", 3, 17)
    assert synthetic_problem("copy", 3, 17) != synthetic_problem("copy", 4, 17) or synthetic_problem(
        "copy", 3, 18
    ) != synthetic_problem("copy", 4, 18)
    for index in range(50):
        prompt, answer = synthetic_problem("copy", 0, index)
        assert len(prompt) == 5 and prompt.endswith("=") and prompt[:-1].rstrip() == answer and 1 <= len(answer) <= 4
        prompt, answer = synthetic_problem("add", 0, index)
        a, b = prompt[:-1].split("+")
        assert int(answer) == int(a) + int(b)
    prompt, answer = synthetic_problem("copy", 0, 0, copy_lengths=(63, 511))
    assert len(prompt) == 512 and 63 <= len(answer) <= 511
    with pytest.raises(ValueError, match="task"):
        synthetic_problem("nope", 0, 0)


def test_char_tokenizer_round_trip():
    tokenizer = CharTokenizer()
    ids = tokenizer.encode("12+3= ")
    assert min(ids) >= 2 and tokenizer.decode(ids + [tokenizer.eos_token_id, tokenizer.pad_token_id]) == "12+3= "
    with pytest.raises(ValueError, match="'x'"):
        tokenizer.encode("x")


def test_copy_exact_is_all_or_nothing_on_the_copy_prompts():
    assert synthetic_problem("copy_exact", 3, 7, copy_lengths=(64, 80)) == synthetic_problem(
        "copy", 3, 7, copy_lengths=(64, 80)
    )
    answer = synthetic_problem("copy_exact", 0, 0, copy_lengths=(64, 80)).answer
    assert 64 <= len(answer) <= 80
    assert synthetic_reward("copy_exact", answer, answer, finished=True) == 1.0
    assert synthetic_reward("copy_exact", answer, answer, finished=False) == 0.0
    wrong = answer[:-1] + str((int(answer[-1]) + 1) % 10)
    assert synthetic_reward("copy_exact", wrong, answer, finished=True) == 0.0
    assert synthetic_reward("copy_exact", answer + "1", answer, finished=True) == 0.0
