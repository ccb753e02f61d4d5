"""The data layout the engine and the kernels share: the device tables and the miss plan
(`tables`), and the widths of their entries (`widths`). It imports nothing else of hisparse,
so the kernels depend on it alone (docs/ARCHITECTURE.md is its contract)."""
