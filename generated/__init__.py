"""Kernels and op modules written by `fagen build`."""
