"""`math_reward` (the paper's grading) against the authors' grader, case by case.

`AUTHORS_REWARD` holds adversarial completions and references with the reward the authors' grader gives them. The
expected values were obtained by running their grader (`verl/utils/reward_score/rewards/math_reward.py` and
`math_utils/utils.py` of zhyang2226/AR-Lopti at commit cbeb333, sympy 1.14.0, pylatexenc 2.11) in a scratch
environment outside this project, called as their `RewardManager` calls it: `rllm_reward_fn_math("deepscaler",
PROMPT + completion, reference)`, i.e. on the decoded prompt + response. None of their code is in this repository.
`math_reward` receives the completion alone, as TRL passes it.
"""

from __future__ import annotations

import pytest

from trl_lopti.tasks.math import math_reward, math_reward_lenient
from trl_lopti.tasks.math.paper_grading import last_box_content, mathd_normalize, sympy_normalize


def _boxed(answer: str) -> str:
    return "<think>work</think> The answer is \\boxed{" + answer + "}."


# (completion, reference, the authors' reward)
AUTHORS_REWARD = [
    (_boxed("\\frac{1}{2}"), "\\frac{1}{2}", 1),
    (_boxed("\\frac{2}{4}"), "\\frac{1}{2}", 0),
    (_boxed("2/4"), "\\frac{1}{2}", 0),
    (_boxed("1/2"), "\\frac{1}{2}", 1),
    (_boxed("\\dfrac{1}{2}"), "\\frac{1}{2}", 1),
    (_boxed("\\tfrac12"), "\\frac{1}{2}", 1),
    (_boxed("0.5"), "\\frac{1}{2}", 1),
    (_boxed("0.50"), "\\frac{1}{2}", 1),
    (_boxed(".5"), "\\frac{1}{2}", 1),
    (_boxed("\\frac{3}{4}"), "0.75", 1),
    (_boxed("6/8"), "3/4", 0),
    (_boxed("-\\frac{2}{3}"), "\\frac{-2}{3}", 1),
    (_boxed("\\frac{-2}{3}"), "-\\frac{2}{3}", 1),
    (_boxed("\\frac{10}{4}"), "\\frac{5}{2}", 0),
    (_boxed("2\\frac{1}{2}"), "\\frac{5}{2}", 1),
    (_boxed("2 1/2"), "\\frac{5}{2}", 1),
    (_boxed("5"), "5", 1),
    (_boxed("5.0"), "5", 1),
    (_boxed("5."), "5", 1),
    (_boxed("5.00001"), "5", 0),
    (_boxed("4.9999999999"), "5", 1),
    (_boxed("1500"), "1500", 1),
    (_boxed("1.5\\times10^3"), "1500", 0),
    (_boxed("1.5 \\times 10^{3}"), "1500", 0),
    (_boxed("1.5e3"), "1500", 1),
    (_boxed("1,500"), "1500", 1),
    (_boxed("1{,}500"), "1500", 1),
    (_boxed("1\\,500"), "1500", 0),
    (_boxed("1,000,000"), "1000000", 1),
    (_boxed("1 million"), "1000000", 0),
    (_boxed("−5"), "-5", 0),
    (_boxed("-5"), "-5", 1),
    (_boxed("- 5"), "-5", 1),
    (_boxed("0.333"), "\\frac{1}{3}", 0),
    (_boxed("50\\%"), "50", 1),
    (_boxed("50%"), "50", 1),
    (_boxed("50"), "50\\%", 1),
    (_boxed("5 \\text{ cm}"), "5", 1),
    (_boxed("5\\text{ cm}^2"), "5", 1),
    (_boxed("5 cm"), "5", 1),
    (_boxed("12 meters"), "12", 1),
    (_boxed("30^\\circ"), "30", 1),
    (_boxed("30^{\\circ}"), "30", 1),
    (_boxed("30 degrees"), "30", 1),
    (_boxed("\\$12.50"), "12.50", 1),
    (_boxed("\\$12.5"), "12.50", 1),
    (_boxed("\\text{12}"), "12", 1),
    (_boxed("\\text{(C)}"), "C", 1),
    (_boxed("C"), "\\text{(C)}", 1),
    (_boxed("\\textbf{(C)}"), "(C)", 1),
    (_boxed("\\text{yes}"), "Yes", 1),
    (_boxed("x = 5"), "5", 1),
    (_boxed("x=5"), "5", 1),
    (_boxed("ab = 5"), "5", 0),
    (_boxed("abc = 5"), "5", 0),
    (_boxed("3\\sqrt{2}"), "\\sqrt{18}", 1),
    (_boxed("3\\sqrt2"), "3\\sqrt{2}", 1),
    (_boxed("\\sqrt{18}"), "3\\sqrt{2}", 1),
    (_boxed("2\\pi"), "2\\pi", 1),
    (_boxed("\\pi \\cdot 2"), "2\\pi", 1),
    (_boxed("(x+1)^2"), "x^2+2x+1", 1),
    (_boxed("x^2+2x+1"), "(x+1)^2", 1),
    (_boxed("2^{10}"), "1024", 0),
    (_boxed("2^10"), "1024", 0),
    (_boxed("\\infty"), "\\infty", 1),
    (_boxed("\\{1, 2, 3\\}"), "\\{1, 2, 3\\}", 1),
    (_boxed("\\{3, 2, 1\\}"), "\\{1, 2, 3\\}", 0),
    (_boxed("1, 2, 3"), "1,2,3", 1),
    (_boxed("3, 2, 1"), "1, 2, 3", 0),
    (_boxed("3, 5"), "5, 3", 0),
    (_boxed("(1, 2)"), "(1,2)", 1),
    (_boxed("(2, 1)"), "(1, 2)", 0),
    (_boxed("(1, 2]"), "(1,2]", 1),
    (_boxed("[1, 2)"), "(1, 2)", 0),
    (_boxed("(0.5, 2)"), "(\\frac{1}{2}, 2)", 1),
    (_boxed("(-\\infty, 0) \\cup (1, \\infty)"), "(-\\infty,0)\\cup(1,\\infty)", 1),
    (_boxed("\\left( 3, \\frac{\\pi}{2} \\right)"), "(3, \\frac{\\pi}{2})", 1),
    (_boxed("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"), "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", 1),
    (_boxed("\\begin{pmatrix}1\\\\2\\end{pmatrix}"), "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", 1),
    (_boxed("3 \\text{ and } 5"), "3, 5", 1),
    ("<think>x</think> \\boxed{3} then \\boxed{5}", "5", 1),
    ("<think>x</think> \\boxed{5} then \\boxed{3}", "5", 0),
    ("<think>x</think> \\boxed{5} then \\boxed{3", "5", 0),
    ("<think>x</think> \\boxed{5 and more", "5", 0),
    ("<think>x</think> \\boxed 5", "5", 0),
    ("<think>x</think> \\boxed 5 $", "5", 0),
    ("<think>x</think> \\fbox{5}", "5", 0),
    ("<think>x</think> \\boxed{5} \\fbox{3}", "5", 1),
    ("<think>x</think> The answer is 5.", "5", 0),
    ("<think>x</think> $\\boxed{\\frac{1}{2}}$", "0.5", 1),
    ("<think>x</think> \\boxed{\\{1,2\\}}", "\\{1,2\\}", 1),
    ("<think>x</think> \\boxed{ 5 }", "5", 1),
    ("<think>x</think> \\boxed{\\boxed{5}}", "5", 1),
    ("<think>x</think> \\boxed{}", "5", 0),
    ("<think>x</think> \\boxedx{5}", "5", 0),
    ("<think>x</think> \\boxed{5}}", "5", 1),
    ("no thinking tag \\boxed{5}", "5", 1),
    ("\\boxed{5} </think> nothing after", "5", 0),
    ("<think>a</think> \\boxed{5} </think> \\boxed{3}", "5", 1),
    ("<think>a</think> \\boxed{3} </think> \\boxed{5}", "5", 0),
    ("<think>a \\boxed{5}</think> so the answer is five", "5", 0),
    ("<think>a</think>", "5", 0),
    ("", "5", 0),
    (_boxed("7"), "\\boxed{7}", 1),
    (_boxed("7"), 7, 1),
    (_boxed("7"), 7.0, 1),
    (_boxed("7.0"), 7.0, 1),
    (_boxed("7"), ["10", "7"], 1),
    (_boxed("9"), ["10", "7"], 0),
    (_boxed("6"), "5", 0),
    (_boxed("0.51"), "\\frac{1}{2}", 0),
    (_boxed("x^2"), "x^3", 0),
]


def test_the_table_is_adversarial():
    """The table covers both outcomes and the cases where the paper's and the lenient grader part ways."""
    rewards = [reward for _, _, reward in AUTHORS_REWARD]
    assert len(AUTHORS_REWARD) >= 60 and 0 < sum(rewards) < len(rewards)
    lenient = math_reward_lenient([c for c, _, _ in AUTHORS_REWARD], [r for _, r, _ in AUTHORS_REWARD])
    assert sum(ours != theirs for ours, theirs in zip(lenient, rewards, strict=True)) >= 20


def test_math_reward_equals_the_authors_reward_on_every_case():
    completions = [completion for completion, _, _ in AUTHORS_REWARD]
    references = [reference for _, reference, _ in AUTHORS_REWARD]
    ours = math_reward(completions, references)
    disagreements = [
        (completion, reference, theirs, mine)
        for (completion, reference, theirs), mine in zip(AUTHORS_REWARD, ours, strict=True)
        if mine != theirs
    ]
    assert not disagreements


@pytest.mark.parametrize(
    "text, content",
    [
        ("\\boxed{a{b}c} x", "a{b}c"),
        ("\\boxed{1} \\boxed{ 2 }", " 2 "),
        ("\\boxed{1} \\boxed{2", None),
        ("\\boxed 2", None),
        ("\\fbox{2}", None),
        ("no box", None),
    ],
)
def test_last_box_content(text, content):
    assert last_box_content(text) == content


def test_normalisers_on_known_forms():
    assert mathd_normalize("\\dfrac12") == mathd_normalize("\\frac{1}{2}") == mathd_normalize("1/2") == "\\frac{1}{2}"
    assert mathd_normalize("x = \\sqrt3") == "\\sqrt{3}"
    assert mathd_normalize(" 5 \\text{ cm} \\text{ m} ") == "5 \\text{ cm} \\text{ m}"  # two units: gives up
    assert sympy_normalize("1,000,000") == "1000000"
    assert sympy_normalize("12 meters") == "12"
    assert sympy_normalize("3 \\text{ and } 5") == "3,5"
