"""Everything between a Spec and a launched kernel; a kernel family is an object with its
passes and a folder of templates, and every family takes the same Spec.

  render    Spec -> CUDA source (Jinja): the passes of the spec's family
  passes    a pass (templates and the kernels they define: signatures, launch geometry), a family
  families  the kernel families' passes, one module each, and their registry
  params    one parameter table per feature
  compile   NVRTC, the disk / memory cache, the ptxas resource report
  launch    one launcher interface: CuPy on a GPU, the emulator on CPU
  attention_kernels  tensors -> kernel arguments and launch order (forward, backward)
  kv_kernels         the same for decoding: the append and the attention over a cache, bound once per step plan
  splits    split-KV: how many key ranges a decoding launch uses
  sources   the checked .cu files behind generated op modules
  build     what `fagen build` writes
"""
