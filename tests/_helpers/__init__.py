"""Helpers several test modules share (one definition each): import them from here."""
