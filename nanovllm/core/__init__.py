"""The torch-free core: requests, KV blocks, scheduling, stop rules and a step's input as plain data.

Nothing here imports torch (``tests/test_layout.py`` checks it), so the core can be driven
thousands of steps a second by property tests over a fake executor.
"""
