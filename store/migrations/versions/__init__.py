"""Hand-written Alembic revisions, applied in order by store.migrate."""
