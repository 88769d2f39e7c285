"""Hand-written Alembic revisions, applied in order by engine.migrate."""
