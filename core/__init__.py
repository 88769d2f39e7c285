"""The words every layer shares: the error tree, ids and names, payloads, settings and fair-share limits.
Imports nothing of ours, so every other package can import it."""
