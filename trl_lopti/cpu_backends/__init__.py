"""What a CPU machine needs to run code paths that TRL, accelerate and vLLM run only on accelerators, so that
the tests and `trl-lopti grpo --rehearse` exercise them for real: `accelerate` (FSDP2 and DeepSpeed on gloo
processes), `vllm` (vLLM's weight transfer over gloo instead of NCCL, for TRL's vLLM modes) and `vllm_server`
(a CPU `vllm serve` and the check of a run's weight sync against it). Each module writes down the private
facts it rests on once and checks them where it acts.
"""
