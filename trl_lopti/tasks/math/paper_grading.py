r"""The paper's math grader: the answer rules of the authors' reward (DeepScaleR's `RewardMathFn`, in verl).

Written here from the rules of their `verl/utils/reward_score/rewards/math_reward.py` and
`math_utils/utils.py` (no code of theirs is copied); `tests/test_tasks_math_paper.py` checks it against their
grader's own output on a table of adversarial answers. The rules, in order:

1. **Graded text**: the text between the first and the second `</think>` (all of it without `</think>`).
2. **Answer**: only when that text contains `\boxed`: the last `\boxed` is located, braces are counted from
   it (escaped braces too) and the answer is what lies between `\boxed{` and the `}` that brings the count
   back to zero. No `\boxed`, braces that never balance, or a last box that is not `\boxed{` (`\boxed 7`,
   `\boxedx{7}`): reward 0. `\fbox` never counts.
3. **Correct** when, for any reference answer, either the two strings are equal after the MATH ("mathd")
   string normaliser ([`mathd_normalize`]), or the "sympy" check holds ([`sympy_equal`]): equal after a
   second normaliser, or split into the same number of tuple/interval parts with the same brackets, each part
   equal by these rules: two plain fractions `a/b` must be the same string (unreduced fractions do not
   match), an integer matches only an integer, anything else is compared by
   `sympy.simplify(reference - answer) == 0` (only for expressions with at most two distinct letters and no
   `^{`, `^(` or multi-digit exponent).

Requires `sympy` and `pylatexenc` (the `math` extra).
"""

import contextlib
import re
from collections.abc import Callable


THINK_END = "</think>"
_BOX = "\\boxed"
_BOX_OPEN = "\\boxed{"


def graded_text(response: str) -> str:
    """The part of a response the authors grade: between the first and second `</think>`, or all of it."""
    return response.split(THINK_END)[1] if THINK_END in response else response


def last_box_content(text: str) -> str | None:
    r"""The answer as the authors extract it: the content of the last `\boxed{...}`, unstripped.

    Braces are counted from the last `\boxed` (escaped ones included); the box ends at the first `}` that
    brings the count back to zero. `None` when `text` holds no `\boxed`, when the count never returns to
    zero, or when the last `\boxed` is not directly followed by `{`."""
    start = text.rfind(_BOX)
    if start < 0:
        return None
    depth = 0
    for position in range(start, len(text)):
        character = text[position]
        if character == "{":
            depth += 1
        elif character == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(_BOX_OPEN) : position] if text.startswith(_BOX_OPEN, start) else None
    return None


_WHOLE_TEXT = re.compile(r"^\\text\{(?P<inner>.+?)\}$")
_MATHD_DELETIONS = ("\\!",)
_MATHD_REPLACEMENTS = (
    ("\\\\", "\\"),
    ("tfrac", "frac"),
    ("dfrac", "frac"),
    ("\\left", ""),
    ("\\right", ""),
    ("^{\\circ}", ""),
    ("^\\circ", ""),
    ("\\$", ""),
)


class _Unnormalisable(Exception):
    """The MATH normaliser gives up on this string (it then compares the raw, stripped string)."""


def _drop_unit_suffix(text: str) -> str:
    """`5 \\text{ cm}` -> `5 `; more than one `\\text{ ` gives up."""
    parts = text.split("\\text{ ")
    if len(parts) > 2:
        raise _Unnormalisable
    return parts[0]


def _brace_sqrt_arguments(text: str) -> str:
    r"""`\sqrt3` -> `\sqrt{3}` (one character); a `\sqrt` at the very end gives up."""
    head, *tails = text.split("\\sqrt")
    rebuilt = [head]
    for tail in tails:
        if not tail:
            raise _Unnormalisable
        rebuilt.append("\\sqrt" + (tail if tail[0] == "{" else "{" + tail[0] + "}" + tail[1:]))
    return "".join(rebuilt)


def _brace_frac_arguments(text: str) -> str:
    r"""`\frac12` -> `\frac{1}{2}`, `\frac1{7}` -> `\frac{1}{7}`; a `\frac` followed by one character or less
    is left as the whole string was (nothing after a `\frac` gives up)."""
    head, *tails = text.split("\\frac")
    rebuilt = [head]
    for tail in tails:
        if not tail:
            raise _Unnormalisable
        if tail[0] == "{":
            rebuilt.append("\\frac" + tail)
        elif len(tail) < 2:
            return text
        elif tail[1] == "{":
            rebuilt.append("\\frac{" + tail[0] + "}" + tail[1:])
        else:
            rebuilt.append("\\frac{" + tail[0] + "}{" + tail[1] + "}" + tail[2:])
    return "".join(rebuilt)


def _slash_to_frac(text: str) -> str:
    r"""`3/4` -> `\frac{3}{4}` when both sides are integers written plainly."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        numerator = int(parts[0])
        denominator = int(parts[1])
    except ValueError:
        return text
    return f"\\frac{{{numerator}}}{{{denominator}}}" if text == f"{numerator}/{denominator}" else text


def _mathd_clean(text: str) -> str:
    text = text.replace("\n", "")
    for deleted in _MATHD_DELETIONS:
        text = text.replace(deleted, "")
    for old, new in _MATHD_REPLACEMENTS:
        text = text.replace(old, new)
    text = _drop_unit_suffix(text) if "\\text{ " in text else text
    text = text.replace("\\%", "")
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text.startswith("."):
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # `x = 5` -> `5`
        text = sides[1]
    if "\\sqrt" in text:
        text = _brace_sqrt_arguments(text)
    text = _brace_frac_arguments(text.replace(" ", ""))
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _slash_to_frac(text)


def mathd_normalize(answer: str) -> str:
    r"""The MATH dataset's answer normaliser, as the authors apply it to an answer or a reference.

    An enclosing `\text{...}` is unwrapped, then line breaks, `\!`, `\left`, `\right`, degree signs, `\$`,
    `\%` and spaces are removed, a trailing unit after `\text{ ` is dropped, `\dfrac`/`\tfrac` become
    `\frac`, `x = ` (one or two characters before a single `=`) is dropped, `\frac12` and `\sqrt3` get
    braces, `0.5` and integer `a/b` become `\frac{...}{...}`. Where the rules give up (two `\text{ `, a bare
    `\sqrt` or `\frac` at the end) the stripped string is returned."""
    answer = answer.strip()
    whole_text = _WHOLE_TEXT.search(answer)
    if whole_text is not None:
        answer = whole_text.group("inner").strip()
    try:
        return _mathd_clean(answer)
    except _Unnormalisable:
        return answer


_UNIT_WORDS = (
    "degree",
    "cm",
    "centimeter",
    "meter",
    "mile",
    "second",
    "minute",
    "hour",
    "day",
    "week",
    "month",
    "year",
    "foot",
    "feet",
    "inch",
    "yard",
)
_UNIT_PATTERNS = tuple(re.compile(word + r"(es)?(s)? *(\^[0-9]+)?") for word in _UNIT_WORDS)
_SCALE_WORDS = (("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12"))
_UNICODE_TO_SYMPY = (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*"))
_THOUSANDS_COMMA = re.compile(r"(\d),(\d\d\d)($|\D)")
_BRACKETS = "()[]"
_PLAIN_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
_MAX_LETTERS = 2
_UNSAFE_POWERS = ("^{", "^(")
_UNSAFE_POWER_PATTERNS = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))


def _drop_thousands_commas(text: str) -> str:
    """`1,000,000` -> `1000000`, tuple commas kept (`1,2`)."""
    while True:
        shorter = _THOUSANDS_COMMA.sub(r"\1\2\3", text)
        if shorter == text:
            return text
        text = shorter


def _float_or_none(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _is_whole(value: float) -> bool:
    """Within 1e-7 of an integer (never for inf or nan)."""
    try:
        return abs(value - round(value)) <= 1e-7
    except (OverflowError, ValueError):
        return False


def _reads_as_integer(text: str) -> bool:
    value = _float_or_none(_drop_thousands_commas(text))
    return value is not None and _is_whole(value)


def _latex_to_plain(text: str) -> str:
    """LaTeX as plain text (pylatexenc), in the spellings sympy reads (`√` as `sqrt`, `π` as `pi`, ...)."""
    from pylatexenc import latex2text

    text = text.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    text = latex2text.LatexNodes2Text().latex_to_text(text)
    for symbol, spelling in _UNICODE_TO_SYMPY:
        text = text.replace(symbol, spelling)
    return text.strip()


def sympy_normalize(answer: str) -> str:
    r"""The second normaliser of the authors' grader (before its sympy check), of an answer or a reference.

    In order: an enclosing `\text{...}` is unwrapped; `$`, `%` and unit words (degree, cm, meter, mile,
    second, ..., yard, with plural and power) are removed; "million", "billion", "trillion" become powers of
    ten; " or " and " and " become commas; one pair of enclosing braces is dropped; a number within 1e-7 of
    an integer becomes that integer; LaTeX is rendered to text with pylatexenc; spaces and braces are
    removed; the text is lower-cased; an integer loses its thousands commas."""
    whole_text = _WHOLE_TEXT.search(answer)
    if whole_text is not None:
        answer = whole_text.group("inner")
    answer = answer.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    answer = answer.replace(" or ", " , ").replace(" and ", " , ")
    for word, power in _SCALE_WORDS:
        answer = answer.replace(word, power)
    for pattern in _UNIT_PATTERNS:
        answer = pattern.sub("", answer)
    answer = re.sub(r"\^ *\\circ", "", answer)
    if answer.startswith("{") and answer.endswith("}"):
        answer = answer[1:-1]
    answer = re.sub(r",\\! *", "", answer)
    value = _float_or_none(answer)
    if value is not None and _is_whole(value):
        answer = str(round(value))
    if "\\" in answer:
        # Unreadable LaTeX stays as it is, as in the authors' grader.
        with contextlib.suppress(Exception):
            answer = _latex_to_plain(answer)
    answer = re.sub("- *", "-", answer)
    answer = re.sub("([0-9]) +([0-9])", r"\1+\2", answer)  # a mixed number `7 3/4` -> `7+3/4`
    answer = answer.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _reads_as_integer(answer):
        answer = str(int(float(answer.replace(",", ""))))
    return answer


def _tuple_parts(text: str) -> list[str]:
    """The comma-separated parts of `(a, b)` / `[a, b)` (one bracket pair, none inside), else `[text]`."""
    text = _drop_thousands_commas(text)
    if not text:
        return []
    inner = text[1:-1]
    if len(text) > 2 and text[0] in _BRACKETS and text[-1] in _BRACKETS and not any(b in inner for b in _BRACKETS):
        return [part.strip() for part in inner.split(",")]
    return [text]


def _safe_for_sympy(expression: str) -> bool:
    letters = {character for character in expression.replace("sqrt", "").replace("frac", "") if character.isalpha()}
    if len(letters) > _MAX_LETTERS or any(power in expression for power in _UNSAFE_POWERS):
        return False
    return not any(pattern.search(expression) for pattern in _UNSAFE_POWER_PATTERNS)


def _sympy_difference_is_zero(reference: str, answer: str) -> bool:
    from sympy import simplify
    from sympy.parsing.sympy_parser import implicit_multiplication_application, parse_expr, standard_transformations

    difference = f"({reference})-({answer})"
    if not _safe_for_sympy(difference):
        return False
    try:
        transformations = standard_transformations + (implicit_multiplication_application,)
        parsed = parse_expr(difference.replace("^", "**"), transformations=transformations)
        return bool(simplify(parsed) == 0)
    except Exception:  # noqa: BLE001 - whatever sympy cannot read or compare is not equal
        return False


def _parts_equal(reference: str, answer: str) -> bool:
    if _PLAIN_FRACTION.search(reference) and _PLAIN_FRACTION.search(answer):
        return reference == answer  # unreduced fractions must not match
    if _reads_as_integer(reference) != _reads_as_integer(answer):
        return False  # an integer matches only an integer
    return _sympy_difference_is_zero(reference, answer)


def sympy_equal(answer: str, reference: str) -> bool:
    """The authors' `grade_answer_sympy` of an extracted answer against one reference: equal after
    [`sympy_normalize`], or the same tuple/interval brackets and, part by part, equal (see the module)."""
    reference = sympy_normalize(reference)
    answer = sympy_normalize(answer)
    if reference == answer:
        return True
    if not answer:
        return False
    reference_parts = _tuple_parts(reference)
    answer_parts = _tuple_parts(answer)
    if len(reference_parts) > 1 and (reference[0] != answer[0] or reference[-1] != answer[-1]):
        return False
    if len(reference_parts) != len(answer_parts):
        return False
    return all(_parts_equal(ref, ans) for ref, ans in zip(reference_parts, answer_parts, strict=True))


def reference_answers(solution: object) -> list[str]:
    r"""The reference answers of `solution` (a string, a number, a list of those, or ORZ's `{"value": ...}`).

    They are read as the authors read them: each value as `str(...)`, a list as alternatives (any one
    counts), the `\boxed{}` content of a reference that has one (dropped when it cannot be extracted)."""
    if isinstance(solution, dict) and "value" in solution:
        solution = solution["value"]
    alternatives = list(solution) if isinstance(solution, (list, tuple)) else [solution]
    references = []
    for alternative in map(str, alternatives):
        if _BOX in alternative:
            alternative = last_box_content(alternative)
            if alternative is None:
                continue
        references.append(alternative)
    return references


def paper_is_correct(
    response: str, solution: object, allow_sympy: Callable[[str], bool] = lambda answer: True
) -> bool:
    r"""Whether a response earns the authors' math reward (1) rather than 0 against `solution` (see
    [`reference_answers`]). `allow_sympy` is called with the answer before any sympy work; `False` skips the
    sympy check (string rules only)."""
    answer = last_box_content(graded_text(response))
    if answer is None:
        return False
    use_sympy = allow_sympy(answer)
    return any(
        mathd_normalize(answer) == mathd_normalize(reference) or (use_sympy and sympy_equal(answer, reference))
        for reference in reference_answers(solution)
    )
