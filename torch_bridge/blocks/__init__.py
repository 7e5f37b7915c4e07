"""SBNet on torch: the block ops (ops), the fused block convolutions (block_conv) and the
residual-unit modules (sparse_res_block)."""
