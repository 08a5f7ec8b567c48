"""The application layer above the services: the `specd` CLI, `specd up` and `specd bench`.

It may import every service package; nothing below it imports it.
"""
