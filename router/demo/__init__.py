"""`kvatlas demo`: the fleet on real processes, and the fast in-process example."""
