"""Autotuning tile sizes per GPU, with a persistent per-GPU cache.

    spec = fagen.autotune(Spec(64, mask="causal"), seqlen_q=4096, batch=4, heads=32)
    spec = fagen.tuning.lookup(base_spec, seqlen_q=..., seqlen_k=..., batch=..., heads=...,
                                 device=q.device)   # what flash_attn_func runs

Modules, in pipeline order:

  device    DeviceLimits (from the driver, or a preset per arch) and DeviceIdentity
  fallback  the untuned tile table by arch class (shared memory per block) and head dim
  space     candidate tiles, pruning by limits and the ptxas report, parallel compile
  measure   the output check against the float64 reference, CUDA-event timing
  cache     the per-GPU JSON cache and its in-memory index
  tuner     tune / autotune / lookup
  command   `fagen tune`
"""

from .cache import ShapeBucket, TuneEntry, clear_cache, reload_cache, show_cache, tune_dir
from .command import add_tune_parser, cmd_tune
from .device import LIMIT_PRESETS, DeviceIdentity, DeviceLimits
from .fallback import FALLBACK_OVERRIDES, arch_class, fallback_spec, fallback_tiles
from .measure import CheckOutcome, CudaEventTimer, ReferenceCheck
from .space import DEFAULT_GRID, TileGrid, candidates, prune
from .tuner import TuneResult, TuningError, autotune, is_tuned, lookup, tune

__all__ = [
    "DEFAULT_GRID", "FALLBACK_OVERRIDES", "LIMIT_PRESETS", "CheckOutcome", "CudaEventTimer",
    "DeviceIdentity", "DeviceLimits", "ReferenceCheck", "ShapeBucket", "TileGrid", "TuneEntry",
    "TuneResult", "TuningError", "add_tune_parser", "arch_class", "autotune", "candidates",
    "clear_cache", "cmd_tune", "fallback_spec", "fallback_tiles", "is_tuned", "lookup", "prune", "reload_cache",
    "show_cache", "tune", "tune_dir",
]
