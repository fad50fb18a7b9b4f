"""fagen.selftest: each user's GPU proves fagen's kernels once, before they serve a call.

No kernel is trusted on hardware it has not run on. So the first call that needs a family's
kernels on a GPU runs one small case per template of the family (`templates`: a head dim or a
feature of its forward, backward or decoding) in a child process under a watchdog
(`watchdog`, `child`), holds each result to flash-attn's tolerance rule (`rule`; the cases in
`cases`, `training`, `decoding`), and stores a verdict per template in the per-GPU cache
(`verdicts`). Then `gate.serving_spec` serves each call: on compute capability 9.0 the sm90
family where its templates passed, else sm80, and never a template that failed.

`fagen selftest` (`command`) runs it on demand. Layers: `templates`, `verdicts`, `watchdog`
and `gate` import nothing of the ops (the ops ask the gate); `cases` and the `child` that runs
them are users of the ops, imported only in the child process.
"""

from .gate import SELFTEST_ENV, SelftestFailure, serving_spec
from .templates import all_templates, templates_of

__all__ = ["SELFTEST_ENV", "SelftestFailure", "all_templates", "serving_spec", "templates_of"]
