"""Experiment: make flashattn_triton build its tensor descriptors on the device (in the kernels)
instead of on the host, in every Python process that has this folder on PYTHONPATH."""

import flashattn_triton.triton_impl as _triton_impl

_triton_impl._host_descriptors = lambda device: False
