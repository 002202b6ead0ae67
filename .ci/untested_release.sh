#!/usr/bin/env bash
# The untested-release path, end to end, from the wheel, outside the checkout (.ci/run stage 8b): the installed TRL is
# made to report a version no one has tested (1.99.0, by rewriting its package metadata in a scratch virtual
# environment), then a user's runs show, each asserted on what the user sees:
#   1. the warning at import;
#   2. the check, run once on this machine by the first run, which then trains;
#   3. the verdict reused: a second run trains without checking;
#   4. a fact broken on purpose (TRL's RLOO returns another old_logps: fact R1, RLOO only): LoptiRLOOTrainer is
#      refused, naming the fact, while LoptiGRPOTrainer keeps training;
#   5. an unwritable cache (HF_HOME names a file): the run trains, with one warning naming the folder;
#   6. TRL_LOPTI_SKIP_CHECK=1: the run trains without the check, with one warning naming the variable.
#
# Usage: .ci/untested_release.sh WORKDIR WHEEL STACK_FILE   (WORKDIR: a scratch folder; STACK_FILE: what the main leg
# pins, .ci/stacks/py3.11-main.txt)
set -euo pipefail
workdir=$1
wheel=$2
stack=$3
python_bin="${PYTHON:-python3}"
"$python_bin" -m venv "$workdir/venv-untested"
# shellcheck disable=SC1091
source "$workdir/venv-untested/bin/activate"
python -m pip install -q -r "$stack" "$wheel"
trl_folder=$(python -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('trl').origin).parent)")
python - "$trl_folder" <<'EOF'
import pathlib, re, sys
site = pathlib.Path(sys.argv[1]).parent
[metadata] = site.glob("trl-*.dist-info/METADATA")
text = metadata.read_text()
assert re.search(r"^Version: ", text, re.MULTILINE), metadata
metadata.write_text(re.sub(r"^Version: .*$", "Version: 1.99.0", text, count=1, flags=re.MULTILINE))
EOF
mkdir -p "$workdir/outside-untested"
cd "$workdir/outside-untested"
export HF_HOME="$PWD/hf"

echo "ci: untested release: 1. the warning at import"
python -c "import trl_lopti.trl_contract" 2> import.log
cat import.log
grep -q "not with the installed TRL 1.99.0" import.log

python -c "from trl_lopti.models import build_tiny_model; build_tiny_model('tiny')" > /dev/null
for i in 1 2 3 4; do echo "{\"prompt\": \"What is $i + 2? The answer is\", \"answer\": $((i + 2))}"; done > prompts.jsonl
train() {  # train COMMAND LOG: one optimizer step of a tiny model on prompts.jsonl; the exit code is the command's
    local command=$1 log=$2
    shift 2
    "$@" trl-lopti "$command" --task dataset --dataset_name prompts.jsonl \
        --reward_funcs trl_lopti.tasks.arithmetic.exact_answer_reward --model_name_or_path tiny --use_cpu true \
        --max_steps 2 --per_device_train_batch_size 4 --num_generations 2 --max_completion_length 4 --report_to none \
        --save_strategy no --output_dir "out-$command" > "$log" 2>&1
}
expect() {  # expect LOG PATTERN: the log holds the pattern, or the stage fails showing the log
    grep -qE -- "$2" "$1" || { tail -n 40 "$1"; echo "ci: untested release: $1 lacks '$2'"; exit 1; }
}

echo "ci: untested release: 2. the first run checks once, then trains"
train grpo first.log || { tail -n 40 first.log; exit 1; }
grep -E "checking trl_lopti's contract once|^(PASS|FAIL|ERROR|SKIP) |^grpo: |^passed: " first.log
expect first.log "checking trl_lopti's contract once: trl-lopti check --trainers grpo --device cpu --precision bf16"
expect first.log "^passed: 5 of 5 checks"
expect first.log "model saved to out-grpo"

echo "ci: untested release: 3. the verdict reused: no second check"
train grpo second.log || { tail -n 40 second.log; exit 1; }
! grep -q "checking trl_lopti's contract" second.log || { echo "ci: the second run checked again"; exit 1; }
expect second.log "model saved to out-grpo"

echo "ci: untested release: 4. fact R1 broken on purpose: LoptiRLOOTrainer refused, LoptiGRPOTrainer trains"
python - "$trl_folder/trainer/rloo_trainer.py" <<'EOF'
import pathlib, sys
path = pathlib.Path(sys.argv[1])
text = path.read_text()
assert text.count('"old_logps": old_logps,') == 1, "TRL's RLOOTrainer no longer returns old_logps as this stage expects"
path.write_text(text.replace('"old_logps": old_logps,', '"old_logps": old_logps + 1.0,'))
EOF
if train rloo broken.log; then tail -n 40 broken.log; echo "ci: a broken fact R1 trained"; exit 1; fi
grep -E "^FAIL |^rloo: |^FAILED: |RuntimeError: " broken.log
expect broken.log "RuntimeError: TRL 1.99.0 breaks trl_lopti's contract for LoptiRLOOTrainer on this machine \(cpu, bf16\): broken facts R1 \(RLOO generation\)"
train grpo after_break.log || { tail -n 40 after_break.log; exit 1; }
expect after_break.log "model saved to out-grpo"

echo "ci: untested release: 5. an unwritable cache: the run trains, with one warning naming the folder"
# The verdicts' folder cannot be made (a file stands where it would be, which stops root too); the datasets' cache
# beside it stays writable, as the command line's data loading needs it.
mkdir hf-unwritable
touch hf-unwritable/trl_lopti
train grpo unwritable.log env HF_HOME="$PWD/hf-unwritable" || { tail -n 40 unwritable.log; exit 1; }
grep "holds for this process only" unwritable.log
[ "$(grep -c "holds for this process only" unwritable.log)" = 1 ] || { echo "ci: not one warning"; exit 1; }
expect unwritable.log "hf-unwritable/trl_lopti/contract"
expect unwritable.log "model saved to out-grpo"

echo "ci: untested release: 6. TRL_LOPTI_SKIP_CHECK=1: trains without the check, with one warning"
train grpo skip.log env HF_HOME="$PWD/hf-empty" TRL_LOPTI_SKIP_CHECK=1 || { tail -n 40 skip.log; exit 1; }
grep "TRL_LOPTI_SKIP_CHECK=1:" skip.log
! grep -q "checking trl_lopti's contract" skip.log || { echo "ci: the skip variable still checked"; exit 1; }
expect skip.log "model saved to out-grpo"
deactivate
