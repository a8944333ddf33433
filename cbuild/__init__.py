"""What the C accelerators are built from (tables.py): the source lists setup.py compiles, the
digest a loader checks a build against, the C string tables generated from schemas/."""
