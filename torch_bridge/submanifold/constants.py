"""spconv's settings (spconv.constants), for code that reads or sets them: OpenPCDet sets
SPCONV_USE_DIRECT_TABLE = False, for instance. None of them changes what this library does:

- SPCONV_USE_DIRECT_TABLE, SPCONV_DIRECT_TABLE_HASH_SIZE_SCALE, SPCONV_DO_SORT: how spconv builds
  its pair tables; ours are built one way (sbnet_cupy.submanifold).
- SPCONV_ALLOW_TF32: float32 products here run as TF32 where torch allows it
  (torch.backends.cuda.matmul.allow_tf32), on CUDA only.
- SPCONV_CPP_GEMM, SPCONV_FX_TRACE_MODE, SPCONV_BWD_SPLITK, DISABLE_JIT: spconv's kernels.
- ALL_WEIGHT_IS_KRSC, FILTER_HWIO, SAVED_WEIGHT_LAYOUT: weights are always [Cout, *kernel, Cin]
  ("KRSC"); checkpoints of other layouts are not permuted on loading.
"""

SPCONV_USE_DIRECT_TABLE = True
SPCONV_DIRECT_TABLE_HASH_SIZE_SCALE = 1.1
SPCONV_DO_SORT = True
SPCONV_ALLOW_TF32 = False
SPCONV_CPP_GEMM = True
SPCONV_FX_TRACE_MODE = False
SPCONV_BWD_SPLITK = [1, 2, 4, 8, 16, 32, 64]
DISABLE_JIT = False
ALL_WEIGHT_IS_KRSC = True
FILTER_HWIO = False
SAVED_WEIGHT_LAYOUT = ""
