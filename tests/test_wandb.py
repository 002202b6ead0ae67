"""`report_to="wandb"`: the Lopti metrics reach Weights & Biases under `train/lopti/...` (offline run, inspected on disk)."""

import math
import struct
from pathlib import Path

import pytest
import wandb  # the test extra installs it: a missing wandb fails here, not skips
from datasets import Dataset
from testing_utils import ETA_FROM_EACH_BATCH
from wandb.proto import wandb_internal_pb2

from trl_lopti import LoptiGRPOConfig


LOPTI_METRICS = (
    "lopti/low_token_share",
    "lopti/ar_weight_mean",
    "lopti/loss_low_pass",
    "lopti/loss_high_pass",
)

# The `.wandb` transaction log uses LevelDB's log format behind a 7-byte W&B header.
_WANDB_HEADER = struct.Struct("<4sHB")  # ident ":W&B", magic 0xBEE1, version 0
_RECORD_HEADER = struct.Struct("<IHB")  # crc32c, payload length, chunk type
_BLOCK_SIZE = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_wandb_records(path: Path) -> list:
    """Parses every record of an offline run's `.wandb` file into `wandb_internal_pb2.Record` messages."""
    data = path.read_bytes()
    ident, magic, version = _WANDB_HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), "unexpected .wandb header"
    records, pending, position = [], b"", _WANDB_HEADER.size
    while position + _RECORD_HEADER.size <= len(data):
        left_in_block = _BLOCK_SIZE - position % _BLOCK_SIZE
        if left_in_block < _RECORD_HEADER.size:  # block trailer: zero padding
            position += left_in_block
            continue
        _, length, chunk_type = _RECORD_HEADER.unpack_from(data, position)
        if chunk_type == 0 and length == 0:  # zero padding up to the end of the block
            position += left_in_block
            continue
        start = position + _RECORD_HEADER.size
        payload, position = data[start : start + length], start + length
        if chunk_type == _FULL:
            chunks = [payload]
        elif chunk_type == _FIRST:
            pending, chunks = payload, []
        elif chunk_type == _MIDDLE:
            pending, chunks = pending + payload, []
        elif chunk_type == _LAST:
            chunks, pending = [pending + payload], b""
        else:
            raise AssertionError(f"unknown chunk type {chunk_type} at byte {position}")
        for chunk in chunks:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
    return records


def _item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


def length_reward(completions, **kwargs):
    """Varies across completions, so advantages are non-zero."""
    return [float(len(completion[0]["content"]) % 5) for completion in completions]


@pytest.mark.slow
def test_report_to_wandb_logs_lopti_metrics_offline(tiny_model_path, tmp_path, monkeypatch, mid_gap_trainer):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_PROJECT", "trl-lopti-test")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)

    config = LoptiGRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-2,
        max_steps=2,  # one generation batch: a low pass and a high pass
        logging_steps=1,
        save_strategy="no",
        report_to="wandb",
        run_name="lopti-wandb-test",
        use_cpu=True,
        seed=0,
        advantage_reweighting_alpha=0.3,
        lopti_threshold=ETA_FROM_EACH_BATCH,
    )
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Count to {i}."}] for i in range(8)]})
    try:
        trainer = mid_gap_trainer(
            model=tiny_model_path, reward_funcs=length_reward, args=config, train_dataset=dataset
        )
        trainer.train()
        assert wandb.run is not None and wandb.run.offline
    finally:
        wandb.finish()
        # wandb-core closes (and flushes) the run's transaction log when its service shuts down
        wandb.teardown()

    run_files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1, list(tmp_path.rglob("*"))
    records = read_wandb_records(run_files[0])

    (run,) = [record.run for record in records if record.WhichOneof("record_type") == "run"]
    assert run.project == "trl-lopti-test" and run.display_name == "lopti-wandb-test"
    assert any(record.WhichOneof("record_type") == "exit" for record in records), "run was not finished"

    history = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {_item_key(item): item.value_json for item in record.history.item}
            if any(key.startswith("train/lopti/") for key in row):
                history.append(row)
    # one logged row per optimizer step: the low pass, then the high pass
    assert len(history) == 2, history

    logged = [entry for entry in trainer.state.log_history if any(key.startswith("lopti/") for key in entry)]
    assert len(logged) == 2
    for metric in LOPTI_METRICS:
        key = f"train/{metric}"
        values = [float(row[key]) for row in history if key in row]
        assert values, f"{key} is missing from the W&B history"
        assert all(math.isfinite(value) for value in values), (key, values)
        # W&B received exactly what the trainer logged
        assert values == pytest.approx([entry[metric] for entry in logged if metric in entry], rel=1e-6), key

    low_pass, high_pass = history
    assert "train/lopti/loss_low_pass" in low_pass and "train/lopti/loss_high_pass" in high_pass
    assert "train/lopti/loss_high_pass" not in low_pass and "train/lopti/loss_low_pass" not in high_pass
    # the split is measured once per generation batch, over all of it: logged with the first pass only
    low_share = float(low_pass["train/lopti/low_token_share"])
    assert len(mid_gap_trainer.etas) == 1 and 0.0 < low_share < 1.0
    assert "train/lopti/low_token_share" not in high_pass and "train/lopti/ar_weight_mean" not in high_pass
    assert 0.7 <= float(low_pass["train/lopti/ar_weight_mean"]) <= 1.0  # alpha * pi_old + 1 - alpha, alpha = 0.3
