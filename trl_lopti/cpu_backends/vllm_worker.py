"""The vLLM worker extension of a CPU server.

`vllm serve ... --worker-extension-cls trl_lopti.cpu_backends.vllm_worker.WeightTransferOnCpu` makes vLLM
import this module in its worker process before the model loads, which installs the server side of
`trl_lopti.cpu_backends.vllm`.
"""

from . import vllm as cpu_vllm


cpu_vllm.install_server_side()


class WeightTransferOnCpu:
    """Mixed into vLLM's worker: reports the weight transfer it ran (`POST /collective_rpc` with
    `{"method": "trl_lopti_weight_transfer"}`, in the server's development mode)."""

    def trl_lopti_weight_transfer(self) -> dict:
        """This worker's communicator with the trainer (`NoneType` before TRL's `init_communicator`), the
        broadcasts it received, and whether its linear layers compute on their own weights (oneDNN off)."""
        from vllm import _custom_ops

        group = getattr(self.weight_transfer_engine, "model_update_group", None)
        received = getattr(group, "broadcasts", 0)
        onednn = _custom_ops._supports_onednn
        return {"communicator": type(group).__name__, "broadcasts": received, "onednn": onednn}
