"""Device backends: one module per device type behind `base.Backend`, found via `registry`.

Importing this package loads nothing device-specific; `registry.get_backend()` does, on demand.
"""
