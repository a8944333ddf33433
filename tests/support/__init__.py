"""Test-support code shared by the test modules (importable as `support.*`: pytest puts tests/ on sys.path)."""
