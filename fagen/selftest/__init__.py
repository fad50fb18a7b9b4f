"""fagen.selftest: each user's GPU proves fagen's kernels once, before they serve a call.

No kernel is trusted on hardware it has not run on. So the first call that needs a family's
kernels on a GPU runs one small case per template of the family (`templates`: a head dim or a
feature of its forward, backward or decoding) in a child process under a watchdog
(`watchdog`), and stores a verdict per template in the per-GPU cache (`verdicts`). Then
`gate.serving_spec` serves each call: on compute capability 9.0 the sm90 family where its
templates passed (its forward alone, with sm80's backward, where only `sm90.backward` did not),
else sm80, and never a template that failed.

`fagen selftest` (`command`) runs it on demand. This package sits below the ops (they ask the
gate) and imports nothing of them. The cases themselves are users of the ops and live above
them, in `fagen.selftest_cases` (the cases, the rule they are held to, and the child process
that runs them); the watchdog starts that child by its module name and reads its reports, so
nothing here imports the cases.
"""

from .gate import SELFTEST_ENV, SelftestFailure, serving_spec
from .templates import all_templates, templates_of

__all__ = ["SELFTEST_ENV", "SelftestFailure", "all_templates", "serving_spec", "templates_of"]
