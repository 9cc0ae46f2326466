"""Matmul backends for frozen quantized weights. `dispatch` picks one per call."""
