"""Math tasks of arXiv 2505.12929 for TRL.

- Grading: [`math_reward`] (the rules of the authors' grader, in [`paper_grading`]) and
  [`math_reward_lenient`] (TRL's math-verify reward).
- Data: [`load_paper_math_dataset`] (the authors' DSR-uniform and evaluation files) and [`load_math_dataset`]
  (Hub sets).
"""

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
from .grading import MAX_ANSWER_CHARS, looks_explosive, math_reward, math_reward_lenient, normalize_reference
