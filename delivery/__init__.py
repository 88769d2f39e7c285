"""Delivery: a dispatch's Job created, its end read and recorded once, the engine told, the Job cleaned up.
The normal path and the one the recovery sweep takes after a crash are the same functions."""
