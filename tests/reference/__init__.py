"""Reference fixtures: built by make_fixtures.py (reference env, torch), checked by compare.py (numpy only)."""
