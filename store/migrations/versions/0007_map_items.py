"""dispatch_maps, map_items, map_item_ends: a map dispatch (fan-out over items, issue 29).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02

A map dispatch is an ordinary `dispatches` row (its own WORKER_SCHEDULED and terminal event)
with a `dispatch_maps` row saying how it runs, its items' inputs in `map_items`, and each item's
one end in `map_item_ends`, whose primary key (dispatch, item) is the arbiter between writers.

Additive: workers of the previous release never read the tables, and schedule no maps.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "dispatch_maps",
        sa.Column("dispatch_id", sa.String(36), nullable=False),
        sa.Column("items", sa.Integer(), nullable=False),
        sa.Column("parallelism", sa.Integer(), nullable=False),
        sa.Column("max_failed_items", sa.Integer(), nullable=True),
        sa.Column("min_succeeded", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("dispatch_id", name="pk_dispatch_maps"),
        sa.ForeignKeyConstraint(
            ["dispatch_id"],
            ["dispatches.dispatch_id"],
            name="fk_dispatch_maps_dispatch_id_dispatches",
            ondelete="CASCADE",
        ),
    )
    op.create_table(
        "map_items",
        sa.Column("dispatch_id", sa.String(36), nullable=False),
        sa.Column("item_index", sa.Integer(), nullable=False, autoincrement=False),
        sa.Column("input", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("dispatch_id", "item_index", name="pk_map_items"),
        sa.ForeignKeyConstraint(
            ["dispatch_id"],
            ["dispatch_maps.dispatch_id"],
            name="fk_map_items_dispatch_id_dispatch_maps",
            ondelete="CASCADE",
        ),
    )
    op.create_table(
        "map_item_ends",
        sa.Column("dispatch_id", sa.String(36), nullable=False),
        sa.Column("item_index", sa.Integer(), nullable=False, autoincrement=False),
        sa.Column("type", sa.String(64), nullable=False),
        sa.Column("output", sa.JSON(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.PrimaryKeyConstraint("dispatch_id", "item_index", name="pk_map_item_ends"),
        sa.ForeignKeyConstraint(
            ["dispatch_id"],
            ["dispatch_maps.dispatch_id"],
            name="fk_map_item_ends_dispatch_id_dispatch_maps",
            ondelete="CASCADE",
        ),
    )


def downgrade() -> None:
    op.drop_table("map_item_ends")
    op.drop_table("map_items")
    op.drop_table("dispatch_maps")
