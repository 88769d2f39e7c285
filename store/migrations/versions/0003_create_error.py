"""dispatches.create_error, create_error_at: why the dispatch's Job could not be created yet.

Revision ID: 0003
Revises: 0002
Create Date: 2025-01-20

A create that meets a passing refusal (403 "exceeded quota": the namespace's ResourceQuota is
full; the API unavailable) is retried with backoff and the dispatch stays scheduled; the error
is recorded here so that `k8s-dispatch status` can say why it waits. It speaks only while newer
than `job_created_at`: a later create makes it history without anyone clearing it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("dispatches") as batch:
        batch.add_column(sa.Column("create_error", sa.Text(), nullable=True))
        batch.add_column(sa.Column("create_error_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("dispatches") as batch:
        batch.drop_column("create_error_at")
        batch.drop_column("create_error")
