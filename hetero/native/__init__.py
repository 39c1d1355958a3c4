"""Kernels hetero compiles on the host (C, with the host's compiler) where no library gives one."""
