"""Runs TRL's own tests of a trainer against its Lopti trainer, offline: a manual check.

    python scripts/run_trl_tests.py TRL_REPO [--trainer rloo|grpo|gmpo] [--mode lopti|plain|trl] [--epochs E]
        [--work DIR] [-- PYTEST_ARGS]

`--trainer` picks TRL's test file: `rloo` (`tests/test_rloo_trainer.py`, against `LoptiRLOOTrainer`), `grpo`
(`tests/test_grpo_trainer.py`, against `LoptiGRPOTrainer`) or `gmpo` (`tests/experimental/test_gmpo_trainer.py`, against
`class GMPOTrainer(LoptiGRPOTrainer, GMPOTrainer)` with `@dataclass class GMPOConfig(LoptiArguments, GMPOConfig)`, as a
user composes them). TRL_REPO is a TRL checkout or bare mirror (read at HEAD). Its test files are copied into the work
folder (no TRL code is kept here), with the trainer import swapped: `lopti` gives the Lopti config and trainer with their
defaults (AR alpha 0.3, Lopti eta 0.5), `plain` the same with both methods off, `trl` TRL's own trainer (the baseline).
Nothing is fetched: the tiny models the tests name are random models of the same families with offline-built
tokenizers, in a Hugging Face cache read with `HF_HUB_OFFLINE=1`; the datasets are made by TRL's own
`scripts/generate_zen*_dataset.py` and saved to disk. A training left at TRL's default length (3 epochs) lasts
`--epochs` epochs (CPU time). Tests that cannot run here are skipped with the reason (`SKIPS`).
"""

import argparse
import codecs
import contextlib
import dataclasses
import io
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest


ORG = "trl-internal-testing"
TEST_FILES = ("__init__.py", "conftest.py", "testing_utils.py", "testing_constants.py")
DATASETS = {"zen": "generate_zen_dataset.py", "zen-image": "generate_zen_image_dataset.py"}
DATASETS["zen-multi-image"] = "generate_zen_multi_image_dataset.py"
OFF = "    advantage_reweighting_alpha: float = 0.0\n    lopti_threshold: float | None = None\n"
LOPTI_GMPO = (
    "from dataclasses import dataclass\n\nfrom trl.experimental.gmpo import GMPOConfig as TRLGMPOConfig\n"
    "from trl.experimental.gmpo import GMPOTrainer as TRLGMPOTrainer\n\nfrom trl_lopti import LoptiArguments, "
    "LoptiGRPOTrainer\n\n\n@dataclass\nclass GMPOConfig(LoptiArguments, TRLGMPOConfig):\n{fields}\n\nclass "
    "GMPOTrainer(LoptiGRPOTrainer, TRLGMPOTrainer): ...\n"
)


@dataclasses.dataclass
class TrainerTests:
    """TRL's test file of a trainer (`path`), the import of the trainer its tests make (`trl_import`), the import
    that replaces it in each mode (`swaps`), and TRL's config class whose defaults a test's training length comes
    from (`config`, as `trl` names it)."""

    path: str
    trl_import: str
    swaps: dict[str, str]
    config: str


TRAINERS = {
    "rloo": TrainerTests(
        "tests/test_rloo_trainer.py",
        "from trl import RLOOConfig, RLOOTrainer\n",
        {
            "lopti": "from trl_lopti import LoptiRLOOConfig as RLOOConfig, LoptiRLOOTrainer as RLOOTrainer\n",
            "plain": "from dataclasses import dataclass\n\nfrom trl_lopti import LoptiRLOOConfig, LoptiRLOOTrainer as "
            "RLOOTrainer\n\n\n@dataclass\nclass RLOOConfig(LoptiRLOOConfig):  # both methods off\n" + OFF,
            "trl": "from trl import RLOOConfig, RLOOTrainer\n",
        },
        "RLOOConfig",
    ),
    "grpo": TrainerTests(
        "tests/test_grpo_trainer.py",
        "from trl import GRPOConfig, GRPOTrainer\n",
        {
            "lopti": "from trl_lopti import LoptiGRPOConfig as GRPOConfig, LoptiGRPOTrainer as GRPOTrainer\n",
            "plain": "from dataclasses import dataclass\n\nfrom trl_lopti import LoptiGRPOConfig, LoptiGRPOTrainer as "
            "GRPOTrainer\n\n\n@dataclass\nclass GRPOConfig(LoptiGRPOConfig):  # both methods off\n" + OFF,
            "trl": "from trl import GRPOConfig, GRPOTrainer\n",
        },
        "GRPOConfig",
    ),
    "gmpo": TrainerTests(
        "tests/experimental/test_gmpo_trainer.py",
        "from trl.experimental.gmpo import GMPOConfig, GMPOTrainer\n",
        {
            "lopti": LOPTI_GMPO.format(fields="    pass\n"),
            "plain": LOPTI_GMPO.format(fields="    # both methods off\n" + OFF),
            "trl": "from trl.experimental.gmpo import GMPOConfig, GMPOTrainer\n",
        },
        "GRPOConfig",
    ),
}
"""What each `--trainer` runs."""
# Tokenizers with the special tokens of the tested ones where a test depends on them (ids hard-coded in a test, a named
# pad token, a processor's image tokens): byte-level BPE merged on the Zen of Python, then filler up to the size.
QWEN = dict(size=151643, eos="<|im_end|>", pad="<|endoftext|>", specials="<|endoftext|> <|im_start|> <|im_end|>")
LLAMA = dict(size=128000, eos="<|eot_id|>", bos="<|begin_of_text|>", specials="<|begin_of_text|> <|end_of_text|> ")
LLAMA["specials"] += "<|r0|> <|r1|> <|finetune_right_pad_id|> <|r2|> <|start_header_id|> <|end_header_id|> <|eot_id|>"
GEMMA = dict(size=4096, eos="<eos>", pad="<pad>", bos="<bos>", specials="<pad> <eos> <bos> <start_of_turn> ")
GEMMA["specials"] += "<end_of_turn> <start_of_image> <end_of_image> <image_soft_token>"
GEMMA["extra"] = dict(image_token="<image_soft_token>", boi_token="<start_of_image>", eoi_token="<end_of_image>")
QWEN["generation_eos"], GEMMA["generation_eos"] = "<|im_end|> <|endoftext|>", "<eos> <end_of_turn>"
CONTENT = (  # a message's content: a string, or text and image parts
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' "
    "%}<start_of_image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
)


def chat(start: str, turn: str, end: str, reply: str = "assistant") -> str:  # turn, content, end per message
    loop = "{% for m in messages %}" + turn + CONTENT + end + "{% endfor %}{% if add_generation_prompt %}"
    return start + loop + turn.replace(ROLE, reply) + "{% endif %}"


ROLE, BOS = "{{ m['role'] }}", "{{ bos_token }}"
QWEN["template"] = chat("", "<|im_start|>" + ROLE + "\n", "<|im_end|>\n")
LLAMA["template"] = chat(BOS, "<|start_header_id|>" + ROLE + "<|end_header_id|>\n\n", "<|eot_id|>")
GEMMA["template"] = chat(BOS, "<start_of_turn>" + ROLE + "\n", "<end_of_turn>\n", reply="model")
SMALL = dict(hidden_size=8, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=32)
MOE, SCORE = dict(num_experts_per_tok=2, moe_intermediate_size=32), dict(hidden_size=16, num_labels=1)
NEMOTRON = dict(MOE, hidden_size=16, layers_block_type=["mamba", "attention", "moe"], use_mamba_kernels=False)
NEMOTRON.update(mamba_num_heads=8, mamba_head_dim=4, mamba_n_groups=1, ssm_state_size=16, n_routed_experts=4)
NEMOTRON["moe_shared_expert_intermediate_size"] = 32
VISION = dict(SMALL, hidden_size=16, image_size=224, patch_size=14, vision_use_head=False)  # 256 patches, as Gemma 3
MODELS = {  # stand-in: (model type, head, tokenizer, config beyond SMALL), sizes as TRL's generation scripts
    "tiny-Qwen2ForCausalLM-2.5": ("qwen2", "causal", QWEN, {}),
    "tiny-Qwen3ForCausalLM": ("qwen3", "causal", QWEN, {}),
    "tiny-Qwen2ForSequenceClassification-2.5": ("qwen2", "seq", QWEN, SCORE),
    "tiny-Qwen3ForSequenceClassification": ("qwen3", "seq", QWEN, SCORE),
    "tiny-LlamaForSequenceClassification-3.2": ("llama", "seq", LLAMA, SCORE),
    "tiny-Cohere2ForCausalLM": ("cohere2", "causal", QWEN, {}),
    "tiny-Glm4MoeForCausalLM": ("glm4_moe", "causal", QWEN, dict(MOE, n_routed_experts=4, head_dim=2)),
    "tiny-GptOssForCausalLM": ("gpt_oss", "causal", QWEN, dict(num_local_experts=4, num_experts_per_tok=2)),
    "tiny-Qwen3MoeForCausalLM": ("qwen3_moe", "causal", QWEN, dict(MOE, num_experts=4)),
    "tiny-NemotronHForCausalLM-nano": ("nemotron_h", "causal", QWEN, NEMOTRON),
    "tiny-RemoteForCausalLM": ("llama", "causal", LLAMA, {}),  # saved as custom code (model_type "remote")
    "tiny-Gemma3ForConditionalGeneration": ("gemma3", "vlm", GEMMA, dict(hidden_size=16, layer_types=None)),
}
REMOTE_CODE = {
    "configuration_remote.py": "from transformers import LlamaConfig\n\n\nclass RemoteConfig(LlamaConfig):\n"
    '    model_type = "remote"\n',
    "modeling_remote.py": "from transformers import LlamaForCausalLM\n\nfrom .configuration_remote import "
    "RemoteConfig\n\n\nclass RemoteForCausalLM(LlamaForCausalLM):\n    config_class = RemoteConfig\n",
}
KEEP_EPOCHS = ("test_prepare_input_called_with_correct_data",)  # asserts the step count of 3 epochs
NO_TORCHVISION = "its processor has a video processor, which transformers cannot build without torchvision (not here)"
SKIPS = dict.fromkeys(("Qwen2_5_VL", "Qwen2VL", "Qwen3_5", "Gemma4"), NO_TORCHVISION)  # test id part: reason
SKIPS["LlavaNext"] = "no stand-in built for LLaVA-NeXT (its anyres image processor and CLIP tower)"


def trl_file(repo: Path, path: str) -> str:  # at HEAD, of a checkout or a bare mirror
    return subprocess.check_output(["git", "-C", str(repo), "show", f"HEAD:{path}"], text=True)


def build_tokenizer(spec):
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401  (the Zen of Python, the tests' text; prints it at its first import)
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    merges = trainers.BpeTrainer(vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(codecs.decode(sys.modules["this"].s, "rot13").splitlines(), merges)
    data = json.loads(tokenizer.to_str())  # BPE merges of the Zen (short prompts), then filler up to the size
    data["model"]["vocab"].update({f"<f{i}>": i for i in range(len(data["model"]["vocab"]), spec["size"])})
    tokenizer = Tokenizer.from_str(json.dumps(data))
    tokenizer.add_special_tokens([AddedToken(s, special=True) for s in spec["specials"].split()])
    names = {f"{k}_token": spec.get(k) for k in ("eos", "pad", "bos")}
    extra = dict(extra_special_tokens=spec["extra"]) if "extra" in spec else {}
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=spec["template"], **names, **extra)


def build_model(folder: Path, name: str) -> None:
    import torch
    import transformers as tf

    model_type, head, spec, overrides = MODELS[name]
    tokenizer = processor = build_tokenizer(spec)
    eos = tokenizer.convert_tokens_to_ids(spec.get("generation_eos", spec["eos"]).split())
    ids = dict(vocab_size=len(tokenizer), eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    config = {**SMALL, **ids, **overrides}
    if head == "vlm":  # Gemma 3: 256 image tokens per image
        image_processor = tf.Gemma3ImageProcessor(size={"height": 224, "width": 224})
        processor = tf.Gemma3Processor(
            image_processor, tokenizer, chat_template=spec["template"], image_seq_length=256
        )
        images = dict(mm_tokens_per_image=256, image_token_id=tokenizer.image_token_id)
        images.update(boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id)
        config = dict(text_config=config, vision_config=VISION, **images)
    torch.manual_seed(0)
    auto = {"causal": tf.AutoModelForCausalLM, "seq": tf.AutoModelForSequenceClassification}.get(head)
    model = (auto or tf.AutoModelForImageTextToText).from_config(tf.AutoConfig.for_model(model_type, **config))
    model.to(torch.bfloat16).save_pretrained(folder)
    processor.save_pretrained(folder)
    if name == "tiny-RemoteForCausalLM":
        for file, code in REMOTE_CODE.items():
            (folder / file).write_text(code)
        saved = json.loads((folder / "config.json").read_text())
        auto_map = {"AutoConfig": "configuration_remote.RemoteConfig"}
        auto_map["AutoModelForCausalLM"] = "modeling_remote.RemoteForCausalLM"
        saved.update(model_type="remote", architectures=["RemoteForCausalLM"], auto_map=auto_map)
        (folder / "config.json").write_text(json.dumps(saved))


def build_standins(repo: Path, work: Path) -> None:
    """Models in a Hugging Face cache (`work/hub`), datasets saved to disk (`work/datasets/<name>/<config>`)."""
    import datasets

    sha = "0" * 40
    for name in MODELS:
        root = work / "hub" / f"models--{ORG}--{name}"
        if not (root / "refs" / "main").exists():
            build_model(root / "snapshots" / sha, name)
            (root / "refs").mkdir(parents=True, exist_ok=True)
            (root / "refs" / "main").write_text(sha)

    def save(dataset, repo_id, config_name, **kwargs):
        dataset.save_to_disk(str(work / "datasets" / repo_id.split("/")[1] / config_name))

    datasets.disable_progress_bars()
    datasets.Dataset.push_to_hub = datasets.DatasetDict.push_to_hub = save
    for name, script in DATASETS.items():
        if not (work / "datasets" / name).exists():
            (work / script).write_text(trl_file(repo, f"scripts/{script}"))
            runpy.run_path(str(work / script))["main"](test_size=0.1, push_to_hub=True, repo_id=f"{ORG}/{name}")


def pytest_configure(config):  # the plugin side, in the pytest process: the stand-in datasets, TRL skew
    import datasets
    from trl import import_utils

    original = datasets.load_dataset

    def load_dataset(path, name=None, split=None, streaming=False, **kwargs):
        if not path.startswith(f"{ORG}/"):
            return original(path, name, split=split, streaming=streaming, **kwargs)
        dataset = datasets.load_from_disk(os.path.join(os.environ["STANDIN_DATASETS"], path.split("/")[1], name))
        dataset, stream = dataset[split] if split else dataset, datasets.Dataset.to_iterable_dataset
        if streaming:
            return (
                stream(dataset) if split else datasets.IterableDatasetDict({k: stream(v) for k, v in dataset.items()})
            )
        return dataset

    datasets.load_dataset = load_dataset
    if not hasattr(import_utils, "is_joblib_available"):  # TRL's testing_utils imports it; TRL 1.16 dropped it
        import_utils.is_joblib_available = lambda: False


@pytest.fixture(autouse=True)
def shorter_training(request, monkeypatch):
    """A training left to TRL's default length (3 epochs, no `max_steps`) lasts `--epochs` epochs (CPU time)."""
    import trl

    config_class = getattr(trl, os.environ["STANDIN_CONFIG"])
    epochs, original = float(os.environ["STANDIN_EPOCHS"]), config_class.__post_init__

    def post_init(self):
        if self.num_train_epochs == 3.0 and self.max_steps == -1:
            self.num_train_epochs = epochs
        original(self)

    if request.node.name not in KEEP_EPOCHS:
        monkeypatch.setattr(config_class, "__post_init__", post_init)


def pytest_collection_modifyitems(config, items):
    for item in items:
        for part, reason in SKIPS.items():
            if part in item.nodeid:
                item.add_marker(pytest.mark.skip(reason=f"offline: {reason}"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trl", type=Path, help="TRL repository: a checkout or a bare mirror")
    parser.add_argument("--trainer", choices=sorted(TRAINERS), default="rloo")
    parser.add_argument("--mode", choices=["lopti", "plain", "trl"], default="lopti")
    parser.add_argument("--epochs", type=float, default=1.0, help="for trainings of TRL's default length")
    parser.add_argument("--work", type=Path, default=Path("/tmp/trl-tests"), help="work folder (reused)")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args, pytest_args = parser.parse_args(argv[:split]), argv[split + 1 :]
    trainer = TRAINERS[args.trainer]
    work, tests = args.work.resolve(), args.work.resolve() / args.trainer / args.mode / "tests"
    (tests / "experimental").mkdir(parents=True, exist_ok=True)
    for name in TEST_FILES:
        (tests / name).write_text(trl_file(args.trl, f"tests/{name}"))
    (tests / "experimental" / "__init__.py").write_text(trl_file(args.trl, "tests/experimental/__init__.py"))
    text = trl_file(args.trl, trainer.path)
    if text.count(trainer.trl_import) != 1:
        raise SystemExit(f"{trainer.path}: the import to swap ({trainer.trl_import.strip()}) is not there once")
    (tests.parent / trainer.path).write_text(text.replace(trainer.trl_import, trainer.swaps[args.mode]))
    build_standins(args.trl, work)
    env = dict(os.environ, HF_HUB_CACHE=str(work / "hub"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.update(STANDIN_DATASETS=str(work / "datasets"), STANDIN_EPOCHS=str(args.epochs), STANDIN_CONFIG=trainer.config)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent)  # this file is the pytest plugin
    command = [sys.executable, "-m", "pytest", "-p", "run_trl_tests", "-p", "no:cacheprovider", "-rfEs"]
    command += [f"--rootdir={tests.parent}", trainer.path, *pytest_args]
    return subprocess.run(command, check=False, cwd=tests.parent, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
