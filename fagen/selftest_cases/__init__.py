"""The self-test's cases: one small call per kernel template, held to flash-attn's tolerance rule.

`cases` maps each template (fagen.selftest.templates) to its case, built from `training`
(forward, backward, packed sequences) and `decoding` (kv-cache steps, paged caches); `rule` is
the tolerance each result is held to against the float64 oracle; `child` is the process the
self-test's watchdog (fagen.selftest.watchdog) starts to run them and report each result.

They call fagen's ops, so they sit above them; the gate the ops ask (fagen.selftest) sits below
and never imports this package: it runs `python -m fagen.selftest_cases.child`.
"""
