"""fagen.distributed: context parallelism over torch.distributed.

  layout   how a sequence is sharded (contiguous, zigzag): shard / unshard
  ring     ring_attention: K/V blocks around the ring, partial results merged by L
           (fagen.merge_attention), dropout on global coordinates

Nothing in fagen imports this package but `fagen` itself (tests/top/test_layering.py).
"""

from .layout import LAYOUTS, shard, unshard
from .ring import ring_attention

__all__ = ["LAYOUTS", "ring_attention", "shard", "unshard"]
