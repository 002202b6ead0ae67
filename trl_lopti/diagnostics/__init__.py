"""Token-probability diagnostics: measure whether low-probability tokens dominate a GRPO update in *your* run.

arXiv 2505.12929 argues from a measurement: group the completion tokens of a batch by the probability of the sampled
token, and the low-probability groups produce larger gradients (Fig. 1d), move the high-probability tokens more than
these tokens' own update does (Fig. 1e/f), and AR/Lopti raise the share of tokens whose probability moves in the
direction of their advantage (Fig. 3). This module measures those quantities, and the ones its reviewers asked for,
on any causal LM and any batch in the format of TRL's `GRPOTrainer` (`inputs` of `_generate_and_score_completions`).

Conventions (all exact, see `grpo_token_weights`):

- Per-token loss of TRL's clipped surrogate, token-level ratio `r = pi / pi_old`:
  `loss_t = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) + beta * k3_t`, `k3 = pi_ref/pi - log(pi_ref/pi) - 1`
  (times `r` with `use_bias_correction_kl=True`, TRL's default and ours). The loss of a batch is
  `sum_t c_t * loss_t`, with `c_t` the normaliser of `loss_type` (`dapo`/`bnpo`: one over the number of completion
  tokens).
- The token weight `w_t` is defined by `d loss_t / d log pi_t = -w_t`, so a positive `w` pushes the token's probability
  up. "Without KL" is `w_pg = r * A * 1[not clipped]`; "with KL" is `w = w_pg + w_kl`, where
  `w_kl = beta * (pi_ref / pi - 1)` for the plain k3 term and `w_kl = beta * r * (pi_ref / pi - 1 - k3)` with the
  bias correction. At the behaviour policy `r = 1` and nothing is clipped; at the reference policy `w_kl = 0`.
- Because `d log pi_t / d logits_t = (e_k - p_t) / temperature`, the gradient of `loss_t` w.r.t. the last hidden
  state (the input of the LM head, `logits = h @ W.T`) is `-w_t * W.T @ (e_k - p_t) / temperature` at position t and
  zero at every other position. This module computes its norm in closed form from the logits and `W`, for all tokens
  at once. Its ratio to `|w| * (1 - pi)` lies in `[0, sqrt(2) * sigma_max(W) / temperature]` because
  `(1 - pi) <= ||e_k - p|| <= sqrt(2) * (1 - pi)`.
- Tokens are grouped by `pi_old` (the behaviour-policy probability: `inputs["old_per_token_logps"]` when present,
  otherwise the model's own probability, which is what TRL uses on-policy) into quartiles over the batch's completion
  tokens: Q1 = `[min, e1)`, Q2 = `[e1, e2)`, Q3 = `[e2, e3)`, Q4 = `[e3, max]`, with the edges `e1, e2, e3` reported.
- Summed parameter gradients are those of `sum_{t in quartile} c_t * loss_t`; they add up exactly to the full
  gradient. They are accumulated into one flat float32 buffer per quartile (memory: 4 x number of trainable
  parameters x 4 bytes, independent of the number of tokens); per-token parameter gradients are never formed.

Modules: `measure` (pure per-token and per-quartile figures), `batch` (the batch, its forward passes and the summed
gradients, with the one settings dataclass `DiagnosticsSettings`), `probe` (the entry points: `measure_token_gradients`
(quartile table), `probability_shift_probe` (one-update probe), `run_token_diagnostics` (both, sharing the gradient
computation), `advance_policy_on_batch` (measure at a later inner iteration, where ratios, clipping and the KL part are
active)), `sampling` (`sample_generation_batch`: a batch generated and scored by the trainer itself), `callback`
(`TokenDiagnosticsCallback`, during training) and `report` (Markdown tables and plots). The `trl-lopti diagnose`
command is `trl_lopti.cli.diagnose`.

Loss coverage: the token weights model TRL's token-level clipped surrogate with its KL term for `loss_type` `dapo`,
`bnpo`, `grpo` and `dr_grpo` (equal to the gradient of TRL's own loss w.r.t. the per-token log-probabilities, tested);
`DiagnosticsSettings.from_trainer` (hence the callback and the command) refuses, by name, a trainer whose loss is
another one (`cispo`, `sapo`, `luspo`, `vespo`, `importance_sampling_level="sequence"`, `delta`,
`top_entropy_quantile < 1`, an entropy bonus, `off_policy_mask_threshold`, vLLM importance-sampling correction).
"""

from .batch import DiagnosticsSettings, check_loss_is_modelled, completion_log_probs, unmodelled_loss_settings
from .callback import TokenDiagnosticsCallback, flatten_report
from .measure import (
    QUARTILE_LABELS,
    SUPPORTED_LOSS_TYPES,
    grpo_token_weights,
    hidden_state_gradient_norms,
    lm_head_spectral_norm,
    loss_normalizer,
    probability_quartiles,
)
from .probe import (
    DEFAULT_PROBE_METHODS,
    PROBE_METHODS,
    advance_policy_on_batch,
    measure_token_gradients,
    probability_shift_probe,
    run_token_diagnostics,
)
from .report import format_tables, plot_report
from .sampling import sample_generation_batch


__all__ = [
    "DEFAULT_PROBE_METHODS",
    "PROBE_METHODS",
    "QUARTILE_LABELS",
    "SUPPORTED_LOSS_TYPES",
    "DiagnosticsSettings",
    "TokenDiagnosticsCallback",
    "advance_policy_on_batch",
    "check_loss_is_modelled",
    "completion_log_probs",
    "flatten_report",
    "format_tables",
    "grpo_token_weights",
    "hidden_state_gradient_norms",
    "lm_head_spectral_norm",
    "loss_normalizer",
    "measure_token_gradients",
    "plot_report",
    "probability_quartiles",
    "probability_shift_probe",
    "run_token_diagnostics",
    "sample_generation_batch",
    "unmodelled_loss_settings",
]
