"""Matmul backends for frozen quantized weights. `dispatch` picks one per call.

The MMA backend (NVFP4 in the kernel layout, CUDA C++ via NVRTC) comes first; the Triton
backend takes the standard layouts (MXFP4, NF4, NVFP4 where the MMA layout does not apply).
Neither compiles anything at import.
"""

import torch

from . import dispatch, humming_backend, mma_backend, triton_backend

dispatch.register_backend(dispatch.Backend("humming", humming_backend.stored_supports, humming_backend.stored_matmul,
                                            humming_backend.stored_matmul_grad_input))
dispatch.register_backend(dispatch.Backend("mma", mma_backend.supports, mma_backend.matmul,
                                            mma_backend.matmul_grad_input))
dispatch.register_backend(
    dispatch.Backend("triton", triton_backend.supports, triton_backend.matmul, triton_backend.matmul_grad_input)
)


def storage_format(fmt, shape: tuple[int, int], device) -> "object":
    """The format a frozen weight of `fmt` is stored in on `device`. NVFP4: humming-kernels' layout where
    KernelSettings.humming_storage asks for it and humming runs here (its shapes; on the CPU too when asked,
    where the torch path reads it: tests), else the MMA kernels' layout where they run (CUDA, shape tiles into
    16 x 64), else `fmt` itself. The one place that decides the layout; the loader asks it layer by layer."""
    from ..formats import nvfp4_humming
    from ..formats.nvfp4 import NVFP4
    from ..formats.nvfp4_mma import NVFP4Mma, supports_shape
    from . import settings, w4_mma

    device = torch.device(device)
    if type(fmt) is not NVFP4:
        return fmt
    if (settings.current().humming_storage and nvfp4_humming.supports_shape(shape)
            and (device.type == "cpu" or humming_backend.available(device))):
        return nvfp4_humming.NVFP4Humming()
    if supports_shape(shape) and w4_mma.available(device):
        return NVFP4Mma()
    return fmt


def plan_copies(model) -> None:
    """At load, once the model's weights are on the device: whether humming-kernels copies of the weights the
    routes send to humming fit (humming_backend.plan_copies). Which kernel runs then never depends on the free
    memory at a first call."""
    from ..layers.qlora_linear import QLoRALinear
    from .routes import copied_shapes

    seen, by_device = set(), {}
    for mod in model.modules():
        if not isinstance(mod, QLoRALinear) or getattr(mod.fmt, "layout", None) != "mma" or mod.home.type != "cuda":
            continue
        owner = mod.group if mod.group is not None else mod
        if id(owner) in seen:
            continue
        seen.add(id(owner))
        shape = owner.shape if mod.group is not None else mod.weight_shape
        if humming_backend.supports_shape(shape):
            by_device.setdefault(mod.home, []).append(tuple(shape))
    for device, shapes in by_device.items():
        humming_backend.plan_copies(copied_shapes(shapes, device), device)
