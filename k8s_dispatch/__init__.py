"""k8s-dispatch under one import name, so an engine's own `tasks`, `engine` and `workers` keep theirs.

The repository keeps its folders at the top (`tasks/`, `workers/`, `recovery/`, `delivery/`,
`store/`, `core/`, ...); in a checkout the entries here are links to them, and the wheel carries
them as subpackages of `k8s_dispatch` (all but the lab). Every import, ours and the engine's, goes
through this name: `k8s_dispatch.api` is what an engine uses, `k8s_dispatch.cli` the command line.
"""
