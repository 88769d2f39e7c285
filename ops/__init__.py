"""Operator tools: the CLI, the demo, the chaos harness, status and process supervision.

They use the product (`tasks`, `engine`, `workers`, `recovery`) and the stand-in clusters; the
product never imports them."""
