"""Matmul backends for frozen quantized weights. `dispatch` picks one per call.

The Triton backend is registered here; Triton is imported only on its first call.
"""

from . import dispatch, triton_backend

dispatch.register_backend(
    dispatch.Backend("triton", triton_backend.supports, triton_backend.matmul, triton_backend.matmul_grad_input)
)
