"""Optional C accelerator of the index core (`_kvnative`, built from kvnative.c by setup.py)."""
