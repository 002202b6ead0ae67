"""Token-probability diagnostics: do low-probability tokens dominate the update of *your* run, under TRL's own loss?

arXiv 2505.12929 argues from a measurement: group the completion tokens of a batch by the probability of the sampled
token, and the low-probability groups get larger gradients (Fig. 1) while AR and Lopti raise the share of tokens whose
probability moves in the direction of their advantage (Fig. 3). This package measures those figures, and the ones its
reviewers asked for, on a batch of a TRL `GRPOTrainer` (or `LoptiGRPOTrainer`), for the loss that trainer trains.

The method is TRL's loss, by autograd. TRL's forward (`GRPOTrainer._get_per_token_logps_and_entropies`) gives each
token's log-probability `log pi_t` and entropy `H_t`; TRL's `GRPOTrainer._compute_loss` is then run on the batch with
that forward replaced by one returning these values as leaf tensors, and `torch.autograd.grad` gives `d L / d log pi_t`
and `d L / d H_t` (`trl_loss_gradients`). Every loss type (`grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo`),
`importance_sampling_level="sequence"`, `delta`, entropy masking, the entropy bonus, the off-policy mask and vLLM
importance sampling are thus measured as TRL computes them; nothing is refused. The loss is taken in TRL's evaluation
branch (`trainer.model.eval()`: no dropout, no gradient-accumulation factor, no adaptive-entropy update), over the
whole batch; whatever TRL logs to `trainer._metrics` meanwhile is discarded. A `LoptiGRPOTrainer` is measured under
TRL's loss with the batch's own advantages (TRL's group-relative ones, or REINFORCE++'s): the GRPO update that AR and
Lopti modify. The probe applies AR and Lopti itself (`trl_lopti.core_algos`).

What is measured, per quartile of pi_old (the batch's `old_per_token_logps`, else TRL's forward at the current
parameters, which is what TRL itself uses on-policy): Q1 = `[min, e1)` ... Q4 = `[e3, max]`, edges reported.

- `w_t = -N * d L / d log pi_t` (N: the batch's loss tokens), with and without KL: for `dapo` and `bnpo` (one process)
  exactly each token's weight (`ratio * A * 1[not clipped]` plus the KL part), for other loss types with their
  normaliser in.
  "Without KL" is TRL's loss at `beta = 0` on the same batch (beta touches only the KL term, so that is exactly the loss
  without it). Also `|N * d L / d H_t|` (the entropy bonus) and the share of tokens with a non-zero advantage whose
  weight without KL is zero (clipped, or masked).
- `||d L / d h_t||` (times N) at the last hidden state `h_t` (the LM head's input), in closed form from the logits and
  the LM head weight (`hidden_state_gradient_norms`, both channels), and `||d log pi_t / d h_t|| / (1 - pi_t)` with its
  bound `sqrt(2) sigma_max(W) / temperature`.
- Each quartile's summed parameter gradient, exact: `d L / d log pi` and `d L / d H` times the quartile's mask, pushed
  back through TRL's forward with grad (`summed_parameter_gradients`); the four add up to the gradient of TRL's loss.
  Their norms, cosines with the full gradient and with each other, and share of it.
- The Fig.-3 probe (`probe_methods`): one update of the model (`grpo`: TRL's loss; `ar`: TRL's loss with AR's
  advantages; `lopti`/`lopti_ar`: the low tokens' part of that gradient, then at the new parameters the high tokens'
  part, ratios against the same pi_old, the same optimizer; `lowest_quartile_only`/`highest_quartile_only`), then, per
  quartile and advantage sign, the share of tokens whose probability moved in the direction of their advantage and the
  mean change of probability (float64 log-probabilities from the logits). The model's parameters are restored after.

TRL private names this package touches: `_compute_loss` and `_get_per_token_logps_and_entropies` (called as
`GRPOTrainer`'s; the second shadowed on the instance for the loss call only), `_metrics` (restored after the loss call;
the callback appends its figures), `_buffered_inputs` (the callback's batch), `_generate_and_score_completions` and
`_logs` (`sample_generation_batch`). Before this rewrite: `_generate_and_score_completions`, `_logs`,
`_buffered_inputs`, `_metrics`, and a hand-derived copy of TRL's loss for 4 of its 8 loss types.

Modules: `loss` (the batch and the oracle), `measure` (the tables, the probe, `advance_policy_on_batch`), `callback`
(`TokenDiagnosticsCallback`), `report` (Markdown and plots) and `plots` (the package's one plotting helper). The
`trl-lopti diagnose` command is `trl_lopti.cli.diagnose`.
"""

from .callback import TokenDiagnosticsCallback, flatten_report
from .loss import generation_batch, sample_generation_batch, summed_parameter_gradients, trl_batch, trl_loss_gradients
from .measure import (
    DEFAULT_PROBE_METHODS,
    PROBE_METHODS,
    QUARTILE_LABELS,
    advance_policy_on_batch,
    completion_log_probs,
    hidden_state_gradient_norms,
    probability_quartiles,
    run_token_diagnostics,
)
from .report import format_tables, plot_report


__all__ = [
    "DEFAULT_PROBE_METHODS",
    "PROBE_METHODS",
    "QUARTILE_LABELS",
    "TokenDiagnosticsCallback",
    "advance_policy_on_batch",
    "completion_log_probs",
    "flatten_report",
    "format_tables",
    "generation_batch",
    "hidden_state_gradient_norms",
    "plot_report",
    "probability_quartiles",
    "run_token_diagnostics",
    "sample_generation_batch",
    "summed_parameter_gradients",
    "trl_batch",
    "trl_loss_gradients",
]
