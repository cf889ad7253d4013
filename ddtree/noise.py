"""Log records of the libraries ddtree drives that are noise on every run, and the filter that drops them (the CLIs,
`python -m ddtree.docs` and the benchmark scripts install it as they start). Imports nothing beyond logging: the
benchmarks run it on machines without Hydra."""

from __future__ import annotations

import logging

# log records of libraries that are noise on every run, dropped from the console and the job log (logging filters on
# their loggers; every other record passes): (logger, a fragment of the message, noise only without a CUDA device)
LIBRARY_NOISE = (
    # torch's pytree registry, on each Enum torchao registers: transformers imports torchao (where it is installed)
    # with its quantizers, i.e. on every model load, quantized or not
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported", False),
    # torchao's CUDA extensions, which a CPU build of torch cannot load
    ("torchao", "Failed to load ", True),
    # transformers' hub kernels (causal_conv1d, flash-linear-attention: CUDA packages) falling back to their PyTorch
    # reference, the only implementation without a GPU; on one the packages would speed up the upstream GDN prefill
    ("transformers.integrations.hub_kernels", "is falling back to its reference PyTorch implementation", True),
)


def quiet_library_noise() -> None:
    """Filter LIBRARY_NOISE's records (once per process: the CLIs call it as they start)."""
    for name, fragment, without_cuda in LIBRARY_NOISE:
        log = logging.getLogger(name)
        if any(getattr(f, "ddtree_noise", False) for f in log.filters):
            continue

        def keep(record: logging.LogRecord, fragment=fragment, without_cuda=without_cuda) -> bool:
            if fragment not in str(record.msg):
                return True
            if without_cuda:
                import torch

                return torch.cuda.is_available()
            return False

        keep.ddtree_noise = True
        log.addFilter(keep)
