"""Knights & Knaves (K&K) logic puzzles and their reward, ready for TRL's `GRPOTrainer`.

On the puzzles' island every inhabitant is a knight (always tells the truth) or a knave (always lies). Each person
makes one statement about the others; the task is to say who is a knight and who is a knave. arXiv 2505.12929 trains
on these puzzles (3 to 7 people) with the prompt and the rule-based reward of Logic-RL, on the puzzles published as
`K-and-K/knights-and-knaves` on the Hugging Face Hub.

This module offers:

- [`generate_dataset`]: a seeded generator of puzzles with exactly one solution, in the published data's format.
- [`load_knights_knaves_dataset`]: the published puzzles from the Hub, mapped to the same columns.
- [`knights_knaves_reward`], and its two parts [`knights_knaves_format_reward`] and [`knights_knaves_answer_reward`]:
  TRL reward functions scoring a completion as the paper's code scores it.

Statements use the published machine notation, nested tuples whose first item is the operator:

    ('telling-truth', i)            person i is a knight
    ('lying', i)                    person i is a knave
    ('not', s)                      s is false
    ('and', s1, s2, ...)            all of s1, s2, ... are true
    ('or', s1, s2, ...)             at least one of s1, s2, ... is true
    ('->', s1, s2)                  if s1 then s2
    ('<=>', s1, s2)                 s1 if and only if s2

As in the published data, statements have nesting depth at most 2 (one operator applied to atoms), nobody says of
themself that they are a knave (that claim is a paradox), and the operands of one operator are distinct.

Scoring (Logic-RL's `compute_score`, used by the paper):

- format: `+1` if the response holds exactly one `<think>`, `</think>`, `<answer>` and `</answer>`, in that order;
  `-1` otherwise.
- answer: `+2` if every person's identity in the `<answer>` block is right; `-1.5` if it parses but is wrong; `-2` if
  it cannot be parsed (a person is missing, or the number of "knight"/"knave" words differs from the number of
  people) or if the format failed.

So a completion scores 3, -0.5, -1 or -3.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any


Statement = tuple  # ('telling-truth', 0), ('and', ('lying', 1), ('telling-truth', 2)), ...

KNIGHTS_KNAVES_HUB_ID = "K-and-K/knights-and-knaves"
"""Hub id of the published K&K puzzles: configs `"train"` and `"test"`, splits `"2ppl"` to `"8ppl"`."""

THINK_PREFILL = "<think>"
"""Text the prompt puts at the start of the assistant turn when `prefill_think=True`."""

SYSTEM_PROMPT = (
    "You are a helpful assistant. You first think through the reasoning process in your mind and then give the user "
    "the answer. The reasoning process and the answer are enclosed within <think> </think> and <answer> </answer> "
    "tags respectively, i.e., <think> reasoning process here </think><answer> answer here </answer>. The user asks "
    "you to solve a logic puzzle. After thinking, when you reach a conclusion, clearly state the identity of each "
    "character within <answer> </answer> tags, one person per line, e.g., <answer> (1) Zoey is a knight\n(2) ... "
    "</answer>."
)
"""System message of the K&K prompt: Logic-RL's instruction, asking for `<think>` reasoning and an `<answer>` list."""

FORMAT_REWARD = 1.0
ANSWER_CORRECT_REWARD = 2.0
ANSWER_WRONG_REWARD = -1.5
ANSWER_UNPARSABLE_REWARD = -2.0

OPERATORS = ("telling-truth", "lying", "not", "and", "or", "->", "<=>")
MIN_PEOPLE, MAX_PEOPLE = 2, 8

# Single-word names, none a case-insensitive duplicate of another, several sharing a prefix (Ella/Ellie, Max/Maxwell)
# so that answers must be matched on whole words.
NAMES = (
    "Emma", "Liam", "Olivia", "Noah", "Ava", "Ethan", "Sophia", "Mason", "Isabella", "William", "Mia", "James",
    "Charlotte", "Benjamin", "Amelia", "Lucas", "Harper", "Henry", "Evelyn", "Alexander", "Abigail", "Michael",
    "Emily", "Daniel", "Elizabeth", "Jacob", "Sofia", "Logan", "Avery", "Jackson", "Ella", "Ellie", "Sebastian",
    "Scarlett", "Jack", "Grace", "Aiden", "Chloe", "Owen", "Victoria", "Samuel", "Riley", "Matthew", "Aria",
    "Joseph", "Lily", "Luke", "Aurora", "David", "Zoey", "Oliver", "Penelope", "Max", "Maxwell", "Hannah", "Leo",
    "Leon", "Nora", "Ruby", "Theo",
)  # fmt: skip

# How a person's claim is introduced. `True` marks direct speech (the claim in quotes), `False` reported speech.
SPEECH_TEMPLATES: tuple[tuple[str, bool], ...] = (
    ("{name} said that {claim}.", False),
    ("{name} told you that {claim}.", False),
    ("{name} claimed that {claim}.", False),
    ("{name} insisted that {claim}.", False),
    ("{name} mentioned that {claim}.", False),
    ("{name} announced that {claim}.", False),
    ('{name} said, "{claim}."', True),
    ('{name} stated: "{claim}."', True),
    ('According to {name}, "{claim}."', True),
    ('"{claim}," said {name}.', True),
    ('{name} remarked, "{claim}."', True),
    ('In {name}\'s words: "{claim}."', True),
    ('"{claim}," {name} declared.', True),
    ('{name} was heard saying, "{claim}."', True),
    ('As {name} put it, "{claim}."', True),
    ('{name} asserted: "{claim}."', True),
    ('"{claim}," {name} added.', True),
    ('{name} commented, "{claim}."', True),
)

_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_SOLUTION_LINE = re.compile(r"^\s*(?:\(\d+\)\s*)?([A-Za-z][\w'-]*)\b.*?\b(knight|knave)\b", re.IGNORECASE)


# ---------------------------------------------------------------------------------------------------------------------
# Solving
# ---------------------------------------------------------------------------------------------------------------------
@cache
def _knight_mask(person: int, num_people: int) -> int:
    """Bit `a` is set iff `person` is a knight in assignment `a` (bit `i` of `a` set means person `i` is a knight)."""
    return sum(1 << assignment for assignment in range(1 << num_people) if assignment >> person & 1)


def _truth_table(statement: Statement, num_people: int) -> int:
    """Bit `a` of the result is set iff `statement` holds under assignment `a`."""
    all_assignments = (1 << (1 << num_people)) - 1
    operator = statement[0]
    if operator == "telling-truth":
        return _knight_mask(statement[1], num_people)
    if operator == "lying":
        return all_assignments & ~_knight_mask(statement[1], num_people)
    operands = [_truth_table(operand, num_people) for operand in statement[1:]]
    if operator == "not":
        return all_assignments & ~operands[0]
    if operator == "and":
        result = all_assignments
        for operand in operands:
            result &= operand
        return result
    if operator == "or":
        result = 0
        for operand in operands:
            result |= operand
        return result
    if operator == "->":
        return all_assignments & (~operands[0] | operands[1])
    if operator == "<=>":
        return all_assignments & ~(operands[0] ^ operands[1])
    raise ValueError(f"Unknown statement operator {operator!r} in {statement!r}")


def solve(statements: Sequence[Statement]) -> list[tuple[bool, ...]]:
    """
    Finds every assignment of knights and knaves consistent with the statements.

    Person `i` is consistent when their statement is true if and only if they are a knight.

    Args:
        statements (`Sequence[Statement]`):
            One statement per person, in the published tuple notation (person indices start at 0).

    Returns:
        `list[tuple[bool, ...]]`: The consistent assignments (`True` = knight), in a fixed order.
    """
    num_people = len(statements)
    consistent = (1 << (1 << num_people)) - 1
    for person, statement in enumerate(statements):
        is_knight = _knight_mask(person, num_people)
        consistent &= ~(is_knight ^ _truth_table(statement, num_people))
    return [
        tuple(bool(assignment >> person & 1) for person in range(num_people))
        for assignment in range(1 << num_people)
        if consistent >> assignment & 1
    ]


def parse_statements(statements: str | Sequence) -> tuple[Statement, ...]:
    """
    Reads statements from their `str` form (as stored in the `statements` column) or from nested lists (as JSON gives).

    Args:
        statements (`str` or `Sequence`):
            E.g. `"(('lying', 1), ('and', ('telling-truth', 0), ('telling-truth', 1)))"`.

    Returns:
        `tuple[Statement, ...]`: One nested tuple per person.
    """
    if isinstance(statements, str):
        statements = ast.literal_eval(statements)

    def to_tuple(node: Any) -> Any:
        return tuple(to_tuple(child) for child in node) if isinstance(node, (list, tuple)) else node

    return tuple(to_tuple(statement) for statement in statements)


# ---------------------------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------------------------
def _sample_atom(rng: random.Random, speaker: int, num_people: int) -> Statement:
    while True:
        atom = (rng.choice(("telling-truth", "lying")), rng.randrange(num_people))
        if atom != ("lying", speaker):  # "I am a knave" has no consistent speaker
            return atom


def _sample_distinct_atoms(rng: random.Random, speaker: int, num_people: int, count: int) -> tuple[Statement, ...]:
    atoms: list[Statement] = []
    while len(atoms) < count:
        atom = _sample_atom(rng, speaker, num_people)
        if atom not in atoms:
            atoms.append(atom)
    return tuple(atoms)


def sample_statement(rng: random.Random, speaker: int, num_people: int, max_depth: int = 2, max_width: int = 2):
    """
    Samples one person's statement with the published generator's distribution.

    At depth 2 the six kinds (atom, `not`, `and`, `or`, `->`, `<=>`) are equally likely; `and`/`or` take 2 to
    `max_width` distinct atoms, `->`/`<=>` two distinct atoms. At depth 1 only atoms are drawn.

    Args:
        rng (`random.Random`):
            Source of randomness.
        speaker (`int`):
            Index of the person making the statement.
        num_people (`int`):
            Number of people in the puzzle.
        max_depth (`int`, *optional*, defaults to `2`):
            2 (one operator over atoms, as in the published data) or 1 (atoms only; puzzles made of atoms alone never
            have a unique solution, since flipping everyone's role keeps them consistent).
        max_width (`int`, *optional*, defaults to `2`):
            Largest number of operands of `and`/`or`.

    Returns:
        `Statement`: The statement, in the published tuple notation.
    """
    if max_depth <= 1:
        return _sample_atom(rng, speaker, num_people)
    kind = rng.randrange(6)
    if kind == 0:
        return _sample_atom(rng, speaker, num_people)
    if kind == 1:
        return ("not", _sample_atom(rng, speaker, num_people))
    if kind in (2, 3):
        width = rng.randint(2, max_width)
        return (("and", "or")[kind - 2],) + _sample_distinct_atoms(rng, speaker, num_people, width)
    return (("->", "<=>")[kind - 4],) + _sample_distinct_atoms(rng, speaker, num_people, 2)


# ---------------------------------------------------------------------------------------------------------------------
# Natural language
# ---------------------------------------------------------------------------------------------------------------------
def _render_atom(atom: Statement, names: Sequence[str], negated: bool = False) -> str:
    if atom[0] not in ("telling-truth", "lying"):
        raise ValueError(f"Only atoms can be rendered here (nesting depth <= 2), got {atom!r}")
    role = "a knight" if atom[0] == "telling-truth" else "a knave"
    return f"{names[atom[1]]} is {'not ' if negated else ''}{role}"


def render_statement(statement: Statement, names: Sequence[str]) -> str:
    """
    Writes a statement in English, the way the published data writes it.

    `('telling-truth', i)` -> "N is a knight", `('lying', i)` -> "N is a knave", `('not', atom)` -> "N is not a
    knight/knave", `and`/`or` join their operands with " and "/" or ", `('->', a, b)` -> "If A then B" and
    `('<=>', a, b)` -> "A if and only if B".

    Args:
        statement (`Statement`):
            A statement of nesting depth at most 2.
        names (`Sequence[str]`):
            The people's names, by index.

    Returns:
        `str`: The claim, without final punctuation.
    """
    operator = statement[0]
    if operator == "not":
        return _render_atom(statement[1], names, negated=True)
    if operator in ("and", "or"):
        return f" {operator} ".join(_render_atom(operand, names) for operand in statement[1:])
    if operator == "->":
        return f"If {_render_atom(statement[1], names)} then {_render_atom(statement[2], names)}"
    if operator == "<=>":
        return f"{_render_atom(statement[1], names)} if and only if {_render_atom(statement[2], names)}"
    return _render_atom(statement, names)


def _join_names(names: Sequence[str]) -> str:
    if len(names) == 2:
        return f"{names[0]} and {names[1]}"
    return ", ".join(names[:-1]) + ", and " + names[-1]


def render_quiz(statements: Sequence[Statement], names: Sequence[str], rng: random.Random) -> str:
    """
    Writes the puzzle text: the island's rules, the inhabitants, each one's claim in a randomly chosen phrasing.

    Args:
        statements (`Sequence[Statement]`):
            One statement per person.
        names (`Sequence[str]`):
            The people's names, by index.
        rng (`random.Random`):
            Chooses each claim's phrasing from [`SPEECH_TEMPLATES`].

    Returns:
        `str`: The puzzle, ending with the question.
    """
    sentences = [
        "A very special island is inhabited only by knights and knaves. Knights always tell the truth, and knaves "
        f"always lie. You meet {len(names)} inhabitants: {_join_names(names)}."
    ]
    for speaker, statement in enumerate(statements):
        template, direct_speech = rng.choice(SPEECH_TEMPLATES)
        claim = render_statement(statement, names)
        if not direct_speech and claim.startswith("If "):
            claim = "if " + claim[3:]
        sentences.append(template.format(name=names[speaker], claim=claim))
    sentences.append("So who is a knight and who is a knave?")
    return " ".join(sentences)


def solution_to_text(names: Sequence[str], solution: Sequence[bool]) -> tuple[str, str]:
    """
    Writes a solution in the two published forms.

    Args:
        names (`Sequence[str]`):
            The people's names, by index.
        solution (`Sequence[bool]`):
            `True` for a knight, `False` for a knave.

    Returns:
        `tuple[str, str]`: `solution_text` ("A is a knight, B is a knave, and C is a knight.") and
        `solution_text_format` ("(1) A is a knight\\n(2) B is a knave\\n(3) C is a knight"), the answer format the
        prompt asks for.
    """
    clauses = [
        f"{name} is {'a knight' if is_knight else 'a knave'}" for name, is_knight in zip(names, solution, strict=True)
    ]
    solution_text = ", ".join(clauses[:-1]) + ", and " + clauses[-1] + "." if len(clauses) > 1 else clauses[0] + "."
    solution_text_format = "\n".join(f"({index}) {clause}" for index, clause in enumerate(clauses, start=1))
    return solution_text, solution_text_format


def make_prompt(quiz: str, system_prompt: str = SYSTEM_PROMPT, prefill_think: bool = False) -> list[dict[str, str]]:
    """
    Builds the conversational prompt of a puzzle.

    Args:
        quiz (`str`):
            The puzzle text.
        system_prompt (`str`, *optional*, defaults to [`SYSTEM_PROMPT`]):
            The system message.
        prefill_think (`bool`, *optional*, defaults to `False`):
            Whether to end the prompt with an assistant message holding `"<think>"` for the model to continue, as the
            paper prompts. TRL 1.16's GRPOTrainer renders conversational prompts with `add_generation_prompt=True`
            only (it would close that assistant turn and open a new one), so render such prompts to text first with
            [`render_prompts_as_text`] (the CLI does this). The `<think>` is then part of the prompt, not of the
            completion: score with `think_prefilled=True` (the `think_prefilled` column does this automatically).

    Returns:
        `list[dict[str, str]]`: The messages.
    """
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": quiz}]
    if prefill_think:
        messages.append({"role": "assistant", "content": THINK_PREFILL})
    return messages


def _example(
    quiz: str,
    names: Sequence[str],
    solution: Sequence[bool],
    statements: str,
    system_prompt: str,
    prefill_think: bool,
    solution_text_format: str | None = None,
    solution_text: str | None = None,
) -> dict[str, Any]:
    default_text, default_text_format = solution_to_text(names, solution)
    return {
        "prompt": make_prompt(quiz, system_prompt, prefill_think),
        "quiz": quiz,
        "names": list(names),
        "solution": [bool(is_knight) for is_knight in solution],
        "solution_text": solution_text if solution_text is not None else default_text,
        "solution_text_format": solution_text_format if solution_text_format is not None else default_text_format,
        "statements": statements,
        "num_people": len(names),
        "think_prefilled": prefill_think,
    }


def _validate_num_people(num_people: int) -> None:
    if isinstance(num_people, bool) or not isinstance(num_people, int):
        raise TypeError(f"num_people must be an int, got {num_people!r}")
    if not MIN_PEOPLE <= num_people <= MAX_PEOPLE:
        raise ValueError(f"num_people must lie in [{MIN_PEOPLE}, {MAX_PEOPLE}], got {num_people}")


def generate_puzzles(
    num_people: int | Sequence[int],
    num_samples: int,
    seed: int = 0,
    max_width: int = 2,
    max_attempts: int = 100_000,
    system_prompt: str = SYSTEM_PROMPT,
    prefill_think: bool = False,
) -> list[dict[str, Any]]:
    """
    Generates puzzles as a list of rows; [`generate_dataset`] wraps them in a `datasets.Dataset`.

    Args and returns: see [`generate_dataset`].
    """
    sizes = [num_people] if isinstance(num_people, int) else list(num_people)
    if not sizes:
        raise ValueError("num_people must be an int or a non-empty list of ints")
    for size in sizes:
        _validate_num_people(size)
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if not 2 <= max_width <= 2 * min(sizes) - 1:
        raise ValueError(f"max_width must lie in [2, 2 * num_people - 1], got {max_width}")

    rng = random.Random(seed)
    seen: set[tuple[Statement, ...]] = set()
    rows = []
    for index in range(num_samples):
        size = sizes[index % len(sizes)]
        for _ in range(max_attempts):
            statements = tuple(sample_statement(rng, speaker, size, 2, max_width) for speaker in range(size))
            if statements in seen:
                continue
            solutions = solve(statements)
            if len(solutions) == 1:
                break
        else:
            raise RuntimeError(
                f"No new puzzle with a unique solution for {size} people after {max_attempts} attempts; ask for fewer "
                f"samples (small puzzles are few: about 400 exist for 2 people)."
            )
        seen.add(statements)
        names = rng.sample(NAMES, size)
        quiz = render_quiz(statements, names, rng)
        rows.append(_example(quiz, names, solutions[0], str(statements), system_prompt, prefill_think))
    return rows


def generate_dataset(
    num_people: int | Sequence[int],
    num_samples: int,
    seed: int = 0,
    max_width: int = 2,
    max_attempts: int = 100_000,
    system_prompt: str = SYSTEM_PROMPT,
    prefill_think: bool = False,
):
    """
    Generates Knights & Knaves puzzles with exactly one solution, as a TRL-ready dataset.

    Each puzzle draws one statement per person (see [`sample_statement`]; nesting depth 2 as in the published data)
    and is kept only if the solver finds exactly
    one consistent assignment and the same statements were not drawn before. Names come from [`NAMES`], claims are
    phrased with [`SPEECH_TEMPLATES`]. The same arguments always give the same dataset.

    Args:
        num_people (`int` or `Sequence[int]`):
            People per puzzle, 2 to 8. A list gives a mixture: puzzle `k` has `num_people[k % len(num_people)]`
            people.
        num_samples (`int`):
            Number of puzzles.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the generator.
        max_width (`int`, *optional*, defaults to `2`):
            Largest number of operands of `and`/`or` (the published data uses 2).
        max_attempts (`int`, *optional*, defaults to `100000`):
            Draws per puzzle before giving up with a `RuntimeError`.
        system_prompt (`str`, *optional*, defaults to [`SYSTEM_PROMPT`]):
            System message of each prompt.
        prefill_think (`bool`, *optional*, defaults to `False`):
            End each prompt with an assistant message `"<think>"` that the model continues, as the paper does. The
            `think_prefilled` column records it, and the K&K reward functions read that column to count the
            pre-filled `<think>` as part of the response.

    Returns:
        `datasets.Dataset`: Columns `prompt` (system + user [+ assistant `"<think>"`] messages), `quiz` (the puzzle
        text), `names`, `solution` (list of bools, `True` = knight), `solution_text`, `solution_text_format` (the
        ground truth in the answer format, `"(1) Name is a knight\\n(2) ..."`), `statements` (the `str` of the
        tuple notation), `num_people` and `think_prefilled`.
    """
    from datasets import Dataset

    rows = generate_puzzles(num_people, num_samples, seed, max_width, max_attempts, system_prompt, prefill_think)
    return Dataset.from_list(rows)


# ---------------------------------------------------------------------------------------------------------------------
# Published data
# ---------------------------------------------------------------------------------------------------------------------
def knights_knaves_record_to_example(
    record: dict[str, Any], system_prompt: str = SYSTEM_PROMPT, prefill_think: bool = False
) -> dict[str, Any]:
    """
    Maps one row of the published K&K data (`quiz`, `names`, `solution`, `solution_text`, `solution_text_format`,
    `statements`, ...) to the columns of [`generate_dataset`].

    Args:
        record (`dict[str, Any]`):
            A row of `K-and-K/knights-and-knaves`.
        system_prompt (`str`, *optional*, defaults to [`SYSTEM_PROMPT`]):
            System message of the prompt.
        prefill_think (`bool`, *optional*, defaults to `False`):
            See [`generate_dataset`].

    Returns:
        `dict[str, Any]`: The row with the columns of [`generate_dataset`].
    """
    names = [str(name) for name in record["names"]]
    statements = parse_statements(record["statements"])
    return _example(
        quiz=record["quiz"],
        names=names,
        solution=record["solution"],
        statements=str(statements),
        system_prompt=system_prompt,
        prefill_think=prefill_think,
        solution_text_format=record.get("solution_text_format"),
        solution_text=record.get("solution_text"),
    )


def prepare_knights_knaves_dataset(dataset, system_prompt: str = SYSTEM_PROMPT, prefill_think: bool = False):
    """
    Maps a dataset in the published K&K format to the columns of [`generate_dataset`], dropping the other columns.

    Args:
        dataset (`datasets.Dataset`):
            Rows with the published columns (from the Hub or from local JSON/parquet files).
        system_prompt (`str`, *optional*, defaults to [`SYSTEM_PROMPT`]):
            System message of each prompt.
        prefill_think (`bool`, *optional*, defaults to `False`):
            See [`generate_dataset`].

    Returns:
        `datasets.Dataset`: The mapped dataset.
    """
    return dataset.map(
        knights_knaves_record_to_example,
        fn_kwargs={"system_prompt": system_prompt, "prefill_think": prefill_think},
        remove_columns=dataset.column_names,
    )


def load_knights_knaves_dataset(
    num_people: int | Sequence[int] = 3,
    subset: str = "train",
    path: str = KNIGHTS_KNAVES_HUB_ID,
    system_prompt: str = SYSTEM_PROMPT,
    prefill_think: bool = False,
    **load_dataset_kwargs: Any,
):
    """
    Loads the published K&K puzzles from the Hugging Face Hub, with the columns of [`generate_dataset`].

    Needs network access to the Hub (or a warm `datasets` cache).

    Args:
        num_people (`int` or `Sequence[int]`, *optional*, defaults to `3`):
            Puzzle sizes to load, 2 to 8; several are concatenated in the given order.
        subset (`str`, *optional*, defaults to `"train"`):
            Config of the Hub dataset: `"train"` (1000 puzzles per size, 200 for 2 people) or `"test"` (100 per
            size).
        path (`str`, *optional*, defaults to `"K-and-K/knights-and-knaves"`):
            Hub id (or a local copy with the same layout).
        system_prompt (`str`, *optional*, defaults to [`SYSTEM_PROMPT`]):
            System message of each prompt.
        prefill_think (`bool`, *optional*, defaults to `False`):
            See [`generate_dataset`].
        **load_dataset_kwargs:
            Passed to `datasets.load_dataset` (e.g. `revision`, `cache_dir`).

    Returns:
        `datasets.Dataset`: The puzzles.
    """
    import datasets

    sizes = [num_people] if isinstance(num_people, int) else list(num_people)
    parts = []
    for size in sizes:
        _validate_num_people(size)
        raw = datasets.load_dataset(path, subset, split=f"{size}ppl", **load_dataset_kwargs)
        parts.append(prepare_knights_knaves_dataset(raw, system_prompt, prefill_think))
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


# ---------------------------------------------------------------------------------------------------------------------
# Reward
# ---------------------------------------------------------------------------------------------------------------------
def completion_to_text(completion: Any) -> str:
    """
    The text of a completion, whether TRL passes it as a string or as a list of messages.

    Args:
        completion (`str`, `list[dict]` or `dict`):
            A plain-text completion, or conversational messages whose `content` is a string or a list of parts.

    Returns:
        `str`: The text (messages joined with newlines); `""` for anything unreadable.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        content = completion.get("content", "")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            return "".join(part.get("text", "") for part in content if isinstance(part, dict))
        return ""
    if isinstance(completion, (list, tuple)):
        return "\n".join(completion_to_text(message) for message in completion)
    return ""


def has_valid_format(response: str) -> bool:
    """
    Whether the response holds exactly one `<think>`, `</think>`, `<answer>` and `</answer>`, in that order.

    Args:
        response (`str`):
            The model's response (with the pre-filled `<think>` when the prompt has one).

    Returns:
        `bool`: The format check of the paper's reward.
    """
    if any(response.count(tag) != 1 for tag in _TAGS):
        return False
    positions = [response.find(tag) for tag in _TAGS]
    return positions == sorted(positions)


def extract_answer(response: str) -> str | None:
    """
    The stripped content of the last `<answer> ... </answer>` block.

    Args:
        response (`str`):
            The model's response.

    Returns:
        `str` or `None`: The answer text, `None` when there is no block.
    """
    blocks = _ANSWER_BLOCK.findall(response)
    return blocks[-1].strip() if blocks else None


def parse_solution_text_format(solution_text_format: str) -> dict[str, str]:
    """
    Reads a ground truth such as `"(1) Zoey is a knight\\n(2) Oliver is a knave"`.

    Args:
        solution_text_format (`str`):
            One person per line, name first, role (`knight`/`knave`) last.

    Returns:
        `dict[str, str]`: Name -> `"knight"` or `"knave"`, in line order.
    """
    roles = {}
    for line in solution_text_format.splitlines():
        match = _SOLUTION_LINE.search(line)
        if match:
            roles[match.group(1)] = match.group(2).lower()
    return roles


def parse_answer_roles(answer: str, names: Sequence[str]) -> dict[str, str] | None:
    """
    Reads each person's role from an answer, as the paper's reward does.

    The answer is unparsable when the words "knight" and "knave" (case-insensitive, also inside longer words) occur
    in total a different number of times than there are people, or when some name is not followed by "is a knight" /
    "is a knave" (whole-word, case-insensitive; the first such phrase per name counts).

    Args:
        answer (`str`):
            Content of the `<answer>` block.
        names (`Sequence[str]`):
            The people to identify.

    Returns:
        `dict[str, str]` or `None`: Name -> `"knight"`/`"knave"`, or `None` when unparsable.
    """
    lowered = answer.lower()
    if lowered.count("knight") + lowered.count("knave") != len(names):
        return None
    roles = {}
    for name in names:
        match = re.search(rf"\b{re.escape(name)}\b\s+is\s+a\s+\b(knight|knave)\b", answer, re.IGNORECASE)
        if match is None:
            return None
        roles[name] = match.group(1).lower()
    return roles


def score_format(response: str) -> float:
    """
    Format part of the paper's reward.

    Args:
        response (`str`):
            The model's response, including a pre-filled `<think>`.

    Returns:
        `float`: `1.0` if [`has_valid_format`], else `-1.0`.
    """
    return FORMAT_REWARD if has_valid_format(response) else -FORMAT_REWARD


def score_answer(response: str, solution_text_format: str) -> float:
    """
    Answer part of the paper's reward.

    Args:
        response (`str`):
            The model's response, including a pre-filled `<think>`.
        solution_text_format (`str`):
            Ground truth, one person per line (see [`parse_solution_text_format`]).

    Returns:
        `float`: `2.0` all identities right, `-1.5` parsed but wrong, `-2.0` unparsable, empty or format failed.
    """
    if not has_valid_format(response):
        return ANSWER_UNPARSABLE_REWARD
    answer = extract_answer(response)
    if not answer:
        return ANSWER_UNPARSABLE_REWARD
    expected = parse_solution_text_format(solution_text_format)
    predicted = parse_answer_roles(answer, list(expected))
    if predicted is None:
        return ANSWER_UNPARSABLE_REWARD
    return ANSWER_CORRECT_REWARD if predicted == expected else ANSWER_WRONG_REWARD


def _per_completion(value: bool | Sequence[bool] | None, count: int) -> list[bool]:
    if value is None:
        return [False] * count
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"think_prefilled has {len(value)} values for {count} completions")
        return [bool(item) for item in value]
    return [bool(value)] * count


def _responses(completions: Sequence[Any], think_prefilled: bool | Sequence[bool] | None) -> list[str]:
    prefilled = _per_completion(think_prefilled, len(completions))
    return [
        (THINK_PREFILL if is_prefilled else "") + completion_to_text(completion)
        for completion, is_prefilled in zip(completions, prefilled, strict=True)
    ]


def knights_knaves_format_reward(
    completions: Sequence[Any], think_prefilled: bool | Sequence[bool] | None = False, **kwargs: Any
) -> list[float]:
    """
    TRL reward function: the format part of the paper's K&K reward (`+1` / `-1`).

    Use it with [`knights_knaves_answer_reward`] (`reward_funcs=[knights_knaves_format_reward,
    knights_knaves_answer_reward]`, default weights 1) to train on exactly [`knights_knaves_reward`] while TRL logs
    both parts (`rewards/knights_knaves_format_reward/mean`, `rewards/knights_knaves_answer_reward/mean`).

    Args:
        completions (`Sequence[str]` or `Sequence[list[dict]]`):
            Plain-text or conversational completions.
        think_prefilled (`bool` or `Sequence[bool]`, *optional*, defaults to `False`):
            Whether the prompt ends with a pre-filled `<think>` that the completion continues; it is then counted as
            the response's first tag. TRL passes the dataset's `think_prefilled` column here (one value per
            completion); set it yourself (e.g. `functools.partial`) for datasets without that column.
        **kwargs:
            Other dataset columns and trainer arguments, ignored.

    Returns:
        `list[float]`: One score per completion.
    """
    return [score_format(response) for response in _responses(completions, think_prefilled)]


def knights_knaves_answer_reward(
    completions: Sequence[Any],
    solution_text_format: Sequence[str],
    think_prefilled: bool | Sequence[bool] | None = False,
    **kwargs: Any,
) -> list[float]:
    """
    TRL reward function: the answer part of the paper's K&K reward (`+2` / `-1.5` / `-2`, and `-2` when the format
    fails).

    Args:
        completions (`Sequence[str]` or `Sequence[list[dict]]`):
            Plain-text or conversational completions.
        solution_text_format (`Sequence[str]`):
            Ground truth per completion (the dataset column), e.g. `"(1) Zoey is a knight\\n(2) Oliver is a knave"`.
        think_prefilled (`bool` or `Sequence[bool]`, *optional*, defaults to `False`):
            See [`knights_knaves_format_reward`].
        **kwargs:
            Other dataset columns and trainer arguments, ignored.

    Returns:
        `list[float]`: One score per completion.
    """
    responses = _responses(completions, think_prefilled)
    return [score_answer(response, truth) for response, truth in zip(responses, solution_text_format, strict=True)]


def knights_knaves_reward(
    completions: Sequence[Any],
    solution_text_format: Sequence[str],
    think_prefilled: bool | Sequence[bool] | None = False,
    log_metric: Callable[[str, float], None] | None = None,
    **kwargs: Any,
) -> list[float]:
    """
    TRL reward function: the paper's K&K reward, format plus answer (3, -0.5, -1 or -3 per completion).

    Equals `knights_knaves_format_reward + knights_knaves_answer_reward` exactly. Inside TRL's `GRPOTrainer` it also
    logs its parts through TRL's `log_metric` hook: `knights_knaves/format` and `knights_knaves/answer` (batch means)
    and `knights_knaves/accuracy` (share of completions with every identity right).

    Args:
        completions (`Sequence[str]` or `Sequence[list[dict]]`):
            Plain-text or conversational completions.
        solution_text_format (`Sequence[str]`):
            Ground truth per completion (the dataset column).
        think_prefilled (`bool` or `Sequence[bool]`, *optional*, defaults to `False`):
            Whether the prompt pre-fills `<think>` (then counted as part of the response). TRL passes the dataset's
            `think_prefilled` column, which [`generate_dataset`] and [`load_knights_knaves_dataset`] write; for other
            datasets set it with `functools.partial(knights_knaves_reward, think_prefilled=True)`.
        log_metric (`Callable[[str, float], None]`, *optional*):
            Passed by TRL; receives the sub-scores.
        **kwargs:
            Other dataset columns and trainer arguments, ignored.

    Returns:
        `list[float]`: One score per completion.
    """
    responses = _responses(completions, think_prefilled)
    format_scores = [score_format(response) for response in responses]
    answer_scores = [
        score_answer(response, truth) for response, truth in zip(responses, solution_text_format, strict=True)
    ]
    if callable(log_metric) and responses:
        count = len(responses)
        log_metric("knights_knaves/format", sum(format_scores) / count)
        log_metric("knights_knaves/answer", sum(answer_scores) / count)
        log_metric("knights_knaves/accuracy", sum(s == ANSWER_CORRECT_REWARD for s in answer_scores) / count)
    return [
        format_score + answer_score for format_score, answer_score in zip(format_scores, answer_scores, strict=True)
    ]


def render_prompts_as_text(dataset, tokenizer, prompt_column: str = "prompt"):
    """
    Renders conversational prompts to text with the model's chat template, continuing a final assistant message.

    TRL 1.16's `GRPOTrainer` applies the chat template with `add_generation_prompt=True` and never continues a final
    assistant message, so a prompt that pre-fills `"<think>"` (the paper's format, `prefill_think=True`) must be
    given to it as text: this opens the assistant turn and leaves `"<think>"` open for the model to continue.
    Prompts without a final assistant message get the usual generation prompt.

    Args:
        dataset (`datasets.Dataset`):
            A dataset with a conversational prompt column.
        tokenizer (`transformers.PreTrainedTokenizerBase`):
            The tokenizer of the model to train (its chat template is used).
        prompt_column (`str`, *optional*, defaults to `"prompt"`):
            The column to render.

    Returns:
        `datasets.Dataset`: The dataset with plain-text prompts.
    """

    def render(example: dict[str, Any]) -> dict[str, str]:
        messages = example[prompt_column]
        if isinstance(messages, str):
            return {prompt_column: messages}
        continues = messages[-1]["role"] == "assistant"
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=not continues, continue_final_message=continues
        )
        return {prompt_column: text}

    return dataset.map(render)
