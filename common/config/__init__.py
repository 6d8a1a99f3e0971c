"""The configuration: one YAML read by every process, one module per section (its schema and its rules),
the loader that reports every problem at once, and the reference generator (docs/config.md).
"""
