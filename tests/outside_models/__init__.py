"""Model files copied from public projects (each file names its source, commit and licence), for
tests/test_outside_models.py."""
