"""SBNet: the block-sparse ops (reduce_mask, sparse_gather, sparse_scatter), the fused block
convolutions (block_conv) and the residual units built on them (sparse_conv)."""
