"""dispatches.job_stopped_at, job_tampered_at, and the index of ended dispatches whose Job may run.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02

A cancel or a failure is recorded before its Job is deleted (and a lost `cancel` message, or a
delete that met a 5xx, leaves the Job running): such a dispatch keeps its fair-share slot until
the sweep sees its Job finished or gone and sets `job_stopped_at`. `ix_dispatches_stopping`
holds just those rows, so the sweep's pass over them and admission's count of them cost what
they return; `ix_dispatches_tampered` the rows whose Job the sweep found hand-edited. `job_tampered_at` is when the sweep first found the dispatch's Job hand-edited: the
origin of its clock to `JobTampered`.

Additive, so that workers of the previous release run beside the new ones: they never read the
columns; a dispatch they end keeps its slot until the new sweep checks its Job. The rows that
ended before this migration are taken as stopped (their Jobs are left to the sweep's LIST, as
before), so that history neither holds slots nor has every old Job looked up.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

STOPPING = "job_stopped_at IS NULL AND state IN ('FAILED', 'CANCELLED')"
TAMPERED = "job_tampered_at IS NOT NULL"


def upgrade() -> None:
    with op.batch_alter_table("dispatches") as batch:
        batch.add_column(sa.Column("job_stopped_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("job_tampered_at", sa.DateTime(timezone=True), nullable=True))
    op.execute(
        "UPDATE dispatches SET job_stopped_at = COALESCE(finished_at, updated_at) "
        "WHERE state IN ('FAILED', 'CANCELLED')"
    )
    op.create_index(
        "ix_dispatches_stopping",
        "dispatches",
        ["dispatch_id"],
        postgresql_where=sa.text(STOPPING),
        sqlite_where=sa.text(STOPPING),
    )
    op.create_index(
        "ix_dispatches_tampered",
        "dispatches",
        ["dispatch_id"],
        postgresql_where=sa.text(TAMPERED),
        sqlite_where=sa.text(TAMPERED),
    )


def downgrade() -> None:
    op.drop_index("ix_dispatches_tampered", table_name="dispatches")
    op.drop_index("ix_dispatches_stopping", table_name="dispatches")
    with op.batch_alter_table("dispatches") as batch:
        batch.drop_column("job_tampered_at")
        batch.drop_column("job_stopped_at")
