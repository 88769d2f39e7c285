"""Our database: the engine's event log and our dispatch rows, their migrations and transactions.
Knows nothing of Kubernetes or Celery; `store.dispatches` is where a terminal event is written."""
