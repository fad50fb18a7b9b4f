"""Everything between a Spec and a launched kernel; a kernel family is a set of templates plus
its render rules, and every family takes the same Spec.

  render    Spec -> CUDA source (Jinja), kernel signatures and launch geometry
  params    (in render) one parameter table per feature
  compile   NVRTC, the disk / memory cache, the ptxas resource report
  launch    one launcher interface: CuPy on a GPU, the emulator on CPU
  run       tensors -> kernel arguments and launch order (forward, backward)
  run_kv_cache  the same for decoding: the append and the attention over a cache, bound once per step plan
  splits    split-KV: how many key ranges a decoding launch uses
  sources   the checked .cu files behind generated op modules
  build     what `fagen build` writes
"""
