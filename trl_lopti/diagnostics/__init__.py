"""Token-probability diagnostics (arXiv 2505.12929, Figs. 1 and 3) of a batch of a TRL `GRPOTrainer`.

The batch is measured under the loss the trainer (TRL's, or a `LoptiGRPOTrainer`) trains: TRL's
`_compute_loss`, by autograd, in its evaluation branch (no dropout) over the whole batch
(`trl_loss_gradients`), so every loss type and option is measured as TRL computes it. A `LoptiGRPOTrainer` is
measured under TRL's loss with the batch's own advantages; the probe applies AR and Lopti itself
(`trl_lopti.core_algos`).

The figures, per quartile of pi_old (`probability_quartiles`; pi_old is the batch's `old_per_token_logps`,
else TRL's forward at the current parameters, as TRL itself uses on-policy):

- `w_t = -N * d L / d log pi_t` (N: the batch's loss tokens), with and without KL (TRL's loss at `beta = 0`):
  for `dapo` and `bnpo` (one process) exactly each token's weight, for other loss types with their normaliser
  in. Also `|N * d L / d H_t|` (the entropy bonus) and the share of tokens with a non-zero advantage whose
  weight without KL is zero.
- `||d L / d h_t||` (times N) at the last hidden state (`hidden_state_gradient_norms`), and
  `||d log pi_t / d h_t|| / (1 - pi_t)` with its bound `sqrt(2) sigma_max(W) / temperature`.
- Each quartile's exact summed parameter gradient (`summed_parameter_gradients`); the four add up to it.
- The Fig.-3 probe (`probability_shift`): per method of `PROBE_METHODS`, one update (Lopti: the low tokens'
  part, then at the new parameters the high tokens', against the same pi_old; undone after), then per
  quartile and advantage sign the share of tokens whose probability moved in the direction of their
  advantage.

The TRL private names used are `_compute_loss` and `_get_per_token_logps_and_entropies` (as `GRPOTrainer`'s),
`_metrics` (restored after the loss call; the callback appends to it), `_buffered_inputs` (the callback's
batch), `_generate_and_score_completions` and `_logs` (`sample_generation_batch`). The command is
`trl_lopti.cli.diagnose`.
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
