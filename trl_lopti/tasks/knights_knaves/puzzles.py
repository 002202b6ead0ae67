"""Knights & Knaves (K&K) puzzles: the solver, a seeded generator and the published data's English phrasing.

On the puzzles' island every inhabitant is a knight (always tells the truth) or a knave (always lies). Each
person makes one statement about the others; the task is to say who is a knight and who is a knave.

Statements use the published machine notation, nested tuples whose first item is the operator:
`('telling-truth', i)` (person i is a knight), `('lying', i)` (a knave), `('not', s)`,
`('and', s1, s2, ...)`, `('or', s1, s2, ...)`, `('->', s1, s2)` (if s1 then s2) and `('<=>', s1, s2)` (s1 if
and only if s2). As in the published data, statements have nesting depth at most 2 (one operator applied to
atoms), nobody says of themself that they are a knave (that claim is a paradox), and the operands of one
operator are distinct.

The rendering uses the published data's 51 names ([`NAMES`]) and 18 speech templates ([`SPEECH_TEMPLATES`]),
checked against the 5,000 puzzles of the authors' `data/kk/instruct/{3..7}ppl/{train,test}.parquet`: each of
their quizzes is these templates filled with [`render_statement`]. The generator draws its own puzzles
(Python's `random`, not the published generator's random stream), so it never reproduces a published puzzle
by design; to train on the paper's puzzles use `load_knights_knaves_dataset(source="paper")`.
"""

import ast
import random
from collections.abc import Sequence
from functools import cache, reduce
from typing import Any


Statement = tuple  # ('telling-truth', 0), ('and', ('lying', 1), ('telling-truth', 2)), ...

MIN_PEOPLE = 2
MAX_PEOPLE = 8

NAMES = (
    "Emma",
    "Liam",
    "Olivia",
    "Noah",
    "Ava",
    "Ethan",
    "Sophia",
    "Mason",
    "Isabella",
    "William",
    "Mia",
    "James",
    "Charlotte",
    "Benjamin",
    "Amelia",
    "Lucas",
    "Harper",
    "Henry",
    "Evelyn",
    "Alexander",
    "Abigail",
    "Michael",
    "Emily",
    "Daniel",
    "Elizabeth",
    "Jacob",
    "Sofia",
    "Logan",
    "Avery",
    "Jackson",
    "Ella",
    "Sebastian",
    "Scarlett",
    "Jack",
    "Grace",
    "Aiden",
    "Chloe",
    "Owen",
    "Victoria",
    "Samuel",
    "Riley",
    "Matthew",
    "Aria",
    "Joseph",
    "Lily",
    "Luke",
    "Aurora",
    "David",
    "Zoey",
    "Oliver",
    "Penelope",
)
"""The name pool of the published puzzles: all 51 occur in the authors' 5,000 puzzles, and no other does."""

SPEECH_TEMPLATES = (
    "{name} said that {claim}.",
    "{name} told you that {claim}.",
    '{name} said, "{claim}."',
    '{name} stated, "{claim}".',
    'According to {name}, "{claim}".',
    'In {name}\'s words: "{claim}".',
    '{name} remarked, "{claim}".',
    '"{claim}," {name} declared.',
    '{name} was heard saying, "{claim}".',
    "{name} expressed that {claim}.",
    '"{claim}" - {name}.',
    'As {name} put it, "{claim}".',
    '{name} asserted: "{claim}".',
    '"{claim}," {name} mentioned.',
    '{name} commented, "{claim}".',
    'In a statement by {name}: "{claim}".',
    '{name} noted, "{claim}".',
    '"{claim}," {name} claimed.',
)
"""How a person's claim is introduced, as in the published puzzles, punctuation included.

Only `said, "..."` puts the period inside the quotes; a claim "If A then B" keeps its capital also in
reported speech ("said that If ...")."""


@cache
def _knight_mask(person: int, num_people: int) -> int:
    """Bit `a` is set iff `person` is a knight in assignment `a`, i.e. iff bit `person` of `a` is set."""
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
        return reduce(lambda a, b: a & b, operands, all_assignments)
    if operator == "or":
        return reduce(lambda a, b: a | b, operands, 0)
    if operator == "->":
        return all_assignments & (~operands[0] | operands[1])
    if operator == "<=>":
        return all_assignments & ~(operands[0] ^ operands[1])
    raise ValueError(f"Unknown statement operator {operator!r} in {statement!r}")


def solve(statements: Sequence[Statement]) -> list[tuple[bool, ...]]:
    """Every assignment of knights (`True`) and knaves consistent with one statement per person.

    The assignments come in a fixed order; person indices start at 0. Person `i` is consistent when their
    statement is true if and only if they are a knight."""
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
    """One nested tuple per person, from the `str` form of the `statements` column (`"(('lying', 1), ('and',
    ('telling-truth', 0), ('telling-truth', 1)))"`) or from nested lists (as JSON gives)."""
    if isinstance(statements, str):
        statements = ast.literal_eval(statements)

    def to_tuple(node: Any) -> Any:
        return tuple(to_tuple(child) for child in node) if isinstance(node, (list, tuple)) else node

    return tuple(to_tuple(statement) for statement in statements)


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


def sample_statement(rng: random.Random, speaker: int, num_people: int, max_width: int = 2) -> Statement:
    """One statement of person `speaker`, with the published generator's distribution at nesting depth 2.

    The six kinds (atom, `not`, `and`, `or`, `->`, `<=>`) are equally likely; `and`/`or` take 2 to
    `max_width` distinct atoms, `->`/`<=>` two. Puzzles made of atoms alone never have a unique solution:
    flipping everyone's role keeps them consistent."""
    kind = rng.randrange(6)
    if kind == 0:
        return _sample_atom(rng, speaker, num_people)
    if kind == 1:
        return ("not", _sample_atom(rng, speaker, num_people))
    if kind in (2, 3):
        width = rng.randint(2, max_width)
        return (("and", "or")[kind - 2],) + _sample_distinct_atoms(rng, speaker, num_people, width)
    return (("->", "<=>")[kind - 4],) + _sample_distinct_atoms(rng, speaker, num_people, 2)


def _render_atom(atom: Statement, names: Sequence[str], negated: bool = False) -> str:
    if atom[0] not in ("telling-truth", "lying"):
        raise ValueError(f"Only atoms can be rendered here (nesting depth <= 2), got {atom!r}")
    role = "a knight" if atom[0] == "telling-truth" else "a knave"
    return f"{names[atom[1]]} is {'not ' if negated else ''}{role}"


def render_statement(statement: Statement, names: Sequence[str]) -> str:
    """
    A statement of nesting depth at most 2 in English as the published data writes it, without final period.

    `names` holds the people's names, by index. The renderings:

    - `('telling-truth', i)`: "N is a knight"; `('lying', i)`: "N is a knave".
    - `('not', atom)`: "N is not a knight" or "N is not a knave".
    - `and` and `or` join their operands with " and " or " or ".
    - `('->', a, b)`: "If A then B"; `('<=>', a, b)`: "A if and only if B".
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


def render_quiz(statements: Sequence[Statement], names: Sequence[str], rng: random.Random) -> str:
    """The puzzle text: the island's rules, the inhabitants, each one's claim in a phrasing of
    [`SPEECH_TEMPLATES`] that `rng` chooses, and the question."""
    listed = f"{names[0]} and {names[1]}" if len(names) == 2 else ", ".join(names[:-1]) + ", and " + names[-1]
    introduction = (
        "A very special island is inhabited only by knights and knaves. Knights always tell the truth, and knaves "
        f"always lie. You meet {len(names)} inhabitants: {listed}."
    )
    sentences = [introduction]
    for speaker, statement in enumerate(statements):
        template = rng.choice(SPEECH_TEMPLATES)
        sentences.append(template.format(name=names[speaker], claim=render_statement(statement, names)))
    sentences.append("So who is a knight and who is a knave?")
    return " ".join(sentences)


def solution_to_text(names: Sequence[str], solution: Sequence[bool]) -> tuple[str, str]:
    """
    A solution (`True`: a knight) in the two published forms, `solution_text` and `solution_text_format`.

    For example "A is a knight, B is a knave, and C is a knight." and
    "(1) A is a knight\\n(2) B is a knave\\n(3) C is a knight", the answer format the prompt asks for.
    """
    roles = ["a knight" if is_knight else "a knave" for is_knight in solution]
    clauses = [f"{name} is {role}" for name, role in zip(names, roles, strict=True)]
    solution_text = ", ".join(clauses[:-1]) + ", and " + clauses[-1] + "." if len(clauses) > 1 else clauses[0] + "."
    solution_text_format = "\n".join(f"({index}) {clause}" for index, clause in enumerate(clauses, start=1))
    return solution_text, solution_text_format


def puzzle_record(
    quiz: str,
    names: Sequence[str],
    solution: Sequence[bool],
    statements: str,
    solution_text_format: str | None = None,
    solution_text: str | None = None,
) -> dict[str, Any]:
    """One puzzle in the published data's columns.

    The columns are `quiz`, `names`, `solution`, `solution_text`, `solution_text_format`, `statements` and
    `num_people`; the solution texts are written with [`solution_to_text`] unless given."""
    default_text, default_text_format = solution_to_text(names, solution)
    return {
        "quiz": quiz,
        "names": list(names),
        "solution": [bool(is_knight) for is_knight in solution],
        "solution_text": solution_text if solution_text is not None else default_text,
        "solution_text_format": solution_text_format if solution_text_format is not None else default_text_format,
        "statements": statements,
        "num_people": len(names),
    }


def puzzle_sizes(num_people: int | Sequence[int]) -> list[int]:
    """`num_people` (one size, or several for a mixture) as a checked, non-empty list of ints from 2 to 8."""
    sizes = [num_people] if isinstance(num_people, int) else list(num_people)
    if not sizes:
        raise ValueError(f"num_people: give at least one size from {MIN_PEOPLE} to {MAX_PEOPLE}")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"num_people must be an int, got {size!r}")
        if not MIN_PEOPLE <= size <= MAX_PEOPLE:
            raise ValueError(f"num_people must lie in [{MIN_PEOPLE}, {MAX_PEOPLE}], got {size}")
    return sizes


def generate_puzzles(
    num_people: int | Sequence[int], num_samples: int, seed: int = 0, max_width: int = 2, max_attempts: int = 100_000
) -> list[dict[str, Any]]:
    """`num_samples` Knights & Knaves puzzles with exactly one solution, in the published data's columns
    ([`puzzle_record`]; `solution`: `True` for a knight; `statements`: the `str` of the tuple notation). The
    same arguments always give the same puzzles; `knights_knaves.generate_dataset` turns them into a
    TRL-ready dataset.

    `num_people` is 2 to 8, or a list of sizes for a mixture (puzzle `k` has
    `num_people[k % len(num_people)]` people). Each puzzle draws one statement per person
    ([`sample_statement`]: nesting depth 2, at most `max_width` operands of `and`/`or`; 2 in the published
    data) from the generator seeded by `seed`, and is kept only if the solver finds exactly one consistent
    assignment and the same statements were not drawn before (a `RuntimeError` after `max_attempts` draws).
    Names come from [`NAMES`], claims are phrased with [`SPEECH_TEMPLATES`]."""
    sizes = puzzle_sizes(num_people)
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
            statements = tuple(sample_statement(rng, speaker, size, max_width) for speaker in range(size))
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
        rows.append(puzzle_record(quiz, names, solutions[0], str(statements)))
    return rows
