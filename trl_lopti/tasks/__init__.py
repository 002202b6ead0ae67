"""The tasks of arXiv 2505.12929 as TRL-ready datasets and reward functions.

- Knights & Knaves logic puzzles (`trl_lopti.tasks.knights_knaves`): [`paper_prompt`] and
  [`load_knights_knaves_dataset`] (the authors' split and exact prompt text, or the Hub set),
  [`generate_dataset`], [`knights_knaves_reward`] (and its parts [`knights_knaves_format_reward`],
  [`knights_knaves_answer_reward`]).
- Math (`trl_lopti.tasks.math`): [`load_paper_math_dataset`] (the authors' DSR-uniform and evaluation files),
  [`load_math_dataset`] (Hub sets), [`math_reward`] (the paper's grading) and [`math_reward_lenient`] (TRL's
  math-verify reward); both need `pip install "trl_lopti[math]"`.
- [`token_parity_reward`]: a reward that varies on any model (for rehearsals and tests with random models).

Example:

```python
from trl import GRPOTrainer
from trl_lopti.tasks import generate_dataset, knights_knaves_reward

dataset = generate_dataset([3, 4, 5, 6, 7], num_samples=5000, seed=0)
trainer = GRPOTrainer(
    model="Qwen/Qwen2.5-3B-Instruct", reward_funcs=knights_knaves_reward, train_dataset=dataset
)
```
"""

from ._text import completion_to_text, token_parity_reward
from .knights_knaves import (
    KNIGHTS_KNAVES_HUB_ID,
    generate_dataset,
    knights_knaves_answer_reward,
    knights_knaves_format_reward,
    knights_knaves_reward,
    load_knights_knaves_dataset,
    paper_prompt,
    prepare_knights_knaves_dataset,
    render_prompts_as_text,
)
from .math import (
    MATH_DATASETS,
    PAPER_MATH_FILES,
    MathDatasetSpec,
    load_math_dataset,
    load_paper_math_dataset,
    math_reward,
    math_reward_lenient,
)
