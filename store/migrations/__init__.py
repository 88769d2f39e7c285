"""Alembic migrations of the engine's store (env.py, versions/); run through store.migrate."""
