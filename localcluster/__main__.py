"""`python -m localcluster serve ...`"""

from k8s_dispatch.localcluster.cli import localcluster

localcluster()
