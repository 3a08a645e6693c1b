"""vLLM worker extension that loads new policy weights in place, without restarting the server.

This file runs inside the vLLM environment, not the project's: it imports only the standard library, torch,
safetensors and vLLM. The server launcher copies it into a directory of its own and puts that directory on the
vLLM process's PYTHONPATH, then passes `--worker-extension-cls marin_rl_vllm_worker_extension.WeightLoader`;
vLLM mixes the class into every worker, and `POST /collective_rpc {"method": "marin_rl_load_weights", "args":
[path]}` (a development endpoint, enabled by VLLM_SERVER_DEV_MODE=1) runs the method on each of them.
"""

from __future__ import annotations

import os
import time


class WeightLoader:
    """Mixed into vLLM's workers: `self` is the worker (it has `model_runner`, `device`, `reload_weights`)."""

    def marin_rl_load_weights(self, path: str) -> dict:
        """Load the Hugging Face-named tensors of the safetensors file at `path` into the served model.

        Uses vLLM's in-place reload (the same path as its `reload_weights` RPC), which runs each architecture's
        `load_weights` (fusing q/k/v and gate/up projections, sharding over tensor-parallel ranks) and copies into the
        existing parameters, so compiled graphs stay valid. Tensors are copied without any dtype conversion when
        their dtype matches the model's. Returns the tensor count, bytes and seconds spent reading and loading.
        """
        import torch
        from safetensors.torch import load_file

        start = time.perf_counter()
        tensors = load_file(path, device="cpu")
        read_s = time.perf_counter() - start
        model = self.model_runner.get_model()
        param_dtypes = {p.dtype for p in model.parameters()}
        for name, t in tensors.items():
            if t.is_floating_point() and t.dtype not in param_dtypes:
                raise ValueError(
                    f"{os.path.basename(path)}: tensor {name} has dtype {t.dtype} but the served model holds "
                    f"{sorted(str(d) for d in param_dtypes)}; serve with a matching --dtype"
                )
        start = time.perf_counter()
        with torch.no_grad():
            if hasattr(self, "reload_weights"):
                self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
            else:  # older vLLM: the architecture's loader directly
                model.load_weights(weights=iter(tensors.items()))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        load_s = time.perf_counter() - start
        return {
            "tensors": len(tensors),
            "bytes": int(sum(t.numel() * t.element_size() for t in tensors.values())),
            "read_s": read_s,
            "load_s": load_s,
        }
