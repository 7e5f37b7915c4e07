"""sbnet_cupy's ops on TensorFlow tensors, with gradients.

Each op runs inside ``tf.py_function``, so it works eagerly and inside ``tf.function``, and its
gradient is registered with ``tf.custom_gradient``. CPU tensors go to sbnet_cupy's NumPy
backend; GPU tensors go to its CuPy kernels through DLPack, without a copy.

What TensorFlow does not allow, and what happens instead:
- XLA (``tf.function(jit_compile=True)``) cannot compile ``py_function``: TensorFlow raises an
  error naming ``EagerPyFunc`` when the function is traced.
- A SavedModel keeps the Python function out: loaded in a new process, calling these ops fails.
  Save the weights and rebuild the model in Python instead.
- ``sparse_scatter_var`` updates a ``tf.Variable`` with ``assign`` (TensorFlow hands out no
  writable view of a variable's buffer), so it saves no copy over ``sparse_scatter``.
"""

import tensorflow as tf

import sbnet_cupy
from sbnet_cupy import BlockParams, ReduceMask, calc_block_params, calc_block_params_res_block
from sbnet_cupy.core import checks as _checks

__all__ = [
    "BlockParams",
    "ReduceMask",
    "SparseKernel",
    "atrous_conv2d",
    "batch_to_space",
    "calc_block_params",
    "calc_block_params_res_block",
    "reduce_mask",
    "res_block_bottleneck",
    "space_to_batch",
    "sparse_gather",
    "sparse_kernel_conv2d",
    "sparse_res_block_bottleneck",
    "sparse_scatter",
    "sparse_scatter_var",
    "submanifold_conv",
]


def _on_gpu(t):
    return "GPU" in t.device


def _to_arrays(tensors):
    """NumPy arrays for CPU tensors, CuPy arrays (DLPack, no copy) for GPU tensors."""
    if not any(_on_gpu(t) for t in tensors):
        return [t.numpy() for t in tensors]
    import cupy

    # to_dlpack synchronises the device, so TensorFlow's pending writes to these tensors
    # (made on its own streams) are done before the kernels read them. Small tensors that
    # TensorFlow keeps in host memory (block counts, indices) are copied over.
    return [cupy.from_dlpack(tf.experimental.dlpack.to_dlpack(t)) if _on_gpu(t)
            else cupy.asarray(t.numpy()) for t in tensors]


def _to_tensor(array):
    if isinstance(array, tf.Tensor) or not hasattr(array, "toDlpack"):
        return tf.convert_to_tensor(array)
    import cupy

    # TensorFlow reads the result on its own streams and knows nothing of CuPy's: finish the
    # kernels first. The DLPack capsule keeps the CuPy memory alive while TensorFlow holds it.
    cupy.cuda.get_current_stream().synchronize()
    return tf.experimental.dlpack.from_dlpack(array.toDlpack())


def _call(fn, inputs, out_dtypes):
    """Run fn on the inputs' arrays inside tf.py_function; fn returns arrays."""
    def body(*tensors):
        result = fn(*_to_arrays(tensors))
        return [_to_tensor(a) for a in (result if isinstance(result, tuple) else (result,))]

    return tf.py_function(body, inputs, out_dtypes)


def _block_list(bin_counts, active_block_indices):
    return (tf.cast(tf.convert_to_tensor(bin_counts), tf.int32),
            tf.cast(tf.convert_to_tensor(active_block_indices), tf.int32))


def reduce_mask(mask, bcount, *, bsize, boffset=(0, 0), bstride=None, tol=0.5, avgpool=False,
                capacity=None):
    """sbnet_cupy.reduce_mask on a tensor: ReduceMask of int32 tensors. Not differentiable."""
    geometry = _checks.block_geometry(bsize, boffset, bstride)
    bcount = _checks.int_pair("bcount", bcount, minimum=0)
    mask = tf.convert_to_tensor(mask)
    if mask.dtype == tf.bfloat16:
        mask = tf.cast(mask, tf.float32)

    def run(mask_array):
        return tuple(sbnet_cupy.reduce_mask(mask_array, bcount, bsize=geometry.bsize,
                                            boffset=geometry.boffset, bstride=geometry.bstride,
                                            tol=tol, avgpool=avgpool, capacity=capacity))

    indices, counts = _call(run, [mask], [tf.int32, tf.int32])
    indices.set_shape([capacity, 3])
    counts.set_shape([1])
    return ReduceMask(indices, counts)


def _stack_shape(rows, geometry, channels, transpose):
    bh, bw = geometry.bsize
    return [rows, channels, bh, bw] if transpose else [rows, bh, bw, channels]


def _gather(x, counts, indices, geometry, transpose):
    def run(x_array, counts_array, indices_array):
        return sbnet_cupy.sparse_gather(x_array, counts_array, indices_array,
                                        bsize=geometry.bsize, boffset=geometry.boffset,
                                        bstride=geometry.bstride, transpose=transpose)

    (out,) = _call(run, [x, counts, indices], [x.dtype])
    out.set_shape(_stack_shape(indices.shape[0], geometry, x.shape[3], transpose))
    return out


def _scatter(blocks, counts, indices, ybase, geometry, add, atomic, transpose):
    def run(blocks_array, counts_array, indices_array, ybase_array):
        return sbnet_cupy.sparse_scatter(blocks_array, counts_array, indices_array, ybase_array,
                                         bsize=geometry.bsize, boffset=geometry.boffset,
                                         bstride=geometry.bstride, add=add, atomic=atomic,
                                         transpose=transpose)

    (y,) = _call(run, [blocks, counts, indices, ybase], [ybase.dtype])
    y.set_shape(ybase.shape)
    return y


def sparse_gather(x, bin_counts, active_block_indices, *, bsize, boffset=(0, 0), bstride=None,
                  transpose=False):
    """sbnet_cupy.sparse_gather on tensors; differentiable in x."""
    geometry = _checks.block_geometry(bsize, boffset, bstride)
    x = _checks.nhwc("x", tf.convert_to_tensor(x))
    counts, indices = _block_list(bin_counts, active_block_indices)
    transpose = bool(transpose)

    @tf.custom_gradient
    def gather(x):
        def grad(dy):
            # Each block pixel came from one pixel of x; overlapping blocks read some twice.
            return _scatter(dy, counts, indices, tf.zeros_like(x), geometry, True, True,
                            transpose)

        return _gather(x, counts, indices, geometry, transpose), grad

    return gather(x)


def sparse_scatter(blocks, bin_counts, active_block_indices, ybase, *, bsize, boffset=(0, 0),
                   bstride=None, add=False, atomic=False, transpose=False):
    """sbnet_cupy.sparse_scatter on tensors; differentiable in blocks and ybase.

    Where blocks overlap without add, which block lands is unspecified and so is the gradient
    of the blocks there."""
    geometry = _checks.block_geometry(bsize, boffset, bstride)
    blocks = tf.convert_to_tensor(blocks)
    ybase = _checks.nhwc("ybase", tf.convert_to_tensor(ybase))
    if blocks.dtype != ybase.dtype:
        raise TypeError(f"blocks dtype {blocks.dtype.name} differs from ybase dtype "
                        f"{ybase.dtype.name}")
    _checks.atomic_for_overlap(geometry, add, atomic)
    counts, indices = _block_list(bin_counts, active_block_indices)
    add, atomic, transpose = bool(add), bool(atomic), bool(transpose)
    expected = _stack_shape(indices.shape[0], geometry, ybase.shape[3], transpose)
    if not blocks.shape.is_compatible_with(expected):
        raise ValueError(f"blocks must have shape {expected} "
                         f"({'[M, C, BH, BW]' if transpose else '[M, BH, BW, C]'}), "
                         f"got {blocks.shape}")

    @tf.custom_gradient
    def scatter(blocks, ybase):
        def grad(dy):
            # Each block element went to one pixel of y (or nowhere, outside it).
            d_blocks = _gather(dy, counts, indices, geometry, transpose)
            if add:
                return d_blocks, dy
            # ybase shows through only where no block was written: zero the written pixels.
            return d_blocks, _scatter(tf.zeros_like(blocks), counts, indices, dy, geometry,
                                      False, False, transpose)

        return _scatter(blocks, counts, indices, ybase, geometry, add, atomic, transpose), grad

    return scatter(blocks, ybase)


def sparse_scatter_var(blocks, bin_counts, active_block_indices, ybase, **kwargs):
    """sparse_scatter into a tf.Variable: assigns the result to ybase and returns ybase."""
    if not isinstance(ybase, tf.Variable):
        raise TypeError(f"ybase must be a tf.Variable, got {type(ybase).__name__}")
    ybase.assign(sparse_scatter(blocks, bin_counts, active_block_indices, ybase.value(),
                                **kwargs))
    return ybase


def _bottleneck_residual(z, weights, conv2_padding, inside=None):
    """BN-ReLU-1x1, BN-ReLU-3x3, BN-ReLU-1x1 with BN as inference affines (scale, shift)."""
    def bn_relu(z, bn):
        scale, shift = bn
        return tf.nn.relu(z * scale + shift)

    z = tf.nn.conv2d(bn_relu(z, weights["bn1"]), weights["conv1"], 1, "VALID")
    z = bn_relu(z, weights["bn2"])
    if inside is not None:
        z = z * inside  # the dense unit's zero padding of the 3x3 input, at the image border
    z = tf.nn.conv2d(z, weights["conv2"], 1, conv2_padding)
    return tf.nn.conv2d(bn_relu(z, weights["bn3"]), weights["conv3"], 1, "VALID")


def res_block_bottleneck(x, weights):
    """The dense pre-activation bottleneck unit, x + F(x), NHWC.

    weights: bn1, bn2, bn3 as (scale, shift) per channel; conv1 [1, 1, C, K], conv2
    [3, 3, K, K], conv3 [1, 1, K, C] (HWIO), as sbnet_cupy.random_bottleneck_weights makes."""
    return x + _bottleneck_residual(x, weights, "SAME")


def sparse_res_block_bottleneck(x, indices, block_params, weights, *, use_var=False):
    """SBNet's sparse_res_block_bottleneck: x + F(x) on the active blocks, x elsewhere.

    indices: the ReduceMask of reduce_mask run with block_params (SBNet's argument name).
    block_params: calc_block_params_res_block((H, W), bsize, [(1, 1), (3, 3), (1, 1)]).
    weights: as for res_block_bottleneck. use_var: x is a tf.Variable updated in place
    (sparse_scatter_var). Differentiable in x and the weights. Block pixels outside the image
    are zeroed before the 3x3 convolution, so blocks at the border match the dense unit."""
    geometry = dict(bsize=block_params.bsize, boffset=block_params.boffset,
                    bstride=block_params.bstrides)
    dense = x.value() if use_var else tf.convert_to_tensor(x)
    counts, active = indices.bin_counts, indices.active_block_indices
    blocks = sparse_gather(dense, counts, active, **geometry)
    inside = sparse_gather(tf.ones_like(dense[..., :1]), counts, active, **geometry)
    out = _bottleneck_residual(blocks, weights, "VALID", inside)
    scatter = sparse_scatter_var if use_var else sparse_scatter
    return scatter(out, counts, active, x, bsize=block_params.bsize_out,
                   bstride=block_params.bsize_out, add=True)


# Op families in modules of their own use the helpers above.
from .dilated import atrous_conv2d, batch_to_space, space_to_batch  # noqa: E402
from .sparse_kernel_conv import SparseKernel, sparse_kernel_conv2d  # noqa: E402
from .submanifold import submanifold_conv  # noqa: E402
