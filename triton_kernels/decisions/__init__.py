"""Fused kernels for the decisions a lossy recompute keeps: ReLU signs, Hardtanh and
LeakyReLU bounds, max-pool window offsets (actsave/runtime/relu_signs.py,
bound_decisions.py, pool_decisions.py, NOTE [ Max-pool decisions ]), packed as NOTE
[ Bit fields ] in bitfields.py says.

The ``*_ref`` functions are the specification in torch; the kernels match them bit for
bit. The kernels touch values only as their bits (a float reinterpreted as the
integer of its width as it is loaded, packed_tiles.load_bits; a gather copies bits),
so no float conversion, rounding mode or flush-to-zero can part kernel, interpreter
and reference.

Bytes moved per element (of the ReLU output, of the pooled output), as the launches
read and write them:

=====================  =========================================================
pack_relu_signs        read the output (4 or 2 B), write 1/8 B
restore_relu_signs_    read 1/8 B and the output, write the output (4 + 4 or 2 + 2 B)
pack_bounds            read the save (4 or 2 B), write 1/8 B
restore_bounds_        read 1/8 B and the save, write the save (4 + 4 or 2 + 2 B)
encode_max_pool        read 8 B of indices, write bits/8 B (1/8 .. 1)
decode_max_pool_       read bits/8 B, write 8 B of indices
gather_max_pool_       read 8 B of indices and one input element, write the output
=====================  =========================================================

A launcher allocates nothing but its packed output (none for the in-place ones), and
meta tensors get that allocation and no launch (actsave.estimate simulates a CUDA step
on them). An input the kernels cannot take (another dtype or layout, no elements, more
elements than they index) is handed to the reference, never to a kernel that would
give other bits. Every launch goes through ``_launch.launch``.

- relu_signs.py: the ReLU kernels (pack, restore), their launchers and references;
- bounds.py: the Hardtanh and LeakyReLU kernels (pack, restore), the bounds as values
  of the save's dtype, their launchers and references;
- max_pool.py: the max-pool kernels (encode, decode, gather), a pool's geometry as
  they see it, their launchers and references;
- packed_tiles.py: what both share: a program's tile of packed bytes and the launch
  options, fields packed and unpacked, the checks of a launcher's inputs, NOTE
  [ Cheap references ];
"""
from .bounds import pack_bounds, pack_bounds_ref, restore_bounds_, restore_bounds_ref_
from .max_pool import (
    decode_max_pool_,
    decode_max_pool_ref_,
    encode_max_pool,
    encode_max_pool_ref,
    gather_max_pool_,
    gather_max_pool_ref_,
)
from .relu_signs import pack_relu_signs, pack_relu_signs_ref, restore_relu_signs_, restore_relu_signs_ref_

__all__ = [
    "decode_max_pool_",
    "decode_max_pool_ref_",
    "encode_max_pool",
    "encode_max_pool_ref",
    "gather_max_pool_",
    "gather_max_pool_ref_",
    "pack_bounds",
    "pack_bounds_ref",
    "pack_relu_signs",
    "pack_relu_signs_ref",
    "restore_relu_signs_",
    "restore_bounds_",
    "restore_bounds_ref_",
    "restore_relu_signs_ref_",
]
