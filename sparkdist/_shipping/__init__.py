"""Shipping the driver's local code to the ranks (``code``).

Imports only ``_core``.
"""
