"""Fake device environments for testing backend logic that needs hardware this machine lacks.

Only tests import this package; nothing under src/ does.
"""
