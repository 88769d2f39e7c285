"""A local Kubernetes API server for batch/v1 Jobs and core/v1 Pods that the official Python
client and kubectl use unchanged; Jobs run as local processes (exec) or are simulated."""

from k8s_dispatch.demo.localcluster.cluster import LocalCluster

__all__ = ["LocalCluster"]
