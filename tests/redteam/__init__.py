"""Adversarial A1 submissions for tests/test_redteam.py, generated from the kit at test time."""
