"""What a CPU machine needs to run code paths that TRL, accelerate and vLLM run only on accelerators, so that the
tests and `trl-lopti train --rehearse` exercise them for real: `accelerate` (FSDP2 and DeepSpeed on gloo processes)
and `vllm` (vLLM's weight transfer over gloo instead of NCCL, for TRL's vLLM server mode). Each module writes down the
private facts it rests on once and checks them where it acts.
"""
