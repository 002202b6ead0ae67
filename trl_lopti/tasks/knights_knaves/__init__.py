"""Knights & Knaves (K&K) logic puzzles and their reward, ready for TRL's `GRPOTrainer` (arXiv 2505.12929).

- `puzzles`: the solver, a seeded generator and the published phrasing.
- `rewards`: the paper's (Logic-RL's) rule-based reward.
- `data`: the authors' split with their exact prompt text, the Hub set and generated puzzles.
"""

from .._text import completion_to_text
from .data import (
    KNIGHTS_KNAVES_HUB_ID,
    KNIGHTS_KNAVES_SOURCES,
    PAPER_KK_DIR,
    PAPER_SIZES,
    PAPER_SPLITS,
    PAPER_SYSTEM_PROMPT,
    SYSTEM_PROMPT,
    generate_dataset,
    knights_knaves_record_to_example,
    load_knights_knaves_dataset,
    load_paper_knights_knaves,
    make_prompt,
    paper_prompt,
    paper_record_to_example,
    prepare_knights_knaves_dataset,
    render_prompts_as_text,
)
from .puzzles import (
    MAX_PEOPLE,
    MIN_PEOPLE,
    NAMES,
    SPEECH_TEMPLATES,
    Statement,
    generate_puzzles,
    parse_statements,
    puzzle_record,
    render_quiz,
    render_statement,
    sample_statement,
    solution_to_text,
    solve,
)
from .rewards import (
    ANSWER_CORRECT_REWARD,
    ANSWER_UNPARSABLE_REWARD,
    ANSWER_WRONG_REWARD,
    ASSISTANT_MARKER,
    FORMAT_REWARD,
    THINK_PREFILL,
    extract_answer,
    has_valid_format,
    knights_knaves_answer_reward,
    knights_knaves_format_reward,
    knights_knaves_reward,
    parse_answer_roles,
    parse_solution_text_format,
    score_answer,
    score_format,
    scored_response,
)
