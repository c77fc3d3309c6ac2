"""What the GPU harness's prompt sets must respect in every engine (tests/gpu_harness)."""

BLOCK_SLACK = 64  # the largest page size of the MLA backends
DECODE_THRESHOLD = 512  # FLASH_ATTN_MLA's reorder_batch_threshold: extends up to this are decodes in stock
