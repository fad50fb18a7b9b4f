"""The variants section: fagen's attention variants against FlexAttention with the same mod.

config    the cases, systems, sizes and forecast (VariantsConfig)
run       each variant in fagen and Flex, the no-mod peers once, and the sanity checks
markdown  its lines in the plan, its block of the short table, its tables in results.md
"""
