"""Glue between hisparse and model frameworks; each submodule needs its framework installed
(`pip install "hisparse[transformers]"` for `hisparse.integrations.transformers`)."""
