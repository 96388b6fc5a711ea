"""The head sizes the CUDA path of ``kernels.dense_decode_attention`` is built for, in a module of
its own: the dispatch (ops/kernels.py), the Triton kernel (ops/triton_dense_decode.py) and the
adapter's setup checks read it, and the kernel module cannot import the dispatch that imports it."""

DENSE_DECODE_HEAD_SIZES = (64, 128, 256)    # what the CUDA path of dense_decode_attention has
