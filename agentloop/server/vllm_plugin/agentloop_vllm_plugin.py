"""agentloop's weight-transfer engine for vLLM, loaded by vLLM itself in each of its processes.

A vLLM server that agentloop launches gets this directory on its ``PYTHONPATH``; the ``.dist-info`` beside this
file declares the ``vllm.general_plugins`` entry point, so vLLM's plug-in loader calls ``register`` in the API
server, the engine core and every worker. Nothing of agentloop is imported here: this module runs under the vLLM
environment's Python, whose pins differ from the project's.

Backend ``agentloop_file``: each ``/update_weights`` call names a safetensors file (written to a RAM disk by the
rollout server actor), which the worker loads with the model's own ``load_weights`` inside vLLM's layerwise reload,
the lifecycle its ``nccl`` engine uses for received tensors. It works wherever the server and the actor share a file
system, CPU or GPU.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

BACKEND = "agentloop_file"
EXIT_WITH_PARENT = "AGENTLOOP_VLLM_EXIT_WITH_PARENT"  # set by agentloop's launcher, never for an attached server
_watchdog_started = False


def register() -> None:
    """Add the ``agentloop_file`` backend to vLLM's weight-transfer registry (idempotent: vLLM may load plug-ins
    more than once in one process); in a server agentloop launched, make this process exit with its parent."""
    if os.environ.get(EXIT_WITH_PARENT) == "1":
        _exit_with_parent()
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    @dataclass
    class FileInitInfo(WeightTransferInitInfo):
        pass

    @dataclass
    class FileUpdateInfo(WeightTransferUpdateInfo):
        path: str

    class FileWeightTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
        """Weights from a safetensors file, loaded in place by the model's ``load_weights``."""

        init_info_cls = FileInitInfo
        update_info_cls = FileUpdateInfo

        def init_transfer_engine(self, init_info: FileInitInfo) -> None:
            pass  # no rendezvous: the file is the channel

        # vLLM's CPU linear layers repack their weights after loading (the checkpoint-shaped parameters are left
        # empty), so new weights go through its layerwise reload, as its own nccl engine does
        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            _tie_output_embeddings(self.model, self.model_config)

        def receive_weights(self, update_info: FileUpdateInfo) -> None:
            from safetensors.torch import load_file

            self.model.load_weights(load_file(update_info.path, device=str(self.device)).items())

        def shutdown(self) -> None:
            pass

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, FileWeightTransferEngine)
    except ValueError:  # registered by an earlier load in this process
        pass


def _tie_output_embeddings(model, model_config) -> None:
    """Refresh a tied model's output head from its new input embeddings. The reload loads no ``lm_head`` (a tied
    checkpoint has none) so it leaves the head alone, but the head may hold the old embedding parameter, and on
    CPU it samples through a packed copy of it made at load time (vLLM 0.32, Qwen3's tied checkpoints)."""
    if not getattr(model_config.hf_config.get_text_config(), "tie_word_embeddings", False):
        return
    head = getattr(model, "lm_head", None)
    embeddings = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embeddings is None:
        return
    head.weight = embeddings.weight
    if getattr(head, "quant_method", None) is not None:
        head.quant_method.process_weights_after_loading(head)


def _exit_with_parent() -> None:
    """Exit once this process's parent is gone. A server's engine core and workers outlive a killed API server
    (reparented, ~1.7 GB each on CPU) when the rollout actor that launched it is killed: the API server dies by
    its death signal and has no time to stop them."""
    global _watchdog_started
    if _watchdog_started:
        return
    _watchdog_started = True
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="agentloop-exit-with-parent", daemon=True).start()
