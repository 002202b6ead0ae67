"""Token-probability diagnostics: do low-probability tokens dominate the update of *your* run, under TRL's own loss?

arXiv 2505.12929 argues from a measurement: group the completion tokens of a batch by the probability of the sampled
token, and the low-probability groups get larger gradients (Fig. 1) while AR and Lopti raise the share of tokens whose
probability moves in the direction of their advantage (Fig. 3). This package measures those figures, and the ones its
reviewers asked for, on a batch of a TRL `GRPOTrainer` (or `LoptiGRPOTrainer`), for the loss that trainer trains.

The method is TRL's loss, by autograd, in TRL's evaluation branch (no dropout) over the whole batch
(`trl_loss_gradients`): every loss type and TRL option is measured as TRL computes it; nothing is refused. A
`LoptiGRPOTrainer` is measured under TRL's loss with the batch's own advantages (the GRPO update that AR and Lopti
modify); the probe applies AR and Lopti itself (`trl_lopti.core_algos`).

What is measured, per quartile of pi_old (the batch's `old_per_token_logps`, else TRL's forward at the current
parameters, which is what TRL itself uses on-policy; `probability_quartiles`):

- `w_t = -N * d L / d log pi_t` (N: the batch's loss tokens), with and without KL (TRL's loss at `beta = 0`, which
  touches only the KL term): for `dapo` and `bnpo` (one process) exactly each token's weight (`ratio * A *
  1[not clipped]` plus the KL part), for other loss types with their normaliser in. Also `|N * d L / d H_t|` (the
  entropy bonus) and the share of tokens with a non-zero advantage whose weight without KL is zero.
- `||d L / d h_t||` (times N) at the last hidden state `h_t` (the LM head's input), in closed form
  (`hidden_state_gradient_norms`), and `||d log pi_t / d h_t|| / (1 - pi_t)` with its bound
  `sqrt(2) sigma_max(W) / temperature`.
- Each quartile's summed parameter gradient, exact (`summed_parameter_gradients`: the four add up to the gradient of
  TRL's loss): their norms, cosines with the full gradient and with each other, and share of it.
- The Fig.-3 probe (`probability_shift`): per method of `PROBE_METHODS`, one update of the model (Lopti: the low
  tokens' part of the gradient, then at the new parameters the high tokens' part, against the same pi_old; undone
  after), then per quartile and advantage sign the share of tokens whose probability moved in the direction of their
  advantage.

TRL private names this package touches: `_compute_loss` and `_get_per_token_logps_and_entropies` (called as
`GRPOTrainer`'s), `_metrics` (restored after the loss call; the callback appends its figures), `_buffered_inputs` (the
callback's batch), `_generate_and_score_completions` and `_logs` (`sample_generation_batch`). The `trl-lopti diagnose`
command is `trl_lopti.cli.diagnose`.
"""

from .callback import TokenDiagnosticsCallback, flatten_report
from .loss import generation_batch, sample_generation_batch, summed_parameter_gradients, trl_batch, trl_loss_gradients
from .measure import (
    DEFAULT_PROBE_METHODS,
    PROBE_METHODS,
    QUARTILE_LABELS,
    advance_policy_on_batch,
    check_probe_methods,
    completion_log_probs,
    hidden_state_gradient_norms,
    probability_quartiles,
    probability_shift,
    run_token_diagnostics,
)
from .report import format_tables, plot_report
