"""Math tasks of arXiv 2505.12929 for TRL: grading ([`math_reward`], the authors' grader's rules, in
[`paper_grading`]; [`math_reward_lenient`], math-verify) and data
([`load_paper_math_dataset`]: the authors' DSR-uniform and evaluation files; [`load_math_dataset`]: Hub sets)."""

from .._text import completion_to_text
from .._time_limit import DeadlineExceeded, run_with_time_limit
from .data import (
    AUTHORS_DATA_URL,
    MATH_DATASETS,
    MATH_PROMPT_SUFFIX,
    PAPER_MATH_FILES,
    MathDatasetSpec,
    load_math_dataset,
    load_paper_math_dataset,
    make_math_prompt,
    math_record_to_example,
    orz_pairs_to_records,
    paper_math_record_to_example,
)
from .grading import (
    GRADING_MODES,
    MAX_ANSWER_CHARS,
    MAX_FALLBACK_CHARS,
    extract_boxed_answer,
    final_part,
    looks_explosive,
    math_reward,
    math_reward_lenient,
    normalize_reference,
    score_in_process,
    verify_answer,
)


__all__ = [
    "AUTHORS_DATA_URL",
    "GRADING_MODES",
    "MATH_DATASETS",
    "MATH_PROMPT_SUFFIX",
    "MAX_ANSWER_CHARS",
    "MAX_FALLBACK_CHARS",
    "PAPER_MATH_FILES",
    "DeadlineExceeded",
    "MathDatasetSpec",
    "completion_to_text",
    "extract_boxed_answer",
    "final_part",
    "load_math_dataset",
    "load_paper_math_dataset",
    "looks_explosive",
    "make_math_prompt",
    "math_record_to_example",
    "math_reward",
    "math_reward_lenient",
    "normalize_reference",
    "orz_pairs_to_records",
    "paper_math_record_to_example",
    "run_with_time_limit",
    "score_in_process",
    "verify_answer",
]
