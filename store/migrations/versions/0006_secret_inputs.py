"""dispatches.secret_input: a secret input, encrypted (Fernet) at rest.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02

A dispatch scheduled with `secret=True` keeps its input only here, as a Fernet token under a key
from `K8S_DISPATCH_INPUT_KEY` (several for rotation): its `input` column and its
WORKER_SCHEDULED event hold no trace of it, and a re-created Job's Secret is made from it again.

Additive, so that workers of the previous release run beside the new ones: they never read the
column, and no dispatch they schedule has one.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("dispatches") as batch:
        batch.add_column(sa.Column("secret_input", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("dispatches") as batch:
        batch.drop_column("secret_input")
