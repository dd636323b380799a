"""The adapter-residual gate's defaults (recovery/adapter_residual.py), apart from it so that the
command line names them without importing torch."""

# From `kmesh bench lora`'s runs (docs/benchmarks.md): the trained adapters' check deviations lie in
# 0.045-0.074 on a 2048-token context and hardly predict their KL, so the bound only stops adapters
# that move the context far more than those do; with 16 check tokens the state held per agent (the
# shared base counted once) stays over 5x below an exact agent's at 8 agents (64 or 256 buy quality
# with compute and bytes: the sweep there).
DEFAULT_MAX_DEVIATION = 0.1
DEFAULT_CHECK_TOKENS = 16
