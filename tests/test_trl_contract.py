"""The TRL 1.16 facts LoptiGRPOTrainer relies on (see the docstring of trl_lopti/trainer.py), pinned.

Run this file first when upgrading TRL: a failure names the fact that changed.
"""

import importlib.metadata
import inspect

import pytest
from datasets import Dataset, IterableDataset
from trl import GRPOConfig, GRPOTrainer

import trl_lopti._compat as compat
from trl_lopti import LoptiGRPOConfig, LoptiGRPOTrainer


def reward(completions, **kwargs):
    return [0.0] * len(completions)


def test_compute_loss_reads_advantages_and_old_logps_after_the_policy_forward():
    source = inspect.getsource(GRPOTrainer._compute_loss)
    forward = source.index("self._get_per_token_logps_and_entropies(")
    assert source.count("self._get_per_token_logps_and_entropies(") == 1
    for read in ('inputs["advantages"]', 'inputs.get("old_per_token_logps")', 'inputs["ref_per_token_logps"]'):
        assert source.index(read) > forward, read
    assert "advantages.dim() == 1" in source, "token-level (B, T) advantages must stay supported"


def test_prepare_inputs_and_training_step_use_the_step_counter():
    prepare = inspect.getsource(GRPOTrainer._prepare_inputs)
    assert "generate_every = self.args.steps_per_generation * self.num_iterations" in prepare
    assert "self._step % generate_every == 0" in prepare
    assert "self._buffered_inputs[self._step % self.args.steps_per_generation]" in prepare
    assert "self._step += 1" in inspect.getsource(GRPOTrainer.training_step)


def test_sampler_repeat_count_is_read_from_num_iterations():
    for method in (GRPOTrainer._get_train_sampler, GRPOTrainer.get_train_dataloader):
        assert "repeat_count=self.num_iterations * self.args.steps_per_generation" in inspect.getsource(method)


@pytest.mark.parametrize("iterable", [False, True], ids=["map-style", "iterable"])
def test_lopti_serves_each_generation_batch_twice(tiny_model_path, tmp_path, iterable):
    prompts = {"prompt": [f"p{i}" for i in range(8)]}
    dataset = Dataset.from_dict(prompts)
    if iterable:
        dataset = dataset.to_iterable_dataset()
        assert isinstance(dataset, IterableDataset)
    common = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, report_to="none",
                  use_cpu=True, max_steps=1)
    grpo = GRPOTrainer(model=tiny_model_path, reward_funcs=reward, args=GRPOConfig(**common), train_dataset=dataset)
    lopti = LoptiGRPOTrainer(model=tiny_model_path, reward_funcs=reward, args=LoptiGRPOConfig(**common),
                             train_dataset=dataset)
    grpo_batches = [batch for batch in grpo.get_train_dataloader()]
    lopti_batches = [batch for batch in lopti.get_train_dataloader()]
    assert len(lopti_batches) == 2 * len(grpo_batches) > 0
    assert lopti.num_iterations == 1, "num_iterations is only doubled while the dataloader is built"
    # the same prompts, each generation batch served twice in a row
    as_prompts = [sorted(example["prompt"] if isinstance(example, dict) else [e["prompt"] for e in example])
                  for example in lopti_batches]
    grpo_prompts = [sorted(example["prompt"] if isinstance(example, dict) else [e["prompt"] for e in example])
                    for example in grpo_batches]
    assert as_prompts[0::2] == grpo_prompts and as_prompts[1::2] == grpo_prompts


def test_incompatible_trl_version_fails_with_a_clear_message(monkeypatch):
    monkeypatch.setattr(compat, "version", lambda name: "1.99.0")
    with pytest.raises(ImportError, match=r"tested with TRL >=1.16.0,<1.17.0 but TRL 1.99.0 is installed"):
        compat.check_trl_version()
    monkeypatch.setattr(compat, "version", lambda name: importlib.metadata.version(name))
    assert compat.check_trl_version() == importlib.metadata.version("trl")


def test_rewards_are_gathered_over_processes_and_scored_once_per_generation():
    calculate = inspect.getsource(GRPOTrainer._calculate_rewards)
    assert "rewards_per_func = gather(rewards_per_func)" in calculate and "return rewards_per_func" in calculate
    generate = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert generate.count("self._calculate_rewards(") == 1
    assert "self.accelerator.process_index * len(prompts)" in generate, "process slices in process order"
    assert 'self._logs["advantages"].extend(all_process_advantages.tolist())' in generate


def test_log_writes_the_completions_table_whenever_log_completions_is_set():
    log = inspect.getsource(GRPOTrainer.log)
    assert "if self.accelerator.is_main_process and self.log_completions:" in log
    assert 'f"completions_{self.state.global_step:05d}.parquet"' in log


def test_model_card_reads_the_trainer_name_and_paper():
    card = inspect.getsource(GRPOTrainer.create_model_card)
    for read in ("trainer_name=self._name", 'trainer_citation=self._paper.get("citation")',
                 'paper_title=self._paper.get("title")', 'paper_id=self._paper.get("id")'):
        assert read in card, read
