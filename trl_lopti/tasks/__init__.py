"""The tasks of arXiv 2505.12929 as TRL-ready datasets and reward functions.

- Knights & Knaves logic puzzles: [`generate_dataset`], [`load_knights_knaves_dataset`], [`knights_knaves_reward`]
  (and its parts [`knights_knaves_format_reward`], [`knights_knaves_answer_reward`]).
- Math: [`load_math_dataset`], [`math_reward`] (needs `pip install "trl_lopti[math]"`).

Example:

```python
from trl import GRPOConfig, GRPOTrainer
from trl_lopti.tasks import generate_dataset, knights_knaves_reward

train_dataset = generate_dataset([3, 4, 5, 6, 7], num_samples=5000, seed=0)
trainer = GRPOTrainer(
    model="Qwen/Qwen2.5-3B-Instruct",
    reward_funcs=knights_knaves_reward,
    args=GRPOConfig(output_dir="kk"),
    train_dataset=train_dataset,
)
```
"""

from .knights_knaves import (
    KNIGHTS_KNAVES_HUB_ID,
    generate_dataset,
    knights_knaves_answer_reward,
    knights_knaves_format_reward,
    knights_knaves_reward,
    load_knights_knaves_dataset,
    prepare_knights_knaves_dataset,
    render_prompts_as_text,
)
from .math import MATH_DATASETS, MathDatasetSpec, load_math_dataset, math_reward


__all__ = [
    "KNIGHTS_KNAVES_HUB_ID",
    "MATH_DATASETS",
    "MathDatasetSpec",
    "generate_dataset",
    "knights_knaves_answer_reward",
    "knights_knaves_format_reward",
    "knights_knaves_reward",
    "load_knights_knaves_dataset",
    "load_math_dataset",
    "math_reward",
    "prepare_knights_knaves_dataset",
    "render_prompts_as_text",
]
