"""Triton kernels for actsave codecs, installed as ``actsave.triton_kernels``."""
