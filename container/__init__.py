"""What runs inside a Job's container: the runner that calls a capability's function and writes its
result where the kubelet reads it. Imports nothing of the product but `core`."""
