"""Optional C helper of the producer (`_pagehash`, built from pagehash.c by setup.py)."""
