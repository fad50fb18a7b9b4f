"""The speed section: fagen v2 and v1 against PyTorch's attention backends and FlexAttention.

config    the systems, their labels, a panel (SpeedConfig) and the section's forecast; the sizes
          themselves are the Plan's own fields (dtypes, head dims, sequence lengths, systems)
run       the sweep over (panel, sequence length, system, pass), with its sanity checks
markdown  the ratios to the best peer, the short table's rows, results.md, the PNG plots and
          the section's lines in the plan
"""
